"""Which segments a report needs: time pruning by store timestamp, and the backlog's tail.

Store timestamps never decrease along the log (the store takes them under its write lock and
holds them when the wall clock steps back), so a segment's records lie between its first
record's store timestamp and the next segment's first one::

    segment i     [ r0 .......... rk ]   ts(r0) = first_i  ...  ts(rk) <= first_{i+1}
    segment i+1   [ s0 .......... ]      ts(s0) = first_{i+1}
    active        [ t0 ... tail ]        first_active .. unbounded (still growing)

A segment overlaps the window [since, until) when first_i < until and first_{i+1} >= since
(the bound is inclusive: the last record of segment i may share a millisecond with the first
of i+1). Reading one header per segment is all this costs. A compacted segment's manifest
holds its exact min/max, which is tighter. A segment whose first record cannot be read (empty
active segment, damage) is kept: reading it either yields nothing or reports the damage.

The backlog table is the queues' current state whatever the window, so it needs the messages
at or after each queue's slowest committed offset. The consume queue maps that offset to its
physical offset (the store's reader, store.consumequeue.read_unit); segments from the smallest
such physical offset onward hold every undelivered message. Without a consume queue to ask,
every segment is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from analytics.compaction import CompactedSegment
from analytics.segments import SegmentFile
from analytics.snapshots import QueueEnd, Subscriber
from store.commitlog import first_store_timestamp as _first_store_timestamp
from store.consumequeue import read_unit
from store.format import CONSUMEQUEUE_DIR


@dataclass(frozen=True, slots=True)
class SegmentSpan:
    """A segment and the store-timestamp range (ms, inclusive) its records can have."""

    segment: SegmentFile
    first_ms: int | None  # None: unknown, never pruned
    last_ms: int | None  # None: unbounded (active segment) or unknown

    def overlaps(self, since_ms: int | None, until_ms: int | None) -> bool:
        """Whether any record of the segment can lie in [since_ms, until_ms)."""
        starts_after = (
            until_ms is not None and self.first_ms is not None and self.first_ms >= until_ms
        )
        ends_before = since_ms is not None and self.last_ms is not None and self.last_ms < since_ms
        return not (starts_after or ends_before)


def first_store_timestamp(segment: SegmentFile) -> int | None:
    """The store timestamp (ms) of the segment's first record; None if there is none to read."""
    return _first_store_timestamp(segment.path)


def segment_spans(
    segments: list[SegmentFile], compacted: dict[int, CompactedSegment] | None = None
) -> list[SegmentSpan]:
    """Each segment's timestamp range: its manifest's if compacted, else from first records."""
    compacted = compacted or {}
    firsts = [first_store_timestamp(s) for s in segments]
    spans = []
    for i, seg in enumerate(segments):
        done = compacted.get(seg.start_offset)
        if done is not None and done.min_ts_ms is not None and done.max_ts_ms is not None:
            spans.append(SegmentSpan(seg, done.min_ts_ms, done.max_ts_ms))
            continue
        # The next known first timestamp bounds this segment (an unreadable one in between
        # only widens the bound); the active segment has none.
        nxt = next((t for t in firsts[i + 1 :] if t is not None), None) if seg.sealed else None
        spans.append(SegmentSpan(seg, firsts[i], nxt))
    return spans


def segments_in_window(
    spans: list[SegmentSpan], since_ms: int | None, until_ms: int | None
) -> list[SegmentFile]:
    """The segments that can hold a record stored in [since_ms, until_ms)."""
    return [s.segment for s in spans if s.overlaps(since_ms, until_ms)]


def backlog_segments(
    data_dir: str | Path,
    segments: list[SegmentFile],
    subs: Iterable[Subscriber],
    ends: Iterable[QueueEnd],
) -> list[SegmentFile]:
    """The segments holding every message some subscriber has not committed yet.

    All segments when a consume queue that would say where the backlog starts is missing.
    """
    end_of = {q.queue: q for q in ends}
    slowest: dict[str, int] = {}
    for s in subs:
        slowest[s.queue] = min(s.committed, slowest.get(s.queue, s.committed))
    lowest: int | None = None
    for queue, committed in slowest.items():
        known = end_of.get(queue)
        if known is None:
            if committed > 0:
                return segments  # committed into a queue the consume queues do not know
            continue
        begin = max(committed, known.min_offset)
        if begin >= known.end_offset:
            continue  # nothing waiting in this queue
        unit = read_unit(Path(data_dir) / CONSUMEQUEUE_DIR, queue, begin)
        if unit is None:
            return segments
        phys = unit[0]
        lowest = phys if lowest is None else min(lowest, phys)
    if lowest is None:
        return []
    return [s for s in segments if s.start_offset + s.size > lowest]
