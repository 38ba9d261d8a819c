"""Recovery: make the consume queues agree with the CommitLog after open.

Clean restart (no ``abort`` marker, valid checkpoint whose offsets agree): trust the
checkpoint, check the log holds nothing past its end, done; no rescan.

Abnormal restart (``abort`` present, or checkpoint missing/stale/inconsistent):

1. Validate the CommitLog from ``scan_start`` (the lower checkpoint offset, or the first
   segment) record by record: magic, length bounds, inner lengths and the ``__CRC32#`` trailer.
   A blank filler moves to the next segment; unwritten space or the first bad record is the
   end. Everything after the end is cut (zeroed / segments deleted) and logged.
2. Every consume queue on disk drops units pointing at or past ``scan_start``: they are
   re-derived in step 3 (this also removes units pointing past the cut log end).
3. Re-dispatch every record in ``[scan_start, end)`` at the offsets recorded in the record
   (QUEUEOFFSET for the parent queue, the dispatch offsets property for light queues).
4. A queue whose next recorded offset is beyond its end lost units before ``scan_start``
   (deleted files): it is emptied and rebuilt from the whole log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from store.checkpoint import Checkpoint
from store.commitlog import CommitLog
from store.consumequeue import ConsumeQueue, ConsumeQueueTable, dispatch
from store.errors import CorruptStoreError
from store.format import (
    BLANK_MAGIC,
    CQ_UNIT,
    CRC_PREFIX,
    CRC_TRAILER_SIZE,
    DISPATCH_FIELDS,
    HEADER_SIZE,
    MAGIC,
    PROP_MULTI_DISPATCH,
    PROP_MULTI_QUEUE_OFFSET,
    SIZE_MAGIC,
    check_record,
    inner_dispatch,
    inner_offsets,
    scan_valid,
)

log = logging.getLogger("lmqtt.store.recovery")


@dataclass
class RecoveryReport:
    """What open() found and did; logged and exposed as ``MessageStore.recovery``."""

    abnormal: bool
    scan_start: int = 0
    log_end: int = 0
    records_scanned: int = 0
    truncated_at: int | None = None
    truncated_bytes: int = 0
    units_dropped: int = 0
    queues_rebuilt: list[str] = field(default_factory=list)
    reason: str = ""
    #: Sum of every queue's max offset after recovery (see Checkpoint.units_total).
    units_total: int = 0


def scan_log(commitlog: CommitLog, start: int) -> tuple[int, int, bool]:
    """Validate records from ``start``: returns ``(end, records, stopped_at_bad_record)``."""
    pos = start
    n = 0
    while True:
        seg = commitlog.segment_for(pos)
        if seg is None:
            return pos, n, False
        rel, k = scan_valid(seg.mm, seg.view, pos - seg.start, seg.size)
        n += k
        pos = seg.start + rel
        r = check_record(seg.view, rel, seg.size)
        if r > 0:  # valid after all (the fast loop stops at the segment's last 88 bytes)
            pos += r
            n += 1
            continue
        if r == 0 and rel + 8 <= seg.size:
            _size, magic = SIZE_MAGIC.unpack_from(seg.view, rel)
            if magic == BLANK_MAGIC and commitlog.segment_for(seg.end) is not None:
                pos = seg.end
                continue
            if magic == BLANK_MAGIC:
                return seg.end, n, False
        return pos, n, r < 0


def _is_record_boundary(commitlog: CommitLog, pos: int) -> bool:
    """Whether a record starts at ``pos``, or the one before ends there (end of data)."""
    seg = commitlog.segment_for(pos)
    if seg is None:
        return False
    rel = pos - seg.start
    r = check_record(seg.view, rel, seg.size)
    if r > 0:
        return True
    if r < 0 or rel < CRC_TRAILER_SIZE:
        return rel == 0 and r == 0
    # Every record ends with its __CRC32# trailer.
    trailer = seg.view[rel - CRC_TRAILER_SIZE : rel]
    return trailer[:9] == CRC_PREFIX and trailer[19] == 2


_ZERO_CHUNK = bytes(1 << 20)


def _bytes_after(commitlog: CommitLog, pos: int) -> int:
    """Bytes a truncation at ``pos`` discards, counted up to the first all-zero MiB."""
    total = 0
    for seg in commitlog.segments:
        if seg.end <= pos:
            continue
        rel = max(pos, seg.start) - seg.start
        while rel < seg.size:
            chunk = seg.view[rel : rel + len(_ZERO_CHUNK)]
            if chunk == _ZERO_CHUNK[: len(chunk)]:
                return total
            total += len(bytes(chunk).rstrip(b"\0"))
            rel += len(chunk)
    return total


def _clean_end(commitlog: CommitLog, cp: Checkpoint) -> int | None:
    """Log end from a clean shutdown's checkpoint, or None if it does not hold up."""
    end = cp.log_flushed_offset
    if cp.queues_flushed_offset != end:
        return None
    if not commitlog.segments:
        return end if end == 0 or end == commitlog.write_pos else None
    if not commitlog.min_offset <= end <= commitlog.segments[-1].end:
        return None
    seg = commitlog.segment_for(end)
    if seg is not None:
        rel = end - seg.start
        if rel + 8 <= seg.size:
            size, magic = SIZE_MAGIC.unpack_from(seg.view, rel)
            if magic == MAGIC or ((size, magic) != (0, 0) and magic != BLANK_MAGIC):
                return None  # data past the checkpoint: not a clean shutdown after all
        if commitlog.segments[-1] is not seg:
            return None
    elif end != commitlog.segments[-1].end:
        return None
    return end


