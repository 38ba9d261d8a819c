"""The batch writer, the mmap reader and the route cache, on real files.

These paths skip per-message checks for speed (routes cached per queue set, records built
in one buffer per batch, no CRC on reads), so their edges get their own tests: segment
rolls in the middle of a batch, queue states evicted under a cached route, limits that must
refuse a whole batch, and property strings that look like the store's own.
"""

from __future__ import annotations

import itertools
import shutil
import threading
from pathlib import Path

import pytest

from store import (
    GetStatus,
    InvalidPropertyError,
    MessageStore,
    MessageTooLargeError,
    StoreConfig,
)
from store import format as fmt
from tests.store.conftest import OpenStore, encoded

SEG = 4096


def read_all(s: MessageStore, queue: str) -> list[bytes]:
    out: list[bytes] = []
    off = 0
    while True:
        g = s.get(queue, off, 7)
        if g.status is not GetStatus.FOUND:
            return out
        out += [m.body for m in g.messages]
        off = g.next_offset


def crash(data: Path) -> None:
    """What a kill -9 plus lost consume queues looks like: no checkpoint, abort marker."""
    (data / fmt.CHECKPOINT_FILE).unlink()
    shutil.rmtree(data / fmt.CONSUMEQUEUE_DIR)
    (data / fmt.ABORT_FILE).touch()


def test_append_encoded_rolls_segments_in_the_middle_of_a_batch(
    open_store: OpenStore, tmp_path: Path
) -> None:
    s = open_store(segment_size=SEG)
    props = [{"k": str(i)} if i % 4 == 0 else {} for i in range(120)]
    reqs = [
        encoded(s, "t", b"m%03d" % i + bytes(100), ["%LMQ%all", f"%LMQ%g{i % 3}"], props[i])
        for i in range(120)
    ]
    results = s.append_encoded(reqs[:60]) + s.append_encoded(reqs[60:])
    rolls = 0
    for prev, r in itertools.pairwise(results):
        if r.physical_offset != prev.end_offset:
            # A roll: the new record opens a segment, a blank filler closes the old one.
            rolls += 1
            assert r.physical_offset % SEG == 0 and r.physical_offset > prev.end_offset
            seg = (tmp_path / "data" / fmt.commitlog_path(r.physical_offset - SEG)).read_bytes()
            rel = prev.end_offset % SEG
            assert fmt.SIZE_MAGIC.unpack_from(seg, rel) == (SEG - rel, fmt.BLANK_MAGIC)
    assert rolls >= 3
    assert [r.light_offsets["%LMQ%all"] for r in results] == list(range(120))
    for r, req, p in zip(results, reqs, props, strict=True):
        m = s.message_at(r.physical_offset)
        assert (m.body, m.properties) == (req[2], p)
    expected = {q: [r[2] for r in reqs if q in r[1]] for q in ("%LMQ%all", "%LMQ%g1")}
    expected["t"] = expected["%LMQ%all"]
    for q, bodies in expected.items():
        assert read_all(s, q) == bodies
    s.close()
    s = open_store(segment_size=SEG)
    assert not s.recovery.abnormal
    assert {q: read_all(s, q) for q in expected} == expected
    s.close()
    crash(tmp_path / "data")
    s = open_store(segment_size=SEG)
    assert s.recovery.abnormal and s.recovery.records_scanned == 120
    assert {q: read_all(s, q) for q in expected} == expected
    r = s.put("t", b"after", ["%LMQ%all"])
    assert (r.queue_offset, r.light_offsets) == (120, {"%LMQ%all": 120})


