"""Batched ingest: runs of plain PUBLISHes in one TCP segment are stored with one store call.

Whatever arrives together must behave as if handled one by one: acknowledgements in arrival
order, interleaved QoS 2 / retained / SUBSCRIBE packets in their place, a store error failing
only its own message, and in `sync` flush mode no PUBACK before the covering fsync.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.connection.ingest import GATHERS_AT_MOST
from gateway.protocol import (
    Disconnect,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    Will,
    encode,
)
from gateway.storage.embedded import EmbeddedStorage
from store import GetStatus
from tests.gateway.conftest import GatewayHarness, RawClient


def _segment(level: int, *events: Any) -> bytes:
    """Several packets as one write: the gateway reads them in one turn."""
    return b"".join(encode(ev, level) for ev in events)


def _publish_in_one_turn(h: GatewayHarness, devices: list[RawClient], prefix: str) -> None:
    """Hold the gateway's loop while device d writes its QoS 1 publish on `prefix/d`, so that
    one turn reads them all; then each device gets its PUBACK."""
    assert h.loop is not None
    release = threading.Event()
    h.loop.call_soon_threadsafe(release.wait, 10)
    for d, dev in enumerate(devices):
        dev.send(Publish(f"{prefix}/{d}", str(d).encode(), qos=1, packet_id=d + 1))
    release.set()
    for d, dev in enumerate(devices):
        assert dev.recv() == PubAck(d + 1)


def _subscriber(gateway: GatewayHarness, filter: str, level: int = 5) -> RawClient:
    sub = RawClient(gateway.port, level=level)
    assert sub.connect(f"sub-{filter}").reason_code == 0
    sub.send(Subscribe(1, [Subscription(filter, 1)]))
    assert isinstance(sub.recv(), SubAck)
    return sub


def _received(sub: RawClient, n: int) -> list[Publish]:
    """The next `n` PUBLISHes, each acknowledged."""
    out: list[Publish] = []
    while len(out) < n:
        ev = sub.recv()
        assert ev is not None, f"closed after {len(out)} of {n} messages"
        if isinstance(ev, Publish):
            out.append(ev)
            if ev.qos == 1 and ev.packet_id is not None:
                sub.send(PubAck(ev.packet_id))
    return out


def _stored_topics(gateway: GatewayHarness, parent: str) -> list[tuple[str, str | None]]:
    """(mqtt.topic, mqtt.pid) of every record of the parent topic's queue, in log order."""
    assert gateway.gw is not None
    got = gateway.call(lambda: gateway.gw.store.get(parent, 0, 1000))  # type: ignore[union-attr]
    assert got.status is GetStatus.FOUND
    return [(m.properties["mqtt.topic"], m.properties.get("mqtt.pid")) for m in got.messages]


def test_mixed_segment_keeps_order_and_acks(gateway: GatewayHarness) -> None:
    watcher = _subscriber(gateway, "mix/#")
    pub = RawClient(gateway.port, level=5)
    assert pub.connect("mixer").reason_code == 0
    pub.send_bytes(
        _segment(
            5,
            Publish("mix/1", b"1", qos=1, packet_id=1),
            Publish("mix/2", b"2", qos=0),
            Publish("mix/3", b"3", qos=2, packet_id=3),
            Publish("mix/4", b"4", qos=1, packet_id=4, retain=True),
            Publish("mix/5", b"5", qos=1, packet_id=5),
            Subscribe(6, [Subscription("other/t", 1)]),
            Publish("mix/6", b"6", qos=1, packet_id=7),
            PubRel(3),
            Publish("mix/7", b"7", qos=0),
            Publish("mix/8", b"8", qos=1, packet_id=8),
        )
    )
    replies = [pub.recv() for _ in range(8)]
    assert replies == [
        PubAck(1),
        PubRec(3),
        PubAck(4),
        PubAck(5),
        SubAck(6, [1]),
        PubAck(7),
        PubComp(3),
        PubAck(8),
    ]
    got = _received(watcher, 8)
    assert [p.topic for p in got] == [f"mix/{i}" for i in range(1, 9)]
    assert [p.payload for p in got] == [str(i).encode() for i in range(1, 9)]
    # The records carry the same MQTT facts as one-by-one puts, packet ids included.
    assert _stored_topics(gateway, "mix") == [
        ("mix/1", "1"), ("mix/2", None), ("mix/3", "3"), ("mix/4", "4"),
        ("mix/5", "5"), ("mix/6", "7"), ("mix/7", None), ("mix/8", "8"),
    ]  # fmt: skip
    # The retained one went through the retained index as before.
    fresh = _subscriber(gateway, "mix/4")
    assert [p.payload for p in _received(fresh, 1)] == [b"4"]
    for c in (watcher, pub, fresh):
        c.close()


