"""RecentMessages: per-queue windows of what the gateway just appended, bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.messages.recent import BUCKETS, COMPACT_AT, PreparedCache, RecentMessages
from gateway.protocol import PreparedPublish, Publish
from store import PutResult

QUEUES = ["%LMQ%a", "%LMQ%b", "%LMQ%c"]


def _batch(
    ends: dict[str, int], phys: int, picks: list[list[str]]
) -> tuple[list[tuple[str, tuple[str, ...], bytes, bytes]], list[PutResult]]:
    """Messages as append_encoded would store them: each queue's offsets are consecutive."""
    messages = []
    results = []
    for queues in picks:
        lights = {}
        for q in queues:
            lights[q] = ends[q]
            ends[q] += 1
        body = b"|".join(b"%s=%d" % (q.encode(), o) for q, o in lights.items())
        messages.append(("t", tuple(lights), body, b""))
        results.append(PutResult(phys, 0, lights, phys + 10, 1))
        phys += 10
    return messages, results


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.lists(st.sampled_from(QUEUES), min_size=1, max_size=3, unique=True),
                 min_size=1, max_size=12),
        min_size=1, max_size=25,
    ),
    st.integers(min_value=1, max_value=40),
)  # fmt: skip
def test_runs_are_exact_and_recent_ones_kept(batches: list[list[list[str]]], size: int) -> None:
    recent = RecentMessages(size=size, max_bytes=1 << 20)
    ends = dict.fromkeys(QUEUES, 0)
    phys = 0
    for picks in batches:
        messages, results = _batch(ends, phys, picks)
        phys += 10 * len(picks)
        recent.add_many(messages, [{}] * len(messages), results)
        # The batch just added is readable (unless it alone exceeds the bound less a bucket).
        if sum(len(p) for p in picks) <= size - size // BUCKETS:
            for q in {q for p in picks for q in p}:
                last = ends[q] - 1
                assert [m.queue_offset for m in recent.run(q, last, 5)] == [last]
        # Never more than `size` messages once an append is done.
        held = sum(len(recent.run(q, o, 1)) for q in QUEUES for o in range(ends[q]))
        assert held <= size
    for q in QUEUES:
        for start in range(ends[q]):
            got = recent.run(q, start, 1000)
            # Whatever is returned is exactly the messages from `start`, consecutive.
            assert [m.queue_offset for m in got] == list(range(start, start + len(got)))
            for m in got:
                assert b"%s=%d" % (q.encode(), m.queue_offset) in m.body.split(b"|")
            # A window ends at the queue's end: nothing newer is missing from it.
            if got:
                assert got[-1].queue_offset == ends[q] - 1


def test_bounded_by_bytes() -> None:
    recent = RecentMessages(size=1000, max_bytes=100)
    ends = dict.fromkeys(QUEUES, 0)
    for i in range(10):
        messages, results = _batch(ends, i * 10, [["%LMQ%a"]])
        messages = [(t, q, b"x" * 30, p) for t, q, _, p in messages]
        recent.add_many(messages, [{}], results)
    got = recent.run("%LMQ%a", 0, 100)
    assert got == []  # offset 0 was dropped
    kept = [m.queue_offset for o in range(10) for m in recent.run("%LMQ%a", o, 1)]
    assert kept == [7, 8, 9]  # 3 x 30 bytes fit in 100


def test_an_eviction_frees_about_a_bucket_not_half_a_window() -> None:
    """A wildcard queue's window gets every message: what its head passed is dropped from its
    list once COMPACT_AT long, so no eviction frees more than that plus a bucket's share (an
    entry freed costs the loop about 0.2 us; a window compacted only at half its length freed
    tens of thousands at once). Failed before: heads reached thousands past COMPACT_AT."""
    size = 16_384
    recent = RecentMessages(size=size)
    ends = dict.fromkeys(["%LMQ%all", "%LMQ%also", "%LMQ%some"], 0)
    phys = 0
    worst = 0
    for i in range(2 * size // 20):
        picks = [["%LMQ%all", "%LMQ%also"] + (["%LMQ%some"] if (i + k) % 10 == 0 else [])
                 for k in range(20)]  # fmt: skip
        messages, results = _batch(ends, phys, picks)
        phys += 10 * len(picks)
        recent.add_many(messages, [{}] * len(messages), results)
        worst = max(worst, *(w.head for w in recent._windows.values()))
    assert worst < COMPACT_AT
    # ... and what is kept is still the newest messages of each queue, up to the bound.
    assert len(recent.run("%LMQ%all", ends["%LMQ%all"] - 1000, 1000)) == 1000


def test_gap_starts_the_window_over() -> None:
    recent = RecentMessages(size=100)
    r0 = PutResult(0, 0, {"%LMQ%a": 0}, 10, 1)
    r5 = PutResult(10, 1, {"%LMQ%a": 5}, 20, 1)
    recent.add("t", b"zero", {}, r0)
    recent.add("t", b"five", {}, r5)
    assert recent.run("%LMQ%a", 0, 10) == []
    assert [m.body for m in recent.run("%LMQ%a", 5, 10)] == [b"five"]


def test_prepared_cache_keeps_the_newest_packets_within_its_size() -> None:
    cache = PreparedCache(size=8)
    packets = {}
    for i in range(30):
        packets[i] = PreparedPublish(4, Publish(f"t/{i}", b"x", qos=1))
        cache.put((i,), packets[i])
        assert len(cache) <= 8
        # The latest put is always there.
        assert cache.lookup((i,)) is packets[i]
    assert [i for i in range(30) if cache.lookup((i,)) is not None] == list(range(22, 30))
    cache.put((29,), packets[28])  # a key put again keeps one place in the order
    cache.put((30,), packets[0])
    assert [i for i in range(31) if cache.lookup((i,)) is not None] == list(range(23, 31))
    assert cache.lookup((29,)) is packets[28] and len(cache) == 8
    made = cache.get((30,), lambda: PreparedPublish(4, Publish("other", b"y", qos=1)))
    assert made is packets[0]
