"""ExpiryTicks: when offline sessions expire, with one event-loop timer for all of them.

Each session due is kept in the first EXPIRY_TICK_MS tick at or after its expiry (a dict per
tick, the ticks in a heap); one loop timer is armed for the earliest tick. A timer per session
would cost a loop timer handle each, and a system call (getpid, asking the running loop) to
make it, at every disconnect. A tick emptied by sessions whose devices came back goes at
once, its heap entry with the next rebuild of the heap: memory follows the sessions offline,
not the time the gateway has run.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from typing import Generic, TypeVar

from gateway.clock import now_ms

__all__ = ["EXPIRY_TICK_MS", "ExpiryTicks"]

#: The expiry's resolution: a session expires at most this many ms after its due time.
EXPIRY_TICK_MS = 100
# The heap is rebuilt from the live ticks when it holds more than twice as many (plus this).
_SLACK = 64

S = TypeVar("S")


class ExpiryTicks(Generic[S]):
    """Sessions (by client id) due at a wall-clock time (ms); `on_due(session)` for each
    once it is due, unless discarded first."""

    def __init__(self, on_due: Callable[[S], None]) -> None:
        self._on_due = on_due
        self._ticks: dict[int, dict[str, S]] = {}  # tick -> client id -> session
        self._tick_of: dict[str, int] = {}  # client id -> its tick
        self._heap: list[int] = []  # the ticks (and, until a rebuild, some emptied ones)
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        """Sessions due."""
        return len(self._tick_of)

    @property
    def heap_size(self) -> int:
        """Ticks kept in the heap, emptied ones included (bounded: see the module docstring)."""
        return len(self._heap)

    def add(self, client_id: str, session: S, at_ms: int) -> None:
        """`session` is due at `at_ms` (replacing when it was due before)."""
        if client_id in self._tick_of:
            self.discard(client_id)
        tick = -(-at_ms // EXPIRY_TICK_MS)
        due = self._ticks.get(tick)
        if due is None:
            due = self._ticks[tick] = {}
            heapq.heappush(self._heap, tick)
            if self._heap[0] == tick:
                self._arm()
        due[client_id] = session
        self._tick_of[client_id] = tick

    def discard(self, client_id: str) -> None:
        """`client_id` is not due any more (it came back, or ended otherwise)."""
        tick = self._tick_of.pop(client_id, None)
        if tick is None:
            return
        due = self._ticks.get(tick)
        if due is None:
            return  # its tick is being expired now
        del due[client_id]
        if not due:
            del self._ticks[tick]
            if len(self._heap) > 2 * len(self._ticks) + _SLACK:
                self._heap = list(self._ticks)
                heapq.heapify(self._heap)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        """The timer, for the earliest tick."""
        self.close()
        if self._heap:
            delay = max(0.0, (self._heap[0] * EXPIRY_TICK_MS - now_ms()) / 1000)
            self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        """`on_due` for the sessions of every tick that is due."""
        self._timer = None
        now = now_ms()
        while self._heap and self._heap[0] * EXPIRY_TICK_MS <= now:
            due = self._ticks.pop(heapq.heappop(self._heap), None)
            if due is None:
                continue  # emptied by discards
            for client_id, session in list(due.items()):
                del self._tick_of[client_id]
                self._on_due(session)
        self._arm()
