"""Will messages (abnormal ends, keep-alive expiry, will delay) and retained delivery."""

from __future__ import annotations

import time

import pytest

from gateway.protocol import (
    Disconnect,
    Properties,
    PubAck,
    Publish,
    Subscribe,
    Subscription,
    Will,
)
from gateway.session.registry import SESSION_KEY_PREFIX
from store import StateLog, read_state_records
from tests.gateway.conftest import Client, GatewayHarness, RawClient, stop_clients, wait_until


def _watcher(gateway: GatewayHarness, topic: str, level: int = 5) -> RawClient:
    w = RawClient(gateway.port, level=level)
    w.connect(f"watch-{topic.replace('/', '-')}")
    w.send(Subscribe(1, [Subscription(topic, 1)]))
    w.recv()
    return w


def test_will_on_socket_drop(gateway: GatewayHarness) -> None:
    w = _watcher(gateway, "will/drop")
    c = RawClient(gateway.port, level=4)
    c.connect("dying", will=Will("will/drop", b"gone", 1, False))
    c.close()  # no DISCONNECT
    msg = w.recv()
    assert isinstance(msg, Publish) and msg.payload == b"gone" and msg.topic == "will/drop"
    w.close()


def test_no_will_on_normal_disconnect(gateway: GatewayHarness) -> None:
    w = _watcher(gateway, "will/normal")
    c = RawClient(gateway.port, level=4)
    c.connect("polite", will=Will("will/normal", b"should-not", 0, False))
    c.send(Disconnect())
    assert c.is_closed()
    p = RawClient(gateway.port, level=4)
    p.connect("probe")
    p.send(Publish("will/normal", b"probe", 0))
    assert w.recv().payload == b"probe"  # the will never came first
    for x in (w, c, p):
        x.close()


def test_mqtt5_disconnect_with_will_message(gateway: GatewayHarness) -> None:
    w = _watcher(gateway, "will/0x04")
    c = RawClient(gateway.port, level=5)
    c.connect("asks-for-will", will=Will("will/0x04", b"w", 0, False))
    c.send(Disconnect(reason_code=0x04))
    assert w.recv().payload == b"w"
    w.close()
    c.close()


def test_will_on_keep_alive_timeout(gateway: GatewayHarness) -> None:
    w = _watcher(gateway, "will/ka")
    c = RawClient(gateway.port, level=5)
    t0 = time.monotonic()
    c.connect("silent", keep_alive=1, will=Will("will/ka", b"timeout", 0, False))
    ev = c.recv(timeout=5)  # the gateway gives up after 1.5 x keep-alive
    assert isinstance(ev, Disconnect) and ev.reason_code == 0x8D
    assert w.recv(timeout=5).payload == b"timeout"
    assert 1.4 <= time.monotonic() - t0 < 4
    w.close()
    c.close()


def test_will_on_protocol_error(gateway: GatewayHarness) -> None:
    w = _watcher(gateway, "will/err")
    c = RawClient(gateway.port, level=4)
    c.connect("broken", will=Will("will/err", b"err", 0, False))
    c.send_bytes(b"\xf0\x00")  # reserved packet type 15 at level 4
    assert c.is_closed()
    assert w.recv().payload == b"err"
    w.close()
    c.close()


def test_will_delay_and_cancel_on_resume(gateway: GatewayHarness) -> None:
    w = _watcher(gateway, "will/delay/+")
    props = Properties(session_expiry_interval=60)
    # Resumed within the delay: no will.
    c = RawClient(gateway.port, level=5)
    c.connect(
        "delayed",
        will=Will("will/delay/a", b"a", 0, False, Properties(will_delay_interval=1)),
        properties=props,
    )
    c.close()
    c2 = RawClient(gateway.port, level=5)
    ack = c2.connect("delayed", clean=False, properties=Properties(session_expiry_interval=60))
    assert ack.session_present
    # Not resumed: published after the delay.
    c3 = RawClient(gateway.port, level=5)
    t0 = time.monotonic()
    c3.connect(
        "delayed-2",
        will=Will("will/delay/b", b"b", 0, False, Properties(will_delay_interval=1)),
        properties=props,
    )
    c3.close()
    msg = w.recv(timeout=5)
    assert msg.payload == b"b"
    assert time.monotonic() - t0 >= 0.9
    c2.send(Disconnect())
    for x in (w, c2):
        x.close()


