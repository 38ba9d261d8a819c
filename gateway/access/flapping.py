"""Flapping detection: a client id that connects too often is banned for a while.

A client stuck in a reconnect loop (a firmware bug, a session taken over by a twin with the
same id) costs the gateway a CONNECT, a session start and a takeover each time. When one client
id connects more than `flapping_max_connects` times within `flapping_window` seconds, it is
banned (gateway/access/bans.py, reason "flapping") for `flapping_ban` seconds: durably, so
every cluster node refuses it, and once, logged with the figures.

The window slides: each client id keeps the times of its last connects within the window (at
most flapping_max_connects of them). The table of client ids is bounded: the least recently
seen ids are forgotten first, so a fleet connecting at once cannot grow it without end (a
flapping id, seen again and again, stays at the recent end). Client ids the gateway assigned
(an empty one in CONNECT) are new each time and are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.bounded import trim_oldest

__all__ = ["FlappingDetector"]

MAX_TRACKED_CLIENTS = 65_536


class FlappingDetector:
    """Counts connects per client id (see the module docstring)."""

    def __init__(
        self,
        max_connects: int,
        window_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = MAX_TRACKED_CLIENTS,
    ) -> None:
        self.max_connects = max_connects
        self.window_s = window_s
        self._clock = clock
        self._max_clients = max_clients
        # client id -> its connect times, in order: a lone float for one connect (what most
        # clients made in the window), a list from the second (a list per device costs ~88
        # bytes, the float 24)
        self._seen: dict[str, float | list[float]] = {}
        self.bans = 0  # clients found flapping

    @property
    def enabled(self) -> bool:
        return self.max_connects > 0

    def connecting(self, client_id: str) -> int:
        """Count a connect of `client_id`; returns how many it made within the window when
        that is more than max_connects (it is flapping: its count starts over), else 0."""
        now = self._clock()
        seen = self._seen
        found = seen.pop(client_id, None)
        times: float | list[float]
        if found is None:
            times = now
        else:
            times = found if isinstance(found, list) else [found]
            start = now - self.window_s
            if times[0] <= start:
                times = [t for t in times if t > start]
            if len(times) >= self.max_connects:
                self.bans += 1
                return len(times) + 1
            times.append(now)
        seen[client_id] = times  # the most recently seen last (dicts keep insertion order)
        trim_oldest(seen, self._max_clients)
        return 0

    def would_ban(self, client_id: str) -> bool:
        """Whether a connect of `client_id` now would find it flapping (connecting() would
        return a count); nothing is counted. A False stays False until its next connect: the
        window only moves on."""
        found = self._seen.get(client_id)
        if found is None or self.max_connects <= 0:
            return False
        start = self._clock() - self.window_s
        if not isinstance(found, list):
            return found > start and self.max_connects <= 1
        return sum(1 for t in found if t > start) >= self.max_connects

    def __len__(self) -> int:
        return len(self._seen)
