"""MQTT 5 features: aliases, subscription ids, receive maximum, no-local, retain-as-published,
maximum packet size, message expiry, overlapping subscriptions, and `$`-topics."""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from gateway.protocol import (
    Disconnect,
    Properties,
    PubAck,
    Publish,
    PubRec,
    PubRel,
    Subscribe,
    Subscription,
)
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until

TCP_CLOSE = 7  # Linux tcp_info states
TCP_CLOSE_WAIT = 8


def _sub(
    gateway: GatewayHarness, cid: str, subs: list[Subscription], **connect: object
) -> RawClient:
    c = RawClient(gateway.port, level=5)
    assert c.connect(cid, **connect).reason_code == 0  # type: ignore[arg-type]
    c.send(Subscribe(1, subs))
    ack = c.recv()
    assert len(ack.reason_codes) == len(subs)
    return c


def _pub(gateway: GatewayHarness, cid: str = "p5") -> RawClient:
    p = RawClient(gateway.port, level=5)
    p.connect(cid)
    return p


def test_inbound_topic_alias(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "s", [Subscription("alias/in", 0)])
    p = _pub(gateway)
    p.send(Publish("alias/in", b"1", properties=Properties(topic_alias=3)))
    p.send(Publish("", b"2", properties=Properties(topic_alias=3)))
    assert [s.recv().payload for _ in range(2)] == [b"1", b"2"]
    # An alias above the maximum we announced is a protocol error (0x94).
    p.send(Publish("alias/in", b"x", properties=Properties(topic_alias=65)))
    ev = p.recv()
    assert ev.reason_code == 0x94
    assert p.is_closed()
    s.close()


def test_inbound_topic_alias_zero_is_topic_alias_invalid(gateway: GatewayHarness) -> None:
    """Alias 0 is never valid ([MQTT-3.3.2-8]): DISCONNECT 0x94 Topic Alias invalid, as for one
    above the maximum (Paho interop test_client_topic_alias, Mosquitto)."""
    p = _pub(gateway)
    # PUBLISH QoS 1 "t", packet id 1, properties: Topic Alias (0x23) = 0. Raw: our encoder
    # refuses to write alias 0.
    p.send_bytes(bytes([0x32, 9, 0, 1]) + b"t" + bytes([0, 1, 3, 0x23, 0, 0]))
    ev = p.recv()
    assert isinstance(ev, Disconnect)
    assert ev.reason_code == 0x94
    assert p.is_closed()


def test_outbound_topic_alias(gateway: GatewayHarness) -> None:
    s = _sub(
        gateway, "s", [Subscription("alias/out/#", 0)], properties=Properties(topic_alias_maximum=2)
    )
    p = _pub(gateway)
    for t in ("alias/out/a", "alias/out/a", "alias/out/b", "alias/out/c", "alias/out/b"):
        p.send(Publish(t, t.encode()))
    got = [s.recv() for _ in range(5)]
    assert [(g.topic, g.properties.topic_alias if g.properties else None) for g in got] == [
        ("alias/out/a", 1),
        ("", 1),
        ("alias/out/b", 2),
        ("alias/out/c", None),  # aliases used up: full topic
        ("", 2),
    ]
    assert [g.payload for g in got][-1] == b"alias/out/b"


def test_subscription_identifiers_and_overlap_single_copy(gateway: GatewayHarness) -> None:
    s = RawClient(gateway.port, level=5)
    s.connect("ids")
    s.send(Subscribe(1, [Subscription("o/+/t", 0)], Properties(subscription_identifiers=[7])))
    s.recv()
    s.send(Subscribe(2, [Subscription("o/#", 1)], Properties(subscription_identifiers=[9])))
    s.recv()
    p = _pub(gateway)
    p.send(Publish("o/1/t", b"both", qos=1, packet_id=1))
    p.recv()
    p.send(Publish("o/1/u", b"one", qos=1, packet_id=2))
    p.recv()
    first = s.recv()
    assert first.payload == b"both" and first.qos == 1  # highest QoS of the matches
    assert sorted(first.properties.subscription_identifiers) == [7, 9]
    s.send(PubAck(first.packet_id))
    second = s.recv()  # no duplicate of "both" in between
    assert second.payload == b"one" and second.properties.subscription_identifiers == [9]
    s.close()


