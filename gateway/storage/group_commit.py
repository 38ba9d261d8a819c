"""GroupCommit: the event loop's waits for an append-only log's fsync, one fsync for all of them.

Callers append to the log in the event loop's thread, then `await wait(position)`. One
worker thread, started at the first wait, runs one fsync at a time; each covers everything
appended before it started, so every caller waiting at that moment is answered by it:

    loop thread                               sync thread
    append A; wait(A); append Z; wait(Z)
    (end of the turn) -- request -------->    fsync (covers A and Z)
    append B; wait(B)    (one running:             |
    append C; wait(C)     no request)              |
    <-- done: A, Z answered; B, C left ------  call_soon_threadsafe(_done)
    _done: request again ---------------->    fsync (covers B and C)
    <-- done: B and C answered --------------  call_soon_threadsafe(_done)

The first wait of a loop turn requests the fsync at the end of the turn, so the turn's other
writes (one SUBSCRIBE per client whose packet came in the same poll) share it rather than
wait for the next one. A wait costs one future; an fsync costs one request (a C queue) and
one call back into the loop, however many callers it answers (a thread pool job per fsync
with a shielded future per caller cost several times that: the loop's share of a
synchronous session write).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Protocol

__all__ = ["GroupCommit", "Syncable"]

_STOP = object()  # the worker's request to end


class Syncable(Protocol):
    """An append-only log as GroupCommit uses it (store/statelog.py StateLog)."""

    @property
    def synced(self) -> int:
        """The position up to which the log is durable."""

    def sync(self, position: int | None = None) -> None:
        """Fsync everything appended up to now (blocking; thread-safe)."""


class GroupCommit:
    """Answers `wait(position)` once `log` is durable up to `position` (see the module
    docstring). Used from one event loop; `stop()` ends the worker thread."""

    __slots__ = (
        "_busy",
        "_log",
        "_loop",
        "_name",
        "_requests",
        "_stopped",
        "_thread",
        "_waiters",
    )

    def __init__(self, log: Syncable, name: str) -> None:
        self._log = log
        self._name = name
        # (position, future) of the callers not answered yet, in append order.
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._busy = False  # an fsync is requested (or will be this turn), its _done not run
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    async def wait(self, position: int) -> None:
        """Return once the log is durable up to `position` (an fsync's error is raised)."""
        if self._log.synced >= position:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append((position, fut))
        if not self._busy:
            # At the end of this loop turn: the other writes of the turn share the fsync.
            self._busy = True
            loop.call_soon(self._request, loop)
        await fut

    def stop(self) -> None:
        """End the worker (after the fsync it runs). Called once the log is closed (its
        close fsyncs everything): the callers still waiting are answered."""
        self._stopped = True
        if self._thread is not None:
            self._requests.put(_STOP)
            self._thread = None
        if self._waiters and not self._waiters[0][1].get_loop().is_closed():
            self._done(None)
            for _, fut in self._waiters:  # not covered: the log was not closed
                fut.cancel()
            self._waiters = []

    def _request(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._stopped:
            return
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._requests.put(None)

    def _run(self) -> None:
        """The worker: one fsync per request, then one call back into the loop."""
        requests, log, loop = self._requests, self._log, self._loop
        assert loop is not None
        while requests.get() is not _STOP:
            error: BaseException | None = None
            try:
                log.sync()
            except BaseException as exc:  # handed to the waiters, not lost in this thread
                error = exc
            try:
                loop.call_soon_threadsafe(self._done, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return

    def _done(self, error: BaseException | None) -> None:
        """An fsync ended (in the loop's thread): answer the callers it covered; request
        the next fsync for those who appended while it ran."""
        self._busy = False
        synced = self._log.synced
        left: list[tuple[int, asyncio.Future[None]]] = []
        for position, fut in self._waiters:
            if fut.done():  # the caller was cancelled
                continue
            if error is not None:
                fut.set_exception(error)
            elif position <= synced:
                fut.set_result(None)
            else:
                left.append((position, fut))
        self._waiters = left
        if left and self._loop is not None:
            self._busy = True
            self._request(self._loop)
