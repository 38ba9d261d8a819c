"""MQTT 3.1.1 behaviours that few clients exercise: redelivery on reconnect (DUP PUBLISH, PUBREL),
$-topics and wildcards, retained messages and QoS, UNSUBSCRIBE of unknown filters, session
present. Raw 3.1.1 clients, so every flag and packet id on the wire is checked."""

from __future__ import annotations

from gateway.protocol import (
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
)
from tests.gateway.conftest import GatewayHarness, RawClient


def _sub(
    gateway: GatewayHarness, cid: str, subs: list[Subscription], clean: bool = True
) -> RawClient:
    c = RawClient(gateway.port, level=4)
    assert c.connect(cid, clean=clean).reason_code == 0
    c.send(Subscribe(1, subs))
    ack = c.recv()
    assert ack.reason_codes == [s.qos for s in subs]
    return c


def _pub(gateway: GatewayHarness, cid: str = "pub") -> RawClient:
    p = RawClient(gateway.port, level=4)
    assert p.connect(cid).reason_code == 0
    return p


def _publish(
    p: RawClient, topic: str, payload: bytes, qos: int, pid: int, retain: bool = False
) -> None:
    """Publish and complete the client-to-server flow."""
    p.send(Publish(topic, payload, qos=qos, retain=retain, packet_id=pid if qos else None))
    if qos == 1:
        assert p.recv() == PubAck(pid)
    elif qos == 2:
        assert p.recv() == PubRec(pid)
        p.send(PubRel(pid))
        assert p.recv() == PubComp(pid)


def test_unacknowledged_qos2_publish_is_resent_with_dup(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "q2dup", [Subscription("q2d/t", 2)], clean=False)
    p = _pub(gateway)
    _publish(p, "q2d/t", b"two", 2, 1)
    first = s.recv()
    assert (first.payload, first.qos, first.dup) == (b"two", 2, False)
    s.close()  # no PUBREC: the exchange has not started on the client's side
    again = RawClient(gateway.port, level=4)
    assert again.connect("q2dup", clean=False).session_present
    resent = again.recv()
    assert (resent.payload, resent.qos, resent.dup) == (b"two", 2, True)
    assert resent.packet_id == first.packet_id  # the original packet identifier
    again.send(PubRec(resent.packet_id))
    assert again.recv() == PubRel(resent.packet_id)
    again.send(PubComp(resent.packet_id))
    _publish(p, "q2d/t", b"next", 0, 0)
    nxt = again.recv()
    assert nxt.payload == b"next" and not nxt.dup
    again.close()
    p.close()


def test_pubrel_is_resent_on_reconnect(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "relre", [Subscription("rel/t", 2)], clean=False)
    p = _pub(gateway)
    _publish(p, "rel/t", b"once", 2, 1)
    msg = s.recv()
    s.send(PubRec(msg.packet_id))
    assert s.recv() == PubRel(msg.packet_id)
    s.close()  # PUBCOMP never sent
    again = RawClient(gateway.port, level=4)
    assert again.connect("relre", clean=False).session_present
    assert again.recv() == PubRel(msg.packet_id)  # the release, not the message again
    again.send(PubComp(msg.packet_id))
    _publish(p, "rel/t", b"after", 1, 2)
    nxt = again.recv()
    assert (nxt.payload, nxt.dup) == (b"after", False)
    again.close()
    p.close()


def test_dollar_topics_are_not_matched_by_leading_wildcards(gateway: GatewayHarness) -> None:
    wild = _sub(
        gateway, "wild", [Subscription("#", 0), Subscription("+/x", 0), Subscription("+/+", 0)]
    )
    sys_sub = _sub(gateway, "sys", [Subscription("$SYS/#", 0), Subscription("$other/+", 0)])
    gateway.run(gateway.gw.publish_internal("$SYS/x", b"sys"))  # type: ignore[union-attr]
    gateway.run(gateway.gw.publish_internal("$other/x", b"other"))  # type: ignore[union-attr]
    p = _pub(gateway)
    _publish(p, "probe/x", b"probe", 1, 1)
    got = wild.recv()
    assert (got.topic, got.payload) == ("probe/x", b"probe")  # no $-topic came before it
    assert [(m.topic, m.payload) for m in (sys_sub.recv(), sys_sub.recv())] == [
        ("$SYS/x", b"sys"),
        ("$other/x", b"other"),
    ]
    for c in (wild, sys_sub, p):
        c.close()