def test_overlapping_subscriptions_311_single_copy(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    s = Client(gateway.port, "ov")
    p = Client(gateway.port, "op")
    clients += [s, p]
    s.subscribe([("ov/a", 0), ("ov/+", 2), ("#", 1)])
    p.publish("ov/a", b"x", qos=2)
    p.publish("ov/b", b"y", qos=2)
    msgs = s.wait_messages(2)
    p.publish("ov/zz", b"probe", qos=0)
    msgs = s.wait_messages(3)
    assert [(m.payload, m.qos) for m in msgs] == [(b"x", 2), (b"y", 2), (b"probe", 0)]


def test_no_local_and_retain_as_published(gateway: GatewayHarness) -> None:
    me = RawClient(gateway.port, level=5)
    me.connect("self")
    me.send(
        Subscribe(
            1,
            [
                Subscription("nl/t", 0, no_local=True),
                Subscription("rap/t", 0, retain_as_published=True),
            ],
        )
    )
    me.recv()
    me.send(Publish("nl/t", b"mine"))
    me.send(Publish("rap/t", b"kept-flag", retain=True))
    got = me.recv()
    assert got.topic == "rap/t" and got.retain  # and nothing from nl/t
    other = _pub(gateway)
    other.send(Publish("nl/t", b"theirs"))
    got = me.recv()
    assert got.payload == b"theirs"
    me.close()


def test_receive_maximum_limits_inflight(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "rm", [Subscription("rm/t", 1)], properties=Properties(receive_maximum=2))
    p = _pub(gateway)
    for i in range(5):
        p.send(Publish("rm/t", f"{i}".encode(), qos=1, packet_id=i + 1))
        p.recv()
    a, b = s.recv(), s.recv()
    assert [a.payload, b.payload] == [b"0", b"1"]
    try:
        extra = s.recv(timeout=0.3)
    except TimeoutError:
        extra = None
    assert extra is None  # the window is full
    s.send(PubAck(a.packet_id))
    assert s.recv().payload == b"2"
    s.send(PubAck(b.packet_id))
    assert s.recv().payload == b"3"
    s.close()


def _tcp_state(sock: socket.socket) -> int:
    return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0])


def _unacked_bytes(sock: socket.socket) -> int:
    """Bytes written to `sock` that the peer has not acknowledged yet (SIOCOUTQ)."""
    out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", out)[0])


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux TCP state")
def test_receive_maximum_exceeded_disconnect_survives_the_clients_acks(tmp_path: Path) -> None:
    """One QoS 2 PUBLISH beyond our Receive Maximum gets DISCONNECT 0x93 (Paho interop
    test_flow_control2). The client answers the PUBRECs queued ahead of it with PUBRELs as any
    client does; the gateway must take those bytes, not reset the connection (a reset fails
    the client's writes and may drop the DISCONNECT unread), then close when the client does."""
    h = GatewayHarness(tmp_path / "data", receive_maximum=5).start()
    try:
        c = RawClient(h.port, level=5)
        assert c.connect("flood").reason_code == 0
        for pid in range(1, 7):
            c.send(Publish("rm/in", b"x", qos=2, packet_id=pid))
        events = []
        while (ev := c.recv()) is not None:  # up to the gateway's end of stream
            events.append(ev)
        assert [type(e) for e in events] == [PubRec] * 5 + [Disconnect]
        assert events[-1].reason_code == 0x93
        for ev in events[:-1]:
            c.send(PubRel(ev.packet_id))
        # Acknowledged, or answered with a reset (the socket closed outright).
        wait_until(lambda: _tcp_state(c.sock) == TCP_CLOSE or _unacked_bytes(c.sock) == 0)
        assert _tcp_state(c.sock) == TCP_CLOSE_WAIT
        c.close()
        # The client closed its side: the gateway closes at once, not after its linger time.
        wait_until(lambda: h.call(lambda: len(h.gw.connections)) == 0, timeout=1.0)  # type: ignore[union-attr]
    finally:
        h.stop()


