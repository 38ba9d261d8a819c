"""MessageStore behaviour on real files: round trips, statuses, rolls, queues, restarts."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from pathlib import Path

import pytest

from store import (
    CorruptStoreError,
    GetStatus,
    InvalidPropertyError,
    InvalidQueueNameError,
    MessageStore,
    MessageTooLargeError,
    PutResult,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreConfig,
    StoreLockedError,
)
from store import format as fmt
from tests.store.conftest import OpenStore, encoded


def test_put_get_round_trip(open_store: OpenStore) -> None:
    s = open_store()
    r = s.put(topic="site", body=b"hello", queues=["%LMQ%a", "%LMQ%b"], properties={"k": "v"},
              born_timestamp=42)  # fmt: skip
    assert (r.physical_offset, r.queue_offset) == (0, 0)
    assert r.light_offsets == {"%LMQ%a": 0, "%LMQ%b": 0}
    r2 = s.put(topic="site", body=b"second", queues=["%LMQ%b"])
    assert r2.physical_offset == r.end_offset and r2.queue_offset == 1
    assert r2.light_offsets == {"%LMQ%b": 1}
    g = s.get("site", 0)
    assert g.status is GetStatus.FOUND and g.next_offset == 2
    assert [m.body for m in g.messages] == [b"hello", b"second"]
    m = g.messages[0]
    assert (m.topic, m.properties, m.born_timestamp, m.physical_offset) == ("site", {"k": "v"},
                                                                            42, 0)  # fmt: skip
    assert m.queues == ("%LMQ%a", "%LMQ%b") and m.store_timestamp > 0
    gb = s.get("%LMQ%b", 1)
    assert [(x.body, x.queue_offset, x.parent_offset) for x in gb.messages] == [(b"second", 1, 1)]
    assert s.get("%LMQ%a", 0, max_messages=10).messages[0].body == b"hello"
    assert s.message_at(r2.physical_offset).body == b"second"
    assert set(s.queues()) == {"site", "%LMQ%a", "%LMQ%b"}
    assert (s.min_offset("%LMQ%b"), s.max_offset("%LMQ%b"), s.max_offset("nope")) == (0, 2, 0)


def test_every_get_status(open_store: OpenStore, tmp_path: Path) -> None:
    s = open_store(segment_size=4096, retention_bytes=4096)
    assert s.get("missing", 0).status is GetStatus.NO_MATCHED_LOGIC_QUEUE
    for i in range(3):
        s.put("t", b"x%d" % i)
    g = s.get("t", 3)
    assert (g.status, g.next_offset) == (GetStatus.OFFSET_OVERFLOW_ONE, 3)
    g = s.get("t", 10)
    assert (g.status, g.next_offset, g.max_offset) == (GetStatus.OFFSET_OVERFLOW_BADLY, 3, 3)
    # A queue that exists but never received a unit: its files were truncated to zero.
    s.put("u", b"only")
    s.close()
    cq_file = tmp_path / "data" / fmt.consumequeue_path("u", 0)
    os.truncate(cq_file, 0)
    s = open_store(segment_size=4096, retention_bytes=4096)
    assert s.get("u", 0).status is GetStatus.NO_MESSAGE_IN_QUEUE
    # Retention makes old offsets too small.
    for _ in range(100):
        s.put("t", b"y" * 100)
    assert s.delete_expired() > 0
    g = s.get("t", 0)
    assert g.status is GetStatus.OFFSET_TOO_SMALL and g.next_offset == g.min_offset > 0
    assert s.get("t", g.next_offset).status is GetStatus.FOUND


def test_a_queue_is_there_when_its_directory_is(open_store: OpenStore, tmp_path: Path) -> None:
    """A queue directory with no files left is an empty queue; no directory, no queue (one
    listing answers: the look-up every new subscription's queue gets)."""
    s = open_store()
    assert s.max_offset("never") == 0
    assert s.get("never", 0).status is GetStatus.NO_MATCHED_LOGIC_QUEUE
    s.put("v", b"x")
    s.close()
    (tmp_path / "data" / fmt.consumequeue_path("v", 0)).unlink()
    s = open_store()
    assert s.get("v", 0).status is GetStatus.NO_MESSAGE_IN_QUEUE
    assert s.get("never", 0).status is GetStatus.NO_MATCHED_LOGIC_QUEUE


def test_segment_roll_writes_blank_filler(open_store: OpenStore, tmp_path: Path) -> None:
    s = open_store(segment_size=4096)
    body = b"b" * 300
    results = [s.put("roll", body, ["%LMQ%r"]) for _ in range(40)]
    segs = sorted((tmp_path / "data" / "commitlog").iterdir())
    assert len(segs) >= 3 and all(p.stat().st_size == 4096 for p in segs)
    assert [p.name for p in segs[:2]] == [fmt.offset_file_name(0), fmt.offset_file_name(4096)]
    first = segs[0].read_bytes()
    recs = list(fmt.iter_records(first))
    end = sum(r.size for r in recs)
    filler_size, magic = struct.unpack_from(">iI", first, end)
    assert magic == fmt.BLANK_MAGIC and filler_size == 4096 - end
    assert results[len(recs)].physical_offset == 4096
    got = s.get("%LMQ%r", 0, max_messages=100)
    assert len(got.messages) == 40 and all(m.body == body for m in got.messages)
    s.close()
    s = open_store()
    assert len(s.get("roll", 0, max_messages=100).messages) == 40


def test_thousands_of_light_queues_with_bounded_handles(
    open_store: OpenStore, tmp_path: Path
) -> None:
    s = open_store(max_open_files=8, max_cached_queues=64, cq_units_per_file=4)
    n = 3000
    for i in range(n):
        s.put("dev", b"%d" % i, [f"%LMQ%q{i}", f"%LMQ%g{i % 7}"])
    s.flush()
    assert len(s.queues_table.states) <= 64 * 1.2 + 16
    assert len(s.queues_table.files._fds) <= 8
    for i in (0, 1, 1234, n - 1):
        g = s.get(f"%LMQ%q{i}", 0)
        assert [m.body for m in g.messages] == [b"%d" % i]
    g7 = s.get("%LMQ%g3", 0, max_messages=1000)
    # A read stops at a consume-queue file boundary; keep reading.
    bodies = []
    off = 0
    while True:
        g = s.get("%LMQ%g3", off, max_messages=1000)
        if g.status is not GetStatus.FOUND:
            break
        bodies += [int(m.body) for m in g.messages]
        off = g.next_offset
    assert g7.messages and bodies == [i for i in range(n) if i % 7 == 3]
    light = tmp_path / "data" / "consumequeue" / "%LMQ%q5" / "0"
    assert [p.stat().st_size for p in light.iterdir()] == [20]  # grown on demand
    assert len(s.queues()) == n + 7 + 1
    s.close()
    s = open_store(max_open_files=8, max_cached_queues=64)
    assert s.recovery.abnormal is False
    assert s.get("%LMQ%q2999", 0).messages[0].body == b"2999"


def test_restart_after_clean_close_is_fast_and_complete(open_store: OpenStore) -> None:
    s = open_store()
    s.put("a", b"1", ["%LMQ%x"])
    s.offsets.commit("g1", "%LMQ%x", 1)
    s.write_config("sessions.json", b"{}")
    s.close()
    with pytest.raises(StoreClosedError):
        s.put("a", b"2")
    s = open_store()
    assert s.recovery.abnormal is False and s.recovery.records_scanned == 0
    assert s.offsets.get("g1", "%LMQ%x") == 1 and s.offsets.all() == {("g1", "%LMQ%x"): 1}
    assert s.read_config("sessions.json") == b"{}" and s.read_config("nope") is None
    r = s.put("a", b"2", ["%LMQ%x"])
    assert (r.queue_offset, r.light_offsets) == (1, {"%LMQ%x": 1})
    assert [m.body for m in s.get("%LMQ%x", 0).messages] == [b"1", b"2"]


def test_listeners_hear_every_queue_after_dispatch(open_store: OpenStore) -> None:
    s = open_store()
    heard: list[tuple[str, int, int]] = []

    class Listener:
        def on_arrival(self, queue: str, max_offset: int) -> None:
            # The message is readable when the notice arrives.
            heard.append((queue, max_offset, len(s.get(queue, max_offset - 1).messages)))

    s.add_listener(Listener())
    s.put("t", b"1", ["%LMQ%a", "%LMQ%b"])
    s.put("t", b"2", ["%LMQ%b"])
    assert heard == [("t", 1, 1), ("%LMQ%a", 1, 1), ("%LMQ%b", 1, 1), ("t", 2, 1),
                     ("%LMQ%b", 2, 1)]  # fmt: skip
    heard.clear()
    s.append_encoded([encoded(s, "t", b"3", ["%LMQ%a"]), encoded(s, "t", b"4", ["%LMQ%a"])])
    assert sorted(heard) == [("%LMQ%a", 3, 1), ("t", 4, 1)]


def test_append_encoded_assigns_consecutive_offsets(open_store: OpenStore) -> None:
    s = open_store(flush="sync")
    rs = s.append_encoded(
        [encoded(s, "t", b"%d" % i, ["%LMQ%a"], {"i": str(i)}) for i in range(50)]
    )
    assert [r.queue_offset for r in rs] == list(range(50))
    assert [r.light_offsets["%LMQ%a"] for r in rs] == list(range(50))
    assert [m.properties["i"] for m in s.get("%LMQ%a", 0, 50).messages] == [
        str(i) for i in range(50)
    ]
    with pytest.raises(InvalidQueueNameError):  # the whole batch is refused
        s.append_encoded([encoded(s, "t", b"ok"), encoded(s, "t", b"bad", [""])])
    assert s.max_offset("t") == 50


def test_offset_by_time(open_store: OpenStore) -> None:
    s = open_store()
    stamps = []
    for i in range(20):
        r = s.put("t", b"%d" % i, ["%LMQ%a"])
        stamps.append(r.store_timestamp)
    for i, ts in enumerate(stamps):
        first = stamps.index(ts)
        assert s.offset_by_time("%LMQ%a", ts) == first <= i
    assert s.offset_by_time("t", 0) == 0
    assert s.offset_by_time("t", stamps[-1] + 1) == 20
    assert s.offset_by_time("nope", 0) == 0


def test_bad_input_is_a_clear_error_and_store_stays_usable(open_store: OpenStore) -> None:
    s = open_store(max_body_size=1000)
    with pytest.raises(MessageTooLargeError):
        s.put("t", b"x" * 1001)
    for bad in ["", "a,b", "x\x01", "q" * 300, "\x00"]:
        with pytest.raises(InvalidQueueNameError):
            s.put("t", b"x", [bad])
    with pytest.raises(InvalidQueueNameError):
        s.put("t" * 128, b"x")
    with pytest.raises(InvalidQueueNameError):
        s.put("t", b"x", ["t"])
    for props in [{"INNER_MULTI_DISPATCH": "q"}, {"a\x02": "b"}, {"a": "b\x01"}, {"": "x"},
                  {"big": "v" * 40000}]:  # fmt: skip
        with pytest.raises(InvalidPropertyError):
            s.put("t", b"x", properties=props)
    r = s.put("%RETAIN%", b"kept", ["%LMQ%site/+/x", "%LMQ%.."])
    assert s.get("%LMQ%..", 0).messages[0].body == b"kept"
    assert s.get("%LMQ%site/+/x", 0).messages[0].physical_offset == r.physical_offset
    assert s.max_offset("t") == 0


def test_segment_too_small_for_message(open_store: OpenStore) -> None:
    s = open_store(segment_size=4096, max_body_size=10_000)
    with pytest.raises(MessageTooLargeError):
        s.put("t", b"x" * 5000)
    s.put("t", b"ok")
    assert s.get("t", 0).messages[0].body == b"ok"


def test_lock_and_foreign_files(open_store: OpenStore, tmp_path: Path) -> None:
    open_store()
    with pytest.raises(StoreLockedError):
        MessageStore.open(StoreConfig(data_dir=tmp_path / "data"))
    other = tmp_path / "other"
    (other / "commitlog").mkdir(parents=True)
    (other / "commitlog" / "notes.txt").write_text("hi")
    with pytest.raises(CorruptStoreError):
        MessageStore.open(StoreConfig(data_dir=other))
    junk = tmp_path / "junk"
    (junk / "commitlog").mkdir(parents=True)
    (junk / "commitlog" / fmt.offset_file_name(0)).write_bytes(b"GIF89a" + bytes(4090))
    with pytest.raises(CorruptStoreError):
        MessageStore.open(StoreConfig(data_dir=junk, segment_size=4096))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CorruptStoreError):
        MessageStore.open(StoreConfig(data_dir=afile))