def test_disconnect_after_publishes_in_one_segment(gateway: GatewayHarness) -> None:
    """A DISCONNECT read with the publishes before it (handled in the read callback, without
    a reader task): they are stored and acknowledged first, then the connection closes."""
    watcher = _subscriber(gateway, "bye/#")
    pub = RawClient(gateway.port, level=5)
    assert pub.connect("leaver").reason_code == 0
    pub.send_bytes(
        _segment(
            5,
            Publish("bye/1", b"1", qos=1, packet_id=1),
            Publish("bye/2", b"2", qos=0),
            Publish("bye/3", b"3", qos=1, packet_id=3),
            Disconnect(),
        )
    )
    assert [pub.recv() for _ in range(3)] == [PubAck(1), PubAck(3), None]
    assert [p.payload for p in _received(watcher, 3)] == [b"1", b"2", b"3"]
    watcher.close()


def test_pubacks_before_a_disconnect_in_one_segment_count(gateway: GatewayHarness) -> None:
    """A persistent session that acknowledges its messages and disconnects in one segment
    gets none of them again when it resumes: the PUBACKs are applied before the session's
    connection ends (its record then has nothing in flight)."""
    device = RawClient(gateway.port, level=4)
    assert device.connect("acker", clean=False).reason_code == 0
    device.send(Subscribe(1, [Subscription("ack/t", 1)]))
    assert isinstance(device.recv(), SubAck)
    pub = RawClient(gateway.port, level=4)
    assert pub.connect("acker-pub").reason_code == 0
    for i in (1, 2):
        pub.send(Publish("ack/t", str(i).encode(), qos=1, packet_id=i))
        assert pub.recv() == PubAck(i)
    got = [device.recv_until(Publish) for _ in range(2)]
    assert [p.payload for p in got] == [b"1", b"2"]
    # A publish first: the PUBACKs after it are read one by one (not by the C read of a
    # run of PUBACKs), as what a DISCONNECT may follow in the same read.
    device.send_bytes(
        _segment(
            4,
            Publish("ack/status", b"bye", qos=0),
            *(PubAck(p.packet_id) for p in got),
            Disconnect(),
        )
    )
    assert device.recv() is None
    again = RawClient(gateway.port, level=4)
    ack = again.connect("acker", clean=False)
    assert ack.session_present
    pub.send(Publish("ack/t", b"3", qos=1, packet_id=3))
    assert pub.recv() == PubAck(3)
    nxt = again.recv_until(Publish)
    assert nxt is not None and nxt.payload == b"3" and not nxt.dup
    for c in (pub, again):
        c.close()


def test_subscribe_after_publishes_in_one_segment(gateway: GatewayHarness) -> None:
    """A SUBSCRIBE read after publishes (handled in the read callback, without a reader
    task): they are stored and acknowledged first, so the new subscription starts after
    them and receives only what is published after it."""
    c = RawClient(gateway.port, level=4)
    assert c.connect("pre-sub").reason_code == 0
    c.send_bytes(
        _segment(
            4,
            Publish("pre/t", b"before", qos=1, packet_id=1),
            Subscribe(2, [Subscription("pre/t", 1)]),
        )
    )
    assert [c.recv(), c.recv()] == [PubAck(1), SubAck(2, [1])]
    c.send(Publish("pre/t", b"after", qos=1, packet_id=3))
    got = c.recv_until(Publish)
    assert got is not None and got.payload == b"after"
    c.close()


