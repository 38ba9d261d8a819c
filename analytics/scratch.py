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

import functools
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
    pieces = _pieces(plan.subscribers)
    reached = _match(pairs, pieces)
    if plan.dedup:
        # A message reaches a subscriber once however many of its queues it holds (the
        # gateway delivers it from the first of them by name: queue ids follow name order);
        # a message lives in one batch, so this is exact per batch.
        reached = (
            reached.group_by(
                ["physical_offset", "client_id", "topic", "sec", "sub"], use_threads=False
            )
            .aggregate([("d", "max"), ("dq", "max"), ("qid", "min")])
            .rename_columns({"d_max": "d", "dq_max": "dq", "qid_min": "qid"})
        )
    # r: messages delivered to at least one subscriber (the rest reached nobody).
    # A batch's messages are in log order: their physical offsets are sorted.
    got = _np(reached.column("physical_offset"))[_np(reached.column("d")) == 1]
    msg_phys = _np(messages.column("physical_offset"))
    was_reached = np.zeros(len(msg_phys), dtype=np.int64)
    was_reached[np.searchsorted(msg_phys, got)] = 1
    cube = (
        pa.table(
            {
                "client_id": messages.column("client_id"),
                "topic": messages.column("topic"),
                "sec": _seconds(messages.column("ts")),
                "fanout": messages.column("fanout"),
                "r": pa.array(was_reached),
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
        reached.group_by(["client_id", "topic", "sec", "sub", "qid"], use_threads=False)
        .aggregate([("d", "sum"), ("d0", "sum"), ("d", "count")])
        .rename_columns({"d_sum": "d", "d0_sum": "d0", "d_count": "e"})
    )
    reached = (
        reached.append_column("subscriber", pc.take(pieces.subscriber_names, reached["sub"]))
        .append_column("queue", pc.take(pieces.queue_names, reached["qid"]))
        .select(REACHED_SCHEMA.names)
        .cast(REACHED_SCHEMA)
    )
    return cube, reached, backlog


@dataclass(frozen=True)
class _Pieces:
    """The plan's pieces as arrays, sorted by queue id (queue ids follow name order)."""

    queue_names: pa.Array
    subscriber_names: pa.Array
    first: np.ndarray  # per queue id: index of its first piece
    count: np.ndarray  # per queue id: how many pieces
    sub: np.ndarray  # per piece: subscriber id
    qid: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    acked: np.ndarray
    qos: np.ndarray


@functools.lru_cache(maxsize=4)
def _pieces(rows: tuple[tuple[str, str, int, int, int, int], ...]) -> _Pieces:
    queues = sorted({r[1] for r in rows})
    subs = sorted({r[0] for r in rows})
    q_id = {q: i for i, q in enumerate(queues)}
    s_id = {name: i for i, name in enumerate(subs)}
    ordered = sorted(rows, key=lambda r: (q_id[r[1]], r[2]))
    qid = np.array([q_id[r[1]] for r in ordered], dtype=np.int64)
    count = np.bincount(qid, minlength=len(queues)).astype(np.int64)
    return _Pieces(
        queue_names=pa.array(queues, pa.string()),
        subscriber_names=pa.array(subs, pa.string()),
        first=np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64),
        count=count,
        sub=np.array([s_id[r[0]] for r in ordered], dtype=np.int64),
        qid=qid,
        lo=np.array([r[2] for r in ordered], dtype=np.int64),
        hi=np.array([r[3] for r in ordered], dtype=np.int64),
        acked=np.array([r[4] for r in ordered], dtype=np.int64),
        qos=np.array([r[5] for r in ordered], dtype=np.int64),
    )


def _match(pairs: pa.Table, pieces: _Pieces) -> pa.Table:
    """Every (pair, piece) with the pair's queue offset in [lo, hi): one row per subscriber
    a message was due to through one of its queues; d = done (below acked), dq = done at a
    QoS above 0 (acknowledged). A join done with numpy on queue ids: the pieces are few, the
    pairs many, and hashing their queue names once is all the string work."""
    n = pairs.num_rows
    if n == 0 or len(pieces.queue_names) == 0:
        ids = np.zeros(0, dtype=np.int64)
        pair_at = piece_at = ids
    else:
        qid = pc.index_in(pairs.column("queue"), value_set=pieces.queue_names)
        qid_np = pc.fill_null(qid, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        known = qid_np >= 0
        safe = np.where(known, qid_np, 0)
        per_pair = np.where(known, pieces.count[safe], 0)
        pair_at = np.repeat(np.arange(n, dtype=np.int64), per_pair)
        step = np.arange(len(pair_at), dtype=np.int64) - np.repeat(
            np.cumsum(per_pair) - per_pair, per_pair
        )
        piece_at = pieces.first[safe[pair_at]] + step
        qoff = _np(pairs.column("qoff"))[pair_at]
        inside = (qoff >= pieces.lo[piece_at]) & (qoff < pieces.hi[piece_at])
        pair_at, piece_at = pair_at[inside], piece_at[inside]
    qoff = _np(pairs.column("qoff"))[pair_at] if n else np.zeros(0, dtype=np.int64)
    done = qoff < pieces.acked[piece_at]
    msg_qos = _np(pairs.column("qos"))[pair_at] if n else np.zeros(0, dtype=np.int64)
    # Delivered QoS = min(publish QoS, subscription QoS): above 0 it was acknowledged.
    acked = done & (msg_qos > 0) & (pieces.qos[piece_at] > 0)
    take = pa.array(pair_at)
    return pa.table(
        {
            "physical_offset": pc.take(pairs.column("physical_offset"), take),
            "client_id": pc.take(pairs.column("client_id"), take),
            "topic": pc.take(pairs.column("topic"), take),
            "sec": _seconds(pc.take(pairs.column("ts"), take)),
            "sub": pa.array(pieces.sub[piece_at]),
            "qid": pa.array(pieces.qid[piece_at]),
            "d": pa.array(done.astype(np.int64)),
            "dq": pa.array(acked.astype(np.int64)),
        }
    )


def _np(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.to_numpy(zero_copy_only=False)


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
