"""Fast, read-only parsing of CommitLog segment files into Arrow record batches.

This module is pure pyarrow + numpy (no Spark) so the data source, compaction and the benchmark
share one parser. The record format and its reader live in the store: segments are listed by
`store.commitlog.segment_files`, records found by `store.format.walk_records`, and every offset
and constant is `store.format`'s. What is added here is the bulk half: validation and columns
for a whole batch of records at once.

A live store is read without coordination: the segment is mapped read-only and walked from its
start; the walk stops at the first record that is not complete and CRC-valid. For the active
(last) segment that is the normal end of what was written (zero bytes, or a record still being
written). For a sealed segment, anything other than a clean end or the BLANK filler is damage.

Speed comes from splitting the work: one Python loop (the store's walk) follows TOTALSIZE from
record to record, while the CRCs, the layout check and fixed-position header fields
(timestamps, body length) are handled for the whole batch at once with numpy, and list columns
are built with Arrow kernels.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analytics.errors import CorruptSegmentError, DataDirError
from store import TIMER_TOPIC
from store.commitlog import segment_files
from store.format import (
    COMMITLOG_DIR,
    CRC_MASK,
    CRC_PREFIX,
    CRC_TRAILER_SIZE,
    HEADER_SIZE,
    MAGIC,
    MULTI_DISPATCH_SEPARATOR,
    NAME_VALUE_SEPARATOR,
    OFF_BODYLENGTH,
    OFF_BORNTIMESTAMP,
    OFF_STORETIMESTAMP,
    PROP_MULTI_DISPATCH,
    PROP_MULTI_QUEUE_OFFSET,
    PROPERTY_SEPARATOR,
    SIZE_MAGIC,
    WALK_BAD,
    WALK_BEYOND,
    walk_records,
)
from topicmap import record

# Arrow schema of the rows. The Spark schema in analytics.datasource is derived from the same
# field list; a unit test checks the two agree exactly (Spark rejects any mismatch).
_TS = pa.timestamp("us", tz="UTC")
ARROW_SCHEMA = pa.schema(
    [
        pa.field("segment", pa.int64(), nullable=False),
        pa.field("physical_offset", pa.int64(), nullable=False),
        pa.field("store_timestamp", _TS, nullable=False),
        pa.field("born_timestamp", _TS, nullable=False),
        pa.field("parent_topic", pa.string(), nullable=False),
        pa.field("topic", pa.string()),
        pa.field("client_id", pa.string()),
        pa.field("qos", pa.int32()),
        pa.field("retain", pa.bool_()),
        pa.field("body_size", pa.int32(), nullable=False),
        pa.field(
            "queues", pa.list_(pa.field("element", pa.string(), nullable=False)), nullable=False
        ),
        pa.field(
            "queue_offsets",
            pa.list_(pa.field("element", pa.int64(), nullable=False)),
            nullable=False,
        ),
    ]
)

DEFAULT_BATCH_ROWS = 32_768


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """One CommitLog segment as found on disk."""

    path: str
    start_offset: int
    size: int
    sealed: bool  # a later segment exists, so this one is complete

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def list_segments(data_dir: str | Path) -> list[SegmentFile]:
    """The CommitLog segments of a store directory, oldest first.

    Raises DataDirError when the directory is missing or has no CommitLog.
    """
    root = Path(data_dir)
    if not root.exists():
        raise DataDirError(f"data directory {root} does not exist")
    if not root.is_dir():
        raise DataDirError(f"data directory {root} is not a directory")
    log_dir = root / COMMITLOG_DIR
    if not log_dir.is_dir():
        raise DataDirError(
            f"{root} is not an lmqtt store: it has no {log_dir.name}/ directory "
            "(point --data-dir at the gateway's data directory)"
        )
    found = segment_files(log_dir)
    segments = []
    for i, (start, path) in enumerate(found):
        segments.append(
            SegmentFile(
                path=str(path),
                start_offset=start,
                size=path.stat().st_size,
                sealed=i < len(found) - 1,
            )
        )
    return segments


class SegmentParser:
    """Walks one segment and yields Arrow record batches of its complete records.

    After iteration, `end_offset` is the physical offset just past the last complete record and
    `records` the number of records read. `strict` (default: the segment is sealed) turns a bad
    record into CorruptSegmentError instead of a quiet end of data.

    Theory of operation. Records are chained by TOTALSIZE, so finding them is sequential: the
    Python loop does only that (one struct call, a magic and bounds check, one append per
    record). Everything else is done for a whole batch at once: the CRC32s through a chain of
    C-level `map`s (no bytecode per record), the stored CRC digits, the layout check and every
    column with numpy gathers and Arrow kernels over zero-copy views of the mapped file.
    """

    def __init__(
        self,
        segment: SegmentFile,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        strict: bool | None = None,
    ) -> None:
        self.segment = segment
        self.batch_rows = batch_rows
        self.strict = segment.sealed if strict is None else strict
        self.records = 0
        self.end_offset = segment.start_offset

    def batches(self) -> Iterator[pa.RecordBatch]:
        try:
            fd = os.open(self.segment.path, os.O_RDONLY)
        except FileNotFoundError:
            # Retention deleted the segment between listing and reading: nothing to read.
            return
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                return
            buf = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            yield from self._batches(buf, size)
        finally:
            buf.close()

    def _batches(self, buf: mmap.mmap, limit: int) -> Iterator[pa.RecordBatch]:
        whole = np.frombuffer(buf, dtype=np.uint8)
        view = memoryview(buf)
        try:
            pos = 0
            done = False
            while not done:
                starts, pos, done = self._walk(buf, pos, limit)
                if not starts:
                    break
                start_arr = np.array(starts, dtype=np.int64)
                end_arr = np.empty_like(start_arr)
                end_arr[:-1] = start_arr[1:]
                end_arr[-1] = pos
                keep, reason = _validate(view, whole, start_arr, end_arr)
                if keep < len(starts):
                    self._bad(int(start_arr[keep]), reason)
                    start_arr, end_arr = start_arr[:keep], end_arr[:keep]
                    done = True
                if keep:
                    self.records += keep
                    self.end_offset = self.segment.start_offset + int(end_arr[-1])
                    batch = _to_batch(whole, start_arr, end_arr, self.segment.start_offset)
                    yield _without_waiting_timers(batch)
        finally:
            del whole
            view.release()

    def _walk(self, buf: mmap.mmap, pos: int, limit: int) -> tuple[list[int], int, bool]:
        """The hot loop (store.format.walk_records): up to batch_rows records from pos.

        Returns the record starts, the position after the last one and whether the data ended.
        """
        starts, pos, why = walk_records(buf, pos, limit, self.batch_rows)
        if why is None:
            return starts, pos, False
        # WALK_END: a filler or unwritten space; WALK_BEYOND in the live segment: a record
        # still being written. Anything else is damage.
        if why == WALK_BAD or (why == WALK_BEYOND and self.segment.sealed):
            size, magic = SIZE_MAGIC.unpack_from(buf, pos)
            if magic != MAGIC:
                self._bad(pos, f"bad magic 0x{magic & 0xFFFFFFFF:08X}")
            else:
                self._bad(pos, f"record size {size} does not fit the segment")
        return starts, pos, True

    def _bad(self, pos: int, reason: str) -> None:
        if self.strict:
            raise CorruptSegmentError(self.segment.path, self.segment.start_offset + pos, reason)


_BE: dict[int, np.dtype[Any]] = {2: np.dtype(">u2"), 4: np.dtype(">u4"), 8: np.dtype(">i8")}
_SPANS = {w: np.arange(w) for w in _BE}


def _without_waiting_timers(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch without the store's delayed records (parent topic TIMER_TOPIC, store/timer.py):
    a delayed message is a row once, when it fired (that record is an ordinary one of its
    topic, stamped with the firing time), not also while it waited."""
    waiting = pc.equal(batch.column(4), TIMER_TOPIC)  # parent_topic
    if not pc.any(waiting).as_py():
        return batch
    return batch.filter(pc.invert(waiting))


