"""Bad input from raw sockets: the right reason code (MQTT 5) or a close (3.1.1), a log line,
no internal error, and no effect on other clients or on stored data."""

from __future__ import annotations

import itertools
import logging
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.protocol import (
    ConnAck,
    Disconnect,
    PingReq,
    PingResp,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
)
from tests.gateway.conftest import GatewayHarness, RawClient


def raw_publish(topic: bytes, payload: bytes = b"x") -> bytes:
    body = struct.pack(">H", len(topic)) + topic + payload
    assert len(body) < 128
    return bytes((0x30, len(body))) + body


def _healthy(gateway: GatewayHarness, client_id: str = "probe") -> None:
    """Another client still gets service, end to end."""
    probe = RawClient(gateway.port, level=4)
    assert probe.connect(client_id).reason_code == 0
    probe.send(Subscribe(1, [Subscription("health/t", 0)]))
    assert probe.recv().reason_codes == [0]
    probe.send(Publish("health/t", b"ok"))
    assert probe.recv().payload == b"ok"
    probe.send(PingReq())
    assert probe.recv() == PingResp()
    probe.close()


@pytest.fixture(autouse=True)
def no_internal_errors(caplog: pytest.LogCaptureFixture) -> object:
    caplog.set_level(logging.WARNING, logger="lmqtt")
    yield
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


def test_garbage_instead_of_connect(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port)
    # 'G' reads as a PUBACK header declaring 69 bytes; send them all so it is judged at once.
    c.send_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(100, b"\n"))
    assert c.is_closed()
    c.close()
    _healthy(gateway)


def test_unsupported_protocol_level(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=4)
    # CONNECT "MQTT" level 6
    body = b"\x00\x04MQTT\x06\x02\x00\x3c\x00\x01x"
    c.send_bytes(bytes((0x10, len(body))) + body)
    ack = c.recv()
    assert isinstance(ack, ConnAck) and ack.reason_code == 0x84
    assert c.is_closed()
    _healthy(gateway)


def test_oversized_packet_mqtt5_and_311(gateway: GatewayHarness) -> None:
    gateway.restart(max_packet_size=1024)
    c5 = RawClient(gateway.port, level=5)
    assert c5.connect("big5").properties.maximum_packet_size == 1024
    c5.send(Publish("big/t", b"x" * 2000))
    ev = c5.recv()
    assert isinstance(ev, Disconnect) and ev.reason_code == 0x95
    assert c5.is_closed()
    c4 = RawClient(gateway.port, level=4)
    c4.connect("big4")
    c4.send(Publish("big/t", b"x" * 2000))
    assert c4.is_closed()
    gw = gateway.gw
    assert gw is not None
    assert gateway.call(lambda: gw.store.max_offset("big")) == 0  # nothing stored
    _healthy(gateway)


def test_invalid_topic_names(gateway: GatewayHarness) -> None:
    c5 = RawClient(gateway.port, level=5)
    c5.connect("wild5")
    c5.send_bytes(raw_publish(b"bad/+/topic"))
    ev = c5.recv()
    assert isinstance(ev, Disconnect) and ev.reason_code in (0x90, 0x81, 0x82)
    assert c5.is_closed()
    c4 = RawClient(gateway.port, level=4)
    c4.connect("wild4")
    c4.send_bytes(raw_publish(b"bad/#"))
    assert c4.is_closed()
    c4 = RawClient(gateway.port, level=4)
    c4.connect("nul4")
    c4.send_bytes(raw_publish(b"bad/\x00/nul"))
    assert c4.is_closed()
    gw = gateway.gw
    assert gw is not None
    assert gateway.call(lambda: gw.store.max_offset("bad")) == 0
    _healthy(gateway)


def test_invalid_filters_are_refused_in_suback(gateway: GatewayHarness) -> None:
    c5 = RawClient(gateway.port, level=5)
    c5.connect("f5")
    c5.send(Subscribe(1, [Subscription("a/#/b", 0), Subscription("ok/#", 1)]))
    ack = c5.recv()
    assert isinstance(ack, SubAck) and ack.reason_codes == [0x8F, 1]
    c4 = RawClient(gateway.port, level=4)
    c4.connect("f4")
    c4.send(Subscribe(1, [Subscription("x+/y", 0), Subscription("$share/g", 0)]))
    assert c4.recv().reason_codes == [0x80, 0x80]
    c4.send(PingReq())
    assert c4.recv() == PingResp()  # the connection lives on
    _healthy(gateway)


def test_unexpected_packets(gateway: GatewayHarness) -> None:
    c5 = RawClient(gateway.port, level=5)
    c5.connect("unexp5")
    c5.send(SubAck(1, [0]))  # a server-to-client packet
    ev = c5.recv()
    assert isinstance(ev, Disconnect) and ev.reason_code == 0x82
    assert c5.is_closed()
    c4 = RawClient(gateway.port, level=4)
    c4.connect("unexp4")
    c4.send_bytes(b"\x10\x00")  # second CONNECT (malformed too)
    assert c4.is_closed()
    pre = RawClient(gateway.port, level=4)
    pre.send(PingReq())  # before CONNECT
    assert pre.is_closed()
    _healthy(gateway)


_EXAMPLES = itertools.count()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(junk=st.binary(min_size=1, max_size=300))
def test_fuzzed_bytes_after_connect(gateway: GatewayHarness, junk: bytes) -> None:
    # One gateway serves every example: each takes new client ids, or the examples' connects
    # would add up to a flapping ban (gateway/access/flapping.py) for a fixed one.
    n = next(_EXAMPLES)
    c = RawClient(gateway.port, level=5)
    try:
        assert c.connect(f"fuzz-{n}").reason_code == 0
        c.send_bytes(junk)
        # Whatever the bytes were, the gateway answers or closes; it never hangs or crashes.
        try:
            c.recv(timeout=0.1)
        except TimeoutError:
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        c.close()
    _healthy(gateway, f"probe-{n}")


def test_silent_socket_closed_after_connect_timeout(gateway: GatewayHarness) -> None:
    gateway.restart(connect_timeout=0.5)
    c = RawClient(gateway.port, level=4)  # sends nothing at all
    assert c.is_closed(timeout=5)
    c.close()
    _healthy(gateway)