def test_retained_messages_are_downgraded_to_the_subscription_qos(gateway: GatewayHarness) -> None:
    p = _pub(gateway)
    _publish(p, "rq/2", b"r2", 2, 1, retain=True)
    _publish(p, "rq/1", b"r1", 1, 2, retain=True)
    _publish(p, "rq/0", b"r0", 0, 0, retain=True)
    for sub_qos in (0, 1, 2):
        s = RawClient(gateway.port, level=4)
        s.connect(f"rq{sub_qos}")
        s.send(Subscribe(1, [Subscription("rq/+", sub_qos)]))
        assert s.recv().reason_codes == [sub_qos]
        msgs = [s.recv() for _ in range(3)]
        assert all(isinstance(m, Publish) and m.retain for m in msgs)  # sent for the SUBSCRIBE
        assert {m.topic: m.qos for m in msgs} == {f"rq/{q}": min(q, sub_qos) for q in (0, 1, 2)}
        for m in msgs:
            if m.qos == 1:
                s.send(PubAck(m.packet_id))
            elif m.qos == 2:
                s.send(PubRec(m.packet_id))
                assert s.recv() == PubRel(m.packet_id)
                s.send(PubComp(m.packet_id))
        s.close()
    p.close()


def test_unsubscribe_of_unknown_filter_is_acknowledged(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "unsub", [Subscription("u/known", 1)])
    s.send(Unsubscribe(7, ["u/never-subscribed", "u/+/x"]))
    ack = s.recv()
    assert isinstance(ack, UnsubAck) and ack.packet_id == 7
    # 3.1.1 UNSUBACK is exactly the packet id: no reason codes on the wire.
    s.send(Unsubscribe(8, ["nope"]))
    raw = s.sock.recv(16)
    assert raw == b"\xb0\x02\x00\x08"
    # The real subscription is untouched.
    p = _pub(gateway)
    _publish(p, "u/known", b"still", 1, 1)
    assert s.recv().payload == b"still"
    s.close()
    p.close()


def test_resubscribe_replaces_qos_and_resends_retained(gateway: GatewayHarness) -> None:
    p = _pub(gateway)
    _publish(p, "rs/t", b"kept", 1, 1, retain=True)
    s = _sub(gateway, "resub", [Subscription("rs/t", 0)])
    first = s.recv()
    assert (first.payload, first.qos, first.retain) == (b"kept", 0, True)
    s.send(Subscribe(2, [Subscription("rs/t", 1)]))
    assert s.recv().reason_codes == [1]
    again = s.recv()  # MQTT-3.8.4-3: retained messages are re-sent
    assert (again.payload, again.qos, again.retain) == (b"kept", 1, True)
    s.send(PubAck(again.packet_id))
    _publish(p, "rs/t", b"live", 1, 2)
    live = s.recv()
    assert (live.payload, live.qos, live.retain) == (b"live", 1, False)  # one copy, new QoS
    s.send(PubAck(live.packet_id))
    s.close()
    p.close()


def test_session_present_follows_clean_session(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=4)
    assert not c.connect("sp", clean=False).session_present  # nothing to resume yet
    c.close()
    c = RawClient(gateway.port, level=4)
    assert c.connect("sp", clean=False).session_present
    c.close()
    c = RawClient(gateway.port, level=4)
    assert not c.connect("sp", clean=True).session_present  # MQTT-3.2.2-1
    c.close()
    c = RawClient(gateway.port, level=4)
    assert not c.connect("sp", clean=False).session_present  # the clean one discarded it
    c.close()


def test_unacknowledged_retained_copy_is_resent_on_reconnect(gateway: GatewayHarness) -> None:
    p = _pub(gateway)
    _publish(p, "rr/t", b"retained", 1, 1, retain=True)
    s = _sub(gateway, "rr", [Subscription("rr/t", 1)], clean=False)
    first = s.recv()
    assert (first.payload, first.qos, first.retain, first.dup) == (b"retained", 1, True, False)
    s.close()  # never acknowledged
    again = RawClient(gateway.port, level=4)
    assert again.connect("rr", clean=False).session_present
    # MQTT-4.4.0-1: unacknowledged PUBLISH packets are re-sent with their packet identifiers.
    resent = again.recv()
    assert (resent.payload, resent.retain, resent.dup) == (b"retained", True, True)
    assert resent.packet_id == first.packet_id
    again.send(PubAck(resent.packet_id))
    _publish(p, "rr/t", b"live", 1, 2)
    live = again.recv()
    assert (live.payload, live.dup) == (b"live", False)
    again.close()
    p.close()


def test_message_in_flight_is_completed_after_unsubscribe(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "uif", [Subscription("uif/t", 1)], clean=False)
    p = _pub(gateway)
    _publish(p, "uif/t", b"started", 1, 1)
    first = s.recv()
    s.send(Unsubscribe(2, ["uif/t"]))
    assert s.recv() == UnsubAck(2)
    s.close()  # the delivery that had started was never acknowledged
    again = RawClient(gateway.port, level=4)
    assert again.connect("uif", clean=False).session_present
    # MQTT-3.10.4-3: QoS 1/2 deliveries already started are completed.
    resent = again.recv()
    assert (resent.payload, resent.dup, resent.packet_id) == (b"started", True, first.packet_id)
    again.send(PubAck(resent.packet_id))
    again.close()
    p.close()


