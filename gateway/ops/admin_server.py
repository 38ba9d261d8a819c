"""The admin HTTP listener: `/metrics`, `/health` and the admin API (`/api/...`).

A deliberately tiny HTTP/1.1 server on the gateway's event loop: one request per connection
(`Connection: close`), bound to admin_host (loopback by default), off unless admin_port is set.

    path       methods                   authentication
    ---------  ------------------------  ------------------------------------------------
    /metrics   GET, HEAD                 none (Prometheus text format)
    /health    GET, HEAD                 none (JSON; 503 while stopping)
    /api/...   GET, POST, PUT, PATCH,    gateway/ops/admin_api.py (token file or password
               DELETE                    file); JSON in and out

Bounds: the request head at most MAX_REQUEST_HEAD bytes, a body at most MAX_BODY bytes and
only with a Content-Length (chunked bodies: 411), the whole request within REQUEST_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from http import HTTPStatus
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from gateway.ops.admin_api import METHODS, AdminApi
from gateway.ops.metrics import GatewayMetrics, MetricsSources

__all__ = ["AdminServer"]

log = logging.getLogger("lmqtt.admin")

MAX_REQUEST_HEAD = 8192
MAX_BODY = 65_536
REQUEST_TIMEOUT_S = 5.0


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _json(data: Any) -> bytes:
    return json.dumps(data, default=str).encode() + b"\n"


class AdminServer:
    """The admin listener (see the module docstring)."""

    def __init__(
        self, sources: MetricsSources, metrics: GatewayMetrics, api: AdminApi | None = None
    ) -> None:
        self.sources = sources
        self.metrics = metrics
        self.api = api
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(
            self._handle, host, port, reuse_address=True, limit=MAX_REQUEST_HEAD
        )

    @property
    def port(self) -> int:
        assert self.server is not None and self.server.sockets
        return int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def health(self) -> tuple[int, dict[str, Any]]:
        src = self.sources
        ok = not src.server.stopping and not src.store.closed
        body = {
            "status": "ok" if ok else "unavailable",
            "clients_connected": src.stats.clients_connected,
            "connections": len(src.server.connections),
        }
        return (200 if ok else 503), body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                answer = await asyncio.wait_for(self._answer(reader), REQUEST_TIMEOUT_S)
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError):
                return
            if answer is None:
                return
            status, ctype, body, extra, head_only = answer
            headers = "".join(f"{k}: {v}\r\n" for k, v in extra.items())
            writer.write(
                f"HTTP/1.1 {status} {_reason(status)}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n{headers}Connection: close\r\n\r\n".encode()
                + (b"" if head_only else body)
            )
            await writer.drain()
        except Exception:
            log.exception("admin request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(
        self, reader: asyncio.StreamReader
    ) -> tuple[int, str, bytes, dict[str, str], bool] | None:
        """(status, content type, body, extra headers, HEAD) for one request; None: drop it."""
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_REQUEST_HEAD:
            return None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        path = target.split("?", 1)[0]
        text = "text/plain; charset=utf-8"
        if path == "/api" or path.startswith("/api/"):
            return await self._api(reader, method, target, headers)
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return 405, text, b"method not allowed\n", {"Allow": "GET, HEAD"}, head_only
        if path == "/metrics":
            await self.metrics.backlog.count()
            return 200, CONTENT_TYPE_LATEST, self.metrics.render(), {}, head_only
        if path == "/health":
            code, data = self.health()
            return code, "application/json", _json(data), {}, head_only
        return 404, text, b"not found: try /metrics, /health or /api/...\n", {}, head_only

    async def _api(
        self, reader: asyncio.StreamReader, method: str, target: str, headers: dict[str, str]
    ) -> tuple[int, str, bytes, dict[str, str], bool]:
        ctype = "application/json"

        def error(status: int, message: str) -> tuple[int, str, bytes, dict[str, str], bool]:
            return status, ctype, _json({"error": message}), {}, False

        if self.api is None:
            return error(404, "the admin API is not available")
        if method not in METHODS:
            return error(405, f"{method or 'this'} method is not allowed")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return error(411, "send the body with a Content-Length")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            return error(400, "Content-Length is not a number")
        if length < 0:
            return error(400, "Content-Length is negative")
        if length > MAX_BODY:
            return error(413, f"the body is over {MAX_BODY} bytes")
        body = await reader.readexactly(length) if length else b""
        response, extra = await self.api.handle(method, target, headers, body)
        return response.status, ctype, _json(response.body), extra, False
