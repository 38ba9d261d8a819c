"""`lmqtt-commitlog`: a Spark Python data source over the store's CommitLog segment files.

    spark.read.format("lmqtt-commitlog").load("/var/lib/lmqtt")          # every segment
    spark.read.format("lmqtt-commitlog").option("compacted", "reports/compacted").load(D)
        # sealed segments already compacted are read from their Parquet file instead

One input partition per segment; each yields Arrow record batches straight from the parser, so
no Python row objects are ever built. Options:

    path            the store's data directory (or pass it to load())
    compacted       a compaction directory (see analytics.compaction); segments with a valid
                    Parquet file there are read from it
    skip_compacted  "true": leave those segments out entirely (the report job reads their
                    Parquet natively and unions the two)
    segments        comma-separated segment start offsets to read (default: all)
    since_ms        only segments that can hold records stored at or after this epoch ms
    until_ms        only segments that can hold records stored before this epoch ms
                    (whole segments are pruned, see analytics.pruning; rows are not filtered)

Read-only and lock-free: a live store's active segment is read up to its last complete record.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from analytics.compaction import CompactedSegment, compacted_segments
from analytics.errors import AnalyticsError, DataDirError
from analytics.pruning import segment_spans, segments_in_window
from analytics.segments import ARROW_SCHEMA, SegmentFile, SegmentParser, list_segments

SOURCE_NAME = "lmqtt-commitlog"

_SPARK_TYPES = {
    pa.int64(): LongType(),
    pa.int32(): IntegerType(),
    pa.bool_(): BooleanType(),
    pa.string(): StringType(),
    pa.timestamp("us", tz="UTC"): TimestampType(),
}


def _spark_type(t: pa.DataType) -> object:
    if pa.types.is_list(t):
        element = t.value_field
        return ArrayType(_spark_type(element.type), containsNull=element.nullable)  # type: ignore[arg-type]
    return _SPARK_TYPES[t]


#: The rows' Spark schema, derived from the parser's Arrow schema so the two cannot drift.
SPARK_SCHEMA = StructType(
    [StructField(f.name, _spark_type(f.type), f.nullable) for f in ARROW_SCHEMA]  # type: ignore[arg-type]
)


class SegmentPartition(InputPartition):
    """One segment to read, raw or from its compacted Parquet file (pickled to the worker)."""

    def __init__(self, segment: SegmentFile, parquet: str | None = None) -> None:
        super().__init__(segment.start_offset)
        self.segment = segment
        self.parquet = parquet


class CommitLogDataSource(DataSource):
    """Rows of the store's CommitLog (see the module docstring for options)."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return SPARK_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return CommitLogReader(dict(self.options))


class CommitLogReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        path = options.get("path")
        if not path:
            raise DataDirError("lmqtt-commitlog needs the store's data directory: .load(DATA_DIR)")
        self.data_dir = path
        self.compacted_dir = options.get("compacted")
        self.skip_compacted = options.get("skip_compacted", "false").lower() == "true"
        wanted = options.get("segments")
        self.wanted = {int(x) for x in wanted.split(",") if x} if wanted else None
        since, until = options.get("since_ms"), options.get("until_ms")
        self.since_ms = int(since) if since else None
        self.until_ms = int(until) if until else None

    def partitions(self) -> list[InputPartition]:
        try:
            return list(
                plan_partitions(
                    self.data_dir,
                    self.compacted_dir,
                    self.skip_compacted,
                    self.wanted,
                    self.since_ms,
                    self.until_ms,
                )
            )
        except AnalyticsError as e:
            raise RuntimeError(e.worker_text()) from None

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentPartition)
        try:
            if partition.parquet is not None:
                yield from _read_parquet(partition.parquet)
            else:
                yield from SegmentParser(partition.segment).batches()
        except AnalyticsError as e:
            # Reaches the driver inside a long Spark error text; the marker lets the CLI find
            # and print just this message.
            raise RuntimeError(e.worker_text()) from None


def plan_partitions(
    data_dir: str,
    compacted_dir: str | None = None,
    skip_compacted: bool = False,
    wanted: set[int] | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> list[SegmentPartition]:
    """The partitions of a read: one per segment, each raw or compacted; with a time window,
    only the segments that can hold records stored in [since_ms, until_ms)."""
    compacted: dict[int, CompactedSegment] = {}
    segments = list_segments(data_dir)
    if compacted_dir is not None:
        compacted = compacted_segments(compacted_dir, segments)
    if since_ms is not None or until_ms is not None:
        spans = segment_spans(segments, compacted)
        segments = segments_in_window(spans, since_ms, until_ms)
    out = []
    for seg in segments:
        if wanted is not None and seg.start_offset not in wanted:
            continue
        done = compacted.get(seg.start_offset)
        if done is not None:
            if not skip_compacted:
                out.append(SegmentPartition(seg, done.parquet))
        else:
            out.append(SegmentPartition(seg))
    return out


def _read_parquet(path: str) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:
        for batch in f.iter_batches(batch_size=65_536):
            yield batch.cast(ARROW_SCHEMA)