def test_client_maximum_packet_size_drops_large(gateway: GatewayHarness) -> None:
    s = _sub(
        gateway, "small", [Subscription("mp/t", 0)], properties=Properties(maximum_packet_size=64)
    )
    p = _pub(gateway)
    p.send(Publish("mp/t", b"x" * 200))
    p.send(Publish("mp/t", b"fits"))
    assert s.recv().payload == b"fits"
    s.close()


def test_resent_publish_too_large_for_the_new_connection_frees_its_window_slot(
    gateway: GatewayHarness,
) -> None:
    """An unacknowledged QoS 1 message is not re-sent to a reconnecting client whose Maximum
    Packet Size it now exceeds; it is done as if sent ([MQTT-3.1.2-25]), so with Receive
    Maximum 1 the next message still flows."""
    s = RawClient(gateway.port, level=5)
    s.connect("shrink", properties=Properties(session_expiry_interval=60))
    s.send(Subscribe(1, [Subscription("shrink/t", 1)]))
    s.recv()
    p = _pub(gateway)
    p.send(Publish("shrink/t", b"x" * 200, qos=1, packet_id=1))
    p.recv()
    assert s.recv().payload == b"x" * 200  # and never acknowledged
    s.close()
    small = Properties(session_expiry_interval=60, maximum_packet_size=100, receive_maximum=1)
    s = RawClient(gateway.port, level=5)
    assert s.connect("shrink", clean=False, properties=small).session_present
    p.send(Publish("shrink/t", b"next", qos=1, packet_id=2))
    p.recv()
    got = s.recv()
    assert got.payload == b"next"
    s.send(PubAck(got.packet_id))
    s.close()
    p.close()


def _unacked_retained_copy(gateway: GatewayHarness, cid: str) -> Publish:
    """`cid` subscribes (session expiry 60) to a topic holding a retained QoS 1 message, gets
    it and drops the connection without acknowledging it."""
    p = _pub(gateway, "retainer")
    p.send(Publish("held/t", b"retained", qos=1, packet_id=1, retain=True))
    p.recv()
    p.close()
    s = RawClient(gateway.port, level=5)
    s.connect(cid, properties=Properties(session_expiry_interval=60))
    s.send(Subscribe(1, [Subscription("held/t", 1)], Properties(subscription_identifiers=[7])))
    s.recv()
    first = s.recv()
    assert first.payload == b"retained"
    s.close()
    return first


@pytest.mark.parametrize("restart", [False, True], ids=["live", "after-restart"])
def test_unacked_retained_copy_is_resent_when_the_session_resumes(
    gateway: GatewayHarness, restart: bool
) -> None:
    """[MQTT-4.4.0-1]: unacknowledged QoS 1 PUBLISH packets are re-sent on resumption, with
    their packet id, DUP and subscription identifiers, the retained copy sent at SUBSCRIBE
    included; sessions.json keeps the copy, so also after a restart. Acknowledging it frees
    the one slot Receive Maximum 1 allows."""
    first = _unacked_retained_copy(gateway, "held")
    if restart:
        gateway.restart()
    s = RawClient(gateway.port, level=5)
    one = Properties(session_expiry_interval=60, receive_maximum=1)
    assert s.connect("held", clean=False, properties=one).session_present
    again = s.recv()
    assert (again.payload, again.packet_id, again.dup, again.retain) == (
        b"retained",
        first.packet_id,
        True,
        True,
    )
    assert again.properties.subscription_identifiers == [7]
    p = _pub(gateway)
    p.send(Publish("held/t", b"next", qos=1, packet_id=2))
    p.recv()
    s.send(PubAck(again.packet_id))  # frees the one slot Receive Maximum 1 allows
    assert s.recv().payload == b"next"
    s.close()
    p.close()