def test_unacknowledged_retained_copy_survives_restart(gateway: GatewayHarness) -> None:
    p = _pub(gateway)
    _publish(p, "rk/t", b"kept", 2, 1, retain=True)
    p.close()
    s = _sub(gateway, "rk", [Subscription("rk/t", 2)], clean=False)
    first = s.recv()
    assert (first.payload, first.qos, first.retain) == (b"kept", 2, True)
    s.close()  # no PUBREC
    gateway.restart()
    again = RawClient(gateway.port, level=4)
    assert again.connect("rk", clean=False).session_present
    resent = again.recv()
    assert (resent.payload, resent.qos, resent.retain, resent.dup) == (b"kept", 2, True, True)
    assert resent.packet_id == first.packet_id
    again.send(PubRec(resent.packet_id))
    assert again.recv() == PubRel(resent.packet_id)
    again.send(PubComp(resent.packet_id))
    again.close()


def test_unsubscribing_the_owner_of_overlapping_matches_loses_nothing(
    gateway: GatewayHarness,
) -> None:
    """A message matching two filters of one session is delivered once, by one of them (the
    owner). The other must not pass it by before the owner has read it: once the owner is
    unsubscribed, the remaining subscription delivers what the owner had not reached."""
    gateway.restart(max_inflight=1)  # the owner stops after its first message
    s = _sub(gateway, "ovu", [Subscription("ovu/+", 1), Subscription("ovu/#", 1)], clean=False)
    s.close()
    p = _pub(gateway)
    for i in range(3):
        _publish(p, "ovu/t", b"m%d" % i, 1, i + 1)  # queued while offline
    s = RawClient(gateway.port, level=4)
    assert s.connect("ovu", clean=False).session_present
    m0 = s.recv()
    assert m0.payload == b"m0"

    # Whichever filter owns the three, dropping either leaves one that matches them all.
    def owner_filter() -> str:
        session = gateway.running.sessions.get("ovu")
        assert session is not None
        return min(session.by_queue.values(), key=lambda x: x.queue).topic_filter

    owner = gateway.call(owner_filter)
    s.send(Unsubscribe(2, [owner]))
    assert s.recv() == UnsubAck(2)
    s.send(PubAck(m0.packet_id))
    # m0 may come once more, for the remaining subscription (3.3.5 allows a copy per matching
    # subscription): it was in flight for the owner when that was dropped.
    got: list[bytes] = []
    while b"m2" not in got:
        m = s.recv()
        got.append(m.payload)
        s.send(PubAck(m.packet_id))
        assert len(got) <= 3
    assert [x for x in got if x != b"m0"] == [b"m1", b"m2"]
    s.close()
    p.close()


def test_takeover_with_clean_session_0_resends_in_flight(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "tko", [Subscription("tko/t", 1)], clean=False)
    p = _pub(gateway)
    _publish(p, "tko/t", b"m", 1, 1)
    first = s.recv()
    new = RawClient(gateway.port, level=4)  # same client id while the first is connected
    assert new.connect("tko", clean=False).session_present
    assert s.recv() is None  # MQTT-3.1.4-2: the old connection is closed
    resent = new.recv()
    assert (resent.payload, resent.dup, resent.packet_id) == (b"m", True, first.packet_id)
    new.send(PubAck(resent.packet_id))
    new.close()
    p.close()


def test_out_of_order_acks_then_reconnect_and_restart(gateway: GatewayHarness) -> None:
    s = _sub(gateway, "ooo", [Subscription("ooo/t", 1)], clean=False)
    p = _pub(gateway)
    for i in range(4):
        _publish(p, "ooo/t", b"%d" % i, 1, i + 1)
    p.close()
    sent = [s.recv() for _ in range(4)]
    s.send(PubAck(sent[1].packet_id))  # only the second and the last
    s.send(PubAck(sent[3].packet_id))
    s.send(PingReq())
    assert s.recv() == PingResp()  # the acks were handled
    s.close()
    expected = [(b"0", sent[0].packet_id), (b"2", sent[2].packet_id)]
    again = RawClient(gateway.port, level=4)
    assert again.connect("ooo", clean=False).session_present
    assert [(m.payload, m.packet_id) for m in (again.recv(), again.recv())] == expected
    again.close()  # still unacknowledged: the same two after a restart
    gateway.restart()
    again = RawClient(gateway.port, level=4)
    assert again.connect("ooo", clean=False).session_present
    resent = [again.recv(), again.recv()]
    assert [(m.payload, m.packet_id, m.dup) for m in resent] == [(*e, True) for e in expected]
    for m in resent:
        again.send(PubAck(m.packet_id))
    p = _pub(gateway)
    _publish(p, "ooo/t", b"new", 1, 9)
    nxt = again.recv()
    assert (nxt.payload, nxt.dup) == (b"new", False)  # nothing acknowledged came back
    again.close()
    p.close()
