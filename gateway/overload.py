"""OverloadGuard: when the gateway cannot keep up, publishers feel it, not subscribers.

Without it, an overloaded gateway keeps reading (and acknowledging) every PUBLISH at the rate
devices send, while deliveries fall seconds behind: the store takes everything, the event loop
turns get longer, and each subscriber's pass waits behind ever larger ingest batches.

Overload, seen from inside the process, shows two ways, and the guard watches both:
  - event-loop lag: a timer due every TICK_S fires late because every turn is long
    (past LAG_HOLD_S);
  - delivery lag: the oldest message an online subscriber has not been sent yet was stored
    more than BACKLOG_HOLD_S ago. The loop may be on time while subscribers fall behind: their
    QoS 1 windows are full, or their passes read BATCH messages a turn while more arrive.
    Delivery loops report themselves when a pass leaves something unsent (`behind()`, O(1)
    per pass); each tick asks at most CHECK_PER_TICK of them for the store time of their
    oldest unsent message (`oldest_unsent_ms()`, a look at each of their subscriptions' next
    message), so the cost is per tick, never per message or per connection.
While either is past its bound the guard holds the connections that publish: after a
connection's publishes of a turn are taken in, its transport stops reading. Its socket buffers
fill and TCP flow control slows the device down; nothing is dropped, and a held QoS 1/2
publisher simply waits for acknowledgements that come later (MQTT puts no deadline on them; a
device with a bounded in-flight window stops sending). Connections that only acknowledge
deliveries are never held, so subscribers' windows keep moving and the backlog drains. Once the
loop lag is under LAG_RELEASE_S and the delivery lag under BACKLOG_RELEASE_S, the held
connections are released in the order they were held (fair: who waited longest goes first), at
most RELEASE_PER_TICK per tick so that a release never turns into a burst that overloads the
loop again (and no step costs O(connections)).

            loop lag > LAG_HOLD_S or                 loop lag < LAG_RELEASE_S and
            delivery lag > BACKLOG_HOLD_S            delivery lag < BACKLOG_RELEASE_S
    normal -------------------------------> holding ----------------------------------> releasing

Holding helps a subscriber that is behind because of the load. A persistent session back
online, catching up on what was stored while it was away, is behind too, but holding the fleet
for it would stop every device without helping: a delivery loop reports itself only once it
has been caught up since it started (DeliveryLoop._step). And one that is sent nothing for
SLOW_SUBSCRIBER_S while it is behind (it stopped reading or acknowledging) is stuck by itself:
it is left out until it has caught up, its messages waiting in the store as for any slow
consumer. A subscriber that drains, however slowly, keeps the publishers held: they then
publish at the pace it reads, which is the point.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Protocol

__all__ = ["Backlogged", "OverloadGuard", "Publisher"]

log = logging.getLogger("lmqtt.gateway")

TICK_S = 0.01
# Hysteresis: hold when a 10 ms timer is 40 ms late, release once it is back within 10 ms.
LAG_HOLD_S = 0.04
LAG_RELEASE_S = 0.01
# The same for the age of the oldest message an online subscriber has not been sent.
BACKLOG_HOLD_S = 0.05
BACKLOG_RELEASE_S = 0.015
SLOW_SUBSCRIBER_S = 2.0
RELEASE_PER_TICK = 500
CHECK_PER_TICK = 64


class Publisher(Protocol):
    closed: bool

    def hold_reading(self) -> None: ...

    def release_reading(self) -> None: ...


class Backlogged(Protocol):
    """A subscriber's delivery loop that a pass left with messages unsent."""

    def oldest_unsent_ms(self) -> int | None:
        """Store timestamp (ms) of the oldest message not sent yet, None when caught up."""
        ...


# A backlogged loop's state in the guard: the oldest unsent message's timestamp (ms) when last
# checked and when that last changed (monotonic s), or EXCUSED (not counted until it catches up).
EXCUSED = (-1, -1.0)


class OverloadGuard:
    __slots__ = (
        "_backlogged",
        "_due",
        "_handle",
        "_held",
        "_loop",
        "_to_check",
        "backlog_lag",
        "holds",
        "lag",
        "overloaded",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._held: deque[Publisher] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        # Delivery loops reported behind, and the order they are checked in (round robin).
        self._backlogged: dict[Backlogged, tuple[int, float]] = {}
        self._to_check: deque[Backlogged] = deque()
        self.overloaded = False
        self.lag = 0.0  # the last tick's lateness, seconds
        self.backlog_lag = 0.0  # the oldest unsent message's age seen in the last tick, seconds
        self.holds = 0  # connections held so far (a counter for metrics)

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def backlogged(self) -> int:
        return len(self._backlogged)

    def start(self) -> None:
        self._due = self._loop.time() + TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.overloaded = False
        self._backlogged.clear()
        self._to_check.clear()
        self._release(len(self._held))

    def hold(self, publisher: Publisher) -> None:
        """`publisher` just handed in publishes while overloaded: stop reading from it."""
        publisher.hold_reading()
        self._held.append(publisher)
        self.holds += 1

    def behind(self, loop: Backlogged) -> None:
        """A delivery pass left messages unsent (window, transport or batch limit)."""
        if loop not in self._backlogged:
            self._backlogged[loop] = (0, 0.0)
            self._to_check.append(loop)

    def _tick(self) -> None:
        now = self._loop.time()
        self.lag = lag = now - self._due
        backlog = self._check_backlog()
        if not self.overloaded and (lag > LAG_HOLD_S or backlog > BACKLOG_HOLD_S):
            self.overloaded = True
            log.warning(
                "overloaded (event loop %.0f ms behind, deliveries %.0f ms): holding publishers",
                lag * 1000,
                backlog * 1000,
            )
        elif self.overloaded and lag < LAG_RELEASE_S and backlog < BACKLOG_RELEASE_S:
            self.overloaded = False
            log.info("caught up: releasing %d publishers", len(self._held))
        if not self.overloaded and self._held:
            self._release(RELEASE_PER_TICK)
        self._due = now + TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def _check_backlog(self) -> float:
        """The largest delivery lag (s) among the loops checked this tick; caught-up loops are
        forgotten. Loops not checked this tick keep their last verdict through the round robin
        (with few backlogged loops, which is the usual case, all are checked every tick)."""
        to_check = self._to_check
        if not to_check:
            self.backlog_lag = 0.0
            return 0.0
        backlogged = self._backlogged
        wall = time.time()
        now = self._loop.time()
        worst = 0.0
        for _ in range(min(CHECK_PER_TICK, len(to_check))):
            loop = to_check.popleft()
            oldest = loop.oldest_unsent_ms()
            if oldest is None:
                del backlogged[loop]
                continue
            to_check.append(loop)
            last, moved = backlogged[loop]
            if last == EXCUSED[0]:
                continue
            age = wall - oldest / 1000
            if oldest != last:
                backlogged[loop] = (oldest, now)
            elif now - moved > SLOW_SUBSCRIBER_S:
                backlogged[loop] = EXCUSED
                log.info(
                    "a subscriber %.0f ms behind was sent nothing for %.0f s: "
                    "not holding publishers for it",
                    age * 1000,
                    SLOW_SUBSCRIBER_S,
                )
                continue
            worst = max(worst, age)
        self.backlog_lag = worst
        return worst

    def _release(self, n: int) -> None:
        held = self._held
        for _ in range(min(n, len(held))):
            publisher = held.popleft()
            if not publisher.closed:
                publisher.release_reading()