def test_read_only_open_while_writer_runs(open_store: OpenStore, tmp_path: Path) -> None:
    w = open_store()
    for i in range(10):
        w.put("t", b"%d" % i, ["%LMQ%a"])
    w.flush()
    r = MessageStore.open(StoreConfig(data_dir=tmp_path / "data", read_only=True))
    try:
        assert [m.body for m in r.get("%LMQ%a", 0).messages] == [b"%d" % i for i in range(10)]
        with pytest.raises(ReadOnlyStoreError):
            r.put("t", b"x")
        w.put("t", b"late")
        assert r.refresh() == w.log_max_offset
        assert r.message_at(w.log_max_offset - len(fmt.encode_record(topic="t", body=b"late"))
                            ).body == b"late"  # fmt: skip
    finally:
        r.close()
    assert (tmp_path / "data" / "abort").exists()  # the writer's marker is untouched


def test_concurrent_sync_puts_share_fsyncs(open_store: OpenStore) -> None:
    s = open_store(flush="sync")
    threads, per = 8, 40
    results: list[list[int]] = [[] for _ in range(threads)]

    def worker(k: int) -> None:
        for i in range(per):
            r = s.put("t", b"%d-%d" % (k, i), ["%LMQ%all", f"%LMQ%w{k}"])
            assert s.commitlog.flushed_pos >= r.end_offset
            results[k].append(r.light_offsets["%LMQ%all"])

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    offsets = sorted(o for rs in results for o in rs)
    assert offsets == list(range(threads * per))
    assert s.commitlog.fsync_count < threads * per  # group commit
    for k in range(threads):
        msgs = s.get(f"%LMQ%w{k}", 0, 100).messages
        assert [m.body for m in msgs] == [b"%d-%d" % (k, i) for i in range(per)]


