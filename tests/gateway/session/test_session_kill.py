"""Session state across a SIGKILL of the gateway process (not a graceful restart).

Each test drives real clients against `lmqtt serve --flush sync` in a subprocess, kills it
with SIGKILL (no shutdown code runs: nothing is flushed, closed or saved on the way out),
starts it again on the same data directory and checks what the clients see. Nothing here
reads the gateway's files: the tests hold whatever way session state is persisted.

A state change the gateway does not acknowledge to anyone (a PUBREL sent, a delayed will
armed, a session gone offline) is made durable "soon", not before a packet. Before each kill
the tests wait for a later change that *is* acknowledged only once durable: another client's
persistent SUBSCRIBE (its SUBACK). Whatever was changed before it must then survive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.messages.records import message_properties
from gateway.protocol import (
    ConnAck,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    Will,
)
from store import GetStatus, MessageStore, StoreConfig
from tests.crash.gateway_proc import GatewayProcess
from tests.gateway.conftest import RawClient

pytestmark = pytest.mark.slow

SEGMENT = 1 << 20


class Gateway:
    """One data directory; ``kill()`` SIGKILLs the process, ``start()`` runs a new one."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.proc: GatewayProcess | None = None

    def start(self) -> int:
        self.proc = GatewayProcess(self.data, flush="sync", segment_size=SEGMENT)
        return self.proc.port

    @property
    def port(self) -> int:
        assert self.proc is not None
        return self.proc.port

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Gateway]:
    g = Gateway(tmp_path / "data")
    g.start()
    try:
        yield g
    finally:
        g.stop()


def _barrier(port: int, n: list[int] = [0]) -> None:  # noqa: B006 (a counter on purpose)
    """A persistent SUBSCRIBE acknowledged: durable, with every state change made before it."""
    n[0] += 1
    c = RawClient(port)
    try:
        assert c.connect(f"barrier{n[0]}", clean=False).reason_code == 0
        c.send(Subscribe(1, [Subscription(f"barrier/{n[0]}", 1)]))
        assert isinstance(c.recv(), SubAck)
    finally:
        c.close()


def _persistent_sub(port: int, cid: str, topic_filter: str, qos: int, level: int = 4) -> None:
    c = RawClient(port, level=level)
    try:
        props = Properties(session_expiry_interval=3600) if level == 5 else None
        assert c.connect(cid, clean=False, properties=props).reason_code == 0
        c.send(Subscribe(1, [Subscription(topic_filter, qos)]))
        ack = c.recv()
        assert isinstance(ack, SubAck) and ack.reason_codes == [qos]
    finally:
        c.close()


def _receive(c: RawClient, n: int, timeout: float = 20.0) -> list[Publish]:
    """The next ``n`` PUBLISH packets (other packets are skipped), acknowledging none."""
    got: list[Publish] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        ev = c.recv(max(0.01, deadline - time.monotonic()))
        assert ev is not None, "connection closed"
        if isinstance(ev, Publish):
            got.append(ev)
    return got


def _drain(c: RawClient, probe_port: int, probe_topic: str) -> list[bytes]:
    """Every payload ``c`` receives (each acknowledged: PUBACK, or PUBREC then PUBCOMP on
    the PUBREL) up to a probe published now on ``probe_topic``: in-order delivery makes the
    probe's arrival the proof that nothing else is coming, without waiting on a timer."""
    p = RawClient(probe_port)
    p.connect("prober", clean=True)
    p.send(Publish(probe_topic, b"probe", qos=1, packet_id=1))
    assert isinstance(p.recv(), PubAck)
    p.close()
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    while True:
        ev = c.recv(max(0.01, deadline - time.monotonic()))
        assert ev is not None, "connection closed"
        if isinstance(ev, PubRel):
            c.send(PubComp(ev.packet_id))
            continue
        if not isinstance(ev, Publish):
            continue
        if ev.qos == 1:
            c.send(PubAck(ev.packet_id or 0))
        elif ev.qos == 2:
            c.send(PubRec(ev.packet_id or 0))
        if ev.payload == b"probe":
            return got
        got.append(ev.payload)


