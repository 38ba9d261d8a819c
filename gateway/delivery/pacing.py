"""When a delivery loop makes a pass: at once, or under load paced to one pass per
PASS_INTERVAL.

A loaded gateway turns its event loop every few hundred microseconds with a few messages each;
a pass per turn would make a fan-out subscriber cost a pass and a socket write for every few
packets. So a pass that arrivals and acknowledgements ask for (`schedule`) runs from a timer
(at most PASS_INTERVAL later, unless a later notice finds the interval over first) when the
subscriber is *busy* (its last write came less than PASS_INTERVAL ago, and that write itself
came within BUSY_WINDOW of the one before) and one of the two ends is short of time:
  - the subscriber: messages it was sent are not acknowledged yet. The acknowledgement asks
    for the pass again, and it runs at once if that leaves nothing unacknowledged: a busy
    subscriber's passes follow its acknowledgements, one write in flight at a time, and a
    subscriber that falls behind gets bigger batches instead of more writes;
  - the event loop: its thread used BUSY_SHARE of a core over the last window (load.py).
Batching starts only then, under load: a message for a subscriber that was idle, that got one
write just now after a quiet spell, or that acknowledged everything on a loop with time to
spare, is sent in this turn's callbacks (call_soon), without waiting for a timer. Not paced
either: `wake()` (window or transport freed after they stopped a pass, a subscription,
retained messages) and a pass stopped at the batch limit (call_soon in DeliveryLoop._step), so
neither low-rate latency nor a window-bound subscriber's throughput pays. uvloop's clock and
timers move in whole milliseconds: 1 ms is the finest step.
"""

from __future__ import annotations

from gateway.delivery.state import UNKNOWN_END, LoopState

PASS_INTERVAL = 0.001
# Below this the interval is not over: uvloop's times are whole ms in binary floating point,
# and 10322.494 - 10322.493 < 0.001.
_PASS_NOT_OVER = PASS_INTERVAL - 1e-6
# Writes this close to each other mean sustained load: a paced pass's timer, armed up to
# PASS_INTERVAL after a write, fires up to one more whole-ms clock step later, so paced writes
# come up to two intervals apart and keep a subscriber under load busy.
BUSY_WINDOW = 2 * PASS_INTERVAL + 1e-6


class Pacing(LoopState):
    """Schedules the passes of a DeliveryLoop (stepped with call_soon rather than a task: an
    idle subscriber costs no task)."""

    __slots__ = ()

    def wake(self) -> None:
        """Schedule a pass over every queue, in this turn's callbacks (not paced: the window
        or the transport had stopped this subscriber, or it has something new to look at)."""
        self._full = True
        if not self._scheduled and not self._stopped:
            self._scheduled = True
            self._loop.call_soon(self._step)

    def arrived(self, queue: str, end: int) -> None:
        """The store's notice (ArrivalHub): `queue` grew, to at least `end`. The pass reads it
        up to there without asking the store where it ends (a queue marked ready without a
        notice, UNKNOWN_END, is asked); notices may come out of order (the flusher thread's
        are handed over later), so the furthest end is kept."""
        ready = self._ready
        if ready is None:
            self._ready = {queue: end}
        else:
            known = ready.get(queue)
            if known is None or UNKNOWN_END < known < end:
                ready[queue] = end
        if not self._scheduled:
            self._schedule()

    def _mark_ready(self, queue: str, end: int) -> None:
        """`queue` is to be read by the next pass (up to `end`, or UNKNOWN_END: ask the store)."""
        ready = self._ready
        if ready is None:
            self._ready = {queue: end}
        else:
            ready[queue] = end

    def wrote(self, now: float) -> None:
        """A pass wrote to the subscriber at loop time `now` (once per pass that sent)."""
        self._busy = now - self._last_write < BUSY_WINDOW
        self._last_write = now

    def _schedule(self) -> None:
        """Schedule a pass over the ready queues (and the offset commits): in this turn's
        callbacks, or, when the subscriber is busy and it or the loop short of time (module
        docstring), at most PASS_INTERVAL later."""
        if self._scheduled or self._stopped:
            return
        loop = self._loop
        if (
            self._busy
            and loop.time() - self._last_write < _PASS_NOT_OVER
            and (self.session.inflight or self.ctx.load.busy())
        ):
            if self._pass_timer is None:
                self._pass_timer = loop.call_later(PASS_INTERVAL, self._paced)
            return
        self._scheduled = True
        loop.call_soon(self._step)

    def _paced(self) -> None:
        self._pass_timer = None
        if not self._scheduled:
            self._step()