def _gather_be(whole: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """Big-endian integers (2, 4 bytes unsigned; 8 signed) at each position, as int64."""
    raw = whole[at[:, None] + _SPANS[width]]  # (n, width) contiguous bytes
    return raw.view(_BE[width]).reshape(len(at)).astype(np.int64)


_TRAILER_SPAN = np.arange(CRC_TRAILER_SIZE)
_DIGITS = slice(len(CRC_PREFIX), len(CRC_PREFIX) + 10)
_PREFIX = np.frombuffer(CRC_PREFIX, dtype=np.uint8)
_POW10 = 10 ** np.arange(9, -1, -1, dtype=np.int64)


def _validate(
    view: memoryview, whole: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[int, str]:
    """How many leading records pass the layout and CRC checks, and why the next one fails."""
    # Layout: body length, topic length and properties length must add up to the size.
    body_len = _gather_be(whole, starts + OFF_BODYLENGTH, 4)
    tpos = starts + HEADER_SIZE + body_len  # TOPICLENGTH follows the body
    layout_ok = tpos + 3 <= ends
    tpos = np.where(layout_ok, tpos, starts)
    ppos = tpos + 1 + whole[tpos].astype(np.int64)
    layout_ok &= ppos + 2 <= ends
    ppos = np.where(layout_ok, ppos, starts)
    layout_ok &= ppos + 2 + _gather_be(whole, ppos, 2) == ends
    # CRC trailer: prefix, digits and separator are checked in bulk; the CRC32s are computed by
    # C-level maps, so no bytecode runs per record.
    trailer = whole[(ends - CRC_TRAILER_SIZE)[:, None] + _TRAILER_SPAN]
    digits = trailer[:, _DIGITS]
    trailer_ok = (
        (trailer[:, : len(CRC_PREFIX)] == _PREFIX).all(axis=1)
        & (trailer[:, -1] == ord(PROPERTY_SEPARATOR))
        & ((digits >= 48) & (digits <= 57)).all(axis=1)
    )
    stored = ((digits.astype(np.int64) - 48) * _POW10).sum(axis=1)
    slices = map(slice, starts.tolist(), (ends - CRC_TRAILER_SIZE).tolist())
    computed = np.fromiter(
        map(zlib.crc32, map(view.__getitem__, slices)), dtype=np.int64, count=len(starts)
    )
    crc_ok = trailer_ok & ((computed & CRC_MASK) == stored)
    valid = layout_ok & crc_ok
    if valid.all():
        return len(starts), ""
    keep = int(np.argmin(valid))
    if not layout_ok[keep]:
        return keep, "body, topic and properties lengths do not add up to the record size"
    return keep, "CRC mismatch"


def _views(data: pa.Buffer, local: np.ndarray, at: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A binary column of (position, length) slices of `local`, copied once by Arrow.

    Built as an Arrow binary-view array over the mapped bytes, then cast to plain binary.
    A view is 16 bytes: length (int32 LE), then either the value itself when it fits in 12
    bytes, or its first 4 bytes, buffer index 0 and offset (int32 LE). Dense numpy only: no
    boolean-mask indexing.
    """
    n = len(at)
    head = local[np.minimum(at[:, None] + _INLINE_SPAN, len(local) - 1)]  # (n, 12)
    inline = (lengths <= 12)[:, None]
    # Inline: the value, zero-padded. Out of line: prefix, buffer 0, offset.
    outline = np.empty((n, 12), dtype=np.uint8)
    outline[:, 0:4] = head[:, 0:4]
    outline[:, 4:8] = 0
    outline[:, 8:12] = at.astype("<i4").view(np.uint8).reshape(n, 4)
    raw = np.empty((n, 16), dtype=np.uint8)
    raw[:, 0:4] = lengths.astype("<i4").view(np.uint8).reshape(n, 4)
    raw[:, 4:16] = np.where(inline, head * (lengths[:, None] > _INLINE_SPAN), outline)
    array = pa.Array.from_buffers(pa.binary_view(), n, [None, pa.py_buffer(raw), data])
    return pc.cast(array, pa.binary())


_INLINE_SPAN = np.arange(12)


def _to_batch(whole: np.ndarray, starts: np.ndarray, ends: np.ndarray, base: int) -> pa.RecordBatch:
    """Gather every column of the validated records at `starts` from the mapped segment."""
    n = len(starts)
    # Views address their buffer with int32 offsets: use a slice starting at the first record.
    lo = int(starts[0])
    local = whole[lo : int(ends[-1])]
    data = pa.py_buffer(local)
    rel = starts - lo
    store_ts = _gather_be(local, rel + OFF_STORETIMESTAMP, 8)
    born_ts = _gather_be(local, rel + OFF_BORNTIMESTAMP, 8)
    body_len = _gather_be(local, rel + OFF_BODYLENGTH, 4)
    tpos = rel + HEADER_SIZE + body_len
    tlen = local[tpos].astype(np.int64)
    ppos = tpos + 3 + tlen
    plen = (ends - lo) - CRC_TRAILER_SIZE - ppos
    parents = _views(data, local, tpos + 1, tlen)
    props = _parse_properties(_views(data, local, ppos, plen))
    del data, local
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.full(n, base, dtype=np.int64)),
            pa.array(starts + base),
            pa.array(store_ts * 1000, type=_TS),
            pa.array(born_ts * 1000, type=_TS),
            pc.cast(parents, pa.string()),
            props[record.TOPIC],
            props[record.CLIENT],
            props[record.QOS],
            props[record.RETAIN],
            pa.array(body_len.astype(np.int32)),
            props[PROP_MULTI_DISPATCH],
            props[PROP_MULTI_QUEUE_OFFSET],
        ],
        schema=ARROW_SCHEMA,
    )


_WANTED = (
    record.TOPIC,
    record.CLIENT,
    record.QOS,
    record.RETAIN,
    PROP_MULTI_DISPATCH,
    PROP_MULTI_QUEUE_OFFSET,
)


def _parse_properties(blobs: pa.Array) -> dict[str, pa.Array]:
    """Pick the wanted properties out of each record's property bytes (CRC property removed).

    All in Arrow kernels: split into key/value pairs, select each wanted key's pairs by prefix,
    and scatter the values back to their records (null when a record lacks the key).
    """
    n = len(blobs)
    pairs = pc.split_pattern(blobs, PROPERTY_SEPARATOR)
    flat = pairs.flatten()
    owner = pc.list_parent_indices(pairs)
    out: dict[str, pa.Array] = {}
    for key in _WANTED:
        prefix = (key + NAME_VALUE_SEPARATOR).encode()
        hit = pc.starts_with(flat, pattern=prefix.decode())
        values = pc.binary_slice(pc.filter(flat, hit), len(prefix), 1 << 30)
        where = np.full(n, -1, dtype=np.int64)
        # A duplicated key keeps its last value, like a dict built from the pairs.
        where[pc.filter(owner, hit).to_numpy()] = np.arange(len(values))
        picked = pc.take(values, pa.array(where, mask=where < 0))
        out[key] = pc.cast(picked, pa.string())
    # QoS is one of three digits: its position in the value set is its value.
    out[record.QOS] = pc.index_in(out[record.QOS], value_set=_QOS_VALUES)
    out[record.RETAIN] = pc.equal(out[record.RETAIN], "1")
    out[PROP_MULTI_DISPATCH] = _split_list(out[PROP_MULTI_DISPATCH], pa.string())
    out[PROP_MULTI_QUEUE_OFFSET] = _split_list(out[PROP_MULTI_QUEUE_OFFSET], pa.int64())
    return out


_QOS_VALUES = pa.array(["0", "1", "2"])


def _to_int(strings: pa.Array, to: pa.DataType) -> pa.Array:
    """Decimal strings to integers; anything unparsable becomes null rather than failing."""
    try:
        return pc.cast(strings, to)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass  # some value is not a number: fall back to checking each one
    valid = pc.match_substring_regex(strings, r"^-?[0-9]{1,18}$")
    cleaned = pc.if_else(valid, strings, pa.scalar(None, pa.string()))
    return pc.cast(cleaned, to)


def _split_list(strings: pa.Array, element: pa.DataType) -> pa.ListArray:
    """Comma-separated values to a non-null list column ([] when the property is absent)."""
    filled = pc.fill_null(strings, "")
    parts = pc.split_pattern(filled, MULTI_DISPATCH_SEPARATOR)
    flat = parts.flatten()
    # "" splits to [""]: an empty property means an empty list, so drop the empty elements
    # (queue names and offsets are never empty).
    nonempty = pc.not_equal(flat, "")
    owner = pc.filter(pc.list_parent_indices(parts), nonempty).to_numpy()
    flat = pc.filter(flat, nonempty)
    if element == pa.int64():
        flat = _to_int(flat, pa.int64()).fill_null(-1)
    counts = np.bincount(owner, minlength=len(strings)).astype(np.int32)
    offsets = np.zeros(len(strings) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    list_type = pa.list_(pa.field("element", element, nullable=False))
    return pa.ListArray.from_arrays(pa.array(offsets), flat, type=list_type)


def read_segment_table(segment: SegmentFile, strict: bool | None = None) -> pa.Table:
    """The whole segment as one Arrow table (compaction and tests)."""
    parser = SegmentParser(segment, strict=strict)
    return pa.Table.from_batches(list(parser.batches()), schema=ARROW_SCHEMA)
