"""The fan-out report's scan: each segment read once, by a Spark task, into small partials.

Why not the data source: rows handed from a Python source to the JVM are converted from Arrow
into Spark rows one by one, then every message's queue list is exploded and joined in the JVM.
Here each task parses its segment (or reads its compacted Parquet file) with pyarrow, pairs each
message with its queues, joins the (tiny) subscriber table and aggregates, all in Arrow's C++
kernels, and writes three small Parquet tables that Spark rolls up into every report table:

    <scratch>/cube/<segment>.parquet      per (client_id, topic, second, fanout) of the window's
        messages: n, r (of those, delivered to at least one subscriber), b (body bytes), first,
        last (store timestamps)
    <scratch>/reached/<segment>.parquet   per (client_id, topic, second, subscriber, queue) of
        the window's messages: e (due: in one of the subscriber's pieces, see
        analytics.snapshots.Piece), d (done: below the piece's acknowledged end), d0 (of d,
        those delivered at QoS 0: sent, nothing to acknowledge); queue is the one the gateway
        delivers through (the first by name of the subscriber's queues holding the message)
    <scratch>/backlog/<segment>.parquet   per light queue, whatever the window: max_qoff, and
        of the messages at or after its first undelivered offset: waiting_bytes, oldest

Seconds are floored epoch seconds: every timeline window is a whole number of seconds, so
flooring a second to the window gives the timestamp's own bucket. Partials are exact: a message
lives in one batch, so counting a subscriber once per message (a session holding several of its
queues) is done per batch. In between, a batch is narrowed to one row per message and one per
(message, queue) pair:

    messages  physical_offset, ts, client_id ("" if none), topic (MQTT topic, else the parent
              topic), body_size, fanout (light queues dispatched to)
    pairs     physical_offset, ts, client_id, topic, body_size, qos, queue, qoff

Queue and offset lists of unequal length (damaged properties) pair up to the shorter one, as
arrays_zip + a join would drop the rest. Each task also returns its row count and store-time
range, so the driver sizes the timeline without another job.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analytics.errors import AnalyticsError
from analytics.segments import SegmentFile, SegmentParser
from analytics.snapshots import LIGHT_QUEUE_PREFIX

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_TS = pa.timestamp("us", tz="UTC")
MESSAGES_SCHEMA = pa.schema(
    [
        ("physical_offset", pa.int64()),
        ("ts", _TS),
        ("client_id", pa.string()),
        ("topic", pa.string()),
        ("body_size", pa.int32()),
        ("fanout", pa.int32()),
    ]
)
PAIRS_SCHEMA = pa.schema(
    [
        ("physical_offset", pa.int64()),
        ("ts", _TS),
        ("client_id", pa.string()),
        ("topic", pa.string()),
        ("body_size", pa.int32()),
        ("qos", pa.int32()),
        ("queue", pa.string()),
        ("qoff", pa.int64()),
    ]
)
CUBE_SCHEMA = pa.schema(
    [
        ("client_id", pa.string()),
        ("topic", pa.string()),
        ("sec", pa.int64()),
        ("fanout", pa.int32()),
        ("n", pa.int64()),
        ("r", pa.int64()),
        ("b", pa.int64()),
        ("first", _TS),
        ("last", _TS),
    ]
)
REACHED_SCHEMA = pa.schema(
    [
        ("client_id", pa.string()),
        ("topic", pa.string()),
        ("sec", pa.int64()),
        ("subscriber", pa.string()),
        ("queue", pa.string()),
        ("d", pa.int64()),
        ("d0", pa.int64()),
        ("e", pa.int64()),
    ]
)
BACKLOG_SCHEMA = pa.schema(
    [
        ("queue", pa.string()),
        ("max_qoff", pa.int64()),
        ("waiting_bytes", pa.int64()),
        ("oldest", _TS),
    ]
)
#: The same columns as Spark DDL, to read the files (or an empty table) with a fixed schema.
CUBE_DDL = (
    "client_id string, topic string, sec bigint, fanout int, n bigint, r bigint, b bigint, "
    "first timestamp, last timestamp"
)
REACHED_DDL = (
    "client_id string, topic string, sec bigint, subscriber string, queue string, d bigint, "
    "d0 bigint, e bigint"
)
BACKLOG_DDL = "queue string, max_qoff bigint, waiting_bytes bigint, oldest timestamp"
CUBE_DIR = "cube"
REACHED_DIR = "reached"
BACKLOG_DIR = "backlog"
_BATCH_ROWS = 65_536


@dataclass(frozen=True, slots=True)
class ScratchInput:
    """One segment to read: raw, or from its compacted Parquet file."""

    segment: SegmentFile
    parquet: str | None = None


@dataclass(frozen=True, slots=True)
class ScratchPart:
    """What one task wrote."""

    segment: int
    messages: int
    min_ts_ms: int | None
    max_ts_ms: int | None


def narrow(batch: pa.RecordBatch | pa.Table) -> tuple[pa.Table, pa.Table]:
    """The messages and pairs rows of a batch in the data source's schema."""
    n = batch.num_rows
    offset = batch.column("physical_offset")
    ts = batch.column("store_timestamp")
    client = pc.fill_null(batch.column("client_id"), "")
    topic = pc.coalesce(batch.column("topic"), batch.column("parent_topic"))
    body = batch.column("body_size")
    qos = pc.fill_null(batch.column("qos"), 0)
    queues = _combined(batch.column("queues"))
    qoffs = _combined(batch.column("queue_offsets"))
    lengths = np.minimum(
        pc.list_value_length(queues).to_numpy(zero_copy_only=False),
        pc.list_value_length(qoffs).to_numpy(zero_copy_only=False),
    ).astype(np.int64)
    q_flat, q_owner = _aligned(queues, lengths)
    o_flat, _ = _aligned(qoffs, lengths)
    # fanout counts every light queue of the message, even one without an offset.
    all_flat = queues.flatten()
    all_light = pc.starts_with(all_flat, pattern=LIGHT_QUEUE_PREFIX).to_numpy(zero_copy_only=False)
    all_owner = pc.list_parent_indices(queues).to_numpy()
    fanout = np.bincount(all_owner[all_light], minlength=n).astype(np.int32)
    messages = pa.table([offset, ts, client, topic, body, pa.array(fanout)], schema=MESSAGES_SCHEMA)
    owner = pa.array(q_owner)
    pairs = pa.table(
        [
            pc.take(offset, owner),
            pc.take(ts, owner),
            pc.take(client, owner),
            pc.take(topic, owner),
            pc.take(body, owner),
            pc.take(qos, owner),
            q_flat,
            o_flat,
        ],
        schema=PAIRS_SCHEMA,
    )
    return messages, pairs


