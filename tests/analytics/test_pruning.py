"""Time pruning: a --since/--until report reads only the segments its window (and the backlog's
tail) can touch, and gives exactly the numbers of filtering every message."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from analytics.datasource import plan_partitions
from analytics.fanout import ReportMeta
from analytics.pruning import segment_spans, segments_in_window
from analytics.segments import list_segments
from store import MessageStore, StoreConfig
from tests.analytics.groundtruth import World, build_world

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> World:
    """The reference traffic in 4 KiB segments: seven of them, one second between messages."""
    return build_world(tmp_path_factory.mktemp("pruning") / "data", rounds=20, segment_size=4096)


def _segment_of(world: World, physical_offset: int) -> int:
    return physical_offset // world.segment_size * world.segment_size


def _expected_window(world: World, since: int | None, until: int | None) -> list[int]:
    """The rule from ground truth: a segment spans [its first message's time, the next
    segment's first message's time]; the last one is open-ended."""
    firsts: dict[int, int] = {}
    for m in world.messages:
        firsts.setdefault(_segment_of(world, m.physical_offset), m.store_ms)
    starts = sorted(firsts)
    out = []
    for i, start in enumerate(starts):
        hi = firsts[starts[i + 1]] if i + 1 < len(starts) else None
        if until is not None and firsts[start] >= until:
            continue
        if since is not None and hi is not None and hi < since:
            continue
        out.append(start)
    return out


def _expected_tail(world: World) -> list[int]:
    """Segments from the one holding the oldest message some subscriber has not committed."""
    slowest: dict[str, int] = {}
    for (_, queue), (_, committed) in world.ranges.items():
        slowest[queue] = min(committed, slowest.get(queue, committed))
    first = None
    for m in world.messages:
        for queue, off in zip(m.queues, m.offsets, strict=True):
            if queue in slowest and off >= slowest[queue]:
                first = m.physical_offset if first is None else min(first, m.physical_offset)
    if first is None:
        return []
    return [
        s.start_offset
        for s in list_segments(world.data_dir)
        if s.start_offset >= _segment_of(world, first)
    ]


def _window(world: World) -> tuple[int, int]:
    """A window over messages 20..39 of 100: inside the log's first half."""
    return world.messages[20].store_ms, world.messages[40].store_ms


def test_spans_are_the_first_timestamps(small: World) -> None:
    segments = list_segments(small.data_dir)
    spans = segment_spans(segments)
    firsts: dict[int, int] = {}
    for m in small.messages:
        firsts.setdefault(_segment_of(small, m.physical_offset), m.store_ms)
    assert [s.first_ms for s in spans] == [firsts[s.start_offset] for s in segments]
    assert [s.last_ms for s in spans] == [firsts[s.start_offset] for s in segments[1:]] + [None]


@pytest.mark.parametrize(
    ("since_i", "until_i"), [(20, 40), (0, 1), (99, None), (None, 30), (55, 56), (None, None)]
)
def test_partitions_are_the_overlapping_segments(
    small: World, since_i: int | None, until_i: int | None
) -> None:
    since = small.messages[since_i].store_ms if since_i is not None else None
    until = small.messages[until_i].store_ms if until_i is not None else None
    got = [p.segment.start_offset for p in plan_partitions(str(small.data_dir), None, False, None,
                                                            since, until)]  # fmt: skip
    assert got == _expected_window(small, since, until)
    # Never too few: every segment holding a message of the window is read.
    holding = {
        _segment_of(small, m.physical_offset)
        for m in small.messages
        if (since is None or m.store_ms >= since) and (until is None or m.store_ms < until)
    }
    assert holding <= set(got)
    spans = segment_spans(list_segments(small.data_dir))
    assert [s.start_offset for s in segments_in_window(spans, since, until)] == got


def test_window_before_or_after_the_log_reads_nothing(small: World) -> None:
    first, last = small.messages[0].store_ms, small.messages[-1].store_ms
    assert plan_partitions(str(small.data_dir), until_ms=first) == []
    # After the last message only the active segment could still grow into the window.
    after = plan_partitions(str(small.data_dir), since_ms=last + 1)
    assert [p.segment.sealed for p in after] == [False]


