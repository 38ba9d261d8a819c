"""The read path: messages of a queue, decoded from the CommitLog through its consume queue.

A get reads the queue's units (consumequeue.ConsumeQueueTable.read_units) and decodes the
records they point at straight from the segment mmap, without re-checking CRCs: recovery
validated what was there at open, this process wrote the rest. Results are built with
``tuple.__new__`` (same NamedTuple type, one Python-level call less per message).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator

from store.commitlog import CommitLog
from store.consumequeue import ConsumeQueue, ConsumeQueueTable
from store.errors import StoreClosedError, StoreError
from store.format import (
    CQ_UNIT,
    CQ_UNIT_SIZE,
    CRC_TRAILER_SIZE,
    HEADER_SIZE,
    MULTI_DISPATCH_SEPARATOR,
    PROP_CRC32,
    READ_FIELDS,
    STORE_TIMESTAMP,
    check_record,
    inner_dispatch,
)
from store.results import GetResult, GetStatus, StoredMessage

_NAME_CACHE_LIMIT = 200_000
_READ_FIELDS = READ_FIELDS.unpack_from
_iter_units = CQ_UNIT.iter_unpack
_tuple_new = tuple.__new__


def _parse_user_props(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in raw.decode("utf-8")[:-1].split("\x02"):
        k, _, v = pair.partition("\x01")
        if k != PROP_CRC32:
            out[k] = v
    return out


class QueueReader:
    """Reads queues of ``table`` from ``commitlog`` under the store's ``lock``; ``closed`` is
    set under it when the store closes."""

    def __init__(
        self, commitlog: CommitLog, table: ConsumeQueueTable, lock: threading.Lock
    ) -> None:
        self.commitlog = commitlog
        self.table = table
        self.lock = lock
        self.closed = False
        #: Topic names and light-queue tuples by their raw bytes in the record.
        self._topic_names: dict[bytes, str] = {}
        self._queue_tuples: dict[bytes, tuple[str, ...]] = {}

    def lookup(self, queue: str) -> ConsumeQueue | None:
        """The state of ``queue``, None if it does not exist. Lock held."""
        if self.closed:
            raise StoreClosedError("store is closed")
        if not isinstance(queue, str) or not queue:
            return None
        try:
            return self.table.lookup(queue)
        except ValueError:  # not encodable: cannot exist
            return None

    def _topic_name(self, raw: bytes) -> str:
        names = self._topic_names
        if len(names) >= _NAME_CACHE_LIMIT:
            names.clear()
        name = names[raw] = raw.decode("utf-8")
        return name

    def _queue_tuple(self, raw: bytes) -> tuple[str, ...]:
        tuples = self._queue_tuples
        if len(tuples) >= _NAME_CACHE_LIMIT:
            tuples.clear()
        queues = tuples[raw] = tuple(raw.decode("utf-8").split(MULTI_DISPATCH_SEPARATOR))
        return queues

    def decode_units(self, units: bytes, offset: int) -> tuple[list[StoredMessage], int]:
        """Messages the consume-queue ``units`` point at; ``offset`` is the first unit's.

        Returns the messages and the offset after the last unit looked at. Lock held. Records
        are trusted (validated by recovery or written by this process), so there is no CRC
        check here. Everything is read straight from the segment's mmap (slicing an mmap gives
        bytes in one copy), the segment is looked up only when a unit leaves the current one,
        topic names and light-queue tuples come from caches keyed by their raw bytes, and a
        message without user properties (the store's INNER_* pair starts the property string)
        builds no dict beyond an empty one. A unit pointing outside the log is skipped.
        """
        commitlog = self.commitlog
        write_pos = commitlog.write_pos
        topics = self._topic_names
        tuples = self._queue_tuples
        msgs: list[StoredMessage] = []
        add = msgs.append
        seg_start = seg_end = 0
        mm: mmap.mmap | None = None
        i = offset
        if len(units) % CQ_UNIT_SIZE:  # a short read of a damaged file: whole units only
            units = units[: len(units) - len(units) % CQ_UNIT_SIZE]
        for phys, size, _tag in _iter_units(units):
            i += 1
            if not seg_start <= phys < seg_end or mm is None:
                seg = commitlog.segment_for(phys)
                if seg is None:
                    continue
                seg_start, seg_end, mm = seg.start, seg.end, seg.mm
            if size <= 0 or phys + size > write_pos:
                continue
            rel = phys - seg_start
            poff, born, store_ts, blen = _READ_FIELDS(mm, rel)
            p = rel + HEADER_SIZE + blen
            body = mm[rel + HEADER_SIZE : p]
            tend = p + 1 + mm[p]
            raw = mm[p + 1 : tend]
            topic = topics.get(raw) or self._topic_name(raw)
            p = tend + 2  # PROPERTIESLENGTH skipped: the record size bounds the properties
            pend = rel + size - CRC_TRAILER_SIZE
            queues: tuple[str, ...] = ()
            props: dict[str, str] = {}
            if p < pend:
                # The store's INNER_* pair is last; user properties (if any) come before it.
                d, raw = inner_dispatch(mm, p, pend)
                if d >= 0:
                    queues = tuples.get(raw) or self._queue_tuple(raw)
                    if d > p:
                        props = _parse_user_props(mm[p:d])
                else:
                    props = _parse_user_props(mm[p:pend])
            add(
                _tuple_new(
                    StoredMessage,
                    (topic, body, props, i - 1, phys, store_ts, born, poff, queues),
                )
            )
        return msgs, i

    def get(self, queue: str, offset: int, max_messages: int) -> GetResult:
        """Up to ``max_messages`` of ``queue`` from ``offset`` (MessageStore.get)."""
        table = self.table
        with self.lock:
            cq = self.lookup(queue)
            if cq is None:
                return GetResult(GetStatus.NO_MATCHED_LOGIC_QUEUE, next_offset=0)
            lo, hi = cq.min_offset, cq.max_offset
            if hi == 0:
                return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], 0, lo, hi)
            if offset < lo:
                return GetResult(GetStatus.OFFSET_TOO_SMALL, [], lo, lo, hi)
            if offset == hi:
                return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, lo, hi)
            if offset > hi:
                return GetResult(GetStatus.OFFSET_OVERFLOW_BADLY, [], hi, lo, hi)
            data = table.read_units(cq, offset, max(1, max_messages))
            msgs, i = self.decode_units(data, offset)
            if len(table.states) > table.max_cached:
                table.evict_overflow()
        if not msgs and i == offset:
            # The unit could not be read (file damaged underneath us): skip nothing, report.
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, lo, hi)
        return GetResult(GetStatus.FOUND, msgs, i, lo, hi)

    def message_at(self, physical_offset: int) -> StoredMessage:
        """The record at ``physical_offset`` (validated); StoreError if there is none."""
        with self.lock:
            if self.closed:
                raise StoreClosedError("store is closed")
            seg = self.commitlog.segment_for(physical_offset)
            if seg is None or physical_offset >= self.commitlog.write_pos:
                raise StoreError(f"no message at offset {physical_offset}")
            rel = physical_offset - seg.start
            size = check_record(seg.view, rel, seg.size)
            if size <= 0:
                raise StoreError(f"no message at offset {physical_offset}")
            msgs, _ = self.decode_units(CQ_UNIT.pack(physical_offset, size, 0), 0)
            if not msgs:
                raise StoreError(f"no message at offset {physical_offset}")
            m = msgs[0]
            return m._replace(queue_offset=m.parent_offset)

    def messages_since(self, physical_offset: int) -> Iterator[StoredMessage]:
        """Every record from ``physical_offset`` (a record's start, or the log's end at some
        earlier time) to the log's end, in append order; the lock is taken per record."""
        pos = max(physical_offset, self.commitlog.min_offset)
        while True:
            with self.lock:
                if self.closed:
                    raise StoreClosedError("store is closed")
                seg = self.commitlog.segment_for(pos)
                if seg is None or pos >= self.commitlog.write_pos:
                    return
                rel = pos - seg.start
                size = check_record(seg.view, rel, seg.size)
                if size == 0:  # the blank filler at a segment's end: on in the next one
                    pos = seg.end
                    continue
                if size < 0:
                    return  # not a record's start (the log was cut below it since)
                msgs, _ = self.decode_units(CQ_UNIT.pack(pos, size, 0), 0)
            if msgs:
                yield msgs[0]._replace(queue_offset=msgs[0].parent_offset)
            pos += size

    def _store_ts_at(self, cq: ConsumeQueue, offset: int) -> int:
        u = self.table.unit_at(cq, offset)
        if u is None:
            return -1
        seg = self.commitlog.segment_for(u[0])
        if seg is None:
            return -1
        return int(STORE_TIMESTAMP.unpack_from(seg.view, u[0] - seg.start)[0])

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int:
        """First offset whose store timestamp is >= ``timestamp_ms`` (max_offset if none)."""
        with self.lock:
            cq = self.lookup(queue)
            if cq is None:
                return 0
            lo, hi = cq.min_offset, cq.max_offset
            while lo < hi:
                mid = (lo + hi) // 2
                if self._store_ts_at(cq, mid) >= timestamp_ms:
                    hi = mid
                else:
                    lo = mid + 1
            return lo
