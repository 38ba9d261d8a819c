"""When a delivery loop makes a pass: at once, waiting for company, or under load paced to one
pass per PASS_INTERVAL.

A loaded gateway turns its event loop every few hundred microseconds with a few messages each;
a pass per turn would make a fan-out subscriber cost a pass and a socket write for every few
packets. So a pass that arrivals and acknowledgements ask for (`schedule`) runs from a timer
(at most PASS_INTERVAL later) when the subscriber is *busy* (its last write came less than
PASS_INTERVAL ago, and that write itself came within BUSY_WINDOW of the one before) and one of
the two ends is short of time:
  - the subscriber: messages it was sent are not acknowledged yet. The acknowledgement asks
    for the pass again, and it runs at once if that leaves nothing unacknowledged: a busy
    subscriber's passes follow its acknowledgements, one write in flight at a time, and a
    subscriber that falls behind gets bigger batches instead of more writes;
  - the event loop: its thread used BUSY_SHARE of a core over the last window (load.py).
A busy subscriber that is short of nothing (it acknowledged everything, the loop has time)
still receives a message every few hundred microseconds: each alone would be a pass, a socket
write and a read of its PUBACK. Its arrival waits for company instead: the next arrival sends
both in that turn's callbacks, and the same timer sends it alone when no other comes (an
acknowledgement meanwhile does not end the wait). So a subscriber under sustained traffic gets
at least two messages per write at about one arrival's gap of latency, and one that is not
busy (idle, or one write just now after a quiet spell) gets its message in this turn's
callbacks (call_soon), without waiting for a timer. Not paced either: `wake()` (window or
transport freed after they stopped a pass, a subscription, retained messages) and a pass
stopped at the batch limit (call_soon in DeliveryLoop._step), so neither low-rate latency nor
a window-bound subscriber's throughput pays. Whether a write is that recent is measured on
time.monotonic(): uvloop's clock moves in whole milliseconds (so do its timers, 1 ms being
their finest step), and a gap of a few hundred microseconds reads there as 0 or 1 ms.
"""

from __future__ import annotations

from time import monotonic

from gateway.delivery.state import UNKNOWN_END, LoopState

PASS_INTERVAL = 0.001
# Writes this close to each other mean sustained load: a paced pass's timer, armed up to
# PASS_INTERVAL after a write, fires up to one more whole-ms clock step later, so paced writes
# come up to two intervals apart and keep a subscriber under load busy.
BUSY_WINDOW = 2 * PASS_INTERVAL + 1e-6
# An arrival waits for company only when the next one is predicted within this (seconds): the
# wait is that gap, about a quarter of what the median message pays through an idle gateway.
COMPANY_GAP = 0.6 * PASS_INTERVAL


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
            ready = self._ready = {queue: end}
        else:
            known = ready.get(queue)
            if known is None or UNKNOWN_END < known < end:
                ready[queue] = end
        if self._scheduled:
            return
        now = monotonic()
        gap = now - self._arrived_at
        # Only one new message waits for company (a batch is company enough), and only when
        # the next arrival is due soon. The gap before last predicts it: a fleet's arrivals
        # come from several evenly paced sources, whose gaps alternate.
        sub = self.session.by_queue.get(queue)
        soon = (
            self._gap_before < COMPANY_GAP
            and sub is not None
            and end - sub.next_offset <= 1
            and len(ready) == 1
        )
        self._gap_before = self._gap
        self._gap = gap
        self._arrived_at = now
        if self._waiting:  # the waiting message has company: both go in this turn's callbacks
            self._waiting = False
            self._scheduled = True
            self._loop.call_soon(self._step)
            return
        self._schedule(soon, now)

    def _mark_ready(self, queue: str, end: int) -> None:
        """`queue` is to be read by the next pass (up to `end`, or UNKNOWN_END: ask the store)."""
        ready = self._ready
        if ready is None:
            self._ready = {queue: end}
        else:
            ready[queue] = end

    def wrote(self) -> None:
        """A pass wrote to the subscriber now (once per pass that sent)."""
        now = monotonic()
        self._busy = now - self._last_write < BUSY_WINDOW
        self._last_write = now

    def _schedule(self, company_soon: bool = False, now: float | None = None) -> None:
        """Schedule a pass over the ready queues (and the offset commits): in this turn's
        callbacks, or, when the subscriber is busy (module docstring), from the pacing timer:
        paced while it or the loop is short of time; else an arrival whose company is due
        soon (`company_soon`) waits for it (arrived() sends both), and an acknowledgement
        does not end that wait. `now`: monotonic() if the caller just read it."""
        if self._scheduled or self._stopped or self._waiting:
            return
        if self._busy and (now or monotonic()) - self._last_write < PASS_INTERVAL:
            if self.session.inflight or self.ctx.load.busy():
                if self._pass_timer is None:
                    self._pass_timer = self._loop.call_later(PASS_INTERVAL, self._paced)
                return
            if company_soon and self._pass_timer is None:
                self._pass_timer = self._loop.call_later(PASS_INTERVAL, self._paced)
                self._waiting = True
                return
        self._scheduled = True
        self._loop.call_soon(self._step)

    def _paced(self) -> None:
        self._pass_timer = None
        if not self._scheduled:
            self._step()
