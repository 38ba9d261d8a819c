"""Flushing: the flusher thread (periodic flush, group commit) and what it makes durable.

Theory of operation: writers append under the store lock and, in sync mode, register the end
offset they need durable. The flusher thread loops: it takes the current CommitLog write
position W, fsyncs up to W without holding the store lock, then completes every waiter whose
end <= W. Writers arriving during an fsync are covered by the next one, so one fsync serves
many puts (group commit). Every ``interval`` it fsyncs the CommitLog even if nobody waits
(async mode), every ``full_interval`` it runs the full flush instead (consume queues,
consumer offsets, checkpoint) and, less often, retention. When a full flush falls due while
writers wait, the CommitLog fsync that releases them comes first, on its own.

Threads wait on a Condition; asyncio callers get a Future resolved through
``loop.call_soon_threadsafe``, so the event loop never blocks on an fsync. What a flush
writes and fsyncs is :class:`FileSync`'s: the CommitLog alone, or everything the store holds
with a checkpoint after it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from store.append import Appender
from store.checkpoint import Checkpoint, write_checkpoint
from store.commitlog import CommitLog
from store.consumequeue import ConsumeQueueTable
from store.errors import FlushTimeoutError, StoreError
from store.offsets import ConsumerOffsets
from store.statelog import StateLog

log = logging.getLogger("lmqtt.store.flush")


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class Flusher:
    """Owns the flush thread. ``flush_log() -> durable end`` must be callable without locks."""

    def __init__(
        self,
        *,
        flush_log: Callable[[], int],
        flush_all: Callable[[], int],
        maintain: Callable[[], None],
        sync: bool,
        interval_s: float,
        full_interval_s: float,
        maintain_interval_s: float,
        timeout_s: float,
    ) -> None:
        self._flush_log = flush_log
        self._flush_all = flush_all
        self._maintain = maintain
        self.sync = sync
        self.interval_s = interval_s
        self.full_interval_s = full_interval_s
        self.maintain_interval_s = maintain_interval_s
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._requested = 0
        self._flushed = 0
        self._futures: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._stopping = False
        self._full_flush_now = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lmqtt-store-flush", daemon=True)

    def start(self, flushed: int, *, full_flush_now: bool = False) -> None:
        """Start the thread; with ``full_flush_now`` its first act is a full flush."""
        self._flushed = flushed
        self._full_flush_now = full_flush_now
        self._thread.start()

    # -- waiting (writers) ---------------------------------------------------------------------
    def wait_flushed(self, end: int) -> None:
        """Block until ``end`` is durable (sync put)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            if end > self._requested:
                self._requested = end
                self._cond.notify_all()
            while self._flushed < end:
                if self._error is not None:
                    raise StoreError(f"flush failed: {self._error}") from self._error
                if self._stopping and not self._thread.is_alive():
                    raise StoreError("store closed before the flush")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FlushTimeoutError(end, self.timeout_s)
                self._cond.wait(left)

    def flushed_future(self, end: int) -> asyncio.Future[None]:
        """A future of the running loop completed once ``end`` is durable."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._flushed >= end:
                fut.set_result(None)
                return fut
            self._futures.append((end, loop, fut))
            if end > self._requested:
                self._requested = end
                self._cond.notify_all()
        return fut

    def kick(self) -> None:
        """Ask for a full flush now (MessageStore.flush from another thread uses its own)."""
        with self._cond:
            self._cond.notify_all()

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        now = time.monotonic()
        next_log = now + self.interval_s
        next_full = now if self._full_flush_now else now + self.full_interval_s
        next_maintain = now + self.maintain_interval_s
        while True:
            with self._cond:
                while not self._stopping and self._requested <= self._flushed:
                    left = min(next_log, next_full) - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                stopping = self._stopping
            if stopping:
                break
            now = time.monotonic()
            try:
                if now >= next_full:
                    if self._requested > self._flushed:
                        # Sync puts are waiting: their bytes are in the CommitLog, so one fsync
                        # of it releases them. They need not also wait for the rest of the full
                        # flush (queue files, offsets, checkpoint: several more fsyncs).
                        self._complete(self._flush_log(), None)
                    end = self._flush_all()
                    next_full = now + self.full_interval_s
                    next_log = now + self.interval_s
                else:
                    end = self._flush_log()
                    if now >= next_log:
                        next_log = now + self.interval_s
                if now >= next_maintain:
                    next_maintain = now + self.maintain_interval_s
                    self._maintain()
                error = None
            except BaseException as e:  # keep serving waiters with the error
                log.exception("flush failed")
                error = e
                end = self._flushed
                next_full = next_log = time.monotonic() + self.interval_s
            self._complete(end, error)
        self._complete(self._flushed, None)

    def _complete(self, end: int, error: BaseException | None) -> None:
        with self._cond:
            self._flushed = max(self._flushed, end)
            if error is not None and self.sync:
                self._error = error
            ready: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
            if self._futures:
                keep: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
                for f in self._futures:
                    (ready if f[0] <= self._flushed or error is not None else keep).append(f)
                self._futures = keep
            self._cond.notify_all()
        for _end, loop, fut in ready:
            exc = StoreError(f"flush failed: {error}") if error is not None else None
            try:
                loop.call_soon_threadsafe(_resolve, fut, exc)
            except RuntimeError:  # loop closed: nobody is waiting any more
                pass

    def note_flushed(self, end: int) -> None:
        """Record a flush done outside the thread (MessageStore.flush) and wake waiters."""
        self._complete(end, None)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def fail_pending(self) -> None:
        """After the final flush: fail whatever is still waiting (nothing, normally)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            pending, self._futures = self._futures, []
        for _end, loop, fut in pending:
            try:
                loop.call_soon_threadsafe(_resolve, fut, StoreError("store closed"))
            except RuntimeError:
                pass