def test_long_run_over_several_turns(gateway: GatewayHarness) -> None:
    """More publishes in one write than one turn handles: all stored, acked, in order."""
    watcher = _subscriber(gateway, "run/+")
    pub = RawClient(gateway.port, level=4)
    assert pub.connect("runner").reason_code == 0
    n = 300
    pub.send_bytes(
        _segment(
            4,
            *(
                Publish(f"run/{i % 7}", b"%d" % i, qos=i % 2, packet_id=i + 1 if i % 2 else None)
                for i in range(n)
            ),
        )
    )
    acks = [pub.recv() for _ in range(n // 2)]
    assert acks == [PubAck(i + 1) for i in range(n) if i % 2]
    assert [p.payload for p in _received(watcher, n)] == [b"%d" % i for i in range(n)]
    watcher.close()
    pub.close()


@pytest.fixture
def small_segments(tmp_path: Path) -> Iterator[GatewayHarness]:
    """Segments of 4 KiB: a 5,000-byte message is refused by the store (not the codec)."""
    h = GatewayHarness(tmp_path / "data", segment_size=4096).start()
    try:
        yield h
    finally:
        h.stop()


def test_store_error_mid_batch_fails_only_that_message(small_segments: GatewayHarness) -> None:
    gateway = small_segments
    watcher = _subscriber(gateway, "err/#")
    pub = RawClient(gateway.port, level=5)
    assert pub.connect("errs").reason_code == 0
    pub.send_bytes(
        _segment(
            5,
            Publish("err/1", b"a", qos=1, packet_id=1),
            Publish("err/2", b"x" * 5000, qos=1, packet_id=2),
            Publish("err/3", b"c", qos=1, packet_id=3),
            Publish("err/4", b"d", qos=0),
        )
    )
    assert [pub.recv() for _ in range(3)] == [PubAck(1), PubAck(2, 0x80), PubAck(3)]
    assert [p.payload for p in _received(watcher, 2)] == [b"a", b"c"]
    assert [p.payload for p in _received(watcher, 1)] == [b"d"]
    assert gateway.call(lambda: gateway.gw.stats.publish_dropped) == 1  # type: ignore[union-attr]
    watcher.close()
    pub.close()


def test_store_error_mid_batch_closes_a_311_client(small_segments: GatewayHarness) -> None:
    """3.1.1 has no negative PUBACK: the publishes before the bad one are stored and acked,
    then the connection closes; nothing after it is stored."""
    gateway = small_segments
    pub = RawClient(gateway.port, level=4)
    assert pub.connect("errs4").reason_code == 0
    pub.send_bytes(
        _segment(
            4,
            Publish("e4/1", b"a", qos=1, packet_id=1),
            Publish("e4/2", b"x" * 5000, qos=1, packet_id=2),
            Publish("e4/3", b"c", qos=1, packet_id=3),
        )
    )
    assert pub.recv() == PubAck(1)
    assert pub.is_closed()
    assert _stored_topics(gateway, "e4") == [("e4/1", "1")]
    pub.close()


@pytest.fixture
def sync_gateway(tmp_path: Path) -> Iterator[GatewayHarness]:
    h = GatewayHarness(tmp_path / "data", flush="sync").start()
    try:
        yield h
    finally:
        h.stop()


def test_sync_flush_batch_acked_only_after_fsync(sync_gateway: GatewayHarness) -> None:
    """With the flusher held at a gate (the real fsync runs once it opens), a run's messages
    are stored and routed but not one PUBACK leaves; they all come, in order, after it."""
    gateway = sync_gateway
    store = gateway.running.store
    assert isinstance(store, EmbeddedStorage)
    flusher = store._flusher
    assert flusher is not None
    gate = threading.Event()
    flush_log, flush_all = flusher._flush_log, flusher._flush_all

    def gated_log() -> int:
        gate.wait(10)
        return flush_log()

    def gated_all() -> int:
        gate.wait(10)
        return flush_all()

    pub = RawClient(gateway.port, level=4)
    assert pub.connect("durable").reason_code == 0
    watcher = _subscriber(gateway, "dur/#", level=4)
    flusher._flush_log, flusher._flush_all = gated_log, gated_all
    try:
        pub.send_bytes(
            _segment(
                4, *(Publish(f"dur/{i}", b"%d" % i, qos=1, packet_id=i + 1) for i in range(20))
            )
        )
        # Routed at once (delivery does not wait for durability, as before batching)...
        assert [p.payload for p in _received(watcher, 20)] == [b"%d" % i for i in range(20)]
        # ...but acknowledged only once durable (nothing comes in time; the acks that follow
        # show the connection was open).
        with pytest.raises(TimeoutError):
            pub.recv(timeout=0.3)
        gate.set()
        assert [pub.recv() for _ in range(20)] == [PubAck(i + 1) for i in range(20)]
        end = gateway.call(lambda: gateway.gw.store.log_max_offset)  # type: ignore[union-attr]
        assert flusher._flushed >= end
    finally:
        gate.set()
        flusher._flush_log, flusher._flush_all = flush_log, flush_all
        watcher.close()
        pub.close()


def test_publishes_of_many_connections_in_one_turn_share_one_append(tmp_path: Path) -> None:
    """A fleet: one PUBLISH per connection per write. Whatever the gateway reads in one turn
    of its loop is stored with one append; every device still gets its own PUBACK, and each
    subscriber gets every message, each once."""
    from tests.gateway.ops.test_metrics import scrape

    h = GatewayHarness(tmp_path / "data", admin_port=0).start()
    devices: list[RawClient] = []
    try:
        watcher = _subscriber(h, "fleet/#")
        for d in range(100):
            dev = RawClient(h.port, level=4)
            assert dev.connect(f"dev-{d}").reason_code == 0
            devices.append(dev)
        before = scrape(h)
        _publish_in_one_turn(h, devices, "fleet")
        got = _received(watcher, 100)
        assert sorted(int(p.payload) for p in got) == list(range(100))
        after = scrape(h)
        stored = (
            after["lmqtt_store_appended_messages_total"]
            - before["lmqtt_store_appended_messages_total"]
        )
        appends = (
            after["lmqtt_store_append_seconds_count"] - before["lmqtt_store_append_seconds_count"]
        )
        assert stored == 100
        assert appends <= 3, f"{appends:.0f} appends for 100 messages read in one turn"
        with pytest.raises(TimeoutError):  # and nothing twice
            watcher.recv(0.3)
    finally:
        for dev in devices:
            dev.close()
        h.stop()


class _Always:
    """Lingers whatever the rate: an idle test gateway's batch would not (Linger)."""

    def __init__(self, most: float) -> None:
        self.most = most

    def linger(self, n: int, now: float) -> float:
        return self.most

    def stored(self, n: int, now: float) -> None:
        pass


def _held_in_the_lingering_batch(h: GatewayHarness, pub: RawClient, publish: Publish) -> None:
    """Send `publish` and wait until the lingering batch holds it: read, not stored yet."""
    assert h.gw is not None and h.gw.ingest is not None
    ingest = h.gw.ingest
    h.call(lambda: setattr(ingest, "linger", _Always(0.1)))
    pub.send(publish)
    deadline = time.monotonic() + 10
    while not h.call(lambda: len(ingest.pubs)):
        assert time.monotonic() < deadline, "the publish never reached the batch"


def test_lingering_batch_stored_before_the_reader_task(tmp_path: Path) -> None:
    """ingest_linger_ms: a device's plain PUBLISH waits in the batch for the linger (forced:
    an idle gateway does not linger, test_ingest_linger.py). A packet of the same connection
    that needs the reader task (a QoS 2 PUBLISH) stores the batch first: the records keep the
    order the client sent them in, and so do the replies."""
    h = GatewayHarness(tmp_path / "data", ingest_linger_ms=100).start()
    try:
        watcher = _subscriber(h, "linger/#")
        pub = RawClient(h.port, level=5)
        assert pub.connect("lingerer").reason_code == 0
        # Waiting in the batch (the linger is long): the next packet comes in a later read,
        # so the batch's timer has not stored it yet.
        _held_in_the_lingering_batch(h, pub, Publish("linger/1", b"1", qos=1, packet_id=1))
        pub.send(Publish("linger/2", b"2", qos=2, packet_id=2))
        assert [pub.recv(), pub.recv()] == [PubAck(1), PubRec(2)]
        assert [p.payload for p in _received(watcher, 2)] == [b"1", b"2"]
        assert _stored_topics(h, "linger") == [("linger/1", "1"), ("linger/2", "2")]
        watcher.close()
        pub.close()
    finally:
        h.stop()


def test_lingering_batch_stored_before_the_will(tmp_path: Path) -> None:
    """A client whose plain PUBLISH waits in a lingering batch and whose connection then ends
    without DISCONNECT: its publish is stored and delivered before its will. (Closing the
    connection stores the batch, IngestBatch.settle; the wills' own tick usually comes later
    anyway, so this holds the behaviour, not that one call.)"""
    h = GatewayHarness(tmp_path / "data", ingest_linger_ms=100).start()
    try:
        watcher = _subscriber(h, "gone/#")
        pub = RawClient(h.port, level=4)
        assert pub.connect("goner", will=Will("gone/will", b"w", 1)).reason_code == 0
        _held_in_the_lingering_batch(h, pub, Publish("gone/1", b"1", qos=1, packet_id=1))
        pub.close()
        assert [p.payload for p in _received(watcher, 2)] == [b"1", b"w"]
        assert _stored_topics(h, "gone") == [("gone/1", "1"), ("gone/will", None)]
        watcher.close()
    finally:
        h.stop()


def test_a_full_lingering_batch_is_stored_without_its_linger(tmp_path: Path) -> None:
    """A lingering batch that holds GATHERS_AT_MOST publishes is stored at the end of the
    turn that filled it: with a linger far longer than the test's patience, every device
    still gets its PUBACK and the subscriber every message, once."""
    h = GatewayHarness(tmp_path / "data", ingest_linger_ms=100).start()
    devices: list[RawClient] = []
    try:
        assert h.gw is not None and h.gw.ingest is not None and h.loop is not None
        ingest = h.gw.ingest
        watcher = _subscriber(h, "full/#")
        count = int(GATHERS_AT_MOST)
        for d in range(count):
            dev = RawClient(h.port, level=4)
            assert dev.connect(f"full-{d}").reason_code == 0
            devices.append(dev)
        h.call(lambda: setattr(ingest, "linger", _Always(3600.0)))
        _publish_in_one_turn(h, devices, "full")
        got = _received(watcher, count)
        assert sorted(int(p.payload) for p in got) == list(range(count))
        watcher.close()
    finally:
        for dev in devices:
            dev.close()
        h.stop()


def test_a_read_that_fills_a_batch_is_stored_without_a_linger(tmp_path: Path) -> None:
    """One read that brings GATHERS_AT_MOST publishes or more (a flood's connection, several
    PUBLISHes per write) is stored at the end of its turn whatever the linger says: with a
    linger far longer than the test's patience, the PUBACKs and the deliveries still come."""
    h = GatewayHarness(tmp_path / "data", ingest_linger_ms=100).start()
    try:
        assert h.gw is not None and h.gw.ingest is not None
        ingest = h.gw.ingest
        watcher = _subscriber(h, "flood/#")
        dev = RawClient(h.port, level=4)
        assert dev.connect("flood-0").reason_code == 0
        # Its first publish to the topic makes the connection's plain path for it; the read
        # below then goes into the batch in one C call, scheduled once, already full.
        dev.send(Publish("flood/t", b"first", qos=1, packet_id=1))
        assert dev.recv() == PubAck(1)
        assert [p.payload for p in _received(watcher, 1)] == [b"first"]
        h.call(lambda: setattr(ingest, "linger", _Always(3600.0)))
        count = 2 * int(GATHERS_AT_MOST)
        dev.send_bytes(
            b"".join(
                encode(Publish("flood/t", str(i).encode(), qos=1, packet_id=i + 2), 4)
                for i in range(count)
            )
        )
        assert [dev.recv() for _ in range(count)] == [PubAck(i + 2) for i in range(count)]
        got = _received(watcher, count)
        assert [int(p.payload) for p in got] == list(range(count))
        watcher.close()
        dev.close()
    finally:
        h.stop()
