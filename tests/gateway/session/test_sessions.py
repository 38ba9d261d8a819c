"""Sessions: client ids, takeover, persistence across reconnects and restarts, expiry."""

from __future__ import annotations

import json

from gateway.protocol import (
    ConnAck,
    Disconnect,
    Properties,
    PubAck,
    Publish,
    Subscribe,
    Subscription,
)
from store import read_state
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until


def test_connack_properties_and_assigned_client_id(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=5)
    ack = c.connect("")
    assert isinstance(ack, ConnAck) and ack.reason_code == 0 and not ack.session_present
    p = ack.properties
    assert p is not None
    assert p.assigned_client_identifier and p.assigned_client_identifier.startswith("lmqtt-")
    assert p.receive_maximum == 1024
    assert p.maximum_packet_size == 1_048_576
    assert p.topic_alias_maximum == 64
    assert p.wildcard_subscription_available == 1
    assert p.subscription_identifier_available == 1
    assert p.shared_subscription_available == 1
    assert p.retain_available == 1
    c.close()


def test_client_id_rules_311(gateway: GatewayHarness) -> None:
    ok = RawClient(gateway.port, level=4)
    assert ok.connect("", clean=True).reason_code == 0  # assigned internally
    ok.close()
    bad = RawClient(gateway.port, level=4)
    ack = bad.connect("", clean=False)
    assert ack.reason_code == 0x85  # identifier rejected (3.1.1 return code 2)
    assert bad.is_closed()
    bad.close()


def test_server_keep_alive_override(gateway: GatewayHarness) -> None:
    gateway.restart(server_keep_alive=5)
    c = RawClient(gateway.port, level=5)
    ack = c.connect("ka", keep_alive=600)
    assert ack.properties.server_keep_alive == 5
    c.close()


def test_session_takeover_mqtt5_reason_0x8e(gateway: GatewayHarness) -> None:
    first = RawClient(gateway.port, level=5)
    assert first.connect("dup-id").reason_code == 0
    second = RawClient(gateway.port, level=5)
    assert second.connect("dup-id").reason_code == 0
    ev = first.recv()
    assert isinstance(ev, Disconnect) and ev.reason_code == 0x8E
    assert first.is_closed()
    second.send(Subscribe(1, [Subscription("still/alive", 0)]))
    assert second.recv().reason_codes == [0]
    first.close()
    second.close()


def test_session_takeover_311_closes_old(gateway: GatewayHarness) -> None:
    first = RawClient(gateway.port, level=4)
    assert first.connect("dup-311").reason_code == 0
    second = RawClient(gateway.port, level=4)
    assert second.connect("dup-311").reason_code == 0
    assert first.is_closed()
    first.close()
    second.close()