def recover(
    commitlog: CommitLog,
    table: ConsumeQueueTable,
    cp: Checkpoint | None,
    *,
    abort_present: bool,
    read_only: bool,
) -> RecoveryReport:
    """Bring ``commitlog.write_pos`` and the consume queues to a consistent state."""
    if not abort_present and cp is not None:
        end = _clean_end(commitlog, cp)
        if end is not None:
            commitlog.write_pos = commitlog.flushed_pos = end
            return RecoveryReport(
                abnormal=False, scan_start=end, log_end=end, units_total=cp.units_total
            )
        reason = "checkpoint does not match the log"
    elif cp is None:
        reason = "no valid checkpoint"
    else:
        reason = "abort marker present (unclean shutdown)"
    if not commitlog.segments:
        commitlog.write_pos = commitlog.flushed_pos = 0
        if not read_only:
            for name in list(table.disk_names()):
                cq = table.lookup(name)
                if cq is not None and cq.max_offset:
                    table.reset(cq, 0)
        return RecoveryReport(abnormal=True, reason=reason)

    report = RecoveryReport(abnormal=True, reason=reason)
    log_min = commitlog.min_offset
    start = log_min
    cand = -1
    if cp is not None:
        cand = min(cp.log_flushed_offset, cp.queues_flushed_offset)
        if cand > log_min and _is_record_boundary(commitlog, cand):
            start = cand
    first = commitlog.segment_for(start)
    if start == log_min and first is not None:
        _size, magic = SIZE_MAGIC.unpack_from(first.view, 0)
        if magic not in (MAGIC, BLANK_MAGIC, 0):
            raise CorruptStoreError(str(first.path), "not a CommitLog segment (bad magic)")
    end, n, bad = scan_log(commitlog, start)
    report.scan_start, report.log_end, report.records_scanned = start, end, n
    last_end = commitlog.segments[-1].end
    if read_only:
        commitlog.write_pos = commitlog.flushed_pos = end
        return report
    if end < last_end:
        cut = _bytes_after(commitlog, end)
        if cut or bad:
            report.truncated_at, report.truncated_bytes = end, cut
            log.warning(
                "recovery: CommitLog truncated at offset %d (%s), %d non-zero bytes cut",
                end, "bad record" if bad else "end of data", cut,
            )  # fmt: skip
        commitlog.truncate(end)
    commitlog.write_pos = commitlog.flushed_pos = end

    rebuild: set[str] = set()
    rebuild_all = False
    units_kept = 0
    names = list(table.disk_names())
    for name in names:
        cq = table.lookup(name)
        if cq is None:
            continue
        if table.has_gap(name):
            rebuild.add(name)
        report.units_dropped += table.truncate_past(cq, start)
        units_kept += cq.max_offset
        table.evict_overflow()
    if cp is not None and start == cand and start > log_min and units_kept != cp.units_total:
        # Units below the checkpoint are missing (or extra): consume-queue files were deleted
        # or damaged. Rebuild every queue from the whole log.
        log.warning(
            "recovery: consume queues hold %d units below offset %d, checkpoint says %d; "
            "rebuilding all of them", units_kept, start, cp.units_total,
        )  # fmt: skip
        rebuild_all = True

    if rebuild_all:
        _rebuild(commitlog, table, names, log_min, end, everything=True)
        report.queues_rebuilt = ["*"]
    else:
        rebuild |= _redispatch(commitlog, table, start, end)
        if rebuild:
            _rebuild(commitlog, table, sorted(rebuild), log_min, end)
            report.queues_rebuilt = sorted(rebuild)
    table.write_pending()
    table.evict_overflow()
    report.units_total = sum(
        cq.max_offset for cq in (table.lookup(n) for n in table.names()) if cq is not None
    )
    table.evict_overflow()
    log.warning(
        "recovery (%s): validated %d records from %d to %d; dropped %d stale queue units",
        reason, n, start, end, report.units_dropped,
    )  # fmt: skip
    return report