async def test_put_async_sync_mode_does_not_block_the_loop(open_store: OpenStore) -> None:
    s = open_store(flush="sync")
    started = finished = 0
    ticks_while_waiting = 0  # loop turns while a put had started and not yet returned
    stop = asyncio.Event()

    async def put(i: int) -> PutResult:
        nonlocal started, finished
        started += 1
        r = await s.put_async("t", b"%d" % i, ["%LMQ%a"])
        finished += 1
        return r

    async def ticker() -> None:
        nonlocal ticks_while_waiting
        while not stop.is_set():
            if started > finished:
                ticks_while_waiting += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    rs = await asyncio.gather(*(put(i) for i in range(200)))
    stop.set()
    await t
    assert sorted(r.queue_offset for r in rs) == list(range(200))
    assert s.commitlog.flushed_pos >= max(r.end_offset for r in rs)
    # A put that blocked the loop until its fsync would start and finish within one step of
    # its task: the ticker would never see one waiting.
    assert ticks_while_waiting > 0
    rs2 = s.append_encoded([encoded(s, "t", b"x")])
    await s.wait_durable(rs2[0].end_offset)
    assert rs2[0].queue_offset == 200 and s.commitlog.flushed_pos >= rs2[0].end_offset


async def test_put_async_async_mode_returns_at_once(open_store: OpenStore) -> None:
    s = open_store(flush="async", flush_interval_ms=60_000)
    r = await s.put_async("t", b"x")
    assert r.queue_offset == 0 and s.get("t", 0).messages[0].body == b"x"


