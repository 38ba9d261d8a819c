"""The admin API framework over real HTTP: authentication, routing, errors as JSON."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.access.auth import PasswordFile
from gateway.ops.admin_api import ApiError, ApiRequest, ApiResponse, Route
from gateway.ops.admin_client import AdminClient, AdminClientError
from tests.gateway.conftest import GatewayHarness

TOKEN = "s3cret-token"


async def _echo(req: ApiRequest) -> ApiResponse:
    body = req.json() if req.method == "POST" else None
    if req.params.get("id") == "teapot":
        raise ApiError(418, "short and stout")
    return ApiResponse(200, {"params": req.params, "query": req.query, "body": body})


def _http(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one raw request; (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.fixture(scope="module")
def api_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHarness]:
    tmp = tmp_path_factory.mktemp("admin-api")
    (tmp / "token").write_text(TOKEN + "\n")
    pw = PasswordFile()
    pw.set("ops", "opspw")
    pw.set("device", "devpw")
    pw.save(tmp / "passwd")
    h = GatewayHarness(
        tmp / "data",
        admin_port=0,
        admin_token_file=tmp / "token",
        password_file=tmp / "passwd",
        admin_users=["ops"],
    ).start()
    assert h.gw is not None
    gw = h.gw
    h.call(lambda: gw.admin_api.add([Route("GET", "/api/echo/{id}", _echo)]))
    h.call(lambda: gw.admin_api.add([Route("POST", "/api/echo/{id}", _echo)]))
    try:
        yield h
    finally:
        h.stop()


def _url(h: GatewayHarness) -> str:
    assert h.gw is not None
    return f"http://127.0.0.1:{h.gw.listeners.port('admin')}"


def test_credentials_are_required(api_gateway: GatewayHarness) -> None:
    url = _url(api_gateway)
    for client in (
        AdminClient(url),
        AdminClient(url, token="wrong"),
        AdminClient(url, basic=("ops", "wrong")),
        AdminClient(url, basic=("device", "devpw")),  # in the file, not in admin_users
    ):
        with pytest.raises(AdminClientError) as err:
            client.get("/api/echo/x")
        assert err.value.status == 401
    # The unauthenticated parts stay open.
    port = int(url.rsplit(":", 1)[1])
    status, _, body = _http(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_routing_and_errors(api_gateway: GatewayHarness) -> None:
    url = _url(api_gateway)
    for client in (AdminClient(url, token=TOKEN), AdminClient(url, basic=("ops", "opspw"))):
        got = client.get("/api/echo/a%2Fb", {"sort": "rate", "limit": "5"})
        assert got == {
            "params": {"id": "a/b"},
            "query": {"sort": "rate", "limit": "5"},
            "body": None,
        }
        assert client.post("/api/echo/x", {"k": 1})["body"] == {"k": 1}
    client = AdminClient(url, token=TOKEN)
    cases = [
        (lambda: client.get("/api/nothing"), 404),
        (lambda: client.delete("/api/echo/x"), 405),
        (lambda: client.get("/api/echo/teapot"), 418),
    ]
    for call, status in cases:
        with pytest.raises(AdminClientError) as err:
            call()
        assert err.value.status == status, err.value
    port = int(url.rsplit(":", 1)[1])
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    bad_json = b"{not json"
    status, headers, body = _http(
        port,
        b"POST /api/echo/x HTTP/1.1\r\n" + auth
        + f"Content-Length: {len(bad_json)}\r\n\r\n".encode() + bad_json,
    )  # fmt: skip
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]
    assert headers["content-type"] == "application/json"
    status, headers, body = _http(port, b"DELETE /api/echo/x HTTP/1.1\r\n" + auth + b"\r\n")
    assert status == 405 and headers["allow"] == "GET, POST"
    status, _, body = _http(
        port, b"POST /api/echo/x HTTP/1.1\r\n" + auth + b"Content-Length: 99999999\r\n\r\n"
    )
    assert status == 413 and "error" in json.loads(body)
    status, _, body = _http(port, b"GET /api/echo/x HTTP/1.1\r\n\r\n")
    assert status == 401 and "credentials" in json.loads(body)["error"]


def test_api_off_without_credentials(tmp_path: Path) -> None:
    h = GatewayHarness(tmp_path / "data", admin_port=0).start()
    try:
        with pytest.raises(AdminClientError) as err:
            AdminClient(_url(h), token="anything").get("/api/bans")
        assert err.value.status == 403
        assert "admin_token_file" in str(err.value)
    finally:
        h.stop()
