"""GroupCommit: the event loop's waits for an append-only log's fsync, one fsync for all of them.

Callers append to the log in the event loop's thread, then `await wait(position)`. An fsync
thread (fsync_thread.py: in C, without the GIL, when built) runs one fdatasync at a time,
each for the highest position requested when it starts, so every caller waiting at that
moment is answered by it. The thread says it is done through an eventfd the loop watches
(`add_reader`), so answering costs the loop one callback, however many callers it answers:

    loop thread                               fsync thread
    append A; wait(A) (nothing in flight)
      -- request(A) ---------------------->   fdatasync (covers A)
    append Z; wait(Z)                              |
    (end of the turn) -- request(Z) ----->         |   (noted: runs next)
    <-- eventfd: A answered ---------------   write(eventfd); fdatasync (covers Z)
    append B; wait(B)                              |
    (end of the turn) -- request(B) ----->         |
    <-- eventfd: Z answered ---------------   write(eventfd); fdatasync (covers B)

`durable(position)` is `wait` without a coroutine: the future itself, for a caller that acts
in its done callback (a SUBSCRIBE's SUBACK, gateway/connection/subscribe.py).

A wait while no other is pending (the thread idles) requests its fsync at once: it runs
beside the rest of the loop's turn rather than after it. Any other wait requests at the end
of the turn, so the turn's writes (one SUBSCRIBE per client whose packet came in the same
poll) share one fsync; a request made while an fsync runs starts the next one as soon as it
ends, without a round trip through the loop. A wait costs one future; a turn's request one
mutex and a condition signal; an fsync one eventfd read, and the fsync thread never
contends for the GIL with the loop (a Python thread took it twice per fsync: after its
wake-up and after the fsync).
"""

from __future__ import annotations

import asyncio
import os
from typing import Protocol

from gateway.storage.fsync_thread import FsyncThreadLike, new_fsync_thread

__all__ = ["GroupCommit", "Syncable"]


class Syncable(Protocol):
    """An append-only log as GroupCommit uses it (store/statelog.py StateLog)."""

    @property
    def synced(self) -> int:
        """The position up to which the log is durable."""

    @property
    def written(self) -> int:
        """The position of the end of the appends."""

    @property
    def generation(self) -> int:
        """Which file appends go to now (changes when the log rolls to a new file)."""

    def dup_for_sync(self) -> tuple[int, int]:
        """(a duplicate of the current file's descriptor, its generation), taken together;
        every position appended before a roll is durable once the old file's is."""

    def note_synced(self, position: int, fsyncs: int) -> None:
        """An fsync made elsewhere made everything up to `position` durable."""


class GroupCommit:
    """Answers `wait(position)` once `log` is durable up to `position` (see the module
    docstring). Used from one event loop; `stop()` ends the fsync thread."""

    __slots__ = ("_generation", "_log", "_loop", "_scheduled", "_stopped", "_thread", "_waiters")

    def __init__(self, log: Syncable) -> None:
        self._log = log
        # (position, future) of the callers not answered yet, in append order.
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._scheduled = False  # a request is due at the end of this loop turn
        self._thread: FsyncThreadLike | None = None
        self._generation = -1  # of the file the thread syncs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    async def wait(self, position: int) -> None:
        """Return once the log is durable up to `position` (an fsync's error is raised)."""
        fut = self.durable(position)
        if fut is not None:
            await fut

    def durable(self, position: int) -> asyncio.Future[None] | None:
        """None if the log is durable up to `position` already; else a future answered once
        it is (an fsync's error is its exception; cancelling it drops only this caller).
        Called in the event loop's thread."""
        if self._log.synced >= position:
            return None
        loop = self._loop
        if loop is None:
            # Kept: get_running_loop() asks for the process id (a system call) each time.
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        idle = not self._waiters
        self._waiters.append((position, fut))
        if not self._scheduled:
            if idle:
                # Nothing in flight: the fsync starts now, beside the rest of the turn's work.
                self._request(loop)
            else:
                # At the end of this loop turn: the other writes of the turn share the fsync.
                self._scheduled = True
                loop.call_soon(self._request, loop)
        return fut

    def stop(self) -> None:
        """End the fsync thread (after the fsync it runs). Called once the log is closed (its
        close fsyncs everything): the callers still waiting are answered."""
        self._stopped = True
        thread, self._thread = self._thread, None
        if thread is not None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.remove_reader(thread.fileno())
            thread.stop()
        if self._waiters and not self._waiters[0][1].get_loop().is_closed():
            self._answer(0)
            for _, fut in self._waiters:  # not covered: the log was not closed
                fut.cancel()
            self._waiters = []

    def _request(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        if self._stopped:
            return
        log, thread = self._log, self._thread
        if thread is None:
            thread = self._thread = new_fsync_thread()
            loop.add_reader(thread.fileno(), self._done)
        if log.generation != self._generation:
            # The log rolled (or this is the first request): sync its current file. No
            # append runs meanwhile (appends are this thread's), so `written` below lies in
            # this file or in older ones, fsynced by the roll.
            try:
                fd, self._generation = log.dup_for_sync()
            except Exception as exc:  # closed under the waiters: they hear why
                waiters, self._waiters = self._waiters, []
                for _, fut in waiters:
                    if not fut.done():
                        fut.set_exception(exc)
                return
            thread.set_fd(fd)
        thread.request(log.written)

    def _done(self) -> None:
        """The fsync thread signalled (in the loop's thread): answer the callers it covered.
        The others' positions were requested at the end of their turns: the thread runs
        (or ran) the fsync that covers them."""
        thread = self._thread
        if thread is None:
            return
        synced, fsyncs, error = thread.collect()
        if fsyncs:
            self._log.note_synced(synced, fsyncs)
        if fsyncs or error:
            self._answer(error)

    def _answer(self, error: int) -> None:
        """Answer the waiters the log's durable position covers; `error` (an errno) fails
        the others (the thread dropped their request)."""
        synced = self._log.synced
        left: list[tuple[int, asyncio.Future[None]]] = []
        for position, fut in self._waiters:
            if fut.done():  # the caller was cancelled
                continue
            if position <= synced:
                fut.set_result(None)
            elif error:
                fut.set_exception(OSError(error, f"state log fsync: {os.strerror(error)}"))
            else:
                left.append((position, fut))
        self._waiters = left