def test_retention_by_age_and_size(open_store: OpenStore, tmp_path: Path) -> None:
    s = open_store(segment_size=4096, retention_hours=1)
    for i in range(60):
        s.put("t", b"%03d" % i + b"." * 200, ["%LMQ%a"] if i % 2 else [])
    nsegs = len(s.commitlog.segments)
    assert nsegs >= 3
    assert s.delete_expired() == 0  # young
    assert s.delete_expired(now=os.path.getmtime(s.commitlog.segments[0].path) + 7200) == (
        nsegs - 1
    )
    assert len(s.commitlog.segments) == 1
    lo = s.min_offset("%LMQ%a")
    assert lo > 0 and s.min_offset("t") > 0
    g = s.get("%LMQ%a", lo)
    assert g.status is GetStatus.FOUND
    assert all(int(m.body[:3]) % 2 == 1 for m in g.messages)
    assert g.messages[0].physical_offset >= s.log_min_offset
    s.close()
    s = open_store(segment_size=4096, retention_bytes=2 * 4096)
    assert s.min_offset("%LMQ%a") == lo
    for _ in range(60):
        s.put("t", b"y" * 200)
    s.delete_expired()
    assert len(s.commitlog.segments) == 2
    assert s.get("t", s.min_offset("t")).status is GetStatus.FOUND


