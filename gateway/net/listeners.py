"""The gateway's listeners besides plain MQTT/TCP: MQTT over TLS, WebSocket (ws, wss) and the
admin HTTP port. Each is off unless its port is set; TLS and WebSocket listeners bind the same
host as the MQTT listener and feed the same MqttServerProtocol, so authentication, ACL and
limits are identical on every transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.config import GatewaySettings
from gateway.connection.context import ClientContext
from gateway.net.server import MqttServerProtocol, ServerState
from gateway.net.tls import server_context
from gateway.net.websocket import WebSocketMqttProtocol
from gateway.ops.admin_api import AdminApi
from gateway.ops.admin_server import AdminServer
from gateway.ops.metrics import GatewayMetrics, MetricsSources

__all__ = ["ExtraListeners"]

log = logging.getLogger("lmqtt.gateway")


class ExtraListeners:
    """Started by Gateway.start() after the MQTT listener, closed by Gateway.stop()."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.servers: dict[str, asyncio.Server] = {}
        self.metrics: GatewayMetrics | None = None  # made by start()
        self.admin: AdminServer | None = None
        st = settings
        # Built now, so a bad certificate stops Gateway() before anything is opened.
        tls = st.tls_port is not None or st.wss_port is not None
        self.ssl_context = server_context(st) if tls else None

    async def start(
        self,
        context: ClientContext,
        state: ServerState,
        sources: MetricsSources,
        api: AdminApi | None = None,
    ) -> None:
        """Listen; connections get `context` and `state`, the metrics read `sources`, the
        admin listener answers `/api/...` with `api`."""
        s = self.settings
        loop = asyncio.get_running_loop()
        metrics = self.metrics = GatewayMetrics(sources)
        if s.admin_port is not None:
            metrics.instrument_store(sources.store)
        try:
            ctx = self.ssl_context
            if s.tls_port is not None:
                self.servers["mqtts"] = await loop.create_server(
                    lambda: MqttServerProtocol(context, state),
                    s.host,
                    s.tls_port,
                    ssl=ctx,
                    reuse_address=True,
                    backlog=s.listen_backlog,
                )
            if s.ws_port is not None:
                self.servers["ws"] = await loop.create_server(
                    lambda: WebSocketMqttProtocol(context, state),
                    s.host,
                    s.ws_port,
                    reuse_address=True,
                    backlog=s.listen_backlog,
                )
            if s.wss_port is not None:
                self.servers["wss"] = await loop.create_server(
                    lambda: WebSocketMqttProtocol(context, state),
                    s.host,
                    s.wss_port,
                    ssl=ctx,
                    reuse_address=True,
                    backlog=s.listen_backlog,
                )
            if s.admin_port is not None:
                self.admin = AdminServer(sources, metrics, api)
                await self.admin.start(s.admin_host, s.admin_port)
        except BaseException:
            self.close()
            raise
        for name in self.servers:
            log.info("lmqtt %s listener on %s:%d", name, s.host, self.port(name))
        if self.admin is not None:
            log.info("lmqtt admin (/metrics, /health) on %s:%d", s.admin_host, self.admin.port)
            if api is not None:
                level = logging.INFO if api.auth.configured else logging.WARNING
                log.log(level, "lmqtt admin API (/api): %s", api.auth.describe())

    def port(self, name: str) -> int:
        """Bound port of listener `name`: mqtts, ws, wss or admin."""
        if name == "admin":
            assert self.admin is not None
            return self.admin.port
        server = self.servers[name]
        return int(server.sockets[0].getsockname()[1])

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        if self.admin is not None:
            self.admin.close()

    async def wait_closed(self) -> None:
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)
