"""TimerWheel: deadlines for many connections at O(what is due) per tick.

A sweep over every connection each second would cost a loop step that grows with the number of
connections, whatever is due. Here each connection has at most one live entry in a hashed wheel
of one-second slots, keyed by absolute tick number::

    slots: {tick -> {item: None, ...}}       tick = int(due / TICK_S), an ordered set per slot
    item.timer_due: float | None             the one deadline that counts for this item

Rescheduling is O(1) and usually free: keep-alive deadlines move on every packet, but nothing
touches the wheel then. When an entry comes due the item is asked (``on_due(now)``) and
returns its real next deadline (last activity + keep-alive, say) or None; the wheel re-inserts
it. ``schedule`` and ``cancel`` take the item's entry out of its slot (found from
``item.timer_due``) in O(1): an item has at most one entry, and a cancelled one none, so the
wheel keeps no reference to a closed connection until its old deadline comes.

Each turn of the wheel handles at most ``BUDGET`` entries and then yields to the event loop
(continuing on the next loop iteration), so even a burst of connections accepted in one second,
and so due in one slot, holds the loop for at most BUDGET entries at a time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

__all__ = ["Timed", "TimerWheel"]

log = logging.getLogger("lmqtt.gateway")

TICK_S = 1.0
# Entries handled per loop step before the wheel yields to the event loop: about 0.2 ms of
# on_due calls. The entries of a connect burst come due together (the CONNECT deadline's entry,
# connect_timeout after the accept: 10,000 devices connecting at ~2,700/s put ~3,000 in each of
# a few slots), and 500 a step held the loop ~1 ms per step, steps back to back: the messages
# of those turns waited 3-5 ms (the 10k @5k fleet's p99.9 bumps, a second apart).
BUDGET = 100


class Timed(Protocol):
    """What the wheel holds: an object with one deadline it can re-check itself."""

    timer_due: float | None

    def on_due(self, now: float) -> float | None:
        """Called at (or just after) ``timer_due``: the next deadline, or None for no more."""


class TimerWheel:
    """One-second slots of items; ``start()`` runs the wheel on the loop, ``stop()`` ends it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick: float = TICK_S) -> None:
        self._loop = loop
        self._tick = tick
        self._slots: dict[int, dict[Timed, None]] = {}
        self._next = int(loop.time() / tick)  # first slot not yet handled
        self._task: asyncio.Task[None] | None = None
        self.entries = 0  # entries in the slots, live and stale

    def __len__(self) -> int:
        return self.entries

    def schedule(self, item: Timed, due: float) -> None:
        """Make ``due`` the item's deadline (replacing any earlier one and its entry); O(1)."""
        self._drop(item)
        item.timer_due = due
        self._insert(item, due)

    def cancel(self, item: Timed) -> None:
        """No deadline for ``item`` any more; its entry goes now (O(1))."""
        self._drop(item)
        item.timer_due = None

    def _insert(self, item: Timed, due: float) -> None:
        slot = max(int(due / self._tick), self._next)
        bucket = self._slots.get(slot)
        if bucket is None:
            self._slots[slot] = {item: None}
        else:
            bucket[item] = None
        self.entries += 1

    def _drop(self, item: Timed) -> None:
        """Take out the entry of ``item``'s current deadline, if it has one still waiting: it
        is in slot max(tick of the deadline, first slot not yet handled), since a deadline
        whose tick had passed went to the first slot not handled when it was inserted, and
        the slots before the current one have been handled (their entries are gone)."""
        due = item.timer_due
        if due is None:
            return
        bucket = self._slots.get(max(int(due / self._tick), self._next))
        if bucket is not None and item in bucket:
            del bucket[item]
            self.entries -= 1

    def start(self) -> None:
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            now = self._loop.time()
            await self.advance(now)
            await asyncio.sleep((int(now / self._tick) + 1) * self._tick - now + 0.001)

    async def advance(self, now: float) -> int:
        """Handle every slot up to ``now``; returns how many items were called."""
        called = 0
        handled = 0
        last = int(now / self._tick)
        while self._next <= last:
            slot = self._next
            bucket = self._slots.get(slot)
            if not bucket:
                self._slots.pop(slot, None)
                self._next += 1
                continue
            item, _ = bucket.popitem()
            self.entries -= 1
            due = item.timer_due
            if due is not None and max(int(due / self._tick), slot) == slot:
                called += 1
                try:
                    after = item.on_due(now)
                except Exception:
                    log.exception("timer of %r failed", item)
                    after = None
                if after is None:
                    item.timer_due = None
                else:
                    # Never back into the slot being handled: an item answering "now" again
                    # is looked at next tick, not in a loop.
                    self.schedule(item, max(after, (slot + 1) * self._tick))
            handled += 1
            if handled >= BUDGET:
                handled = 0
                await asyncio.sleep(0)  # let the loop breathe
        return called