def test_persistent_session_resumes_with_backlog(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    sub = Client(gateway.port, "persist", clean=False)
    clients.append(sub)
    assert sub.connack == (False, 0)
    sub.subscribe("p/#", 1)
    sub.disconnect()
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    for i in range(50):
        pub.publish("p/x", f"{i}".encode(), qos=1)
    sub2 = Client(gateway.port, "persist", clean=False)
    clients.append(sub2)
    assert sub2.connack == (True, 0)
    msgs = sub2.wait_messages(50)
    assert [m.payload for m in msgs] == [f"{i}".encode() for i in range(50)]
    # A clean session afterwards discards it.
    sub2.disconnect()
    sub3 = Client(gateway.port, "persist", clean=True)
    clients.append(sub3)
    assert sub3.connack == (False, 0)


def test_persistent_session_survives_gateway_restart(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    sub = Client(gateway.port, "dev-1", v5=True, clean=True, session_expiry=3600)
    clients.append(sub)
    sub.subscribe("r/+/t", 1)
    sub.disconnect()
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    for i in range(10):
        pub.publish("r/1/t", f"before-{i}".encode(), qos=1)
    pub.disconnect()
    gateway.restart()
    # The session is one record of the state log, read back through the store's reader.
    entry = json.loads(read_state(gateway.data_dir / "state")["session/dev-1"])
    assert entry["expiry_interval"] == 3600
    assert entry["subscriptions"][0]["filter"] == "r/+/t"
    # Publishing after the restart still reaches the offline session (router restored).
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    for i in range(10):
        pub.publish("r/2/t", f"after-{i}".encode(), qos=1)
    sub2 = Client(gateway.port, "dev-1", v5=True, clean=False, session_expiry=3600)
    clients.append(sub2)
    assert sub2.connack == (True, 0)
    msgs = sub2.wait_messages(20)
    assert [m.payload for m in msgs] == [f"before-{i}".encode() for i in range(10)] + [
        f"after-{i}".encode() for i in range(10)
    ]


def test_unacknowledged_messages_are_resent_with_dup(gateway: GatewayHarness) -> None:
    sub = RawClient(gateway.port, level=4)
    assert sub.connect("redeliver", clean=False).reason_code == 0
    sub.send(Subscribe(1, [Subscription("u/t", 1)]))
    sub.recv()
    pub = RawClient(gateway.port, level=4)
    pub.connect("p")
    for i in range(3):
        pub.send(Publish("u/t", f"{i}".encode(), qos=1, packet_id=i + 1))
        assert pub.recv() == PubAck(i + 1)
    first = [sub.recv() for _ in range(3)]
    assert [m.payload for m in first] == [b"0", b"1", b"2"] and not any(m.dup for m in first)
    sub.send(PubAck(first[0].packet_id))  # ack only the first, then vanish
    sub.close()
    again = RawClient(gateway.port, level=4)
    ack = again.connect("redeliver", clean=False)
    assert ack.session_present
    resent = [again.recv() for _ in range(2)]
    assert [(m.payload, m.dup) for m in resent] == [(b"1", True), (b"2", True)]
    assert [m.packet_id for m in resent] == [first[1].packet_id, first[2].packet_id]
    for m in resent:
        again.send(PubAck(m.packet_id))
    # Nothing else pending: a new message comes next, without DUP.
    pub.send(Publish("u/t", b"new", qos=1, packet_id=9))
    pub.recv()
    nxt = again.recv()
    assert nxt.payload == b"new" and not nxt.dup
    again.close()
    pub.close()


def test_session_expiry_mqtt5(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=5)
    c.connect("short", clean=True, properties=Properties(session_expiry_interval=1))
    c.send(Subscribe(1, [Subscription("e/t", 1)]))
    c.recv()
    c.send(Disconnect())
    c.close()
    gw = gateway.gw
    assert gw is not None
    assert gateway.call(lambda: gw.sessions.get("short") is not None)
    wait_until(lambda: gateway.call(lambda: gw.sessions.get("short") is None), 5, "expiry")
    assert gateway.call(lambda: "e/t" not in gw.router.filters())
    again = RawClient(gateway.port, level=5)
    ack = again.connect("short", clean=False)
    assert not ack.session_present
    again.close()


def test_disconnect_can_lower_session_expiry(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=5)
    c.connect("lower", properties=Properties(session_expiry_interval=3600))
    c.send(Disconnect(properties=Properties(session_expiry_interval=0)))
    assert c.is_closed()
    gw = gateway.gw
    assert gw is not None
    wait_until(lambda: gateway.call(lambda: gw.sessions.get("lower") is None), 5, "end")
    c.close()


def test_311_persistent_session_expires_after_configured_default(gateway: GatewayHarness) -> None:
    gateway.restart(default_session_expiry=1)
    c = RawClient(gateway.port, level=4)
    c.connect("old-style", clean=False)
    c.send(Subscribe(1, [Subscription("d/e", 1)]))
    c.recv()
    c.send(Disconnect())
    c.close()
    gw = gateway.gw
    assert gw is not None
    wait_until(lambda: gateway.call(lambda: gw.sessions.get("old-style") is None), 5, "expiry")
    again = RawClient(gateway.port, level=4)
    assert not again.connect("old-style", clean=False).session_present
    again.close()
