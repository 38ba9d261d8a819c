"""MQTT over WebSocket (subprotocol `mqtt`), plain and TLS, with paho's websocket transport,
plus raw-socket checks of the HTTP upgrade and framing rules."""

from __future__ import annotations

import base64
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from gateway.protocol import Connect, encode
from tests.gateway.certs import Certs, make_certs
from tests.gateway.conftest import Client, GatewayHarness, wait_until


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def ws_gateway(tmp_path: Path, certs: Certs) -> Iterator[GatewayHarness]:
    h = GatewayHarness(
        tmp_path / "data",
        ws_port=0,
        wss_port=0,
        tls_certfile=certs.server_cert,
        tls_keyfile=certs.server_key,
        connect_timeout=1.0,
    ).start()
    try:
        yield h
    finally:
        h.stop()


class WsClient:
    """paho over WebSocket, recording messages."""

    def __init__(self, port: int, *, v5: bool = False, ca: Path | None = None) -> None:
        proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        self.c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, protocol=proto, transport="websockets"
        )
        self.c.ws_set_options(path="/mqtt")
        if ca is not None:
            self.c.tls_set(ca_certs=str(ca))
        self.messages: list[mqtt.MQTTMessage] = []
        self.connack: int | None = None
        self.subacks: dict[int, list[int]] = {}
        self.lock = threading.Lock()
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.on_subscribe = self._on_subscribe
        self.c.connect("127.0.0.1", port, keepalive=30)
        self.c.loop_start()
        wait_until(lambda: self.connack is not None, what="CONNACK over websocket")

    def _on_connect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self.connack = int(rc.value)

    def _on_message(self, c: Any, u: Any, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append(msg)

    def _on_subscribe(self, c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
        self.subacks[mid] = [int(r.value) for r in rcs]

    def subscribe(self, topic: str, qos: int) -> list[int]:
        _rc, mid = self.c.subscribe(topic, qos)
        assert mid is not None
        wait_until(lambda: mid in self.subacks, what="SUBACK")
        return self.subacks[mid]

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _ports(h: GatewayHarness) -> tuple[int, int]:
    assert h.gw is not None
    return h.gw.listeners.port("ws"), h.gw.listeners.port("wss")


@pytest.mark.parametrize("v5", [True, False])
def test_ws_and_wss_publish_subscribe(
    ws_gateway: GatewayHarness, certs: Certs, clients: list[Client], v5: bool
) -> None:
    ws_port, wss_port = _ports(ws_gateway)
    ws = WsClient(ws_port, v5=v5)
    wss = WsClient(wss_port, v5=v5, ca=certs.ca)
    try:
        assert ws.connack == 0 and wss.connack == 0
        assert ws.subscribe("web/#", 1) == [1]
        assert wss.subscribe("web/#", 2) == [2]
        tcp = Client(ws_gateway.port, v5=v5)
        clients.append(tcp)
        tcp.subscribe("web/#", 1)
        big = os.urandom(200_000)  # spans many websocket frames and TCP segments
        for i in range(20):
            tcp.publish(f"web/{i}", f"m{i}".encode(), 1)
        wss.c.publish("web/big", big, 1).wait_for_publish(10)
        ws.c.publish("web/from-ws", b"hello", 1).wait_for_publish(10)
        for cl in (ws, wss):
            wait_until(lambda cl=cl: len(cl.messages) >= 22, what="22 messages")  # type: ignore[misc]
            payloads = [m.payload for m in cl.messages]
            assert payloads[:20] == [f"m{i}".encode() for i in range(20)]
            assert big in payloads and b"hello" in payloads
        assert tcp.wait_messages(22)
    finally:
        ws.close()
        wss.close()


def _upgrade(port: int, protocol: str | None) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    head = (
        f"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
    )
    if protocol:
        head += f"Sec-WebSocket-Protocol: {protocol}\r\n"
    sock.sendall((head + "\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return sock, data


def _frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (payload < 126 bytes)."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes((0x80 | opcode, 0x80 | len(payload))) + mask + masked


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection. A server that stays silent past the
    socket's timeout raises TimeoutError: silence is not a close."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_upgrade_requires_mqtt_subprotocol(ws_gateway: GatewayHarness) -> None:
    ws_port, _ = _ports(ws_gateway)
    sock, head = _upgrade(ws_port, None)
    sock.close()
    assert head.startswith(b"HTTP/1.1 400")
    sock, head = _upgrade(ws_port, "chat, mqtt")
    try:
        assert head.startswith(b"HTTP/1.1 101")
        assert b"sec-websocket-protocol: mqtt" in head.lower()
        # A CONNECT split over two binary frames still parses ([MQTT-6.0.0-2]).
        connect = encode(Connect(4, "raw-ws", True, 30), 4)
        sock.sendall(_frame(0x2, connect[:5]) + _frame(0x2, connect[5:]))
        reply = sock.recv(64)
        assert reply[:2] == b"\x82\x04" and reply[2:6] == b"\x20\x02\x00\x00"  # CONNACK
        sock.sendall(_frame(0x1, b"text is not allowed"))  # [MQTT-6.0.0-1]: close
        rest = _read_all(sock)
        assert rest[:1] == b"\x88"  # a close frame, then the connection ends
    finally:
        sock.close()


def test_garbage_and_silent_sockets_are_closed(ws_gateway: GatewayHarness) -> None:
    ws_port, _ = _ports(ws_gateway)
    with socket.create_connection(("127.0.0.1", ws_port), timeout=10) as sock:
        sock.sendall(b"\x10\x00garbage that is not HTTP\r\n\r\n")
        reply = _read_all(sock)  # closed at once (websockets may or may not say 400 first)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", ws_port), timeout=10) as sock:
        # Never completes the upgrade: closed after connect_timeout (1 s here).
        sock.sendall(b"GET /mqtt HTTP/1.1\r\n")
        assert _read_all(sock) == b""
    gw = ws_gateway.gw
    assert gw is not None
    wait_until(lambda: ws_gateway.call(lambda: len(gw.connections)) == 0, what="no connections")