def test_retained_delivery_replace_delete_and_handling(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    pub = Client(gateway.port, "rp")
    clients.append(pub)
    pub.publish("ret/a", b"a1", qos=1, retain=True)
    pub.publish("ret/a", b"a2", qos=1, retain=True)  # replaces
    pub.publish("ret/b", b"b1", qos=1, retain=True)
    pub.publish("ret/b", b"", qos=1, retain=True)  # deletes
    pub.publish("ret/c", b"c1", qos=0, retain=True)
    # QoS 0 has no acknowledgement: a QoS 1 publish after it on the same connection, once
    # acknowledged, says the gateway has taken it (a connection's packets in order), else the
    # SUBSCRIBE below may overtake it and get c1 live, not retained.
    pub.publish("barrier/c", b"", qos=1)
    s = Client(gateway.port, "rs", v5=True)
    clients.append(s)
    s.subscribe("ret/#", 1)
    msgs = s.wait_messages(2)
    assert sorted((m.topic, m.payload, m.retain) for m in msgs) == [
        ("ret/a", b"a2", True),
        ("ret/c", b"c1", True),
    ]
    # A live message on the same topic is not flagged retained.
    pub.publish("ret/a", b"live", qos=1)
    live = s.wait_messages(3)[2]
    assert (live.payload, live.retain) == (b"live", False)
    # retain-handling 2: never send retained; 1: only on a new subscription.
    r = RawClient(gateway.port, level=5)
    r.connect("rh")
    r.send(Subscribe(1, [Subscription("ret/a", 1, retain_handling=2)]))
    r.recv()
    r.send(Subscribe(2, [Subscription("ret/c", 0, retain_handling=1)]))
    r.recv()
    got = r.recv()
    assert got.topic == "ret/c" and got.retain
    r.send(Subscribe(3, [Subscription("ret/c", 0, retain_handling=1)]))  # existing: none
    r.recv()
    pub.publish("ret/c", b"probe")
    got = r.recv()
    assert got.payload == b"probe" and not got.retain
    r.close()


def test_retained_survive_restart(gateway: GatewayHarness, clients: list[Client]) -> None:
    pub = Client(gateway.port, "rp")
    pub.publish("keep/x", b"durable", qos=1, retain=True)
    pub.disconnect()
    gateway.restart()
    s = Client(gateway.port, "rs")
    clients.append(s)
    s.subscribe("keep/+", 0)
    m = s.wait_messages(1)[0]
    assert (m.topic, m.payload, m.retain) == ("keep/x", b"durable", True)


def test_will_published_when_session_expires_before_delay(gateway: GatewayHarness) -> None:
    w = _watcher(gateway, "will/expiry")
    c = RawClient(gateway.port, level=5)
    t0 = time.monotonic()
    c.connect(
        "expiring",
        will=Will("will/expiry", b"ended", 0, False, Properties(will_delay_interval=30)),
        properties=Properties(session_expiry_interval=1),
    )
    c.close()
    msg = w.recv(timeout=5)
    assert msg.payload == b"ended"
    assert 0.9 <= time.monotonic() - t0 < 5  # at session end (1 s), not after the 30 s delay
    w.close()


def test_delayed_will_survives_gateway_restart(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=5)
    c.connect(
        "restart-will",
        will=Will("will/restart", b"after-restart", 1, False, Properties(will_delay_interval=1)),
        properties=Properties(session_expiry_interval=60),
    )
    c.close()  # abnormal: the delayed will is pending
    gw = gateway.gw
    assert gw is not None
    wait_until(
        lambda: gateway.call(lambda: gw.sessions.get("restart-will").connection is None),  # type: ignore[union-attr]
        what="session offline",
    )
    gateway.restart()
    w = _watcher(gateway, "will/restart")
    msg = w.recv(timeout=5)
    assert msg.payload == b"after-restart"
    w.close()


def test_wills_of_connections_cut_by_a_crash_are_published(gateway: GatewayHarness) -> None:
    gw = gateway.gw
    assert gw is not None
    w = RawClient(gateway.port, level=4)
    w.connect("watch-crash", clean=False)
    w.send(Subscribe(1, [Subscription("will/crash/+", 1)]))
    w.recv()
    w.close()
    persistent = RawClient(gateway.port, level=4)
    persistent.connect("crash-p", clean=False, will=Will("will/crash/p", b"p", 1, False))
    clean = RawClient(gateway.port, level=4)
    clean.connect("crash-c", clean=True, will=Will("will/crash/c", b"c", 1, False))
    # A crash: the state log as saved while both were connected, and no graceful stop.
    gateway.run(gw.sessions.save_all())
    state = gateway.data_dir / "state"
    saved = {p.name: p.read_bytes() for p in state.iterdir()}
    gateway.stop()
    for p in state.iterdir():
        p.unlink()
    for name, data in saved.items():
        (state / name).write_bytes(data)
    persistent.close()
    clean.close()
    gateway.start()
    w = RawClient(gateway.port, level=4)
    assert w.connect("watch-crash", clean=False).session_present
    got = sorted(w.recv().payload for _ in range(2))
    assert got == [b"c", b"p"]
    w.close()


@pytest.mark.parametrize("image", ["will-pending", "connection-alive"])
def test_a_will_published_before_a_crash_is_not_published_again_at_the_restart(
    gateway: GatewayHarness, image: str
) -> None:
    """A will is published; the gateway stops before its session's record says so, and the
    state log is left with an older record of the session as the newest: the image a crash
    between the publication and the next save leaves. "will-pending": a delayed will's
    record, due in the past. "connection-alive": the record written before CONNACK, the
    connection still alive and its will (no delay) not armed. At the restart the will's id is
    found in the wills log: it is not published again."""
    gw = gateway.gw
    assert gw is not None
    w = RawClient(gateway.port, level=4)
    w.connect("watch-once", clean=False)
    w.send(Subscribe(1, [Subscription("will/once/#", 1)]))
    w.recv()
    delay = 1 if image == "will-pending" else 0
    c = RawClient(gateway.port, level=5)
    c.connect(
        "once-dev",
        will=Will("will/once/dev", b"once", 1, False, Properties(will_delay_interval=delay)),
        properties=Properties(session_expiry_interval=60),
    )
    state = gateway.data_dir / "state"
    key = SESSION_KEY_PREFIX + "once-dev"

    def records(armed: bool) -> list[bytes]:
        return [
            v
            for k, v in read_state_records(state)
            if k == key and v and b'"will":{' in v and (b'"will_due_ms":null' not in v) == armed
        ]

    if image == "connection-alive":
        gateway.run(gw.sessions.save_all())
        alive = records(armed=False)
        assert alive
    c.close()  # abnormal: the will is published now, or after its 1 s delay
    wait_until(
        lambda: gateway.call(lambda: gw.sessions.get("once-dev").connection is None),  # type: ignore[union-attr]
        what="session offline",
    )
    if image == "will-pending":
        gateway.run(gw.sessions.save_all())  # the record with the will pending and its due time
        older = records(armed=True)
        assert older
    else:
        older = alive
    msg = w.recv(timeout=5)
    assert isinstance(msg, Publish) and msg.payload == b"once"
    w.send(PubAck(msg.packet_id))  # type: ignore[arg-type]
    w.close()
    gateway.stop()
    log = StateLog.open(state)
    log.append([(key, older[-1])])  # the newest again: as if not yet rewritten
    log.close()
    gateway.start()
    w = RawClient(gateway.port, level=4)
    assert w.connect("watch-once", clean=False).session_present
    marker = Client(gateway.port, "once-marker")
    marker.publish("will/once/marker", b"end", 1)
    stop_clients([marker])
    msg = w.recv(timeout=5)
    assert isinstance(msg, Publish) and msg.topic == "will/once/marker", msg
    w.close()
