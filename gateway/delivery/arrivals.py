"""ArrivalHub: the store's arrival notices, routed to whoever reads the queue that grew.

Long polling: a delivery loop or a shared group watches the light queues it reads and sleeps
until the store reports an append to one of them (Storage.add_listener). The store calls
`on_arrival` synchronously on the loop thread after dispatch (or from its flusher thread,
handed over with call_soon_threadsafe), so no notice falls between "found nothing" and "sleep".
The embedded store tells a whole append batch's queue ends in one call (`on_arrivals`): one
call per batch rather than one per queue it touched. A notice carries the queue's end at the
time ("ends at least here"): a reader that has read up to it is caught up with every append
notified so far, and any later append brings a notice of its own.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Protocol, TypeVar

K = TypeVar("K")
V = TypeVar("V")


def table_add(table: dict[K, V | set[V]], key: K, value: V) -> bool:
    """Add `value` under `key` of a table that maps a key to its one value itself, and to a
    set only once a second one comes (see ArrivalHub). True when `key` is new."""
    found = table.get(key)
    if found is None:
        table[key] = value
        return True
    if isinstance(found, set):
        found.add(value)
    elif found is not value:
        table[key] = {found, value}
    return False


def table_discard(table: dict[K, V | set[V]], key: K, value: V) -> bool:
    """Remove `value` from under `key` (table_add's layout). True when `key` is gone."""
    found = table.get(key)
    if found is value:
        del table[key]
        return True
    if isinstance(found, set):
        found.discard(value)
        if len(found) == 1:
            table[key] = next(iter(found))
    return False


class Watcher(Protocol):
    """A reader of light queues: a session's delivery loop, or a shared group."""

    def arrived(self, queue: str, end: int) -> None:
        """`queue` grew: it ends at least at offset `end` (its next free offset)."""


class ArrivalHub:
    """The store's ArrivalListener: wakes whoever reads a queue when it grows.

    Most queues have one reader (a device's own command topic), so a queue maps to its watcher
    itself, and only to a set of them when a second one comes: a set per device costs 216
    bytes, a bound-method partial per watch another ~360 (memory per device is what limits
    how many fit).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._waiters: dict[str, Watcher | set[Watcher]] = {}
        # The delivery account, watching the queues of offline sessions to sample their lag:
        # told like the others, but no reader of the queue (`watchers` leaves it out).
        self.sampler: Watcher | None = None

    def watch(self, queue: str, watcher: Watcher) -> None:
        table_add(self._waiters, queue, watcher)

    def unwatch(self, queue: str, watcher: Watcher) -> None:
        table_discard(self._waiters, queue, watcher)

    def watchers(self, queue: str) -> int:
        """How many delivery loops (or shared groups) read `queue` now."""
        found = self._waiters.get(queue)
        if found is None:
            return 0
        if isinstance(found, set):
            return len(found) - (self.sampler in found)
        return 0 if found is self.sampler else 1

    def on_arrival(self, queue: str, max_offset: int) -> None:
        if queue not in self._waiters:
            return
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._notify, queue, max_offset)
        else:
            self._notify(queue, max_offset)

    def on_arrivals(self, ends: dict[str, int]) -> None:
        """The queue ends of one append batch (the store's batch notice): each watcher is
        told of its queues, in this one call."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.on_arrivals, dict(ends))
            return
        waiters = self._waiters
        for queue, end in ends.items():
            found = waiters.get(queue)
            if found is None:
                continue
            if isinstance(found, set):
                for watcher in tuple(found):
                    watcher.arrived(queue, end)
            else:
                found.arrived(queue, end)

    def _notify(self, queue: str, end: int) -> None:
        found = self._waiters.get(queue)
        if found is None:
            return
        if isinstance(found, set):
            for watcher in tuple(found):
                watcher.arrived(queue, end)
        else:
            found.arrived(queue, end)