def _combined(column: pa.Array | pa.ChunkedArray) -> pa.ListArray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column


def _aligned(lists: pa.ListArray, lengths: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    """The first lengths[i] elements of each list, flattened, and the row each came from."""
    flat = lists.flatten()
    owner = pc.list_parent_indices(lists).to_numpy()
    full = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
    if np.array_equal(full, lengths):
        return flat, owner
    starts = lists.offsets.to_numpy()[:-1] - lists.offsets[0].as_py()
    index = np.arange(len(flat)) - np.repeat(starts, full)
    keep = index < lengths[owner]
    return pc.filter(flat, pa.array(keep)), owner[keep]


@dataclass(frozen=True, slots=True)
class ScratchPlan:
    """What the tasks need to aggregate: the window and the small subscriber table."""

    since_ms: int | None
    until_ms: int | None
    # (subscriber, queue, start, end, acked, qos): the pieces of analytics.snapshots; a
    # message at qoff in [start, end) was due to the subscriber, in [start, acked) done
    subscribers: tuple[tuple[str, str, int, int, int, int], ...]
    dedup: bool  # some subscriber holds several queues: count it once per message
    backlog_from: tuple[tuple[str, int], ...]  # per subscribed queue: first undelivered offset


def partials(batch: pa.RecordBatch | pa.Table, plan: ScratchPlan) -> tuple[pa.Table, ...]:
    """The cube, reached and backlog partial aggregates of one batch (see the module doc)."""
    messages, pairs = narrow(batch)
    # Backlog: every pair, whatever the window (it is the queues' current state).
    light = pairs.filter(pc.starts_with(pairs.column("queue"), pattern=LIGHT_QUEUE_PREFIX))
    starts = pa.table(
        [
            pa.array([q for q, _ in plan.backlog_from], pa.string()),
            pa.array([f for _, f in plan.backlog_from], pa.int64()),
        ],
        names=["queue", "backlog_from"],
    )
    joined = light.join(starts, "queue", join_type="left outer", use_threads=False)
    waiting = pc.fill_null(
        pc.greater_equal(joined.column("qoff"), joined.column("backlog_from")), False
    )
    backlog = (
        pa.table(
            {
                "queue": joined.column("queue"),
                "qoff": joined.column("qoff"),
                "waiting_bytes": pc.if_else(
                    waiting, pc.cast(joined.column("body_size"), pa.int64()), None
                ),
                "waiting_ts": pc.if_else(waiting, joined.column("ts"), None),
            }
        )
        .group_by("queue", use_threads=False)
        .aggregate([("qoff", "max"), ("waiting_bytes", "sum"), ("waiting_ts", "min")])
        .rename_columns(
            {
                "qoff_max": "max_qoff",
                "waiting_bytes_sum": "waiting_bytes",
                "waiting_ts_min": "oldest",
            }
        )
        .select(BACKLOG_SCHEMA.names)
        .cast(BACKLOG_SCHEMA)
    )
    messages = messages.filter(_in_window(messages.column("ts"), plan))
    pairs = pairs.filter(_in_window(pairs.column("ts"), plan))
    subs = pa.table(
        [pa.array([row[i] for row in plan.subscribers], t) for i, t in enumerate(_SUB_TYPES)],
        names=["subscriber", "queue", "lo", "hi", "acked", "sub_qos"],
    )
    if subs.num_rows > len(set(subs.column("queue").to_pylist())):
        subs = _overlapping(subs, pairs)
    hit = pairs.join(subs, "queue", join_type="inner", use_threads=False)
    qoff = hit.column("qoff")
    hit = hit.filter(
        pc.and_(pc.greater_equal(qoff, hit.column("lo")), pc.less(qoff, hit.column("hi")))
    )
    done = pc.less(hit.column("qoff"), hit.column("acked"))
    # Delivered QoS = min(publish QoS, subscription QoS): above 0 it was acknowledged.
    acked_qos = pc.and_(
        done, pc.and_(pc.greater(hit.column("qos"), 0), pc.greater(hit.column("sub_qos"), 0))
    )
    reached = pa.table(
        {
            "physical_offset": hit.column("physical_offset"),
            "client_id": hit.column("client_id"),
            "topic": hit.column("topic"),
            "sec": _seconds(hit.column("ts")),
            "subscriber": hit.column("subscriber"),
            "queue": hit.column("queue"),
            "d": pc.cast(done, pa.int64()),
            "dq": pc.cast(acked_qos, pa.int64()),
        }
    )
    if plan.dedup:
        # A message reaches a subscriber once however many of its queues it holds (the
        # gateway delivers it from the first of them by name); a message lives in one
        # batch, so this is exact per batch.
        reached = (
            reached.group_by(
                ["physical_offset", "client_id", "topic", "sec", "subscriber"], use_threads=False
            )
            .aggregate([("d", "max"), ("dq", "max"), ("queue", "min")])
            .rename_columns({"d_max": "d", "dq_max": "dq", "queue_min": "queue"})
        )
    # r: messages delivered to at least one subscriber (the rest reached nobody).
    got = pc.filter(reached.column("physical_offset"), pc.equal(reached.column("d"), 1))
    was_reached = pc.is_in(messages.column("physical_offset"), value_set=pc.unique(got))
    cube = (
        pa.table(
            {
                "client_id": messages.column("client_id"),
                "topic": messages.column("topic"),
                "sec": _seconds(messages.column("ts")),
                "fanout": messages.column("fanout"),
                "r": pc.cast(was_reached, pa.int64()),
                "b": pc.cast(messages.column("body_size"), pa.int64()),
                "ts": messages.column("ts"),
            }
        )
        .group_by(["client_id", "topic", "sec", "fanout"], use_threads=False)
        .aggregate([("b", "count"), ("r", "sum"), ("b", "sum"), ("ts", "min"), ("ts", "max")])
        .rename_columns(
            {"b_count": "n", "r_sum": "r", "b_sum": "b", "ts_min": "first", "ts_max": "last"}
        )
        .select(CUBE_SCHEMA.names)
        .cast(CUBE_SCHEMA)
    )
    reached = reached.append_column("d0", pc.subtract(reached.column("d"), reached.column("dq")))
    reached = (
        reached.group_by(["client_id", "topic", "sec", "subscriber", "queue"], use_threads=False)
        .aggregate([("d", "sum"), ("d0", "sum"), ("d", "count")])
        .rename_columns({"d_sum": "d", "d0_sum": "d0", "d_count": "e"})
        .select(REACHED_SCHEMA.names)
        .cast(REACHED_SCHEMA)
    )
    return cube, reached, backlog


def _overlapping(subs: pa.Table, pairs: pa.Table) -> pa.Table:
    """The pieces that can hold one of the batch's pairs: a subscriber with many pieces on a
    queue (clean sessions coming and going) would otherwise multiply the join's rows."""
    spans = pairs.group_by("queue", use_threads=False).aggregate([("qoff", "min"), ("qoff", "max")])
    both = subs.join(spans, "queue", join_type="inner", use_threads=False)
    keep = pc.and_(
        pc.less_equal(both.column("lo"), both.column("qoff_max")),
        pc.greater(both.column("hi"), both.column("qoff_min")),
    )
    return both.filter(keep).select(subs.column_names)


_SUB_TYPES = (pa.string(), pa.string(), pa.int64(), pa.int64(), pa.int64(), pa.int32())


def _in_window(ts: pa.ChunkedArray | pa.Array, plan: ScratchPlan) -> pa.Array:
    micros = pc.cast(ts, pa.int64())
    keep = pa.array(np.ones(len(ts), dtype=bool))
    if plan.since_ms is not None:
        keep = pc.and_(keep, pc.greater_equal(micros, plan.since_ms * 1000))
    if plan.until_ms is not None:
        keep = pc.and_(keep, pc.less(micros, plan.until_ms * 1000))
    return keep


def _seconds(ts: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Whole seconds since the epoch, floored: every timeline window is a multiple of it."""
    micros = pc.cast(ts, pa.int64())
    if isinstance(micros, pa.ChunkedArray):
        micros = micros.combine_chunks()
    return pa.array(np.floor_divide(micros.to_numpy(zero_copy_only=False), 1_000_000))


def write_part(source: ScratchInput, scratch_dir: str, plan: ScratchPlan) -> ScratchPart:
    """Read one segment and write its partial aggregates (runs in a Spark worker)."""
    import pyarrow.parquet as pq

    root = Path(scratch_dir)
    name = f"{source.segment.name}.parquet"
    for d in (CUBE_DIR, REACHED_DIR, BACKLOG_DIR):
        (root / d).mkdir(parents=True, exist_ok=True)
    n_msgs = 0
    lo: int | None = None
    hi: int | None = None
    # Scratch lives for one report: fast compression.
    opts: dict[str, Any] = {"compression": "lz4", "write_statistics": False}
    try:
        with (
            pq.ParquetWriter(root / CUBE_DIR / name, CUBE_SCHEMA, **opts) as cw,
            pq.ParquetWriter(root / REACHED_DIR / name, REACHED_SCHEMA, **opts) as rw,
            pq.ParquetWriter(root / BACKLOG_DIR / name, BACKLOG_SCHEMA, **opts) as bw,
        ):
            for batch in _batches(source):
                if not batch.num_rows:
                    continue
                cube, reached, backlog = partials(batch, plan)
                cw.write_table(cube)
                rw.write_table(reached)
                bw.write_table(backlog)
                n_msgs += batch.num_rows
                span = pc.min_max(batch.column("store_timestamp"))
                b_lo, b_hi = span["min"].value // 1000, span["max"].value // 1000
                lo = b_lo if lo is None else min(lo, b_lo)
                hi = b_hi if hi is None else max(hi, b_hi)
    except AnalyticsError as e:
        raise RuntimeError(e.worker_text()) from None
    return ScratchPart(source.segment.start_offset, n_msgs, lo, hi)


def _batches(source: ScratchInput) -> Iterator[pa.RecordBatch]:
    if source.parquet is None:
        yield from SegmentParser(source.segment, batch_rows=_BATCH_ROWS).batches()
        return
    import pyarrow.parquet as pq

    with pq.ParquetFile(source.parquet) as f:
        yield from f.iter_batches(batch_size=_BATCH_ROWS)


def build_scratch(
    spark: SparkSession, sources: list[ScratchInput], scratch_dir: str | Path, plan: ScratchPlan
) -> list[ScratchPart]:
    """Write the partial aggregates of every source, one Spark task per segment."""
    target = str(Path(scratch_dir).resolve())
    os.makedirs(target, exist_ok=True)
    if not sources:
        return []
    rdd = spark.sparkContext.parallelize(sources, len(sources))
    return list(rdd.map(lambda s: write_part(s, target, plan)).collect())
