"""MessageStore: the facade over CommitLog, consume queues, recovery, flushing and offsets.

Thread-safety: every method may be called from any thread. One lock (``_lock``) serialises
appends, dispatch, reads of consume-queue state and segment deletion; the flusher thread
fsyncs without it. Arrival listeners run after the lock is released, in the putting thread.

Dispatch happens inside the append critical section: the parent queue offset, every light
queue offset and the physical offset are assigned together (rocketmq #7511 lost messages
when they were not), so a get right after put sees the message.

Writing: three entry points, append_encoded for batches (_append_batch) and put and
put_async for one message (_put: the same checks without the batch loop), both ending in
``_append``. A message resolves its (topic, light queues) pair through a
cached ``_Route`` (names validated once, INNER_* property head, queue states) and is validated
against worst-case sizes before the lock. Under it, ``_write_locked`` hands out the offsets;
the layers do the rest: the record step (format.append_record, in C when store/_speedups.c is
built) builds each record into the CommitLog's BatchWriter (one write per batch, rolls), and
consumequeue.dispatch adds its units, the same dispatch recovery uses. Reading: a get
decodes records straight from the segment mmap without re-checking CRCs (recovery validates;
this process wrote the rest). Both build their NamedTuple results with ``tuple.__new__``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from store.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from store.commitlog import BatchWriter, CommitLog
from store.config import FlushMode, StoreConfig
from store.consumequeue import ConsumeQueue, ConsumeQueueTable, dispatch
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
    CQ_UNIT_SIZE,
    CRC_TRAILER_SIZE,
    FIXED_OVERHEAD,
    HEADER_SIZE,
    LOCK_FILE,
    MAX_PROPERTIES_BYTES,
    MAX_TOPIC_BYTES,
    MULTI_DISPATCH_SEPARATOR,
    PROP_CRC32,
    READ_FIELDS,
    RESERVED_PROPERTIES,
    STORE_TIMESTAMP,
    append_record,
    check_record,
    encode_queue_dir,
    inner_dispatch,
    inner_head,
)
from store.kernel import load as load_kernel
from store.offsets import OFFSETS_DIR, OFFSETS_FILE, ConsumerOffsets
from store.recovery import RecoveryReport, recover, scan_log
from store.results import (
    ArrivalListener,
    GetResult,
    GetStatus,
    PutResult,
    StoredMessage,
)
from store.retention import apply_retention
from store.segment import fsync_dir
from store.statelog import STATE_DIR, StateLog, StateRecord, read_state_records

log = logging.getLogger("lmqtt.store")

_FORBIDDEN_NAME_CHARS = frozenset(",\x00\x01\x02")
_VALID_CACHE_LIMIT = 200_000
_RECORD_OVERHEAD = FIXED_OVERHEAD + CRC_TRAILER_SIZE
_MAX_USER_PROPS = MAX_PROPERTIES_BYTES - CRC_TRAILER_SIZE
_pack_unit = CQ_UNIT.pack
_time = time.time


_record_kernel = load_kernel()
_run_kernel = load_kernel("LMQTT_PURE_PYTHON_APPEND")
#: The record step: store/_speedups.c's append_record, or its reference format.append_record.
_append_record: Callable[..., int] = getattr(_record_kernel, "append_record", append_record)
SPEEDUPS = _append_record is not append_record


def write_run_py(
    batch: list[_Prepared],
    i: int,
    now: int,
    buf: bytearray,
    limit: int,
    state: list[int],
    generation: int,
    dirty: dict[str, ConsumeQueue],
    results: list[PutResult],
    put_result: type[PutResult],
) -> int:
    """MessageStore._write_locked's common case: from ``batch[i]`` on, while a message's
    route is resolved for ``generation`` and its record fits before ``limit``, append the
    record, dispatch its unit to the route's queues (consumequeue.dispatch) and add its
    PutResult to ``results``; return the index of the first message left (a route to resolve
    again, a record for the next segment). ``state`` = [next physical offset, units
    dispatched] is written back on every exit, errors included. The reference of
    store/_speedups.c ``write_run``, which must give the same bytes, queues and results
    (tests/store/test_write_run.py)."""
    phys, units = state
    n = len(batch)
    try:
        while i < n:
            route, body, uprops, born = batch[i]
            if route.generation != generation:
                break
            qoff = route.parent.max_offset
            lo: dict[str, int] = {}
            for cq in route.cqs:
                lo[cq.name] = cq.max_offset
            size = _append_record(
                buf, limit - phys, qoff, phys, now if born is None else born, now, body,
                route.topic_field, uprops, route.inner_head, tuple(lo.values()),
            )  # fmt: skip
            if size < 0:
                break
            dispatch(route.queues, _pack_unit(phys, size, 0), dirty)
            units += route.units
            end = phys + size
            results.append(_tuple_new(put_result, (phys, qoff, lo, end, now)))
            phys = end
            i += 1
    finally:
        state[0] = phys
        state[1] = units
    return i


def prepare_run_py(
    messages: list[EncodedMessage],
    i: int,
    routes: dict[tuple[str, tuple[str, ...]], _Route],
    max_body: int,
    born: int | None,
    batch: list[_Prepared],
    touched: dict[_Route, None],
) -> int:
    """MessageStore._append_batch's validation loop, its common case: from ``messages[i]``
    on, while a message's route is cached and its body and properties fit the route's
    worst-case room and ``max_body``, append (route, body, block, born) to ``batch`` and mark
    the route in ``touched``; return the index of the first message left (the caller routes
    it or checks it in full, and raises what it must). The reference of store/_speedups.c
    ``prepare_run``."""
    n = len(messages)
    while i < n:
        topic, lights, body, uprops = messages[i]
        route = routes.get((topic, lights))
        if route is None:
            break
        blen = len(body)
        plen = len(uprops)
        if blen > max_body or blen + plen > route.size_room or plen > route.props_room:
            break
        batch.append((route, body, uprops, born))
        touched[route] = None
        i += 1
    return i


#: The two loops' common cases: store/_speedups.c's, or their references above. LMQTT_PURE_PYTHON
#: (every accelerator) or LMQTT_PURE_PYTHON_APPEND (this path's, for A/B runs) keep these.
_write_run: Callable[..., int] = getattr(_run_kernel, "write_run", write_run_py)
_prepare_run: Callable[..., int] = getattr(_run_kernel, "prepare_run", prepare_run_py)
#: Builds PutResult / StoredMessage without the Python-level NamedTuple __new__ (one call
#: less per message on the hot paths); same type, same fields.
_tuple_new = tuple.__new__
_MAX_OFFSET = (1 << 63) - 1
#: Consume-queue files, consumer offsets and the checkpoint are flushed at most this often
#: (RocketMQ: flushIntervalConsumeQueue = 1 s); the CommitLog, the only truth, every
#: flush_interval_ms. Each full flush fsyncs one file per queue written since the last, so
#: doing it every 200 ms with a thousand busy queues cost more CPU than the appends.
_FULL_FLUSH_INTERVAL_S = 1.0
# Each full flush unmaps the CommitLog pages more than this far behind the write position
# (RSS, not data: Segment.release). Pages near the end stay mapped: the writer is filling
# them and readers that keep up read them; older ones cost a minor fault if read again.
MAPPED_TAIL_BYTES = 8 << 20
_FSYNC_THREADS = 8
_READ_FIELDS = READ_FIELDS.unpack_from
_iter_units = CQ_UNIT.iter_unpack


def _fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # deleted since (retention): nothing to make durable
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_paths(paths: list[str]) -> None:
    for path in paths:
        _fsync_path(path)


def _parse_user_props(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in raw.decode("utf-8")[:-1].split("\x02"):
        k, _, v = pair.partition("\x01")
        if k != PROP_CRC32:
            out[k] = v
    return out


class _Route:
    """What every put to one (topic, light queues) pair shares, worked out once.

    Names are validated when the route is made. ``inner_head`` is the INNER_* property pair
    up to the light-queue offsets (only they vary per message). ``parent`` and
    ``cqs`` are the ConsumeQueue states, resolved under the store lock and re-resolved when
    the table's ``generation`` moved (a state was evicted and may come back as a new object).
    """

    __slots__ = (
        "cqs", "fixed_size", "generation", "inner_head", "lights", "max_inner", "parent",
        "props_room", "queues", "size_room", "topic", "topic_field", "units",
    )  # fmt: skip

    def __init__(
        self, topic: str, topic_bytes: bytes, lights: tuple[str, ...], max_record: int
    ) -> None:
        self.topic = topic
        self.lights = lights
        #: TOPICLENGTH + TOPIC, as they follow the body in the record.
        self.topic_field = bytes((len(topic_bytes),)) + topic_bytes
        #: Record size without body and properties (those vary per message).
        self.fixed_size = _RECORD_OVERHEAD + len(topic_bytes)
        self.units = 1 + len(lights)
        #: The INNER_* properties up to the offsets: DISPATCH \x01 q1,q2 \x02 QOFFSET \x01;
        #: append_record adds "o1,o2" \x02.
        self.inner_head = inner_head(lights)
        #: Longest the INNER_* pair can get (19-digit offsets, commas, \x02): a message whose
        #: properties fit with it always fits, so size errors are raised before anything is
        #: written.
        self.max_inner = len(self.inner_head) + len(lights) * (len(str(_MAX_OFFSET)) + 1)
        #: Room left for user properties, and for body plus user properties, in the worst
        #: case: one comparison each per message; _check_size says what was exceeded.
        self.props_room = _MAX_USER_PROPS - self.max_inner
        self.size_room = max_record - self.fixed_size - self.max_inner
        self.generation = -1  # never resolved
        self.parent: ConsumeQueue
        self.cqs: tuple[ConsumeQueue, ...] = ()
        #: The parent then the light queues: every queue a record of this route joins.
        self.queues: tuple[ConsumeQueue, ...] = ()

    def resolve(self, table: ConsumeQueueTable) -> None:
        self.parent = table.get_or_create(self.topic)
        self.cqs = tuple([table.get_or_create(q) for q in self.lights])
        self.queues = (self.parent, *self.cqs)
        self.generation = table.generation


#: A validated message waiting for the lock: (route, body, user properties, born timestamp).
_Prepared = tuple[_Route, bytes, bytes, "int | None"]
#: One message of :meth:`MessageStore.append_encoded`: (topic, light queues, body, property
#: block from :meth:`MessageStore.encode_properties`).
EncodedMessage = tuple[str, tuple[str, ...], bytes, bytes]


class MessageStore:
    """An embedded CommitLog store with light message queues. Create with :meth:`open`."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.config_dir = self.data_dir / CONFIG_DIR
        self.read_only = config.read_only
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._fsync_pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock_fd: int | None = None
        self._listeners: tuple[ArrivalListener, ...] = ()
        self._routes: dict[tuple[str, tuple[str, ...]], _Route] = {}
        self._topic_names: dict[bytes, str] = {}
        self._queue_tuples: dict[bytes, tuple[str, ...]] = {}
        self._last_store_ts = 0
        self._units_total = 0
        self._lock_wanted = False
        self._released_to = 0  # CommitLog end at the last Segment.release pass
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
        self.offsets = ConsumerOffsets(
            self.data_dir / OFFSETS_DIR, self.config_dir / OFFSETS_FILE, read_only=config.read_only
        )
        self.recovery = RecoveryReport(abnormal=False)
        self._flusher: Flusher | None = None
        # The users' durable state (statelog.py): its own directory, beyond CommitLog retention.
        self.state_dir = self.data_dir / STATE_DIR
        self.state: StateLog | None = None

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
            self.state = StateLog.open(self.state_dir)
        self.offsets.load()
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
        fd = os.open(abort, os.O_WRONLY | os.O_CREAT, 0o644)
        os.fsync(fd)
        os.close(fd)
        fsync_dir(self.data_dir)
        self._flusher = Flusher(
            flush_log=self._flush_log,
            flush_all=self._flush_all,
            maintain=self._maintain,
            sync=self._sync,
            interval_s=self.config.flush_interval_ms / 1000,
            full_interval_s=max(self.config.flush_interval_ms / 1000, _FULL_FLUSH_INTERVAL_S),
            maintain_interval_s=self.config.retention_check_interval_s,
            timeout_s=self.config.sync_flush_timeout_ms / 1000,
        )
        # After an abnormal recovery the first full flush (rebuilt queue files, checkpoint)
        # runs at once, in the flusher thread: fsyncing tens of MB of rebuilt units need not
        # hold up open(). A crash before it completes recovers from the old checkpoint again.
        self._flusher.start(self.commitlog.flushed_pos, full_flush_now=self.recovery.abnormal)

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
        if self._fsync_pool is not None:
            self._fsync_pool.shutdown()
            self._fsync_pool = None
        self.commitlog.close()
        self.queues_table.close()
        if self.state is not None:
            self.state.close()
        self.offsets.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

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
            fsync_dir(self.data_dir)
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
        if end - self._released_to >= MAPPED_TAIL_BYTES:
            self._release_mapped(end)  # a fast writer: do not wait for the full flush
        return end

    def _release_mapped(self, end: int) -> None:
        """Unmap CommitLog pages more than MAPPED_TAIL_BYTES behind ``end`` (RSS only)."""
        with self._lock:  # segments are closed (retention, close) only under it
            if not self._closed:
                self.commitlog.release_mapped(end - MAPPED_TAIL_BYTES)
                self._released_to = end

    def _flush_all(self) -> int:
        """Consume-queue units, CommitLog, fsyncs, consumer offsets, checkpoint.

        Serialised: flush() from a caller and the flusher thread would otherwise race on the
        checkpoint's temp file (and could write an older checkpoint over a newer one).
        """
        with self._flush_lock:
            return self._flush_all_serialised()

    def _flush_all_serialised(self) -> int:
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
        if self.state is not None:
            self.state.sync()  # async flush mode's bound on state changes lost to a power cut
        # Also lets go of pages readers faulted in (a backlog being drained) since the last one.
        self._release_mapped(end)
        unique = list(dict.fromkeys(paths))
        if len(unique) > 1:
            # One fsync per queue file written. Issued from several threads at once the file
            # system folds them into shared journal commits: 1,000 files take ~0.1 s instead
            # of ~1 s one after the other (ext4), which kept the checkpoint seconds behind.
            # One task per thread, each fsyncing its share in turn: as many fsyncs in
            # flight, without a Future (lock, condition) per file.
            if self._fsync_pool is None:
                self._fsync_pool = ThreadPoolExecutor(_FSYNC_THREADS, "lmqtt-store-fsync")
            shares = [unique[i::_FSYNC_THREADS] for i in range(min(_FSYNC_THREADS, len(unique)))]
            list(self._fsync_pool.map(_fsync_paths, shares))
        elif unique:
            _fsync_path(unique[0])
        self.offsets.persist()
        write_checkpoint(
            self.data_dir / CHECKPOINT_FILE,
            Checkpoint(end, end, ts, ts, units),
        )
        return end

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
                retention_bytes=self.config.retention_bytes, now=now, data_dir=self.data_dir,
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
    def _new_route(self, key: tuple[str, tuple[str, ...]]) -> _Route:
        """Validate a (topic, light queues) pair seen for the first time and cache its route."""
        topic, queues = key
        tb = self._check_name(topic, topic=True)
        for q in queues:
            self._check_name(q, topic=False)
        lights = tuple(dict.fromkeys(queues))
        if topic in lights:
            raise InvalidQueueNameError(topic, "a light queue may not be the parent topic")
        route = _Route(topic, tb, lights, self.commitlog.max_record_size())
        if len(self._routes) >= _VALID_CACHE_LIMIT:
            self._routes.clear()
        self._routes[key] = route
        return route

    def _check_size(self, route: _Route, body_len: int, props_len: int) -> None:
        """Refuse a message that could exceed the property or segment limits once written."""
        props_len += route.max_inner
        if props_len > _MAX_USER_PROPS:
            raise InvalidPropertyError(f"properties of up to {props_len} bytes are too long")
        size = route.fixed_size + body_len + props_len
        if size > self.commitlog.max_record_size():
            raise MessageTooLargeError(size, self.commitlog.max_record_size())

    def _write_locked(self, batch: Sequence[_Prepared], now: int) -> list[PutResult]:
        """Assign every offset, append the records and dispatch their units. Lock held.

        The layers: the CommitLog's BatchWriter places the records (segment, roll, one write
        per batch), the record step ``_append_record`` builds each one (store/_speedups.c, or
        its Python reference format.append_record: the same bytes), and the dispatch
        rule consumequeue.dispatch gives it a unit in its parent and light queues. The common case
        of this loop, a run of records that fit in the segment on routes resolved already, is
        ``_write_run`` (store/_speedups.c ``write_run``, or its reference ``write_run_py``);
        the record it stops at (a route to resolve, a segment to roll) is done here. Sizes
        were checked against the worst case when the batch was prepared, so nothing here
        should fail; should it anyway, each record is complete in the buffer before its
        queues move and ``finally`` writes out the records whose queues moved, leaving those
        written and dispatched.
        """
        table = self.queues_table
        gen = table.generation
        results: list[PutResult] = []
        writer = self.commitlog.batch()
        state = [writer.start, 0]  # next physical offset, units dispatched
        items = batch if type(batch) is list else list(batch)
        n = len(items)
        i = 0
        try:
            while True:
                i = _write_run(
                    items, i, now, writer.buf, writer.limit, state, gen, table.dirty, results,
                    PutResult,
                )  # fmt: skip
                if i >= n:
                    break
                self._write_one(writer, items[i], now, gen, state, results)
                i += 1
        finally:
            writer.finish(state[0])
            self._units_total += state[1]
        return results

    def _write_one(
        self,
        writer: BatchWriter,
        item: _Prepared,
        now: int,
        gen: int,
        state: list[int],
        results: list[PutResult],
    ) -> None:
        """One record of _write_locked that ``_write_run`` left: resolve its route, or roll
        to the next segment for it."""
        table = self.queues_table
        route, body, uprops, born = item
        if route.generation != gen:
            route.resolve(table)
        phys = state[0]
        qoff = route.parent.max_offset
        # The light offsets, as PutResult reports them (a queue's name is its key).
        lo: dict[str, int] = {}
        for cq in route.cqs:
            lo[cq.name] = cq.max_offset
        stamp = now if born is None else born
        size = _append_record(
            writer.buf, writer.limit - phys, qoff, phys, stamp, now, body, route.topic_field,
            uprops, route.inner_head, tuple(lo.values()),
        )  # fmt: skip
        if size < 0:
            phys = state[0] = writer.roll(
                phys, route.fixed_size + len(body) + len(uprops) + route.max_inner
            )
            size = _append_record(
                writer.buf, writer.limit - phys, qoff, phys, stamp, now, body,
                route.topic_field, uprops, route.inner_head, tuple(lo.values()),
            )  # fmt: skip
            if size < 0:  # unreachable: _check_size saw the worst case
                raise MessageTooLargeError(route.fixed_size + len(body), writer.limit - phys)
        dispatch(route.queues, _pack_unit(phys, size, 0), table.dirty)
        state[1] += route.units
        end = phys + size
        results.append(_tuple_new(PutResult, (phys, qoff, lo, end, now)))
        state[0] = end

    def _append(self, batch: Sequence[_Prepared]) -> list[PutResult]:
        """Write a prepared batch under one lock acquisition."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("store is closed")
            # Taken under the lock and never decreasing, so store timestamps follow the log
            # order (offset_by_time bisects on them) even if the wall clock steps back.
            now = int(_time() * 1000)
            if now < self._last_store_ts:
                now = self._last_store_ts
            self._last_store_ts = now
            table = self.queues_table
            try:
                results = self._write_locked(batch, now)
            finally:
                if len(table.states) > table.max_cached:
                    table.evict_overflow()
        if self._lock_wanted:
            # A full flush waits for the lock: let it have it before our next put.
            time.sleep(0)
        return results

    # The entry points: append_encoded (batches: the gateway's publishes), put and put_async
    # (one message, waiting for its durability). All three go through _append_batch.
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
        r = self._put(topic, body, queues, properties, born_timestamp)
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
        r = self._put(topic, body, queues, properties, born_timestamp)
        if self._sync and self._flusher is not None:
            await self._flusher.flushed_future(r.end_offset)
        return r

    def _put(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str],
        properties: dict[str, str] | None,
        born_timestamp: int | None,
    ) -> PutResult:
        if self._closed or self.read_only:
            self._check_writable()
        uprops = self._encode_props(properties) if properties else b""
        key = (topic, queues if type(queues) is tuple else tuple(queues))
        route = self._routes.get(key) or self._new_route(key)
        # _append_batch's checks for a batch of one, without its loop: one message per call
        # is the path of retained messages and wills, and of tools.
        blen = len(body)
        if blen > self._max_body:
            raise MessageTooLargeError(blen, self._max_body)
        if blen + len(uprops) > route.size_room or len(uprops) > route.props_room:
            self._check_size(route, blen, len(uprops))
        r = self._append(((route, body, uprops, born_timestamp),))[0]
        if self._listeners:
            self._notify((route,))
        return r

    def encode_properties(self, properties: dict[str, str]) -> bytes:
        """Validate and encode user properties once, for :meth:`append_encoded`.

        The result is a run of ``key \x01 value \x02`` pairs; the concatenation of several
        such blocks (with distinct keys) is again one.
        """
        return self._encode_props(properties)

    def append_encoded(self, messages: Sequence[EncodedMessage]) -> list[PutResult]:
        """Append a batch of ``(topic, light queues, body, property block)`` under one lock.

        The hot path of a publisher flood: the property blocks come from
        :meth:`encode_properties` (validated once per distinct block by the caller, not per
        message), ``light queues`` is a tuple. Nothing waits for the fsync, in either flush
        mode: a caller that must (sync mode) awaits :meth:`wait_durable` with the last
        result's ``end_offset``. Sizes and names are checked before anything is written, so
        an error (StoreError) means none of the batch was stored. Listeners hear once per
        queue touched, after the whole batch.
        """
        if self._closed or self.read_only:
            self._check_writable()
        return self._append_batch(messages, None)

    def _append_batch(
        self, messages: Sequence[EncodedMessage], born: int | None
    ) -> list[PutResult]:
        """Validate (before the lock), append, then tell the listeners; ``born`` is the born
        timestamp of every message (None: the store timestamp). _put does the same for one."""
        routes = self._routes
        max_body = self._max_body
        batch: list[_Prepared] = []
        touched: dict[_Route, None] = {}
        items = messages if type(messages) is list else list(messages)
        n = len(items)
        i = 0
        while True:
            i = _prepare_run(items, i, routes, max_body, born, batch, touched)
            if i >= n:
                break
            topic, lights, body, uprops = items[i]  # a new route, or a size to check in full
            route = routes.get((topic, lights))
            if route is None:
                route = self._new_route((topic, tuple(lights)))
            blen = len(body)
            if blen > max_body:
                raise MessageTooLargeError(blen, max_body)
            if blen + len(uprops) > route.size_room or len(uprops) > route.props_room:
                self._check_size(route, blen, len(uprops))
            touched[route] = None
            batch.append((route, body, uprops, born))
            i += 1
        results = self._append(batch)
        if self._listeners:
            self._notify(touched)
        return results

    def _notify(self, routes: Iterable[_Route]) -> None:
        """Tell the listeners where the queues of ``routes`` end, once per queue.

        Queue ends are read after the lock: later puts only move them further, and a
        listener is told "ends at least here", once per queue for the whole batch.
        """
        ends: dict[str, int] = {}
        for route in routes:
            ends[route.topic] = route.parent.max_offset
            for cq in route.cqs:
                ends[cq.name] = cq.max_offset
        for listener in self._listeners:
            try:
                for q, m in ends.items():
                    listener.on_arrival(q, m)
            except Exception:
                log.exception("arrival listener %r failed", listener)

    async def wait_durable(self, end_offset: int) -> None:
        """Sync flush mode: return once the CommitLog is fsynced up to ``end_offset`` (group
        commit, the event loop keeps running). Async mode: return at once."""
        if self._sync and self._flusher is not None:
            await self._flusher.flushed_future(end_offset)

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

    def _topic_name(self, raw: bytes) -> str:
        names = self._topic_names
        if len(names) >= _VALID_CACHE_LIMIT:
            names.clear()
        name = names[raw] = raw.decode("utf-8")
        return name

    def _queue_tuple(self, raw: bytes) -> tuple[str, ...]:
        tuples = self._queue_tuples
        if len(tuples) >= _VALID_CACHE_LIMIT:
            tuples.clear()
        queues = tuples[raw] = tuple(raw.decode("utf-8").split(MULTI_DISPATCH_SEPARATOR))
        return queues

    def _decode_units(self, units: bytes, offset: int) -> tuple[list[StoredMessage], int]:
        """Messages the consume-queue ``units`` point at; ``offset`` is the first unit's.

        Returns the messages and the offset after the last unit looked at. Records are
        trusted (validated by recovery or written by this process), so there is no CRC check
        here. Theory: everything is read straight from the segment's mmap (slicing an mmap
        gives bytes in one copy, ``find``/``rfind`` search it in place), the segment is looked
        up only when a unit leaves the current one, topic names and INNER_MULTI_DISPATCH
        queue tuples come from caches keyed by their raw bytes, and a message without user
        properties (the common case: the store's INNER_* pair starts the property string)
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
            msgs, i = self._decode_units(data, offset)
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
            msgs, _ = self._decode_units(CQ_UNIT.pack(physical_offset, size, 0), 0)
            if not msgs:
                raise StoreError(f"no message at offset {physical_offset}")
            m = msgs[0]
            return m._replace(queue_offset=m.parent_offset)

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
        return int(STORE_TIMESTAMP.unpack_from(seg.view, u[0] - seg.start)[0])

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
    # state log (statelog.py)
    # =========================================================================================
    def state_records(self) -> Iterable[StateRecord]:
        """Every state record in log order (the newest of a key wins); works read-only."""
        return read_state_records(self.state_dir)

    def _state_log(self) -> StateLog:
        self._check_writable()
        assert self.state is not None
        return self.state

    def append_state(self, records: Iterable[StateRecord]) -> int:
        """Append state changes with one write; returns the position for sync_state()."""
        return self._state_log().append(records)

    def sync_state(self, position: int | None = None) -> None:
        """Block until the state log is on disk up to `position` (group commit)."""
        self._state_log().sync(position)

    def state_needs_compaction(self) -> bool:
        return self.state is not None and self.state.needs_compaction()

    def rewrite_state(self) -> None:
        """Compact the state log into a snapshot (blocking: run it in a thread)."""
        self._state_log().compact()

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
