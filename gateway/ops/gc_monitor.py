"""GcMonitor: how long Python's garbage collector stops the gateway, and keeping it short.

Pauses are timed with ``gc.callbacks`` (start/stop of every collection) into a ring of the
last ``RING`` pauses plus running totals; /metrics shows them (``lmqtt_gc_*``) and the gateway
logs a summary when it stops.

Policy: a device fleet keeps tens of objects per connection alive for hours (transport,
protocol state machine, session, subscription, delivery loop), and traffic keeps tens of
thousands of per-message objects alive for a while (the store's recent-message windows, the
decode and encode caches, in-flight QoS 1 copies). Left alone, collections walk them again
and again, and with a large fleet a full collection stops the event loop for tens of
milliseconds several times a minute (docs/benchmarks.md has the measurements).

So every FREEZE_INTERVAL_S everything alive is frozen (``gc.freeze``: moved to the permanent
generation, which collections skip; the call is O(1)): a collection only walks what was
allocated since. Frozen objects that are dropped are still freed by reference counting; only
garbage in reference cycles waits. Cyclic garbage that outlives its first collection is what
may have been frozen before it died, so when the collections of generations 1 and 2 have found
RECLAIM_GARBAGE objects since the last reclaim, when the
fleet has shrunk to below half of what it was, and at the latest every RECLAIM_MAX_S, the
permanent generation is handed back to the collector (``gc.unfreeze``) for one full pass: the
one long pause (about a microsecond per live object) this policy keeps, made rare. After a burst
of connects the young generations are collected before freezing, so that the burst's own
short-lived cycles are not kept.

Between ticks, a youngest-generation collection that found no garbage freezes its survivors
at once (while the monitor runs, ``start``). A burst of new long-lived objects (a fleet's
first publishes: every new topic's entries in the routing, encoding and property caches)
otherwise climbs into generation 1, whose collections walk it all again (milliseconds each,
several per burst) before the next tick would have frozen it unwalked. Freezing what one
young collection has just walked keeps less than the tick's freeze of everything alive does;
a young collection that found cyclic garbage leaves the generations alone.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from array import array
from collections.abc import Callable
from typing import Any

__all__ = ["BUCKETS_S", "GcMonitor"]

log = logging.getLogger("lmqtt.gateway")

RING = 4096
# Upper bounds (seconds) of the pause histogram /metrics exposes; the last bucket is +Inf.
BUCKETS_S = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
FREEZE_GROWTH = 1.10
FREEZE_MIN = 200
RECLAIM_GARBAGE = 20_000
RECLAIM_MAX_S = 3600.0
# How often what is alive is frozen. Traffic keeps per-message objects alive for about a
# second (the caches of the last few thousand messages), so a young collection walks what a
# freeze interval allocated: every 100 ms, a tenth of what a freeze every second would leave.
FREEZE_INTERVAL_S = 0.1


class GcMonitor:
    """Install once per gateway; ``maybe_freeze`` from housekeeping; ``summary`` anytime."""

    def __init__(self) -> None:
        self.collections = 0
        self.total_ns = 0
        self.max_ns = 0
        self.freezes = 0
        self.unfreezes = 0
        self.buckets = [0] * (len(BUCKETS_S) + 1)  # per bucket, not cumulative
        self.by_generation = [0, 0, 0]  # collections of each generation
        self.max_by_generation = [0, 0, 0]  # longest pause of each, ns
        self._ring = array("q", bytes(8 * RING))
        self._filled = 0
        self._started = 0
        self._frozen_at = 0  # connections at the last burst freeze (or unfreeze)
        self._reclaimed_at: float | None = None  # monotonic time of the last unfreeze
        self.escaped = 0  # cyclic garbage found by generation 1 and 2 collections since then
        self._installed = False
        self._timer: asyncio.TimerHandle | None = None
        self._freeze_young = False  # freeze the survivors of a young collection (start)

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._freeze_young = False

    def start(self, loop: asyncio.AbstractEventLoop, connections: Callable[[], int]) -> None:
        """Timing, plus ``tick`` every FREEZE_INTERVAL_S on ``loop`` (``connections()``: how
        many connections are open now)."""
        self.install()
        self._freeze_young = True

        def run() -> None:
            try:
                self.tick(connections(), loop.time())
            finally:
                self._timer = loop.call_later(FREEZE_INTERVAL_S, run)

        self._timer = loop.call_later(FREEZE_INTERVAL_S, run)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
            return
        if not self._started:
            return
        pause = time.perf_counter_ns() - self._started
        self._started = 0
        self._ring[self._filled % RING] = pause
        self._filled += 1
        self.collections += 1
        self.total_ns += pause
        if pause > self.max_ns:
            self.max_ns = pause
        generation = info.get("generation", 2)
        if generation >= 1:
            self.escaped += int(info.get("collected", 0))
        elif self._freeze_young and not info.get("collected"):
            gc.freeze()  # nothing died young: what it walked goes where the tick puts it
            self.freezes += 1
        if 0 <= generation <= 2:
            self.by_generation[generation] += 1
            if pause > self.max_by_generation[generation]:
                self.max_by_generation[generation] = pause
        seconds = pause / 1e9
        for i, bound in enumerate(BUCKETS_S):
            if seconds <= bound:
                self.buckets[i] += 1
                break
        else:
            self.buckets[-1] += 1

    def tick(self, connections: int, now: float) -> str:
        """Every FREEZE_INTERVAL_S: freeze what is alive; unfreeze instead (one full collection
        may then reclaim cyclic garbage that was frozen) when RECLAIM_GARBAGE escaped the young
        collections, when the fleet shrank below half of what it was, or after RECLAIM_MAX_S.
        Returns what it did: freeze, unfreeze, or burst (a freeze after a burst of connects,
        with young garbage collected first)."""
        if self._reclaimed_at is None:
            self._reclaimed_at = now
        if (
            (self._frozen_at and connections < self._frozen_at // 2)
            or self.escaped >= RECLAIM_GARBAGE
            or now - self._reclaimed_at >= RECLAIM_MAX_S
        ):
            self.escaped = 0
            gc.unfreeze()
            self._frozen_at = connections
            self._reclaimed_at = now
            self.unfreezes += 1
            return "unfreeze"
        if connections >= max(self._frozen_at * FREEZE_GROWTH, self._frozen_at + FREEZE_MIN):
            gc.collect(1)  # young garbage (cycles among short-lived objects) is not frozen
            gc.freeze()
            self._frozen_at = connections
            self.freezes += 1
            return "burst"
        gc.freeze()
        self.freezes += 1
        return "freeze"

    def percentile_ns(self, q: float) -> int:
        """Pause at quantile ``q`` of the last RING collections (0 before any)."""
        size = min(self._filled, RING)
        if not size:
            return 0
        ordered = sorted(self._ring[:size])
        return ordered[min(size - 1, int(q * size))]

    def summary(self) -> dict[str, Any]:
        return {
            "collections": self.collections,
            "pause_p50_ms": self.percentile_ns(0.50) / 1e6,
            "pause_p99_ms": self.percentile_ns(0.99) / 1e6,
            "pause_max_ms": self.max_ns / 1e6,
            "pause_total_ms": self.total_ns / 1e6,
            "by_generation": list(self.by_generation),
            "max_ms_by_generation": [round(n / 1e6, 3) for n in self.max_by_generation],
            "freezes": self.freezes,
            "frozen_objects": gc.get_freeze_count(),
        }