def test_message_expiry(gateway: GatewayHarness) -> None:
    s = RawClient(gateway.port, level=5)
    s.connect("exp", properties=Properties(session_expiry_interval=60))
    s.send(Subscribe(1, [Subscription("ex/t", 1)]))
    s.recv()
    s.close()
    p = _pub(gateway)
    p.send(
        Publish(
            "ex/t", b"short", qos=1, packet_id=1, properties=Properties(message_expiry_interval=1)
        )
    )
    p.recv()
    p.send(
        Publish(
            "ex/t", b"long", qos=1, packet_id=2, properties=Properties(message_expiry_interval=100)
        )
    )
    p.recv()
    time.sleep(1.1)  # let the first message's expiry interval pass while the session is offline
    s = RawClient(gateway.port, level=5)
    s.connect("exp", clean=False, properties=Properties(session_expiry_interval=60))
    got = s.recv()
    assert got.payload == b"long"
    # Counted down by the >= 1.1 s it waited (so below 100), with slack for a loaded host
    # (RocketMQ's store time, a slow CI machine), not reset and not expired.
    assert 90 <= got.properties.message_expiry_interval <= 99
    s.close()


def test_dollar_topics(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "all", [Subscription("#", 0), Subscription("+/x", 0)])
    p = _pub(gateway)
    p.send(Publish("$SYS/fake", b"no", qos=1, packet_id=1))
    ack = p.recv()
    assert isinstance(ack, PubAck) and ack.reason_code == 0x87
    p.send(Publish("$other/x", b"no"))
    p.send(Publish("ok/x", b"yes"))
    got = s.recv()
    assert got.payload == b"yes"  # neither the refused nor a $-topic for "#"
    s.close()


def test_overlap_added_later_neither_loses_nor_duplicates(gateway: GatewayHarness) -> None:
    x = _sub(gateway, "x", [Subscription("ov2/#", 1)])
    y = _sub(gateway, "y", [Subscription("ov2/a", 1)])  # registers ov2/a's queue early
    p = _pub(gateway)
    p.send(Publish("ov2/a", b"m1", qos=1, packet_id=1))  # in both queues, x only on ov2/#
    p.recv()
    first = x.recv()
    assert first.payload == b"m1"
    x.send(PubAck(first.packet_id))
    x.send(Subscribe(2, [Subscription("ov2/a", 1)], Properties(subscription_identifiers=[4])))
    assert x.recv().reason_codes == [1]
    p.send(Publish("ov2/a", b"m2", qos=1, packet_id=2))
    p.recv()
    p.send(Publish("ov2/b", b"m3", qos=1, packet_id=3))
    p.recv()
    got = []
    for _ in range(2):
        m = x.recv()
        got.append((m.payload, (m.properties.subscription_identifiers if m.properties else None)))
        x.send(PubAck(m.packet_id))
    assert got == [(b"m2", [4]), (b"m3", None)]
    for c in (x, y, p):
        c.close()


def test_mqtt5_publish_properties_pass_through(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "props", [Subscription("req/+", 1)])
    p = _pub(gateway)
    sent = Properties(
        payload_format_indicator=1,
        content_type="application/json",
        response_topic="resp/42",
        correlation_data=b"\x00\x01corr",
        user_properties=[("k", "v"), ("k", "v2"), ("x", "\x01odd\x02")],
    )
    p.send(Publish("req/1", b'{"a":1}', qos=1, packet_id=1, properties=sent))
    p.recv()
    got = s.recv().properties
    assert got.payload_format_indicator == 1
    assert got.content_type == "application/json"
    assert got.response_topic == "resp/42"
    assert got.correlation_data == b"\x00\x01corr"
    assert got.user_properties == [("k", "v"), ("k", "v2"), ("x", "\x01odd\x02")]
    s.close()
    p.close()
