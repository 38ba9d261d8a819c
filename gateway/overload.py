"""OverloadGuard: when the gateway cannot keep up, publishers feel it, not subscribers.

Without it, an overloaded gateway keeps reading (and acknowledging) every PUBLISH at the rate
devices send, while deliveries fall seconds behind: the store takes everything, the event loop
turns get longer, and each subscriber's pass waits behind ever larger ingest batches.

Overload, seen from inside the process, is event-loop lag: a timer due every TICK_S fires
late because every turn is long. The guard measures it on every tick and, past LAG_HOLD_S,
holds the connections that publish: after a connection's publishes of a turn are taken in, its
transport stops reading. Its socket buffers fill and TCP flow control slows the device down;
nothing is dropped, and a held QoS 1/2 publisher simply waits for acknowledgements that come
later (MQTT puts no deadline on them). Connections that only acknowledge deliveries are never
held, so subscribers' windows keep moving and the backlog drains. Below LAG_RELEASE_S the held
connections are released, at most RELEASE_PER_TICK per tick so that a release never turns into
a burst that overloads the loop again (and no step costs O(connections)).

            lag > LAG_HOLD_S                      lag < LAG_RELEASE_S
    normal ------------------> holding publishers ------------------> releasing --> normal
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

__all__ = ["OverloadGuard", "Publisher"]

log = logging.getLogger("lmqtt.gateway")

TICK_S = 0.01
# Hysteresis: hold when a 10 ms timer is 40 ms late, release once it is back within 10 ms.
LAG_HOLD_S = 0.04
LAG_RELEASE_S = 0.01
RELEASE_PER_TICK = 500


class Publisher(Protocol):
    closed: bool

    def hold_reading(self) -> None: ...

    def release_reading(self) -> None: ...


class OverloadGuard:
    __slots__ = ("_due", "_handle", "_held", "_loop", "holds", "lag", "overloaded")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._held: deque[Publisher] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self.overloaded = False
        self.lag = 0.0  # the last tick's lateness, seconds
        self.holds = 0  # connections held so far (a counter for metrics)

    @property
    def held(self) -> int:
        return len(self._held)

    def start(self) -> None:
        self._due = self._loop.time() + TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.overloaded = False
        self._release(len(self._held))

    def hold(self, publisher: Publisher) -> None:
        """`publisher` just handed in publishes while overloaded: stop reading from it."""
        publisher.hold_reading()
        self._held.append(publisher)
        self.holds += 1

    def _tick(self) -> None:
        now = self._loop.time()
        self.lag = lag = now - self._due
        if not self.overloaded and lag > LAG_HOLD_S:
            self.overloaded = True
            log.warning("event loop %.0f ms behind: holding publishers", lag * 1000)
        elif self.overloaded and lag < LAG_RELEASE_S:
            self.overloaded = False
            log.info("event loop caught up: releasing %d publishers", len(self._held))
        if not self.overloaded and self._held:
            self._release(RELEASE_PER_TICK)
        self._due = now + TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def _release(self, n: int) -> None:
        held = self._held
        for _ in range(min(n, len(held))):
            publisher = held.popleft()
            if not publisher.closed:
                publisher.release_reading()
