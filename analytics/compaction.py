"""Compaction: sealed CommitLog segments rewritten once as Parquet, so reports stop re-parsing.

Layout of a compaction directory (default `<reports>/compacted/`)::

    compacted/
      00000000000000000000.parquet   rows of segment 0, the data source's schema
      00000000000000000000.json      {"segment": 0, "size": 1073741824, "records": 5000000,
                                      "end_offset": ..., "min_ts_ms": ..., "max_ts_ms": ...}

A sealed segment never changes (the store only appends to the newest one and deletes whole old
ones), so a Parquet file stays valid while its segment exists with the recorded size. The JSON
manifest is written last, after the Parquet file is renamed into place, so a crash never leaves
a manifest pointing at a partial file. The Spark side runs one task per segment.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from analytics.errors import AnalyticsError
from analytics.segments import SegmentFile, SegmentParser, list_segments

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

COMPACTED_DIR = "compacted"


@dataclass(frozen=True, slots=True)
class CompactedSegment:
    """The manifest of one compacted segment."""

    segment: int
    size: int
    records: int
    end_offset: int
    min_ts_ms: int | None
    max_ts_ms: int | None
    parquet: str


@dataclass(frozen=True, slots=True)
class CompactionResult:
    compacted: list[CompactedSegment]  # newly written by this run
    already: int  # sealed segments that were compacted before
    pending: int  # segments left raw (the active one)


def compacted_segments(
    compacted_dir: str | Path, segments: list[SegmentFile]
) -> dict[int, CompactedSegment]:
    """Valid compacted files for the given segments, by segment start offset."""
    root = Path(compacted_dir)
    out: dict[int, CompactedSegment] = {}
    for seg in segments:
        if not seg.sealed:
            continue
        manifest = root / f"{seg.name}.json"
        try:
            doc = json.loads(manifest.read_text())
            entry = CompactedSegment(**doc)
        except (OSError, ValueError, TypeError):
            continue
        if entry.size != seg.size or not Path(entry.parquet).is_file():
            continue
        out[seg.start_offset] = entry
    return out


def compact_segment(segment: SegmentFile, compacted_dir: str) -> CompactedSegment:
    """Parse one sealed segment and write its Parquet file and manifest (runs in a worker)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from analytics.segments import ARROW_SCHEMA

    root = Path(compacted_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{segment.name}.parquet"
    tmp = root / f".{segment.name}.parquet.tmp-{os.getpid()}"
    parser = SegmentParser(segment, batch_rows=65_536, strict=True)
    lo: int | None = None
    hi: int | None = None
    try:
        with pq.ParquetWriter(tmp, ARROW_SCHEMA, compression="zstd") as writer:
            for batch in parser.batches():
                ts = pc.min_max(batch.column("store_timestamp"))
                b_lo = ts["min"].value // 1000
                b_hi = ts["max"].value // 1000
                lo = b_lo if lo is None else min(lo, b_lo)
                hi = b_hi if hi is None else max(hi, b_hi)
                writer.write_batch(batch)
        os.replace(tmp, final)
    except AnalyticsError as e:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(e.worker_text()) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    entry = CompactedSegment(
        segment=segment.start_offset,
        size=segment.size,
        records=parser.records,
        end_offset=parser.end_offset,
        min_ts_ms=lo,
        max_ts_ms=hi,
        parquet=str(final.resolve()),
    )
    manifest_tmp = root / f".{segment.name}.json.tmp-{os.getpid()}"
    manifest_tmp.write_text(json.dumps(asdict(entry)))
    os.replace(manifest_tmp, root / f"{segment.name}.json")
    return entry


def compact(
    spark: SparkSession, data_dir: str | Path, compacted_dir: str | Path
) -> CompactionResult:
    """Compact every sealed segment not compacted yet, one Spark task per segment."""
    segments = list_segments(data_dir)
    done = compacted_segments(compacted_dir, segments)
    todo = [s for s in segments if s.sealed and s.start_offset not in done]
    # Drop compacted files whose segment retention has deleted: they are no longer the store.
    _prune(Path(compacted_dir), {s.name for s in segments})
    written: list[CompactedSegment] = []
    if todo:
        target = str(Path(compacted_dir).resolve())
        rdd = spark.sparkContext.parallelize(todo, len(todo))
        written = rdd.map(lambda seg: compact_segment(seg, target)).collect()
    return CompactionResult(
        compacted=sorted(written, key=lambda c: c.segment),
        already=len(done),
        pending=sum(1 for s in segments if not s.sealed),
    )


def _prune(root: Path, live: set[str]) -> None:
    if not root.is_dir():
        return
    for entry in root.iterdir():
        stem = entry.name.split(".", 1)[0]
        if entry.suffix in (".json", ".parquet") and stem.isdigit() and stem not in live:
            entry.unlink(missing_ok=True)