def _rebuild(
    commitlog: CommitLog,
    table: ConsumeQueueTable,
    names: list[str],
    log_min: int,
    end: int,
    *,
    everything: bool = False,
) -> None:
    """Empty ``names`` and re-derive them from every record in ``[log_min, end)``.

    With ``everything``, also re-create queues whose directories are gone entirely.
    """
    log.warning("recovery: rebuilding %s consume queue(s) from the log: %s",
                "all" if everything else len(names), names[:10])  # fmt: skip
    for name in names:
        table.reset(table.get_or_create(name), 0)
        table.evict_overflow()
    _redispatch(
        commitlog, table, log_min, end, rebuilding=True, only=None if everything else set(names)
    )


_DISPATCH_FIELDS = DISPATCH_FIELDS.unpack_from


def _redispatch(
    commitlog: CommitLog,
    table: ConsumeQueueTable,
    start: int,
    end: int,
    *,
    rebuilding: bool = False,
    only: set[str] | None = None,
) -> set[str]:
    """Re-derive the units of every record in ``[start, end)`` (validated before).

    A unit whose index is its queue's next offset is appended; the rare others go to
    :func:`_place_out_of_order`. Returns the queues that lost units before ``start``. With
    ``only``, units of other queues are dropped (partial rebuild).

    Theory: this runs for every record of the log in a full rebuild, so it reads the mapping
    in place and resolves the queues of a record through a cache keyed by the raw topic and
    dispatch property bytes (a handful of distinct values for millions of records); only
    the offsets are parsed per record. The cache holds ConsumeQueue objects, so it is
    dropped whenever the table may have evicted states.
    """
    gaps: set[str] = set()
    routes: dict[tuple[bytes, bytes], _Route] = {}
    dirty = table.dirty
    pack = CQ_UNIT.pack
    pos = start
    while pos < end:
        seg = commitlog.segment_for(pos)
        if seg is None:
            break
        mm = seg.mm
        base = seg.start
        rel = pos - base
        stop = min(end - base, seg.size)
        last_header = seg.size - HEADER_SIZE  # fewer bytes than a header left: a filler
        while rel < stop:
            if rel > last_header:
                rel = seg.size
                break
            size, magic, qoff, blen = _DISPATCH_FIELDS(mm, rel)
            if magic != MAGIC:  # blank filler: the rest of the segment is unused
                rel = seg.size
                break
            p = rel + HEADER_SIZE + blen
            tend = p + 1 + mm[p]
            pstart = tend + 2
            pend = rel + size - CRC_TRAILER_SIZE
            offsets: list[bytes] = []
            d, names = inner_dispatch(mm, pstart, pend)
            if d >= 0:
                offsets = inner_offsets(mm, d, names, pstart, pend)
            key = (mm[p + 1 : tend], names)
            route = routes.get(key)
            if route is None:
                route = routes[key] = _resolve(table, key, only)
            parent, lights, queues = route
            if len(offsets) != len(lights):
                raise ValueError(
                    f"record at {base + rel}: {PROP_MULTI_DISPATCH} and "
                    f"{PROP_MULTI_QUEUE_OFFSET} differ in length"
                )
            unit = pack(base + rel, size, 0)
            # The common case: the unit is the next one of every queue the record names.
            in_order = parent is None or qoff == parent.max_offset
            if in_order:
                for cq, raw_index in zip(lights, offsets):  # noqa: B905 (lengths checked)
                    if cq is not None and int(raw_index) != cq.max_offset:
                        in_order = False
                        break
            if in_order:
                dispatch(queues, unit, dirty)
            else:
                for cq, index in zip((parent, *lights), (qoff, *map(int, offsets))):  # noqa: B905
                    if cq is None:
                        continue
                    if index == cq.max_offset:
                        dispatch((cq,), unit, dirty)
                    else:
                        _place_out_of_order(table, cq, index, unit, rebuilding, gaps)
            if len(dirty) > 4096:
                table.write_pending()
                table.evict_overflow()
                # Evicted states may come back as new objects: resolve routes afresh.
                routes.clear()
            rel += size
        pos = base + rel
    return gaps


