"""MessageStore: the facade over the CommitLog, the consume queues and their parts.

It composes the append path (append.Appender: validation, the write-and-dispatch critical
section), the read path (reader.QueueReader), recovery at open (recovery.recover), flushing
(flush.Flusher, the thread, and flush.FileSync, what it makes durable), retention, consumer
offsets and the state log, and owns what ties them together: the data directory and its
lock file, the abort marker, open and close.

Thread-safety: every method may be called from any thread. One lock (``_lock``, handed to
the parts) serialises appends, dispatch, reads of consume-queue state and segment deletion;
the flusher thread fsyncs without it. Arrival listeners run after the lock is released, in
the putting thread.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from store.append import Appender, EncodedMessage
from store.atomicfile import fsync_dir, make_dirs, write_atomic
from store.checkpoint import read_checkpoint
from store.commitlog import CommitLog
from store.config import FlushMode, StoreConfig
from store.consumequeue import ConsumeQueueTable
from store.errors import (
    CorruptStoreError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from store.flush import FileSync, Flusher
from store.format import (
    ABORT_FILE,
    CHECKPOINT_FILE,
    COMMITLOG_DIR,
    CONFIG_DIR,
    CONSUMEQUEUE_DIR,
    LOCK_FILE,
)
from store.offsets import OFFSETS_DIR, OFFSETS_FILE, ConsumerOffsets
from store.reader import QueueReader
from store.recovery import RecoveryReport, recover, scan_log
from store.results import ArrivalListener, GetResult, PutResult, StoredMessage
from store.retention import apply_retention
from store.statelog import STATE_DIR, StateLog, StateRecord, read_state_records

#: Consume-queue files, consumer offsets and the checkpoint are flushed at most this often
#: (RocketMQ: flushIntervalConsumeQueue = 1 s); the CommitLog, the only truth, every
#: flush_interval_ms. Each full flush fsyncs one file per queue written since the last, which
#: with many busy queues costs more than the appends if done at the CommitLog's pace.
_FULL_FLUSH_INTERVAL_S = 1.0


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
        self._sync = config.flush == FlushMode.SYNC
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
        self._appender = Appender(
            self.commitlog, self.queues_table, self._lock, config.max_body_size
        )
        self._reader = QueueReader(self.commitlog, self.queues_table, self._lock)
        self.recovery = RecoveryReport(abnormal=False)
        self._files: FileSync | None = None  # writable stores, once open
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
            for d in (COMMITLOG_DIR, CONSUMEQUEUE_DIR, CONFIG_DIR):
                make_dirs(data_dir / d)
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
            # The zero tail where each acknowledgement waits for an fsync (statelog.py).
            self.state = StateLog.open(
                self.state_dir, preallocate=self.config.flush == FlushMode.SYNC
            )
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
        self._appender.units_total = self.recovery.units_total
        if self.read_only:
            return
        fd = os.open(abort, os.O_WRONLY | os.O_CREAT, 0o644)
        os.fsync(fd)
        os.close(fd)
        fsync_dir(self.data_dir)
        self._files = FileSync(
            commitlog=self.commitlog, table=self.queues_table, offsets=self.offsets,
            state=self.state, writer=self._appender, lock=self._lock,
            checkpoint_path=self.data_dir / CHECKPOINT_FILE,
        )  # fmt: skip
        self._flusher = Flusher(
            flush_log=self._files.flush_log,
            flush_all=self._files.flush_all,
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
        if self._files is not None:
            self._files.close()
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
            self._closed = self._appender.closed = self._reader.closed = True
        if self._flusher is not None:
            self._flusher.stop()
        if self._files is not None:
            end = self._files.flush_all()
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
    # flushing, retention
    # =========================================================================================
    @property
    def flushed_offset(self) -> int:
        """The CommitLog's end known durable (fsynced)."""
        return self.commitlog.flushed_pos

    def flush(self) -> None:
        """Force a full flush and checkpoint now."""
        self._check_writable()
        assert self._files is not None
        end = self._files.flush_all()
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

    def _check_writable(self) -> None:
        if self._closed:
            raise StoreClosedError("store is closed")
        if self.read_only:
            raise ReadOnlyStoreError("store was opened read-only")

    # =========================================================================================
    # writing (append.py)
    # =========================================================================================
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
        if self._closed or self.read_only:
            self._check_writable()
        r = self._appender.put(topic, body, queues, properties, born_timestamp)
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
        if self._closed or self.read_only:
            self._check_writable()
        r = self._appender.put(topic, body, queues, properties, born_timestamp)
        if self._sync and self._flusher is not None:
            await self._flusher.flushed_future(r.end_offset)
        return r

    def encode_properties(self, properties: dict[str, str]) -> bytes:
        """Validate and encode user properties once, for :meth:`append_encoded`.

        The result is a run of ``key \x01 value \x02`` pairs; the concatenation of several
        such blocks (with distinct keys) is again one.
        """
        return self._appender.encode_properties(properties)

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
        return self._appender.append(messages, None)

    async def wait_durable(self, end_offset: int) -> None:
        """Sync flush mode: return once the CommitLog is fsynced up to ``end_offset`` (group
        commit, the event loop keeps running). Async mode: return at once."""
        if self._sync and self._flusher is not None:
            await self._flusher.flushed_future(end_offset)

    def add_listener(self, listener: ArrivalListener) -> None:
        with self._lock:
            self._appender.listeners = (*self._appender.listeners, listener)

    def remove_listener(self, listener: ArrivalListener) -> None:
        with self._lock:
            listeners = self._appender.listeners
            self._appender.listeners = tuple(x for x in listeners if x is not listener)

    # =========================================================================================
    # reading (reader.py)
    # =========================================================================================
    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        """Read up to ``max_messages`` from ``queue`` starting at ``offset``."""
        return self._reader.get(queue, offset, max_messages)

    def message_at(self, physical_offset: int) -> StoredMessage:
        """The record at ``physical_offset`` (validated); StoreError if there is none."""
        return self._reader.message_at(physical_offset)

    def messages_since(self, physical_offset: int) -> Iterator[StoredMessage]:
        """The records from ``physical_offset`` (a record's start or an earlier log end) to
        the end of the log, in append order (recovery's scan of a tail)."""
        return self._reader.messages_since(physical_offset)

    def min_offset(self, queue: str) -> int:
        with self._lock:
            cq = self._reader.lookup(queue)
            return 0 if cq is None else cq.min_offset

    def max_offset(self, queue: str) -> int:
        """Next offset to be written in ``queue`` (0 for an unknown queue)."""
        with self._lock:
            cq = self._reader.lookup(queue)
            return 0 if cq is None else cq.max_offset

    def queues(self) -> list[str]:
        """Names of every queue the store knows (parent topics and light queues)."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("store is closed")
            return self.queues_table.names()

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int:
        """First offset whose store timestamp is >= ``timestamp_ms`` (max_offset if none)."""
        return self._reader.offset_by_time(queue, timestamp_ms)

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

    def rewrite_state(self, *, child: bool = False) -> None:
        """Compact the state log into a snapshot (blocking: run it in a thread); with
        `child`, its snapshot is written by a child process (statelog.py)."""
        self._state_log().compact(child=child)

    # =========================================================================================
    # config files
    # =========================================================================================
    def _config_path(self, name: str) -> Path:
        if not name or "/" in name or name in (".", "..") or "\x00" in name:
            raise StoreError(f"invalid config file name {name!r}")
        return self.config_dir / name

    def write_config(self, name: str, data: bytes) -> None:
        """Replace ``config/<name>`` atomically (temp + fsync + rename + directory fsync)."""
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