def test_source_reads_only_the_window(spark, small: World) -> None:  # type: ignore[no-untyped-def]
    since, until = _window(small)
    df = (
        spark.read.format("lmqtt-commitlog")
        .option("since_ms", str(since))
        .option("until_ms", str(until))
        .load(str(small.data_dir))
    )
    expected = _expected_window(small, since, until)
    assert 0 < len(expected) < len(list_segments(small.data_dir))
    assert df.rdd.getNumPartitions() == len(expected)
    assert sorted(r.segment for r in df.select("segment").distinct().collect()) == expected
    ts = "store_timestamp"
    n = df.where(f"{ts} >= timestamp_millis({since}) and {ts} < timestamp_millis({until})").count()
    assert n == sum(1 for m in small.messages if since <= m.store_ms < until) == 20


@pytest.fixture(scope="module")
def caught_up(small: World, tmp_path_factory: pytest.TempPathFactory) -> World:
    """`small` with every subscriber at most 3 messages behind, so the backlog's tail is short."""
    data = tmp_path_factory.mktemp("caught-up") / "data"
    shutil.copytree(small.data_dir, data)
    ranges = {
        (key, queue): (start, max(committed, small.ends[queue] - 3))
        for (key, queue), (start, committed) in small.ranges.items()
    }
    store = MessageStore.open(StoreConfig(data_dir=data))
    for (key, queue), (_, committed) in ranges.items():
        store.offsets.commit(key, queue, committed)
    store.close()
    pieces = [
        (key, queue, start, end, ranges[(key, queue)][1] if end is None else acked, qos)
        for key, queue, start, end, acked, qos in small.pieces
    ]  # open subscriptions caught up as their committed offsets say
    return World(
        data, small.segment_size, list(small.messages), ranges, pieces=pieces, ends=dict(small.ends)
    )


def test_window_report_is_exact_and_pruned(  # type: ignore[no-untyped-def]
    spark, caught_up: World, report: tuple[Path, ReportMeta], tmp_path: Path
) -> None:
    from analytics.fanout import run_fanout

    world = caught_up
    since, until = _window(world)
    meta = run_fanout(spark, world.data_dir, tmp_path, since_ms=since, until_ms=until)
    window = _expected_window(world, since, until)
    tail = _expected_tail(world)
    n_segments = len(list_segments(world.data_dir))
    assert meta.window_segments == len(window) == 2
    assert 0 < len(tail) < n_segments - len(window)
    assert meta.segments_read == len(set(window) | set(tail)) < n_segments
    full = report[1]  # the unwindowed report reads everything
    assert full.segments_read == full.window_segments == full.segments

    # The unpruned filter, evaluated by the ground-truth model over the window's messages.
    inside = World(
        world.data_dir, world.segment_size, ranges=world.ranges, ends=world.ends,
        pieces=world.pieces,
    )  # fmt: skip
    inside.messages = [m for m in world.messages if since <= m.store_ms < until]
    expected = inside.expected_devices()
    tables = tmp_path / "report"
    got = {r["client_id"]: r for r in pq.read_table(tables / "device_fanout").to_pylist()}
    assert set(got) == set(expected)
    for client, exp in expected.items():
        for key, value in exp.items():
            assert got[client][key] == value, (client, key)
    assert len(inside.messages) == 20
    assert meta.messages == len(inside.device_messages())
    assert meta.deliveries == sum(e["deliveries"] for e in expected.values())

    # The backlog is the queues' current state, whatever the window: exact from the tail.
    backlog = {r["queue"]: r for r in pq.read_table(tables / "queue_backlog").to_pylist()}
    assert set(backlog) == set(world.ends)
    for queue, end in world.ends.items():
        held = [c for (_, q), (_, c) in world.ranges.items() if q == queue]
        if not held:  # c-gone's queue: nobody is subscribed any more
            assert backlog[queue]["backlog_messages"] == 0
            continue
        slowest = min(held)
        waiting = [
            (m.body_size, m.store_ms)
            for m in world.messages
            for q, off in zip(m.queues, m.offsets, strict=True)
            if q == queue and off >= slowest
        ]
        row = backlog[queue]
        assert row["end_offset"] == end
        assert row["backlog_messages"] == end - slowest == len(waiting)
        assert row["backlog_bytes"] == sum(b for b, _ in waiting)
        oldest = row["oldest_undelivered_at"]
        assert (oldest is None) == (not waiting)
        if waiting:
            assert int(oldest.timestamp() * 1000) == min(t for _, t in waiting)