def test_qos2_inbound_dedup_survives_a_kill(gw: Gateway) -> None:
    """PUBREC'd, then killed: the resent PUBLISH (DUP) is answered, not stored again, and the
    PUBREL completes it; the subscriber gets the message once."""
    _persistent_sub(gw.port, "q2sub", "k/q2/#", 2)
    pub = RawClient(gw.port)
    assert pub.connect("q2pub", clean=False).reason_code == 0
    pub.send(Publish("k/q2/a", b"exactly once", qos=2, packet_id=7))
    assert isinstance(pub.recv(), PubRec)
    gw.kill()
    pub.close()
    gw.start()
    pub = RawClient(gw.port)
    ack = pub.connect("q2pub", clean=False)
    assert isinstance(ack, ConnAck) and ack.session_present
    pub.send(Publish("k/q2/a", b"exactly once", qos=2, dup=True, packet_id=7))
    rec = pub.recv()
    assert isinstance(rec, PubRec) and rec.packet_id == 7
    pub.send(PubRel(7))
    comp = pub.recv()
    assert isinstance(comp, PubComp) and comp.packet_id == 7 and comp.reason_code == 0
    pub.close()
    sub = RawClient(gw.port)
    assert sub.connect("q2sub", clean=False).session_present
    assert _drain(sub, gw.port, "k/q2/probe") == [b"exactly once"]
    sub.close()


def _stored_copies(data: Path, payload: bytes) -> int:
    """How often the parent queues of the store in ``data`` hold ``payload`` (gateway stopped)."""
    n = 0
    with MessageStore.open(StoreConfig(data_dir=data, segment_size=SEGMENT)) as store:
        for q in store.queues():
            if q.startswith("%LMQ%"):
                continue
            off = store.min_offset(q)
            while (g := store.get(q, off, 256)).status is GetStatus.FOUND:
                n += sum(m.body == payload for m in g.messages)
                off = g.next_offset
    return n


def test_a_qos2_publish_stored_but_not_pubrecd_at_the_kill_is_stored_once(gw: Gateway) -> None:
    """Killed after a QoS 2 message reached the log, before its packet id reached the session
    record (the PUBREC waits for that): the resent PUBLISH (DUP) is recognised from the log,
    answered with PUBREC and not stored again."""
    pub = RawClient(gw.port)
    assert pub.connect("q2late", clean=False).reason_code == 0
    pub.send(Publish("late/a", b"before", qos=2, packet_id=1))
    assert isinstance(pub.recv(), PubRec)
    pub.send(PubRel(1))
    assert isinstance(pub.recv(), PubComp)
    _barrier(gw.port)
    gw.kill()
    pub.close()
    # The kill's window, drawn exactly: the record appended as the publish path appends it
    # (same properties: client id, packet id, QoS), the session record as last saved.
    late = Publish("late/a", b"stored, never acknowledged", qos=2, packet_id=2)
    with MessageStore.open(StoreConfig(data_dir=gw.data, segment_size=SEGMENT)) as store:
        store.put("late", late.payload, [], message_properties(late, "q2late"))
    gw.start()
    pub = RawClient(gw.port)
    assert pub.connect("q2late", clean=False).session_present
    pub.send(Publish(late.topic, late.payload, qos=2, dup=True, packet_id=2))
    rec = pub.recv()
    assert isinstance(rec, PubRec) and rec.packet_id == 2 and rec.reason_code == 0
    pub.send(PubRel(2))
    comp = pub.recv()
    assert isinstance(comp, PubComp) and comp.packet_id == 2 and comp.reason_code == 0
    # The id is free again: a new message with it is stored.
    pub.send(Publish("late/a", b"after", qos=2, packet_id=2))
    assert isinstance(pub.recv(), PubRec)
    pub.send(PubRel(2))
    assert isinstance(pub.recv(), PubComp)
    pub.close()
    gw.stop()
    assert _stored_copies(gw.data, late.payload) == 1
    assert _stored_copies(gw.data, b"after") == 1


def test_a_pubrel_open_at_the_kill_is_still_known_after_it(gw: Gateway) -> None:
    """The gateway sent PUBLISH (QoS 2), got PUBREC and sent PUBREL; the subscriber never sent
    PUBCOMP. After the kill the gateway resends the PUBREL, never the PUBLISH [MQTT-4.4.0-1]."""
    _persistent_sub(gw.port, "relsub", "k/rel", 2)
    pub = RawClient(gw.port)
    pub.connect("relpub", clean=True)
    pub.send(Publish("k/rel", b"two", qos=2, packet_id=2))
    assert isinstance(pub.recv(), PubRec)
    pub.send(PubRel(2))
    assert isinstance(pub.recv(), PubComp)
    pub.close()
    sub = RawClient(gw.port)
    assert sub.connect("relsub", clean=False).session_present
    two = _receive(sub, 1)[0]
    assert two.payload == b"two" and two.qos == 2 and two.packet_id is not None
    sub.send(PubRec(two.packet_id))
    rel = sub.recv_until(PubRel)
    assert isinstance(rel, PubRel) and rel.packet_id == two.packet_id
    _barrier(gw.port)
    gw.kill()
    sub.close()
    gw.start()
    sub = RawClient(gw.port)
    assert sub.connect("relsub", clean=False).session_present
    ev = sub.recv()
    assert isinstance(ev, PubRel) and ev.packet_id == two.packet_id, ev
    sub.send(PubComp(two.packet_id))
    assert _drain(sub, gw.port, "k/rel") == []
    sub.close()