def test_cached_routes_follow_evicted_queue_states(open_store: OpenStore) -> None:
    s = open_store(max_cached_queues=16, cq_units_per_file=8)
    for rnd in range(3):
        batch = [encoded(s, "t", b"%d/%d" % (rnd, i), [f"%LMQ%q{i}", "%LMQ%all"])
                 for i in range(40)]  # fmt: skip
        for i, r in enumerate(s.append_encoded(batch[:20]) + [s.put(b[0], b[2], b[1])
                                                                for b in batch[20:]]):  # fmt: skip
            assert r.light_offsets == {f"%LMQ%q{i}": rnd, "%LMQ%all": rnd * 40 + i}
        assert len(s.queues_table.states) <= 16 + 16 // 10 + 42
    for i in range(40):
        assert read_all(s, f"%LMQ%q{i}") == [b"%d/%d" % (rnd, i) for rnd in range(3)]
    assert s.max_offset("%LMQ%all") == s.max_offset("t") == 120


def test_size_limits_refuse_the_whole_batch_before_writing(open_store: OpenStore) -> None:
    s = open_store(segment_size=SEG, max_body_size=SEG * 2)
    ok = encoded(s, "t", b"ok", ["%LMQ%a"])
    end = s.put("t", b"first").end_offset
    # Fits with today's offsets, not with the longest ones the INNER_* pair can carry.
    room = fmt.MAX_PROPERTIES_BYTES - fmt.CRC_TRAILER_SIZE
    inner = len(fmt.dispatch_properties(["%LMQ%a"], [(1 << 63) - 1]))
    big_props = {"k": "v" * (room - inner - 2)}
    for bad, error in [
        (encoded(s, "t", b"x", ["%LMQ%a"], big_props), InvalidPropertyError),
        (encoded(s, "t", b"x" * SEG, ["%LMQ%a"]), MessageTooLargeError),
    ]:
        with pytest.raises(error):
            s.append_encoded([ok, ok, bad])
        assert s.log_max_offset == end and s.max_offset("%LMQ%a") == 0
    assert s.append_encoded([ok])[0].light_offsets == {"%LMQ%a": 0}


def test_properties_that_look_like_the_stores_own(open_store: OpenStore, tmp_path: Path) -> None:
    s = open_store()
    cases = [
        ({"XINNER_MULTI_DISPATCH": "a", "b": ""}, []),
        ({"XINNER_MULTI_DISPATCH": "a"}, ["%LMQ%x"]),
        ({"v": "INNER_MULTI_DISPATCH"}, ["%LMQ%x", "%LMQ%y"]),
        (None, ["%LMQ%x"]),
        (None, []),
    ]
    for props, queues in cases:
        s.put("t", b"b", queues, props)
    s.close()
    crash(tmp_path / "data")
    s = open_store()
    got = s.get("t", 0).messages
    assert [(m.properties, list(m.queues)) for m in got] == [(p or {}, q) for p, q in cases]
    assert [m.queue_offset for m in s.get("%LMQ%x", 0).messages] == [0, 1, 2]


def test_store_timestamps_follow_log_order_across_threads(open_store: OpenStore) -> None:
    s = open_store()

    def writer(k: int) -> None:
        for i in range(300):
            s.put("t", b"%d" % i, [f"%LMQ%w{k}"])

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stamps = []
    off = 0
    while (g := s.get("t", off, 100)).status is GetStatus.FOUND:
        stamps += [m.store_timestamp for m in g.messages]
        off = g.next_offset
    assert len(stamps) == 900 and stamps == sorted(stamps)


def test_read_only_store_reads_through_the_same_decoder(tmp_path: Path) -> None:
    w = MessageStore.open(StoreConfig(data_dir=tmp_path / "d"))
    try:
        w.put("t", b"one", ["%LMQ%a"], {"p": "1"})
        w.flush()
        r = MessageStore.open(StoreConfig(data_dir=tmp_path / "d", read_only=True))
        try:
            m = r.get("%LMQ%a", 0).messages[0]
            assert (m.topic, m.body, m.properties, m.queues) == ("t", b"one", {"p": "1"},
                                                                 ("%LMQ%a",))  # fmt: skip
        finally:
            r.close()
    finally:
        w.close()
