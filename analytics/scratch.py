"""The fan-out report's scratch tables: each segment read once, by a Spark task, into Parquet.

Why not the data source: rows handed from a Python source to the JVM are converted from Arrow
into Spark rows, and the report then has to write them out again (to scan them more than once)
and explode every message's queue list in the JVM twice. Here each task parses its segment
(or reads its compacted Parquet file) with pyarrow and writes, in C++, the two narrow tables
every later stage reads natively with Spark's vectorized Parquet reader:

    <scratch>/messages/<segment>.parquet   one row per message
        physical_offset int64, ts timestamp[us, UTC], client_id string ("" if none),
        topic string (MQTT topic, else the parent topic), body_size int32,
        fanout int32 (light queues dispatched to)
    <scratch>/pairs/<segment>.parquet      one row per (message, queue it was dispatched to)
        physical_offset, ts, client_id, topic, body_size, queue string, qoff int64

The task returns the segment's row count and store-timestamp range, so the driver needs no
extra Spark job to size the timeline. Queue and offset lists of unequal length (damaged
properties) pair up to the shorter one, as arrays_zip + a join would drop the rest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
        ("queue", pa.string()),
        ("qoff", pa.int64()),
    ]
)
#: The same columns as Spark DDL, to read the files (or an empty table) with a fixed schema.
MESSAGES_DDL = (
    "physical_offset bigint, ts timestamp, client_id string, topic string, body_size int, "
    "fanout int"
)
PAIRS_DDL = (
    "physical_offset bigint, ts timestamp, client_id string, topic string, body_size int, "
    "queue string, qoff bigint"
)
MESSAGES_DIR = "messages"
PAIRS_DIR = "pairs"
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
    pairs: int
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


def write_part(source: ScratchInput, scratch_dir: str) -> ScratchPart:
    """Read one segment and write its messages and pairs files (runs in a Spark worker)."""
    import pyarrow.parquet as pq

    root = Path(scratch_dir)
    name = f"{source.segment.name}.parquet"
    (root / MESSAGES_DIR).mkdir(parents=True, exist_ok=True)
    (root / PAIRS_DIR).mkdir(parents=True, exist_ok=True)
    n_msgs = n_pairs = 0
    lo: int | None = None
    hi: int | None = None
    # Scratch lives for one report: fast compression, big row groups.
    opts = {"compression": "lz4", "write_statistics": False}
    try:
        with (
            pq.ParquetWriter(root / MESSAGES_DIR / name, MESSAGES_SCHEMA, **opts) as mw,
            pq.ParquetWriter(root / PAIRS_DIR / name, PAIRS_SCHEMA, **opts) as pw,
        ):
            for batch in _batches(source):
                if not batch.num_rows:
                    continue
                messages, pairs = narrow(batch)
                mw.write_table(messages, row_group_size=1 << 20)
                pw.write_table(pairs, row_group_size=1 << 20)
                n_msgs += messages.num_rows
                n_pairs += pairs.num_rows
                span = pc.min_max(messages.column("ts"))
                b_lo, b_hi = span["min"].value // 1000, span["max"].value // 1000
                lo = b_lo if lo is None else min(lo, b_lo)
                hi = b_hi if hi is None else max(hi, b_hi)
    except AnalyticsError as e:
        raise RuntimeError(e.worker_text()) from None
    return ScratchPart(source.segment.start_offset, n_msgs, n_pairs, lo, hi)


def _batches(source: ScratchInput) -> Iterator[pa.RecordBatch]:
    if source.parquet is None:
        yield from SegmentParser(source.segment, batch_rows=_BATCH_ROWS).batches()
        return
    import pyarrow.parquet as pq

    with pq.ParquetFile(source.parquet) as f:
        yield from f.iter_batches(batch_size=_BATCH_ROWS)


def build_scratch(
    spark: SparkSession, sources: list[ScratchInput], scratch_dir: str | Path
) -> list[ScratchPart]:
    """Write the scratch tables of every source, one Spark task per segment."""
    target = str(Path(scratch_dir).resolve())
    os.makedirs(target, exist_ok=True)
    if not sources:
        return []
    rdd = spark.sparkContext.parallelize(sources, len(sources))
    return list(rdd.map(lambda s: write_part(s, target)).collect())