def test_an_unacknowledged_delivery_is_resent_with_dup_after_a_kill(gw: Gateway) -> None:
    _persistent_sub(gw.port, "dupsub", "k/dup", 1)
    pub = RawClient(gw.port)
    pub.connect("duppub", clean=True)
    pub.send(Publish("k/dup", b"resend me", qos=1, packet_id=1))
    assert isinstance(pub.recv(), PubAck)
    pub.close()
    sub = RawClient(gw.port)
    assert sub.connect("dupsub", clean=False).session_present
    first = _receive(sub, 1)[0]
    assert first.payload == b"resend me" and not first.dup
    _barrier(gw.port)
    gw.kill()
    sub.close()
    gw.start()
    sub = RawClient(gw.port)
    assert sub.connect("dupsub", clean=False).session_present
    again = _receive(sub, 1)[0]
    assert again.payload == b"resend me" and again.qos == 1
    assert again.dup, "a resent PUBLISH must have DUP set [MQTT-3.3.1-1]"
    sub.send(PubAck(again.packet_id or 0))
    assert _drain(sub, gw.port, "k/dup") == []
    sub.close()


def test_a_delayed_will_armed_before_the_kill_is_published_after_it(gw: Gateway) -> None:
    """MQTT 5: the connection drops, its will waits will_delay_interval; the gateway dies in
    the meantime. After the restart the will is still published (once)."""
    _persistent_sub(gw.port, "willsub", "k/will", 1, level=5)
    c = RawClient(gw.port, level=5)
    will = Will("k/will", b"gone", qos=1, properties=Properties(will_delay_interval=2))
    ack = c.connect(
        "dying", clean=False, will=will, properties=Properties(session_expiry_interval=3600)
    )
    assert ack.reason_code == 0
    c.close()  # no DISCONNECT: the will is armed, due in 2 s
    _barrier(gw.port)
    gw.kill()
    gw.start()
    sub = RawClient(gw.port, level=5)
    assert sub.connect(
        "willsub", clean=False, properties=Properties(session_expiry_interval=3600)
    ).session_present
    w = _receive(sub, 1, timeout=30)[0]
    assert w.payload == b"gone" and w.topic == "k/will"
    sub.send(PubAck(w.packet_id or 0))
    assert _drain(sub, gw.port, "k/will") == []  # once
    sub.close()


def test_the_will_of_a_connection_alive_at_the_kill_is_published_after_it(gw: Gateway) -> None:
    """The gateway died under a live connection: that is not a normal DISCONNECT, so its will
    goes out once the gateway is back."""
    _persistent_sub(gw.port, "willsub2", "k/will2", 1)
    c = RawClient(gw.port)
    assert c.connect("alive", clean=True, will=Will("k/will2", b"lost", qos=1)).reason_code == 0
    _barrier(gw.port)
    gw.kill()
    c.close()
    gw.start()
    sub = RawClient(gw.port)
    assert sub.connect("willsub2", clean=False).session_present
    w = _receive(sub, 1, timeout=30)[0]
    assert w.payload == b"lost"
    sub.send(PubAck(w.packet_id or 0))
    assert _drain(sub, gw.port, "k/will2") == []  # once
    sub.close()


def test_session_expiry_runs_across_a_kill(gw: Gateway) -> None:
    """MQTT 5: a session offline when the gateway dies keeps its expiry: a long one is there
    after the restart, a short one that ran out while the gateway was down is gone."""
    for cid, expiry in (("long", 3600), ("short", 1)):
        c = RawClient(gw.port, level=5)
        ack = c.connect(cid, clean=False, properties=Properties(session_expiry_interval=expiry))
        assert ack.reason_code == 0
        c.send(Subscribe(1, [Subscription(f"k/exp/{cid}", 1)]))
        assert isinstance(c.recv(), SubAck)
        c.close()
    went_offline = time.monotonic()
    _barrier(gw.port)
    gw.kill()
    # Let the short one's second run out (the thing under test is time passing).
    time.sleep(max(0.0, went_offline + 1.5 - time.monotonic()))
    gw.start()
    for cid, present in (("long", True), ("short", False)):
        c = RawClient(gw.port, level=5)
        ack = c.connect(cid, clean=False, properties=Properties(session_expiry_interval=60))
        assert ack.session_present is present, cid
        c.close()