def test_read_only_requires_existing_store(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="no store"):
        MessageStore.open(StoreConfig(data_dir=tmp_path / "none", read_only=True))


def test_new_queues_are_told_absent_without_listing_their_directories(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device fleet subscribes to thousands of queues that have no directory yet: each
    look-up is answered from the one listing of the queue root (and the queues created
    since), not by a failed listing of its own; queues created, evicted from the cache and
    looked up again are found, before and after a restart."""
    listings: list[str] = []
    scandir = os.scandir

    def counting(path: str) -> object:
        if "consumequeue/%LMQ%" in str(path):  # a light queue's own directory
            listings.append(str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counting)
    s = open_store(max_cached_queues=64, cq_units_per_file=4)
    n = 1500  # past the merge of the created queues into the sorted listing (1,024)
    for i in range(n):
        assert s.max_offset(f"%LMQ%cmd{i}") == 0  # a new subscription's queue
        s.put("dev", b"%d" % i, [f"%LMQ%cmd{i}"])
    assert listings == []
    s.flush()
    assert len(s.queues_table.states) < n  # most were evicted: found again on disk
    assert [s.max_offset(f"%LMQ%cmd{i}") for i in (0, 1, 777, n - 1)] == [1, 1, 1, 1]
    assert s.get("%LMQ%cmd3", 0).messages[0].body == b"3"
    s.close()
    s = open_store(max_cached_queues=64, cq_units_per_file=4)
    listings.clear()
    assert s.max_offset("%LMQ%new") == 0 and listings == []
    assert s.max_offset("%LMQ%cmd42") == 1 and len(listings) == 1  # from the previous run
    s.put("dev", b"x", ["%LMQ%new"])
    assert s.max_offset("%LMQ%new") == 1