#: Each full flush unmaps the CommitLog pages more than this far behind the write position
#: (RSS, not data: Segment.release). Pages near the end stay mapped: the writer is filling
#: them and readers that keep up read them; older ones cost a minor fault if read again.
MAPPED_TAIL_BYTES = 8 << 20
_FSYNC_THREADS = 8


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


class FileSync:
    """What the store's flushes write and fsync: :meth:`flush_log` (the CommitLog, without the
    store lock) and :meth:`flush_all` (queue units, CommitLog, state log, queue files,
    consumer offsets, then the checkpoint at ``checkpoint_path``).

    ``writer`` is the store's Appender: under ``lock`` (the store's) a full flush reads how far
    its appends went, and asks it to yield the lock once when it is waiting for it.
    """

    def __init__(
        self,
        *,
        commitlog: CommitLog,
        table: ConsumeQueueTable,
        offsets: ConsumerOffsets,
        state: StateLog | None,
        writer: Appender,
        lock: threading.Lock,
        checkpoint_path: Path,
    ) -> None:
        self.commitlog = commitlog
        self.table = table
        self.offsets = offsets
        self.state = state
        self.writer = writer
        self.lock = lock
        self.checkpoint_path = checkpoint_path
        self._flush_lock = threading.Lock()
        self._fsync_pool: ThreadPoolExecutor | None = None
        self._released_to = 0  # CommitLog end at the last Segment.release pass

    def flush_log(self) -> int:
        """fsync the CommitLog up to the current write position (no store lock held)."""
        end = self.commitlog.write_pos
        self.commitlog.fsync_to(end)
        if end - self._released_to >= MAPPED_TAIL_BYTES:
            self._release_mapped(end)  # a fast writer: do not wait for the full flush
        return end

    def _release_mapped(self, end: int) -> None:
        """Unmap CommitLog pages more than MAPPED_TAIL_BYTES behind ``end`` (RSS only)."""
        with self.lock:  # segments are closed (retention, close) only under it
            if not self.writer.closed:
                self.commitlog.release_mapped(end - MAPPED_TAIL_BYTES)
                self._released_to = end

    def flush_all(self) -> int:
        """Consume-queue units, CommitLog, fsyncs, consumer offsets, checkpoint.

        Serialised: flush() from a caller and the flusher thread would otherwise race on the
        checkpoint's temp file (and could write an older checkpoint over a newer one).
        """
        with self._flush_lock:
            return self._flush_all_serialised()

    def _flush_all_serialised(self) -> int:
        writer = self.writer
        # A writer looping on put() would win the lock again and again (the GIL hands it
        # back before this thread runs): ask writers to yield once after their section.
        writer.lock_wanted = True
        with self.lock:
            writer.lock_wanted = False
            end = self.commitlog.write_pos
            ts = writer.last_store_ts
            units = writer.units_total
            paths = self.table.write_pending()
        self.commitlog.fsync_to(end)
        if self.state is not None:
            self.state.sync()  # async flush mode's bound on state changes lost to a power cut
        # Also lets go of pages readers faulted in (a backlog being drained) since the last one.
        self._release_mapped(end)
        unique = list(dict.fromkeys(paths))
        if len(unique) > 1:
            # One fsync per queue file written. Issued from several threads at once the file
            # system folds them into shared journal commits, where one after the other they
            # would keep the checkpoint behind. One task per thread, each fsyncing its share
            # in turn: as many fsyncs in flight, without a Future (lock, condition) per file.
            if self._fsync_pool is None:
                self._fsync_pool = ThreadPoolExecutor(_FSYNC_THREADS, "lmqtt-store-fsync")
            shares = [unique[i::_FSYNC_THREADS] for i in range(min(_FSYNC_THREADS, len(unique)))]
            list(self._fsync_pool.map(_fsync_paths, shares))
        elif unique:
            _fsync_path(unique[0])
        self.offsets.persist()
        write_checkpoint(self.checkpoint_path, Checkpoint(end, end, ts, ts, units))
        return end

    def close(self) -> None:
        """Stop the fsync threads (after the last flush)."""
        if self._fsync_pool is not None:
            self._fsync_pool.shutdown()
            self._fsync_pool = None
