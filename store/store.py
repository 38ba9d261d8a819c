"""MessageStore: the facade over CommitLog, consume queues, recovery, flushing and offsets.

Thread-safety: every method may be called from any thread. One lock (``_lock``) serialises
appends, dispatch, reads of consume-queue state and segment deletion; the flusher thread
fsyncs without it. Arrival listeners run after the lock is released, in the putting thread.

Dispatch happens inside the append critical section: the parent queue offset, every light
queue offset and the physical offset are assigned together (rocketmq #7511 lost messages
when they were not), so a get right after put sees the message.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from store.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from store.commitlog import CommitLog
from store.config import FlushMode, StoreConfig
from store.consumequeue import ConsumeQueue, ConsumeQueueTable
from store.errors import (
    CorruptStoreError,
    InvalidPropertyError,
    InvalidQueueNameError,
    MessageTooLargeError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from store.flush import Flusher
from store.format import (
    ABORT_FILE,
    CHECKPOINT_FILE,
    COMMITLOG_DIR,
    CONFIG_DIR,
    CONSUMEQUEUE_DIR,
    CQ_UNIT,
    CRC_TRAILER_SIZE,
    DISPATCH_PREFIX,
    FIXED_OVERHEAD,
    HEADER_SIZE,
    INT64,
    LOCK_FILE,
    MAX_PROPERTIES_BYTES,
    MAX_TOPIC_BYTES,
    OFF_STORETIMESTAMP,
    PROP_CRC32,
    QOFFSET_PREFIX,
    RESERVED_PROPERTIES,
    check_record,
    encode_queue_dir,
    write_record,
)
from store.offsets import OFFSETS_FILE, ConsumerOffsets
from store.recovery import RecoveryReport, recover, scan_log
from store.results import (
    ArrivalListener,
    GetResult,
    GetStatus,
    PutRequest,
    PutResult,
    StoredMessage,
)
from store.retention import apply_retention

log = logging.getLogger("lmqtt.store")

_FORBIDDEN_NAME_CHARS = frozenset(",\x00\x01\x02")
_VALID_CACHE_LIMIT = 200_000
_RECORD_OVERHEAD = FIXED_OVERHEAD + CRC_TRAILER_SIZE
_MAX_USER_PROPS = MAX_PROPERTIES_BYTES - CRC_TRAILER_SIZE
_pack_unit = CQ_UNIT.pack
_time = time.time
#: QUEUEOFFSET, BORNTIMESTAMP, STORETIMESTAMP, BODYLENGTH of a record header (see format.py).
_READ_FIELDS = struct.Struct(">20xq12xq8xq20xi").unpack_from


def _parse_user_props(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in raw.decode("utf-8")[:-1].split("\x02"):
        k, _, v = pair.partition("\x01")
        if k != PROP_CRC32:
            out[k] = v
    return out


def _now_ms() -> int:
    return int(time.time() * 1000)


class MessageStore:
    """An embedded CommitLog store with light message queues. Create with :meth:`open`."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.config_dir = self.data_dir / CONFIG_DIR
        self.read_only = config.read_only
        self._lock = threading.Lock()
        self._closed = False
        self._lock_fd: int | None = None
        self._listeners: tuple[ArrivalListener, ...] = ()
        self._valid: dict[str, bytes] = {}
        self._topic_names: dict[bytes, str] = {}
        self._queue_tuples: dict[bytes, tuple[str, ...]] = {}
        self._queue_sets: dict[tuple[str, ...], tuple[tuple[str, ...], bytes]] = {}
        self._last_store_ts = 0
        self._units_total = 0
        self._lock_wanted = False
        self._sync = config.flush == FlushMode.SYNC
        self._max_body = config.max_body_size
        self.commitlog = CommitLog(
            self.data_dir / COMMITLOG_DIR, config.segment_size, read_only=config.read_only
        )
        self.queues_table = ConsumeQueueTable(
            self.data_dir / CONSUMEQUEUE_DIR,
            units_per_file=config.cq_units_per_file,
            max_open_files=config.max_open_files,
            max_cached_queues=config.max_cached_queues,
            read_only=config.read_only,
        )
        self.offsets = ConsumerOffsets(self.config_dir / OFFSETS_FILE, read_only=config.read_only)
        self.recovery = RecoveryReport(abnormal=False)
        self._flusher: Flusher | None = None

    # =========================================================================================
    # open / close
    # =========================================================================================
    @classmethod
    def open(cls, config: StoreConfig) -> MessageStore:
        """Create or recover the store in ``config.data_dir``."""
        data_dir = Path(config.data_dir)
        if data_dir.exists() and not data_dir.is_dir():
            raise CorruptStoreError(str(data_dir), "data directory is not a directory")
        if config.read_only and not (data_dir / COMMITLOG_DIR).is_dir():
            raise StoreError(f"{data_dir}: no store to open read-only")
        if not config.read_only:
            for d in (data_dir, data_dir / COMMITLOG_DIR, data_dir / CONSUMEQUEUE_DIR):
                d.mkdir(parents=True, exist_ok=True)
            (data_dir / CONFIG_DIR).mkdir(exist_ok=True)
        store = cls(config)
        try:
            store._open()
        except BaseException:
            store._release()
            raise
        return store

    def _open(self) -> None:
        if not self.read_only:
            self._take_lock()
        self.commitlog.load()
        self.queues_table.log_min_offset = self.commitlog.min_offset
        abort = self.data_dir / ABORT_FILE
        abort_present = abort.exists()
        cp = read_checkpoint(self.data_dir / CHECKPOINT_FILE)
        if self.read_only:
            abort_present = True  # never trust a live writer's checkpoint blindly
        self.recovery = recover(
            self.commitlog, self.queues_table, cp,
            abort_present=abort_present, read_only=self.read_only,
        )  # fmt: skip
        self.queues_table.log_min_offset = self.commitlog.min_offset
        self._units_total = self.recovery.units_total
        if self.read_only:
            return
        if self.recovery.abnormal:
            self._checkpoint_now()
        fd = os.open(abort, os.O_WRONLY | os.O_CREAT, 0o644)
        os.fsync(fd)
        os.close(fd)
        self._fsync_dir(self.data_dir)
        self._flusher = Flusher(
            flush_log=self._flush_log,
            flush_all=self._flush_all,
            maintain=self._maintain,
            sync=self._sync,
            interval_s=self.config.flush_interval_ms / 1000,
            maintain_interval_s=self.config.retention_check_interval_s,
            timeout_s=self.config.sync_flush_timeout_ms / 1000,
        )
        self._flusher.start(self.commitlog.flushed_pos)

    def _take_lock(self) -> None:
        fd = os.open(self.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise StoreLockedError(f"{self.data_dir} is already open by another store") from e
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _release(self) -> None:
        self.commitlog.close()
        self.queues_table.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Flush everything, write the checkpoint, remove the abort marker, release the lock."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._flusher is not None:
            self._flusher.stop()
        if not self.read_only:
            end = self._flush_all()
            if self._flusher is not None:
                self._flusher.note_flushed(end)
                self._flusher.fail_pending()
            try:
                os.unlink(self.data_dir / ABORT_FILE)
            except FileNotFoundError:
                pass
            self._fsync_dir(self.data_dir)
        with self._lock:
            self._release()

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # =========================================================================================
    # flushing
    # =========================================================================================
    def _flush_log(self) -> int:
        """fsync the CommitLog up to the current write position (no store lock held)."""
        end = self.commitlog.write_pos
        self.commitlog.fsync_to(end)
        return end

    def _flush_all(self) -> int:
        """Consume-queue units, CommitLog, fsyncs, consumer offsets, checkpoint."""
        # A writer looping on put() would win the lock again and again (the GIL hands it
        # back before this thread runs): ask writers to yield once after their section.
        self._lock_wanted = True
        with self._lock:
            self._lock_wanted = False
            end = self.commitlog.write_pos
            ts = self._last_store_ts
            units = self._units_total
            paths = self.queues_table.write_pending()
        self.commitlog.fsync_to(end)
        for p in dict.fromkeys(paths):
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.offsets.persist()
        write_checkpoint(
            self.data_dir / CHECKPOINT_FILE,
            Checkpoint(end, end, ts, ts, units),
        )
        return end

    def _checkpoint_now(self) -> None:
        self._flush_all()

    def flush(self) -> None:
        """Force a full flush and checkpoint now."""
        self._check_writable()
        end = self._flush_all()
        if self._flusher is not None:
            self._flusher.note_flushed(end)

    def _maintain(self) -> None:
        if self.config.retention_hours is None and self.config.retention_bytes is None:
            return
        self.delete_expired()

    def delete_expired(self, now: float | None = None) -> int:
        """Apply retention now; returns the number of segments deleted."""
        self._check_writable()
        with self._lock:
            return apply_retention(
                self.commitlog, self.queues_table,
                retention_hours=self.config.retention_hours,
                retention_bytes=self.config.retention_bytes, now=now,
            )  # fmt: skip

    # =========================================================================================
    # validation
    # =========================================================================================
    def _check_writable(self) -> None:
        if self._closed:
            raise StoreClosedError("store is closed")
        if self.read_only:
            raise ReadOnlyStoreError("store was opened read-only")

    def _check_name(self, name: str, *, topic: bool) -> bytes:
        if not isinstance(name, str) or not name:
            raise InvalidQueueNameError(str(name), "empty or not a string")
        bad = _FORBIDDEN_NAME_CHARS.intersection(name)
        if bad:
            raise InvalidQueueNameError(name, f"contains reserved character(s) {sorted(bad)!r}")
        try:
            encode_queue_dir(name)
            raw = name.encode("utf-8")
        except (ValueError, UnicodeEncodeError) as e:
            raise InvalidQueueNameError(name, str(e)) from e
        if topic and len(raw) > MAX_TOPIC_BYTES:
            raise InvalidQueueNameError(name, f"topic longer than {MAX_TOPIC_BYTES} bytes")
        if len(self._valid) >= _VALID_CACHE_LIMIT:
            self._valid.clear()
        self._valid[name] = raw
        return raw

    @staticmethod
    def _encode_props(properties: dict[str, str]) -> bytes:
        parts = []
        for k, v in properties.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InvalidPropertyError(f"property {k!r}: keys and values must be str")
            if k in RESERVED_PROPERTIES:
                raise InvalidPropertyError(f"property {k!r} is reserved by the store")
            if not k or "\x01" in k or "\x02" in k or "\x01" in v or "\x02" in v:
                raise InvalidPropertyError(f"property {k!r}: empty key or separator character")
            parts.append(f"{k}\x01{v}\x02")
        return "".join(parts).encode("utf-8")

    # =========================================================================================
    # writing
    # =========================================================================================
    def _prepare(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str],
        properties: dict[str, str] | None,
    ) -> tuple[bytes, tuple[str, ...], bytes, bytes]:
        """Validate one message: ``(topic bytes, light queues, INNER_* template, props)``."""
        if len(body) > self._max_body:
            raise MessageTooLargeError(len(body), self._max_body)
        tb = self._valid.get(topic)
        if tb is None:
            tb = self._check_name(topic, topic=True)
        if queues:
            key = queues if isinstance(queues, tuple) else tuple(queues)
            qs = self._queue_sets.get(key)
            if qs is None or (qs[0][0] is not topic and topic in qs[0]):
                qs = self._check_queue_set(topic, key)
            lights, qbytes = qs
        else:
            lights, qbytes = (), b""
        props = self._encode_props(properties) if properties else b""
        return tb, lights, qbytes, props

    def _check_queue_set(self, topic: str, key: tuple[str, ...]) -> tuple[tuple[str, ...], bytes]:
        for q in key:
            if q not in self._valid:
                self._check_name(q, topic=False)
        lights = tuple(dict.fromkeys(key))
        if topic in lights:
            raise InvalidQueueNameError(topic, "a light queue may not be the parent topic")
        # INNER_MULTI_DISPATCH is fixed for a queue set; only the offsets vary per message.
        template = b"".join((
            DISPATCH_PREFIX, ",".join(lights).encode("utf-8").replace(b"%", b"%%"), b"\x02",
            QOFFSET_PREFIX, b",".join([b"%d"] * len(lights)), b"\x02",
        ))  # fmt: skip
        qs = (lights, template)
        if len(self._queue_sets) >= _VALID_CACHE_LIMIT:
            self._queue_sets.clear()
        self._queue_sets[key] = qs
        return qs

    def _append_locked(
        self,
        topic: str,
        tb: bytes,
        body: bytes,
        lights: tuple[str, ...],
        qbytes: bytes,
        uprops: bytes,
        born: int,
        now: int,
    ) -> PutResult:
        """Assign every offset, append the record and dispatch its units. Lock held.

        This is the hot path: consume-queue states are touched directly rather than through
        ConsumeQueueTable methods (same logic as ConsumeQueueTable.append).
        """
        table = self.queues_table
        cache = table.states
        parent = cache.get(topic) or table.get_or_create(topic)
        qoff = parent.max_offset
        if lights:
            cqs = [cache.get(q) or table.get_or_create(q) for q in lights]
            loffs = [cq.max_offset for cq in cqs]
            props = uprops + qbytes % tuple(loffs)
        else:
            cqs = []
            loffs = []
            props = uprops
        if len(props) > _MAX_USER_PROPS:
            raise InvalidPropertyError(f"properties of {len(props)} bytes are too long")
        size = _RECORD_OVERHEAD + len(body) + len(tb) + len(props)
        view, rel, phys = self.commitlog.reserve(size)
        write_record(view, rel, tb, body, props, qoff, phys, born, now)
        unit = _pack_unit(phys, size, 0)
        dirty = table.dirty
        if not parent.pending:
            dirty[topic] = parent
        parent.pending += unit
        parent.max_offset = qoff + 1
        self._units_total += 1 + len(cqs)
        for cq in cqs:
            if not cq.pending:
                dirty[cq.name] = cq
            cq.pending += unit
            cq.max_offset += 1
        return PutResult(
            phys,
            qoff,
            dict(zip(lights, loffs, strict=False)) if lights else {},
            phys + size,
            now,
        )

    def _notify(self, topic: str, r: PutResult) -> None:
        for listener in self._listeners:
            try:
                listener.on_arrival(topic, r.queue_offset + 1)
                for q, o in r.light_offsets.items():
                    listener.on_arrival(q, o + 1)
            except Exception:
                log.exception("arrival listener %r failed", listener)

    def _append(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str],
        properties: dict[str, str] | None,
        born_timestamp: int | None,
    ) -> PutResult:
        if self._closed or self.read_only:
            self._check_writable()
        tb, lights, qbytes, uprops = self._prepare(topic, body, queues, properties)
        now = int(_time() * 1000)
        born = now if born_timestamp is None else born_timestamp
        with self._lock:
            if self._closed:
                raise StoreClosedError("store is closed")
            r = self._append_locked(topic, tb, body, lights, qbytes, uprops, born, now)
            self._last_store_ts = now
            table = self.queues_table
            if len(table.states) > table.max_cached:
                table.evict_overflow()
        if self._lock_wanted:
            time.sleep(0)
        if self._listeners:
            self._notify(topic, r)
        return r

    def put(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str] = (),
        properties: dict[str, str] | None = None,
        born_timestamp: int | None = None,
    ) -> PutResult:
        """Append a message to ``topic``'s queue and every light queue in ``queues``.

        In sync flush mode returns only after the fsync covering the message.
        """
        r = self._append(topic, body, queues, properties, born_timestamp)
        if self._sync and self._flusher is not None:
            self._flusher.wait_flushed(r.end_offset)
        return r

    async def put_async(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str] = (),
        properties: dict[str, str] | None = None,
        born_timestamp: int | None = None,
    ) -> PutResult:
        """put() for event loops: appends now, awaits the group-commit fsync in sync mode."""
        r = self._append(topic, body, queues, properties, born_timestamp)
        if self._sync and self._flusher is not None:
            await self._flusher.flushed_future(r.end_offset)
        return r

    def _append_many(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        if self._closed or self.read_only:
            self._check_writable()
        prepared = [(r, *self._prepare(r.topic, r.body, r.queues, r.properties)) for r in requests]
        results: list[PutResult] = []
        now = _now_ms()
        with self._lock:
            if self._closed:
                raise StoreClosedError("store is closed")
            append = self._append_locked
            for req, tb, lights, qbytes, uprops in prepared:
                born = now if req.born_timestamp is None else req.born_timestamp
                results.append(append(req.topic, tb, req.body, lights, qbytes, uprops, born, now))
            self._last_store_ts = now
            table = self.queues_table
            if len(table.states) > table.max_cached:
                table.evict_overflow()
        if self._lock_wanted:
            time.sleep(0)
        if self._listeners:
            latest: dict[str, int] = {}
            for req, r in zip(requests, results, strict=True):
                latest[req.topic] = r.queue_offset + 1
                for q, o in r.light_offsets.items():
                    latest[q] = o + 1
            for listener in self._listeners:
                for q, m in latest.items():
                    try:
                        listener.on_arrival(q, m)
                    except Exception:
                        log.exception("arrival listener %r failed", listener)
        return results

    def put_many(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Append a batch under one lock acquisition (one fsync wait in sync mode).

        Validation happens before anything is written: a bad request fails the whole batch.
        Listeners hear once per queue with its final max offset.
        """
        results = self._append_many(requests)
        if results and self._sync and self._flusher is not None:
            self._flusher.wait_flushed(results[-1].end_offset)
        return results

    async def put_many_async(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        results = self._append_many(requests)
        if results and self._sync and self._flusher is not None:
            await self._flusher.flushed_future(results[-1].end_offset)
        return results

    # =========================================================================================
    # listeners
    # =========================================================================================
    def add_listener(self, listener: ArrivalListener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: ArrivalListener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    # =========================================================================================
    # reading
    # =========================================================================================
    def _lookup(self, queue: str) -> ConsumeQueue | None:
        if self._closed:
            raise StoreClosedError("store is closed")
        if not isinstance(queue, str) or not queue:
            return None
        try:
            return self.queues_table.lookup(queue)
        except ValueError:  # not encodable: cannot exist
            return None

    def _decode_at(self, phys: int, size: int, queue_offset: int) -> StoredMessage | None:
        """Decode the record a unit points at (trusted: validated by recovery or written here)."""
        seg = self.commitlog.segment_for(phys)
        if seg is None or size <= 0 or phys + size > self.commitlog.write_pos:
            return None
        mv = seg.view
        rel = phys - seg.start
        poff, born, store_ts, blen = _READ_FIELDS(mv, rel)
        p = rel + HEADER_SIZE + blen
        tlen = mv[p]
        rest = bytes(mv[p + 1 : rel + size - CRC_TRAILER_SIZE])
        topic_b = rest[:tlen]
        topic = self._topic_names.get(topic_b)
        if topic is None:
            topic = self._topic_names.setdefault(topic_b, topic_b.decode("utf-8"))
        raw = rest[tlen + 2 :]
        queues: tuple[str, ...] = ()
        if raw:
            # The store's INNER_* pair is last; user properties (if any) come before it.
            i = raw.rfind(DISPATCH_PREFIX)
            if i >= 0 and (i == 0 or raw[i - 1] == 2):
                j = raw.index(b"\x02", i)
                qb = raw[i + len(DISPATCH_PREFIX) : j]
                cached = self._queue_tuples.get(qb)
                if cached is None:
                    if len(self._queue_tuples) >= _VALID_CACHE_LIMIT:
                        self._queue_tuples.clear()
                    cached = self._queue_tuples[qb] = tuple(qb.decode("utf-8").split(","))
                queues = cached
                raw = raw[:i]
            props = _parse_user_props(raw) if raw else {}
        else:
            props = {}
        return StoredMessage(
            topic, bytes(mv[rel + HEADER_SIZE : rel + HEADER_SIZE + blen]), props, queue_offset,
            phys, store_ts, born, poff, queues,
        )  # fmt: skip

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        """Read up to ``max_messages`` from ``queue`` starting at ``offset``."""
        with self._lock:
            cq = self._lookup(queue)
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
            data = self.queues_table.read_units(cq, offset, max(1, max_messages))
            msgs: list[StoredMessage] = []
            decode = self._decode_at
            i = offset
            for phys, size, _tag in CQ_UNIT.iter_unpack(data[: len(data) // 20 * 20]):
                m = decode(phys, size, i)
                if m is not None:
                    msgs.append(m)
                i += 1
            if len(self.queues_table.states) > self.queues_table.max_cached:
                self.queues_table.evict_overflow()
        if not msgs and i == offset:
            # The unit could not be read (file damaged underneath us): skip nothing, report.
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, lo, hi)
        return GetResult(GetStatus.FOUND, msgs, i, lo, hi)

    def message_at(self, physical_offset: int) -> StoredMessage:
        """The record at ``physical_offset`` (validated); StoreError if there is none."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("store is closed")
            seg = self.commitlog.segment_for(physical_offset)
            if seg is None or physical_offset >= self.commitlog.write_pos:
                raise StoreError(f"no message at offset {physical_offset}")
            rel = physical_offset - seg.start
            size = check_record(seg.view, rel, seg.size)
            if size <= 0:
                raise StoreError(f"no message at offset {physical_offset}")
            m = self._decode_at(physical_offset, size, 0)
            if m is None:
                raise StoreError(f"no message at offset {physical_offset}")
            return StoredMessage(
                m.topic, m.body, m.properties, m.parent_offset, m.physical_offset,
                m.store_timestamp, m.born_timestamp, m.parent_offset, m.queues,
            )  # fmt: skip

    def min_offset(self, queue: str) -> int:
        with self._lock:
            cq = self._lookup(queue)
            return 0 if cq is None else cq.min_offset

    def max_offset(self, queue: str) -> int:
        """Next offset to be written in ``queue`` (0 for an unknown queue)."""
        with self._lock:
            cq = self._lookup(queue)
            return 0 if cq is None else cq.max_offset

    def queues(self) -> list[str]:
        """Names of every queue the store knows (parent topics and light queues)."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("store is closed")
            return self.queues_table.names()

    def _store_ts_at(self, cq: ConsumeQueue, offset: int) -> int:
        u = self.queues_table.unit_at(cq, offset)
        if u is None:
            return -1
        seg = self.commitlog.segment_for(u[0])
        if seg is None:
            return -1
        return int(INT64.unpack_from(seg.view, u[0] - seg.start + OFF_STORETIMESTAMP)[0])

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int:
        """First offset whose store timestamp is >= ``timestamp_ms`` (max_offset if none)."""
        with self._lock:
            cq = self._lookup(queue)
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

    @property
    def log_min_offset(self) -> int:
        return self.commitlog.min_offset

    @property
    def log_max_offset(self) -> int:
        """End of the CommitLog (next physical offset)."""
        return self.commitlog.write_pos

    def refresh(self) -> int:
        """Read-only stores: pick up records a live writer appended since; returns the end."""
        with self._lock:
            if self.read_only:
                end, _n, _bad = scan_log(self.commitlog, self.commitlog.write_pos)
                self.commitlog.write_pos = end
                for cq in self.queues_table.cached():
                    fresh = self.queues_table._load(cq.name)
                    if fresh is not None:
                        cq.flushed = cq.max_offset = fresh.flushed
            return self.commitlog.write_pos

    # =========================================================================================
    # config files
    # =========================================================================================
    def _config_path(self, name: str) -> Path:
        if not name or "/" in name or name in (".", "..") or "\x00" in name:
            raise StoreError(f"invalid config file name {name!r}")
        return self.config_dir / name

    def write_config(self, name: str, data: bytes) -> None:
        """Replace ``config/<name>`` atomically (temp + fsync + rename + directory fsync)."""
        from store.atomicfile import write_atomic

        self._check_writable()
        write_atomic(self._config_path(name), data)

    def read_config(self, name: str) -> bytes | None:
        """Content of ``config/<name>``, or None if it does not exist."""
        try:
            return self._config_path(name).read_bytes()
        except FileNotFoundError:
            return None

    def config_files(self) -> Iterable[str]:
        return sorted(p.name for p in self.config_dir.glob("*") if not p.name.endswith(".tmp"))
