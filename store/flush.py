"""The flusher thread: periodic flush (async mode) and group commit (sync mode).

Theory of operation: writers append under the store lock and, in sync mode, register the end
offset they need durable. The flusher thread loops: it takes the current CommitLog write
position W, fsyncs up to W without holding the store lock, then completes every waiter whose
end <= W. Writers arriving during an fsync are covered by the next one, so one fsync serves
many puts (group commit). Every ``interval`` it fsyncs the CommitLog even if nobody waits
(async mode), every ``full_interval`` it runs the full flush instead (consume queues,
consumer offsets, checkpoint) and, less often, retention. When a full flush falls due while
writers wait, the CommitLog fsync that releases them comes first, on its own.

Threads wait on a Condition; asyncio callers get a Future resolved through
``loop.call_soon_threadsafe``, so the event loop never blocks on an fsync.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from store.errors import FlushTimeoutError, StoreError

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
                        # flush (queue files, offsets, checkpoint: several more fsyncs, each
                        # 3-30 ms when the shared disk is busy).
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
