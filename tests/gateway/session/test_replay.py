"""Replay (issue 20) end to end with real paho-mqtt clients, 3.1.1 and 5.0: a subscription that
starts in the past, then continues live with no gap and no duplicate at the seam."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.session.model import Session
from gateway.session.replay import iso_ms
from gateway.storage.embedded import EmbeddedStorage
from tests.gateway.conftest import Client, GatewayHarness, paho_property, wait_until
from topicmap import TopicFilter, queue_name


def _replay_props(start: str) -> Properties:
    props = Properties(PacketTypes.SUBSCRIBE)
    props.UserProperty = ("replay-from", start)
    return props


def _subscribe(c: Client, flt: str, qos: int, start: str | None) -> list[int]:
    """SUBSCRIBE `flt`, asking for a replay from `start`: through the MQTT 5 property on a v5
    client, through the `$replay/` prefix on a 3.1.1 one."""
    if start is None:
        return c.subscribe(flt, qos)
    if c.v5:
        return c.subscribe(flt, options=SubscribeOptions(qos=qos), properties=_replay_props(start))
    return c.subscribe(f"$replay/{start}/{flt}", qos)


def _history_end(gateway: GatewayHarness, flt: str) -> int:
    """How far the store holds the history a replay of `flt` reads (the ends of its history
    queues: the embedded store's parent topics, RocketMQ's one parent topic)."""

    def ends() -> int:
        assert gateway.gw is not None
        store = gateway.gw.store
        return sum(store.max_offset(q) for q in store.history_queues(TopicFilter(flt)))

    return gateway.call(ends)


def _session(gateway: GatewayHarness, client_id: str) -> Session:
    s = gateway.running.sessions.get(client_id)
    assert s is not None
    return s


def _seqs(c: Client) -> list[int]:
    return [int(p.split(b":")[-1]) for p in c.payloads()]


def _publish_seq(pub: Client, topic: str, first: int, n: int, qos: int = 1) -> None:
    for i in range(first, first + n):
        pub.publish(topic, f"{topic}:{i}".encode(), qos)


def _now_ms(gateway: GatewayHarness) -> int:
    """A store time strictly after everything acknowledged so far (store times are
    milliseconds). A backend may acknowledge before it stores (RocketMQ in async mode: before
    SEND_OK): drain() waits until what was appended is stored."""
    assert gateway.gw is not None
    gateway.run(gateway.gw.store.drain())
    t = int(time.time() * 1000)
    wait_until(lambda: int(time.time() * 1000) > t + 1, what="the clock to move")
    return t + 1


@pytest.mark.parametrize("v5", [False, True], ids=["3.1.1", "5.0"])
def test_replay_from_before_the_filter_existed(
    gateway: GatewayHarness, clients: list[Client], v5: bool
) -> None:
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    _publish_seq(pub, "site/a/t", 0, 20)  # nobody subscribed with any filter yet
    since = _now_ms(gateway)
    _publish_seq(pub, "site/a/t", 20, 30)
    _publish_seq(pub, "other/t", 0, 5)  # another parent topic: not matched

    sub = Client(gateway.port, "sub", v5=v5)
    clients.append(sub)
    start = iso_ms(since) if v5 else str(since)  # RFC 3339 and epoch milliseconds
    assert _subscribe(sub, "site/#", 1, start) == [1]
    sub.wait_messages(30)
    _publish_seq(pub, "site/a/t", 50, 10)  # live after the replay
    msgs = sub.wait_messages(40)
    assert _seqs(sub) == list(range(20, 60))
    assert all(m.topic == "site/a/t" and not m.retain for m in msgs)
    assert [m.qos for m in msgs] == [1] * 40

    early = Client(gateway.port, "early", v5=v5)
    clients.append(early)
    assert _subscribe(early, "site/a/+", 0, "earliest") == [0]  # QoS downgraded to 0
    msgs = early.wait_messages(60)
    assert _seqs(early) == list(range(60))
    assert {m.qos for m in msgs} == {0}


def test_replay_of_retained_message_has_retain_cleared(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    pub.publish("site/r", b"site/r:0", 1, retain=True)
    pub.publish("site/r", b"site/r:1", 1)
    sub = Client(gateway.port, "sub", v5=True)
    clients.append(sub)
    _subscribe(sub, "site/#", 1, "earliest")
    msgs = sub.wait_messages(2)
    assert _seqs(sub) == [0, 1]  # once each: no separate retained copy ahead of the history
    assert not any(m.retain for m in msgs)
    pub.publish("site/r", b"site/r:2", 1)
    sub.wait_messages(3)
    assert _seqs(sub) == [0, 1, 2]


@pytest.mark.parametrize("v5", [False, True], ids=["3.1.1", "5.0"])
@pytest.mark.parametrize("known", [False, True], ids=["new-filter", "filter-in-use"])
def test_seam_under_concurrent_publishing(
    gateway: GatewayHarness, clients: list[Client], v5: bool, known: bool
) -> None:
    """Publishers run before, during and after the SUBSCRIBE: every sequence number arrives
    exactly once, in order, whichever side of the seam it fell on. `filter-in-use`: another
    session holds the filter all along, so messages on both sides of the seam are in its
    light queue (the replay must not deliver again what the light queue delivers)."""
    if known:
        other = Client(gateway.port, "other")
        clients.append(other)
        assert other.subscribe("seam/+", 1) == [1]
    pubs = [Client(gateway.port, f"pub{i}") for i in range(2)]
    clients.extend(pubs)
    stop = threading.Event()
    sent = [0, 0]

    def run(i: int) -> None:
        n = 0
        while not stop.is_set() or n < 300:
            info = pubs[i].c.publish(f"seam/{i}", f"seam/{i}:{n}".encode(), 1)
            n += 1
            if n % 50 == 0:
                # At the gateway's pace: paho queues what its in-flight window cannot send yet,
                # so an unpaced loop counted tens of thousands of messages still in that queue
                # when the seam took long (a loaded host, the RocketMQ backend), all of which
                # the subscriber then had to receive before the timeout.
                info.wait_for_publish(timeout=30)
                time.sleep(0.001)
        sent[i] = n

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: _history_end(gateway, "seam/+") > 200)
        sub = Client(gateway.port, "sub", v5=v5)
        clients.append(sub)
        _subscribe(sub, "seam/+", 1, "earliest")
        at_seam = _history_end(gateway, "seam/+")
        # Publishing goes on across the seam.
        wait_until(lambda: _history_end(gateway, "seam/+") > at_seam + 300)
    finally:
        stop.set()
        for t in threads:
            t.join()
    total = sum(sent)
    sub.wait_messages(total, timeout=max(30, total / 1000))  # >= 1,000 deliveries a second
    pubs[0].publish("seam/end", b"seam/end:0", 1)  # live, after anything a duplicate could be
    msgs = sub.wait_messages(total + 1)
    assert msgs[-1].topic == "seam/end"
    per: dict[str, list[int]] = {"seam/0": [], "seam/1": []}
    with sub.lock:
        for m in sub.messages[:-1]:
            per[m.topic].append(int(bytes(m.payload).split(b":")[-1]))
    assert per["seam/0"] == list(range(sent[0]))
    assert per["seam/1"] == list(range(sent[1]))


@pytest.mark.parametrize("v5", [False, True], ids=["3.1.1", "5.0"])
def test_wildcard_spanning_parent_topics_in_store_order(
    gateway: GatewayHarness, clients: list[Client], v5: bool
) -> None:
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    expected = []
    for i in range(40):
        topic = ["a/t", "b/t", "c/u", "d/t/x"][i % 4]
        pub.publish(topic, f"{topic}:{i}".encode(), 1)
        if topic in ("a/t", "b/t"):
            expected.append((topic, i))
    pub.publish("$SYS/t", b"never", 0)  # `+` does not match a $ topic (rejected anyway)
    sub = Client(gateway.port, "sub", v5=v5)
    clients.append(sub)
    _subscribe(sub, "+/t", 1, "earliest")
    sub.wait_messages(len(expected))
    pub.publish("e/t", b"e/t:99", 1)  # a parent topic created after the seam: live
    msgs = sub.wait_messages(len(expected) + 1)
    got = [(m.topic, int(bytes(m.payload).split(b":")[-1])) for m in msgs]
    assert got == [*expected, ("e/t", 99)]


def test_retention_cut_off_starts_at_the_oldest_kept_and_says_so(
    tmp_path: Path, clients: list[Client], caplog: pytest.LogCaptureFixture
) -> None:
    h = GatewayHarness(tmp_path / "data", segment_size=4096, retention_bytes=3 * 4096).start()
    try:
        since = int(time.time() * 1000) - 60_000
        pub = Client(h.port, "pub")
        clients.append(pub)
        _publish_seq(pub, "site/t", 0, 150)
        store = h.running.store
        assert isinstance(store, EmbeddedStorage)
        h.call(lambda: store.delete_expired())  # what the store's maintenance runs
        assert h.call(lambda: store.min_offset("site")) > 0  # retention deleted some
        oldest = h.call(lambda: store.min_offset("site"))
        sub = Client(h.port, "sub", v5=True)
        clients.append(sub)
        got: dict[str, Any] = {}

        def on_subscribe(c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
            got["reason"] = getattr(props, "ReasonString", None)
            sub.subacks[mid] = [int(r.value) for r in rcs]

        sub.c.on_subscribe = on_subscribe
        with caplog.at_level("INFO", logger="lmqtt.gateway"):
            assert _subscribe(sub, "site/#", 1, iso_ms(since)) == [1]
        sub.wait_messages(150 - oldest)
        assert _seqs(sub) == list(range(oldest, 150))
        assert "the oldest message kept" in got["reason"]
        assert "site/#" in got["reason"]
        assert any("oldest message kept" in r.getMessage() for r in caplog.records)
    finally:
        h.stop()


def test_acl_read_check_on_every_replayed_message(tmp_path: Path, clients: list[Client]) -> None:
    acl = tmp_path / "acl"
    acl.write_text(
        "topic read public/#\ntopic deny public/secret\n\nuser admin\ntopic readwrite #\n"
    )
    h = GatewayHarness(tmp_path / "data", acl_file=acl).start()
    try:
        pub = Client(h.port, "pub", connect=False)
        pub.c.username_pw_set("admin")
        pub.connect()
        clients.append(pub)
        for i in range(10):
            topic = "public/secret" if i % 3 == 0 else "public/open"
            pub.publish(topic, f"{topic}:{i}".encode(), 1)
        sub = Client(h.port, "anon")
        clients.append(sub)
        assert _subscribe(sub, "public/#", 1, "earliest") == [1]
        pub.publish("public/open", b"public/open:10", 1)
        sub.wait_messages(7)
        assert _seqs(sub) == [1, 2, 4, 5, 7, 8, 10]
        assert {m.topic for m in sub.messages} == {"public/open"}
    finally:
        h.stop()


@pytest.mark.parametrize("v5", [False, True], ids=["3.1.1", "5.0"])
def test_persistent_replay_resumes_after_restart(
    tmp_path: Path, clients: list[Client], v5: bool
) -> None:
    """A persistent session stops part way through its replay (unacknowledged messages in
    flight), the gateway restarts; the reconnect finishes it: nothing acknowledged is sent
    again, nothing is skipped, and live messages follow."""
    h = GatewayHarness(tmp_path / "data", max_inflight=10).start()
    try:
        pub = Client(h.port, "pub")
        clients.append(pub)
        _publish_seq(pub, "site/t", 0, 300)
        kw: dict[str, Any] = {"session_expiry": 3600} if v5 else {}
        sub = Client(h.port, "sub", v5=v5, clean=False, auto_ack=False, **kw)
        clients.append(sub)
        _subscribe(sub, "site/#", 1, "earliest")
        first = sub.wait_messages(10)
        for m in first[:5]:
            sub.c.ack(m.mid, m.qos)  # 0..4 acknowledged, 5..9 in flight
        sub.wait_messages(15)
        acked = _seqs(sub)[:5]
        assert acked == [0, 1, 2, 3, 4]
        sub.drop()
        pub.drop()
        h.restart()
        pub2 = Client(h.port, "pub2")
        clients.append(pub2)
        sub2 = Client(h.port, "sub", v5=v5, clean=False, **kw)
        clients.append(sub2)
        assert sub2.connack is not None and sub2.connack[0]  # session present
        _publish_seq(pub2, "site/t", 300, 5)
        sub2.wait_messages(300 - 5 + 5)
        seqs = _seqs(sub2)
        assert seqs == list(range(5, 305))
        assert [m.dup for m in sub2.messages[:10]] == [True] * 10
    finally:
        h.stop()


def test_bad_replay_requests_are_refused_clearly(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    v3 = Client(gateway.port, "v3")
    clients.append(v3)
    assert v3.subscribe("$replay/yesterday/site/#", 1) == [0x80]
    assert v3.subscribe("$replay/earliest", 1) == [0x80]
    assert v3.subscribe("$replay/earliest/$share/g/site/#", 1) == [0x80]
    v5 = Client(gateway.port, "v5", v5=True)
    clients.append(v5)
    one = SubscribeOptions(qos=1)
    bad_time = _replay_props("2026-13-01T00:00:00Z")
    assert v5.subscribe("site/#", options=one, properties=bad_time) == [0x8F]
    shared = _replay_props("earliest")
    assert v5.subscribe("$share/g/site/#", options=one, properties=shared) == [0x8F]
    assert v5.subscribe("site/#", 1) == [1]  # the connection is fine


def test_unsubscribe_by_the_replay_filter(gateway: GatewayHarness, clients: list[Client]) -> None:
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    sub = Client(gateway.port, "sub")
    clients.append(sub)
    sub.subscribe("$replay/earliest/site/#", 1)
    sub.unsubscribe("$replay/earliest/site/#")
    wait_until(lambda: gateway.call(lambda: _session(gateway, "sub").subscriptions == {}))
    pub.publish("site/t", b"x", 1)
    sub.subscribe("other", 1)
    pub.publish("other", b"other:1", 1)
    sub.wait_messages(1)
    assert sub.payloads() == [b"other:1"]


def test_replay_at_qos2_with_a_subscription_identifier(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    pub = Client(gateway.port, "pub", v5=True)
    clients.append(pub)
    _publish_seq(pub, "q/t", 0, 5, qos=2)
    sub = Client(gateway.port, "sub", v5=True)
    clients.append(sub)
    props = _replay_props("earliest")
    props.SubscriptionIdentifier = 7
    assert sub.subscribe("q/#", options=SubscribeOptions(qos=2), properties=props) == [2]
    msgs = sub.wait_messages(5)
    assert _seqs(sub) == [0, 1, 2, 3, 4]
    assert {m.qos for m in msgs} == {2}
    assert all(paho_property(m, "SubscriptionIdentifier") == [7] for m in msgs)
    # Every QoS 2 exchange completed: nothing left in flight.
    wait_until(lambda: gateway.call(lambda: not _session(gateway, "sub").inflight))


def test_overlapping_live_subscription_is_not_held_by_a_replay(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """`ov/#` replays (held: the client does not acknowledge, its window is full) while the
    same session's `ov/live` keeps receiving live messages; after the replay nothing comes
    twice."""
    pub = Client(gateway.port, "pub")
    clients.append(pub)
    _publish_seq(pub, "ov/old", 0, 30)
    props = Properties(PacketTypes.CONNECT)
    props.ReceiveMaximum = 5
    sub = Client(gateway.port, "sub", v5=True, auto_ack=False, connect_props=props)
    clients.append(sub)
    assert sub.subscribe("ov/live", options=SubscribeOptions(qos=0)) == [0]
    _subscribe(sub, "ov/#", 1, "earliest")
    held = sub.wait_messages(5)  # the window is full: the replay waits
    live = queue_name("ov/live")
    before = gateway.call(lambda: gateway.running.store.max_offset(live))
    pub.publish("ov/live", b"ov/live:100", 0)
    # In `ov/live`'s light queue, where the next pass finds it (on RocketMQ a moment after the
    # PUBACK: once stored, and pulled by the gateway).
    wait_until(lambda: gateway.call(lambda: gateway.running.store.max_offset(live)) > before)
    sub.c.ack(held[0].mid, 1)  # room for one more: the pass serves `ov/live` too
    msgs = sub.wait_messages(7)
    assert ("ov/live", b"ov/live:100") in [(m.topic, bytes(m.payload)) for m in msgs]
    assert len(msgs) == 7  # the replay is still far from done
    done = 1  # messages[0] acknowledged; acknowledge the rest as it comes
    while done < 31:
        msgs = sub.wait_messages(done + 1)
        for m in msgs[done:]:
            if m.qos:
                sub.c.ack(m.mid, m.qos)
        done = len(msgs)
    pub.publish("ov/live", b"ov/live:101", 1)  # live for both filters: delivered once
    msgs = sub.wait_messages(32)
    seqs = [(m.topic, int(bytes(m.payload).split(b":")[-1])) for m in msgs]
    assert [s for s in seqs if s[0] == "ov/old"] == [("ov/old", i) for i in range(30)]
    assert [s for s in seqs if s[0] == "ov/live"] == [("ov/live", 100), ("ov/live", 101)]
