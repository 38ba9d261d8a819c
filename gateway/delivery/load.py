"""LoopLoad: whether the event loop's thread is under load, the question pacing.py asks before
it batches a subscriber's passes.

A subscriber that gets a message every few hundred microseconds is busy whatever the load of
the gateway; batching its passes (one per PASS_INTERVAL) saves a pass and a socket write per
batch, and costs up to two intervals of latency per message. That is worth paying only while
the loop is short of time: then each pass saved is time given to the rest. So a busy
subscriber's pass is paced only while the loop's thread used at least BUSY_SHARE of a core
over the last measured window; below that a busy subscriber's message waits only for the next
arrival's company (pacing.py), and every other message goes out in the turn it arrived.

The measure is the thread's CPU time (time.thread_time) against the wall clock, taken at most
once per WINDOW_S, when pacing asks (a subscriber that wrote within the last PASS_INTERVAL): no
timer, nothing per message, and an idle gateway measures nothing. A window longer than
WINDOW_S (the first question after a quiet spell) averages over the quiet spell too, so it
reads as not loaded: the first messages after quiet are never held back.
"""

from __future__ import annotations

import time

__all__ = ["BUSY_SHARE", "WINDOW_S", "LoopLoad"]

# Share of one core the loop's thread used over the last window from which passes are batched.
BUSY_SHARE = 0.75
# How long a measure holds before the next question takes a new one (seconds).
WINDOW_S = 0.05


class LoopLoad:
    """The event loop thread's recent CPU share (see the module docstring); one per loop,
    shared by its delivery loops, used on the loop's thread only."""

    __slots__ = ("_cpu", "_share", "_since", "loaded")

    def __init__(self, share: float = BUSY_SHARE) -> None:
        self._share = share  # of one core: loaded from there
        self._since = time.monotonic()
        self._cpu = time.thread_time()
        self.loaded = False  # as of the last measure

    def busy(self) -> bool:
        """Whether the loop's thread used its share of a core (BUSY_SHARE) over the last
        window, measuring anew once the window is over."""
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed >= WINDOW_S:
            cpu = time.thread_time()
            self.loaded = cpu - self._cpu >= self._share * elapsed
            self._since = now
            self._cpu = cpu
        return self.loaded
