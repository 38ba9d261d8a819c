"""Every limit hit from a real client, with the reason code it must produce."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.access.limits import ConnectRateLimiter, is_loopback, socket_limit, topic_limit_error
from gateway.protocol import ConnAck, Disconnect, Publish, SubAck, Subscribe, Subscription
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until

# ---------------------------------------------------------------- pure parts


def test_token_bucket_per_address() -> None:
    rl = ConnectRateLimiter(rate=2.0, burst=3, limit_loopback=True)
    t = 100.0
    assert [rl.allow("10.0.0.1", t) for _ in range(4)] == [True, True, True, False]
    assert rl.allow("10.0.0.2", t)  # another address has its own bucket
    assert not rl.allow("10.0.0.1", t + 0.4)  # 0.8 tokens
    assert rl.allow("10.0.0.1", t + 0.5)  # refilled to 1
    assert [rl.allow("10.0.0.1", t + 100) for _ in range(4)] == [True, True, True, False]


def test_token_bucket_table_is_bounded_and_loopback_exempt_by_default() -> None:
    rl = ConnectRateLimiter(rate=1.0, burst=1, max_addresses=100)
    for i in range(1000):
        rl.allow(f"10.1.{i // 256}.{i % 256}", 0.0)
    assert len(rl) == 100
    assert all(rl.allow("127.0.0.1", 0.0) for _ in range(50))
    assert all(ConnectRateLimiter(0, 1, limit_loopback=True).allow("1.2.3.4") for _ in range(50))


@pytest.mark.parametrize(
    ("host", "loop"),
    [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("", False)],
)
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_topic_limit_error() -> None:
    assert topic_limit_error("a/b/c", 10, 3) is None
    assert "levels" in (topic_limit_error("a/b/c/d", 100, 3) or "")
    assert "bytes" in (topic_limit_error("é" * 6, 10, 3) or "")  # UTF-8 bytes, not characters
    assert socket_limit(2) == 18 and socket_limit(1000) == 1100


# ---------------------------------------------------------------- against a running gateway


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[GatewayHarness]:
    h = GatewayHarness(
        tmp_path / "data",
        max_connections=3,
        connect_timeout=0.5,
        max_topic_length=32,
        max_topic_levels=4,
        max_subscriptions=3,
        max_packet_size=1024,
        max_inflight=5,
    ).start()
    try:
        yield h
    finally:
        h.stop()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def three_connections(tmp_path: Path) -> Iterator[GatewayHarness]:
    """max_connections 3 and a connect timeout far longer than the test: the sockets it holds
    open without a CONNECT stay open (with `limited`'s 0.5 s they were closed while a loaded
    host was still opening the others), and a socket closed within seconds was closed by the
    socket limit, not by the timeout."""
    h = GatewayHarness(tmp_path / "data", max_connections=3, connect_timeout=60).start()
    try:
        yield h
    finally:
        h.stop()


def test_max_connections(three_connections: GatewayHarness, clients: list[Client]) -> None:
    limited = three_connections
    for i in range(3):
        c = Client(limited.port, f"c{i}")
        clients.append(c)
        assert c.connack == (False, 0)
    over5 = Client(limited.port, "over5", v5=True)
    clients.append(over5)
    assert over5.connack is not None and over5.connack[1] == 0x97  # quota exceeded
    raw = RawClient(limited.port, level=4)
    try:
        raw.send_bytes(b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01x")
        assert raw.sock.recv(4) == b"\x20\x02\x00\x03"  # 3.1.1: server unavailable
    finally:
        raw.close()
    # Beyond socket_limit(3) = 19 open sockets, new ones are closed without being read.
    held = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(16)]
    try:
        gw = limited.gw
        assert gw is not None
        wait_until(lambda: limited.call(lambda: len(gw.connections)) == 19, what="19 sockets")
        with socket.create_connection(("127.0.0.1", limited.port)) as extra:
            assert _closed_within(extra, 5)
    finally:
        for s in held:
            s.close()


def test_connect_timeout_closes_silent_sockets(limited: GatewayHarness) -> None:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", limited.port)) as silent:
        assert _closed_within(silent, 10)
    assert time.monotonic() - t0 < 5
    with socket.create_connection(("127.0.0.1", limited.port)) as partial:
        partial.sendall(b"\x10\x20\x00\x04MQ")  # a CONNECT that never completes
        assert _closed_within(partial, 10)


def test_connect_rate_per_address(tmp_path: Path, clients: list[Client]) -> None:
    h = GatewayHarness(
        tmp_path / "data", connect_rate=0.5, connect_burst=3, connect_rate_loopback=True
    ).start()
    try:
        codes = []
        for i in range(4):
            c = Client(h.port, f"r{i}", v5=True)
            clients.append(c)
            assert c.connack is not None
            codes.append(c.connack[1])
        assert codes == [0, 0, 0, 0x9F]  # connection rate exceeded
    finally:
        h.stop()


def _raw5(port: int, cid: str) -> RawClient:
    raw = RawClient(port, level=5)
    ack = raw.connect(cid)
    assert isinstance(ack, ConnAck) and ack.reason_code == 0
    return raw


def test_topic_length_and_levels(limited: GatewayHarness) -> None:
    raw = _raw5(limited.port, "topics")
    try:
        raw.send(
            Subscribe(
                1,
                [
                    Subscription("a/b/c/d", 0),
                    Subscription("a/b/c/d/e", 0),  # 5 levels
                    Subscription("x" * 33, 0),  # 33 bytes
                ],
            )
        )
        ack = raw.recv_until(SubAck)
        assert ack.reason_codes == [0, 0x8F, 0x8F]
        raw.send(Publish(topic="a/b/c/d/e", payload=b"", qos=0))
        dis = raw.recv_until(Disconnect)
        assert dis is not None and dis.reason_code == 0x90
        assert raw.is_closed()
    finally:
        raw.close()
    raw4 = RawClient(limited.port, level=4)
    try:
        assert raw4.connect("t4").reason_code == 0
        raw4.send(Subscribe(1, [Subscription("1/2/3/4/5", 0)]))
        assert raw4.recv_until(SubAck).reason_codes == [0x80]
        raw4.send(Publish(topic="y" * 40, payload=b"", qos=0))
        assert raw4.is_closed()  # 3.1.1: nothing to say, the connection is closed
    finally:
        raw4.close()


def test_max_subscriptions(limited: GatewayHarness, clients: list[Client]) -> None:
    c = Client(limited.port, "subs", v5=True)
    clients.append(c)
    assert c.subscribe([("s/1", 0), ("s/2", 0), ("s/3", 0)]) == [0, 0, 0]
    assert c.subscribe("s/4", 0) == [0x97]
    assert c.subscribe("s/2", 1) == [1]  # replacing an existing one is not a new one
    c.unsubscribe("s/1")
    assert c.subscribe("s/4", 0) == [0]


def test_max_packet_size(limited: GatewayHarness) -> None:
    raw = _raw5(limited.port, "big")
    try:
        raw.send(Publish(topic="big", payload=b"x" * 2000, qos=0))
        dis = raw.recv_until(Disconnect)
        assert dis is not None and dis.reason_code == 0x95  # packet too large
    finally:
        raw.close()


def test_max_inflight_window(limited: GatewayHarness, clients: list[Client]) -> None:
    slow = Client(limited.port, "slow", v5=True, auto_ack=False)
    clients.append(slow)
    slow.subscribe("w/#", 1)
    pub = Client(limited.port, "pub")
    clients.append(pub)
    for i in range(20):
        pub.publish(f"w/{i}", str(i).encode(), 1)
    slow.wait_messages(5)
    gw = limited.gw
    assert gw is not None

    def inflight() -> int:
        session: Any = gw.sessions.get("slow")
        return len(session.inflight)

    assert limited.call(inflight) == 5  # max_inflight: the rest waits in the store
    assert len(slow.messages) == 5
    acked = 0
    while acked < 20:

        def more(n: int = acked) -> bool:
            return len(slow.messages) > n

        wait_until(more, what="next message")
        with slow.lock:
            batch = slow.messages[acked:]
        for m in batch:
            slow.c.ack(m.mid, m.qos)
        acked += len(batch)
    assert [m.payload for m in slow.messages] == [str(i).encode() for i in range(20)]
