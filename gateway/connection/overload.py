"""OverloadGuard: when the gateway cannot keep up, publishers feel it, not subscribers.

Without it, an overloaded gateway keeps reading (and acknowledging) every PUBLISH at the rate
devices send, while deliveries fall seconds behind: the store takes everything, the event loop
turns get longer, and each subscriber's pass waits behind ever larger ingest batches.

Overload, seen from inside the process, shows two ways, and the guard watches both:
  - event-loop lag: the guard's own timer fires late because every turn is long
    (past LAG_HOLD_S);
  - delivery lag: the oldest message an online subscriber (or shared-subscription group) has
    not been sent yet was stored more than BACKLOG_HOLD_S ago. The loop may be on time while
    subscribers fall behind: their QoS 1 windows are full, or their passes (at most
    PASS_LIMIT messages of a queue) take less a turn than arrives. Delivery loops and share
    groups report themselves when a pass leaves something unsent (`behind()`, O(1) per pass);
    each tick asks at most CHECK_PER_TICK of them for the store time of their oldest unsent
    message (`oldest_unsent_ms()`, a look at each of their queues' next message), so the cost
    is per tick, never per message or per connection.

The guard's timer runs every TICK_S while it has anything to watch closely: it holds, someone is
still held, or the last tick saw either lag past its release bound. Otherwise (the usual case,
the gateway keeping up) it runs every IDLE_TICK_S, and its cost while nothing is behind is a
few ticks a second, nothing per message: a timer's lateness measures the loop's lag whatever
its period, and a delivery lag growing from under BACKLOG_RELEASE_S is seen at most
IDLE_TICK_S later, then followed every TICK_S.

One long turn (a garbage collection, the process descheduled on a busy host) makes one tick late
and the oldest unsent message old at once, without the gateway being behind: holding then would
cost a hold and a release for every connection that publishes until the guard is calm again,
for nothing. So the guard holds once either lag has been past its bound for HOLD_TICKS ticks in
a row (TICK_S apart: a tick past a bound is followed closely); an overload keeps a lag past its
bound tick after tick.

Then the guard holds the connections that publish, from the moment
they hand in publishes (ClientConnection.published): the PUBACKs of what a held connection
hands in wait (MQTT puts no deadline on them and they still leave in order), so a device with
an in-flight window stops sending once its window is full of messages already stored and being
delivered; it is still read, so what it sends when its PUBACKs come is taken in at once, not
left waiting in its socket. A connection that goes on sending regardless (QoS 0, which has no
acknowledgement to wait for, or more than HELD_READ_MAX publishes while held) is not read any
more: its socket buffers fill and TCP flow control slows the device down. Nor is any held
connection while the delivery lag is past READ_HOLD_BACKLOG_S or the loop lags (`read_hold`):
devices with deep windows (50) keep sending until their windows are full, and with every
PUBLISH read at once the backlog that fills them grows in the gateway, each message read on its
own; left waiting in their sockets they are read in batches, which cost less per message.
Nothing is dropped.
Connections that only acknowledge deliveries are never held, so subscribers' windows keep
moving and the backlog drains.

Held publishers are not released all at once (that would turn the hold into a cycle: a burst of
everything that waited, a backlog, a hold again). They are released at the rate the
subscribers drain, round robin: each tick releases held connections from the head of the queue
(who waited longest first) until the tick's admission credit is spent (a released connection
costs the PUBACKs it gets, which is what its device may now send, or, when its reading was
paused, about what such a connection handed in when released); a released connection is held
again, at the back, when it next publishes. So every device gets its turn, and none starves.
The credit is the measured drain rate, corrected toward a backlog of BACKLOG_TARGET_S:

    rate = drain x clamp(1 - (backlog - BACKLOG_TARGET_S) / CORRECT_S, MIN_FACTOR, MAX_FACTOR)

The drain is measured without knowing who subscribes to what: the guard keeps, each tick, how
many publishes the gateway had stored by then (`stored()`); the slowest subscriber's oldest
unsent message was stored at time T, so every publish stored before T has been passed by every
subscriber: `stored at T` is the position of the slowest reader in publishes, and its advance
per second is the drain, whatever the fan-out. With nothing behind, the position is the store's
end (the drain is what comes in) and a factor above 1 lets the rate grow. Once the delivery
lag is under BACKLOG_RELEASE_S and the loop lag under LAG_RELEASE_S for CALM_TICKS in a row
(or nobody is left held), the guard stops holding and releases who is left, RESUME_PER_TICK a
tick: while devices publish, a resumed one is held again at its next PUBLISH, so the queue
need not empty by itself.

            loop lag > LAG_HOLD_S or                 loop lag < LAG_RELEASE_S and delivery lag
            delivery lag > BACKLOG_HOLD_S            < BACKLOG_RELEASE_S for CALM_TICKS
            for HOLD_TICKS in a row
    normal -------------------------------> holding (held connections read at the drain rate,
       ^                                             round robin) --------------------+
       +------------------------------------------------------------------------------+

QoS 0 publishers are held by their reading: MQTT would allow dropping their messages, but the
gateway stores QoS 0 as it stores QoS 1 (persistent sessions and replays read them from the
log), and dropping after reading would still cost the read and the parse while the device goes
on sending as fast as before; holding costs nothing per message and TCP flow control slows the
device down. Memory stays bounded: a held connection's PUBACKs are packet ids (at most
HELD_READ_MAX before its reading pauses), and a connection not read keeps what waits in its
kernel socket buffers (bounded per socket), never in the gateway's heap.

Holding helps a subscriber that is behind because of the load. A persistent session back
online, catching up on what was stored while it was away, is behind too, but holding the fleet
for it would stop every device without helping: a delivery loop (a share group) reports itself
only once it has been caught up since it started (DeliveryLoop._step). And one that is sent
nothing for SLOW_SUBSCRIBER_S while it is behind (it stopped reading or acknowledging) is stuck
by itself: it is left out until it has caught up, its messages waiting in the store as for any
slow consumer. A subscriber that drains, however slowly, keeps the publishers held: they then
publish at the pace it reads, which is the point.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from typing import Protocol

from gateway.delivery.backlog import Backlogged

__all__ = ["Backlogged", "OverloadGuard", "Publisher"]

log = logging.getLogger("lmqtt.gateway")

TICK_S = 0.01
# The timer's period while both lags are under their release bounds and nobody is held.
IDLE_TICK_S = 0.05
# Hysteresis: hold when a 10 ms timer is 40 ms late, release once it is back within 10 ms.
LAG_HOLD_S = 0.04
LAG_RELEASE_S = 0.01
# The same for the age of the oldest message an online subscriber has not been sent.
BACKLOG_HOLD_S = 0.05
BACKLOG_RELEASE_S = 0.015
# While holding: the delivery lag the admission aims at, and how fast it corrects toward it
# (a backlog CORRECT_S above the target admits nothing new beyond MIN_FACTOR of the drain).
BACKLOG_TARGET_S = 0.03
CORRECT_S = 0.1
MIN_FACTOR = 0.25
MAX_FACTOR = 1.3
# Past this, held connections are not read either (their PUBACKs alone do not hold devices whose
# windows are still filling; a connection read in turns also hands in its messages in batches,
# which cost less per message). Equal to BACKLOG_HOLD_S: a later read bound measured worse for
# windows of 10 and 50 alike (docs/benchmarks.md, the overload runs).
READ_HOLD_BACKLOG_S = BACKLOG_HOLD_S
# Admission never stops entirely (a stalled subscriber is excused after SLOW_SUBSCRIBER_S).
MIN_RATE = 100.0
# Unspent credit is kept for at most this long: no burst after a quiet moment.
MAX_CREDIT_S = 0.02
# The drain estimate: exponentially weighted, about ten ticks.
DRAIN_WEIGHT = 0.1
# How far back the stored-publish history goes (a backlog older than this reads as no drain).
HISTORY_S = 5.0
SLOW_SUBSCRIBER_S = 2.0
# Ticks in a row with both lags under their release bounds before holding stops; the connections
# still held are then released RESUME_PER_TICK a tick.
CALM_TICKS = 10
# Ticks in a row with a lag past its hold bound before holding starts (one late tick is a long
# turn, not an overload).
HOLD_TICKS = 2
# Connections resumed per tick at most (the round robin's step, and stop()'s release pace).
RESUME_PER_TICK = 500
CHECK_PER_TICK = 64
# A tick this late counts as a stall of the event loop (metrics; every client of the process
# waited that long).
STALL_S = 0.05


class Publisher(Protocol):
    """A connection that publishes (gateway/connection/client.py ClientConnection)."""

    closed: bool

    def hold_publishing(self) -> None:
        """Hold its PUBACKs (and, past a bound or for QoS 0, its reading) until released."""
        ...

    def release_publishing(self) -> int:
        """Send what was held and read again; returns the PUBACKs it held."""
        ...


# A backlogged loop's state in the guard: the oldest unsent message's timestamp (ms) when last
# checked and when that last changed (monotonic s), or EXCUSED (not counted until it catches up).
EXCUSED = (-1, -1.0)


class OverloadGuard:
    __slots__ = (
        "_admitted",
        "_backlogged",
        "_calm",
        "_credit",
        "_due",
        "_handle",
        "_held",
        "_history",
        "_hot",
        "_last_tick",
        "_loop",
        "_position",
        "_resumed",
        "_resumes_avg",
        "_stored",
        "_stored_last",
        "_to_check",
        "backlog_lag",
        "drain",
        "holds",
        "lag",
        "lag_max",
        "overloaded",
        "per_resume",
        "rate",
        "read_hold",
        "resumes",
        "stalls",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, stored: Callable[[], int] | None = None
    ) -> None:
        """`stored`: how many publishes the gateway has stored so far (a counter that only
        grows; the stats' messages_received)."""
        self._loop = loop
        self._stored = stored if stored is not None else _nothing
        self._held: deque[Publisher] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._last_tick = 0.0
        # Delivery loops reported behind, and the order they are checked in (round robin).
        self._backlogged: dict[Backlogged, tuple[int, float]] = {}
        self._to_check: deque[Backlogged] = deque()
        # (wall-clock s, publishes stored by then), one per tick over HISTORY_S.
        self._history: deque[tuple[float, int]] = deque()
        self._position = 0.0  # publishes every subscriber has passed (see the module doc)
        self._stored_last = 0
        self._credit = 0.0  # publishes the round robin may still admit
        self._calm = 0  # ticks in a row with both lags under their release bounds
        self._hot = 0  # ticks in a row with a lag past its hold bound, while not holding
        self._resumed = 0  # connections resumed in the last tick
        self._admitted = 0.0  # publishes stored per tick, smoothed
        self._resumes_avg = 0.0  # connections resumed per tick, smoothed
        self.overloaded = False
        self.read_hold = False  # holding reading too (see READ_HOLD_BACKLOG_S)
        self.lag = 0.0  # the last tick's lateness, seconds
        self.lag_max = 0.0  # the largest lateness of a tick since start (metrics)
        self.stalls = 0  # ticks later than STALL_S (metrics: lmqtt_event_loop_stalls_total)
        self.backlog_lag = 0.0  # the oldest unsent message's age seen in the last tick, seconds
        self.drain = 0.0  # publishes/s the subscribers pass, smoothed
        self.rate = 0.0  # publishes/s admitted while holding
        self.per_resume = 1.0  # publishes a resumed connection hands in, smoothed
        self.holds = 0  # connections held so far (a counter for metrics)
        self.resumes = 0  # held connections resumed by the round robin while holding

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def backlogged(self) -> int:
        return len(self._backlogged)

    def start(self) -> None:
        self._last_tick = now = self._loop.time()
        self._stored_last = stored = self._stored()
        self._position = float(stored)
        self._due = now + IDLE_TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.overloaded = False
        self._backlogged.clear()
        self._to_check.clear()
        held = self._held
        while held:
            publisher = held.popleft()
            if not publisher.closed:
                publisher.release_publishing()

    def hold(self, publisher: Publisher) -> None:
        """`publisher` just handed in publishes while overloaded: stop reading from it."""
        publisher.hold_publishing()
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
        if lag > STALL_S:
            self.stalls += 1
            if lag > self.lag_max:
                self.lag_max = lag
        dt = max(now - self._last_tick, TICK_S / 10)
        self._last_tick = now
        wall = time.time()
        backlog = self._check_backlog(wall, now)
        self._measure(backlog, dt, wall)
        if self.overloaded or (lag <= LAG_HOLD_S and backlog <= BACKLOG_HOLD_S):
            self._hot = 0
        else:
            self._hot += 1
        if self._hot >= HOLD_TICKS:
            self._hot = 0
            self.overloaded = True
            self._credit = 0.0
            self._calm = 0
            log.warning(
                "overloaded (event loop %.0f ms behind, deliveries %.0f ms, draining %.0f "
                "msg/s): holding publishers",
                lag * 1000,
                backlog * 1000,
                self.drain,
            )
        self.read_hold = self.overloaded and (backlog > READ_HOLD_BACKLOG_S or lag > LAG_HOLD_S)
        if self.overloaded:
            self._admit(lag, backlog, dt)
            if lag < LAG_RELEASE_S and backlog < BACKLOG_RELEASE_S:
                # Caught up: once for CALM_TICKS in a row (while publishers publish, the round
                # robin never empties the held queue: a resumed device is held again at its
                # next PUBLISH), or at once when nobody is left held.
                self._calm += 1
                if self._calm >= CALM_TICKS or not self._held:
                    self.overloaded = False
                    log.info(
                        "caught up (admitting %.0f msg/s): releasing %d publishers",
                        self.rate,
                        len(self._held),
                    )
            else:
                self._calm = 0
        elif self._held:  # left from a hold that ended (stop() releases the rest)
            self._resume(RESUME_PER_TICK)
        if self.overloaded or self._held or lag > LAG_RELEASE_S or backlog > BACKLOG_RELEASE_S:
            self._due = now + TICK_S
        else:
            self._due = now + IDLE_TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def _measure(self, backlog: float, dt: float, wall: float) -> None:
        """Advance the slowest reader's position (publishes) and the drain estimate."""
        stored = self._stored()
        history = self._history
        history.append((wall, stored))
        while history and history[0][0] < wall - HISTORY_S:
            history.popleft()
        admitted = stored - self._stored_last
        self._stored_last = stored
        # What a resumed connection hands in, from the averages of both (a resumed connection
        # may be read over several turns, so the two are not counted in the same tick).
        self._admitted += DRAIN_WEIGHT * (admitted - self._admitted)
        self._resumes_avg += DRAIN_WEIGHT * (self._resumed - self._resumes_avg)
        if self._resumes_avg > 0.01:
            self.per_resume = max(self._admitted / self._resumes_avg, 1.0)
        position = float(stored) if backlog <= 0 else _stored_at(history, wall - backlog)
        # The position only moves forward (a subscriber joining the backlogged set may read
        # further behind than the last one did: that is no negative drain).
        position = max(position, self._position)
        self.drain += DRAIN_WEIGHT * ((position - self._position) / dt - self.drain)
        self._position = position

    def _admit(self, lag: float, backlog: float, dt: float) -> None:
        """Resume held connections, round robin, for this tick's share of the drain."""
        factor = 1.0 - (backlog - BACKLOG_TARGET_S) / CORRECT_S
        factor = min(max(factor, MIN_FACTOR), MAX_FACTOR)
        if lag > LAG_HOLD_S:  # the loop itself is late: admit less than it drained
            factor = min(factor, 0.5)
        self.rate = rate = max(self.drain * factor, MIN_RATE)
        self._credit = min(self._credit + rate * dt, rate * MAX_CREDIT_S)
        held = self._held
        if not held:
            self._resumed = 0
            return
        per_resume = self.per_resume
        resumed = 0
        while self._credit > 0 and held and resumed < RESUME_PER_TICK:
            publisher = held.popleft()
            if publisher.closed:
                continue
            # A QoS 1 device may send as many as the PUBACKs it gets; a connection whose reading
            # was paused hands in what its socket buffered (about per_resume).
            acks = publisher.release_publishing()
            self._credit -= acks if acks else per_resume
            resumed += 1
        self._resumed = resumed
        self.resumes += resumed

    def _resume(self, n: int) -> None:
        held = self._held
        resumed = 0
        while held and resumed < n:
            publisher = held.popleft()
            if not publisher.closed:
                publisher.release_publishing()
                resumed += 1
        self._resumed = resumed

    def _check_backlog(self, wall: float, now: float) -> float:
        """The largest delivery lag (s) among the loops checked this tick; caught-up loops are
        forgotten. Loops not checked this tick keep their last verdict through the round robin
        (with few backlogged loops, which is the usual case, all are checked every tick)."""
        to_check = self._to_check
        if not to_check:
            self.backlog_lag = 0.0
            return 0.0
        backlogged = self._backlogged
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


def _nothing() -> int:
    return 0


def _stored_at(history: deque[tuple[float, int]], wall: float) -> float:
    """Publishes stored by wall-clock time `wall`, interpolated between the ticks' samples
    (the oldest sample when `wall` is older than the history)."""
    i = bisect_left(history, wall, key=_first)
    if i == 0:
        return float(history[0][1])
    if i >= len(history):
        return float(history[-1][1])
    t0, c0 = history[i - 1]
    t1, c1 = history[i]
    return c0 + (c1 - c0) * (wall - t0) / max(t1 - t0, 1e-9)


def _first(sample: tuple[float, int]) -> float:
    return sample[0]