#: A record's parent queue and light queues (None for those a partial rebuild leaves alone),
#: and all of them but the None ones: what one dispatch gives a unit.
_Route = tuple["ConsumeQueue | None", list["ConsumeQueue | None"], tuple[ConsumeQueue, ...]]


def _resolve(table: ConsumeQueueTable, key: tuple[bytes, bytes], only: set[str] | None) -> _Route:
    """The queues of records with this raw topic and dispatch property value."""
    topic, names = key
    lights = names.decode("utf-8").split(",") if names else []
    cqs = [
        table.get_or_create(n) if only is None or n in only else None
        for n in (topic.decode("utf-8"), *lights)
    ]
    return cqs[0], cqs[1:], tuple(cq for cq in cqs if cq is not None)


def _place_out_of_order(
    table: ConsumeQueueTable,
    cq: ConsumeQueue,
    index: int,
    unit: bytes,
    rebuilding: bool,
    gaps: set[str],
) -> None:
    """A unit that is not its queue's next one.

    Redispatch: an index past the end means units before the scan start are lost, so the
    queue is noted for a rebuild; one below the end is already there. Rebuild (queues reset
    to 0): a queue's first unit sets where it starts (retention may have deleted the records
    before it); a later jump is a hole the log cannot fill, logged and skipped over.
    """
    if not rebuilding:
        if index > cq.max_offset:
            gaps.add(cq.name)
        return
    if cq.max_offset == 0:
        cq.min_offset = cq.flushed = cq.max_offset = index
    elif index > cq.max_offset:
        log.error("recovery: queue %r has no record for offsets %d..%d", cq.name,
                  cq.max_offset, index - 1)  # fmt: skip
        table.write_pending()
        cq.flushed = cq.max_offset = index
    else:
        return
    dispatch((cq,), unit, table.dirty)
