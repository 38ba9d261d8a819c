"""Will messages: published when a connection ends without a normal DISCONNECT.

Timing (MQTT 5 3.1.3.2.2): the will waits `will_delay_interval` seconds, or until the session
ends, whichever is first; a new connection to the same session before then cancels it.
With no delay (and always for MQTT 3.1.1) it is published at once. The will's JSON form in
the session record is gateway/session.py's (will_to_json).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.protocol import Will

log = logging.getLogger("lmqtt.gateway")

WillPublisher = Callable[[str, Will], Awaitable[None]]


class WillScheduler:
    """Pending (delayed) wills by client id."""

    def __init__(self, publish: WillPublisher) -> None:
        self._publish = publish
        self._pending: dict[str, tuple[Will, asyncio.TimerHandle]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._pending)

    def schedule(self, client_id: str, will: Will, delay_s: float) -> None:
        """Publish `will` after `delay_s` (0 = now) unless cancelled first."""
        self.cancel(client_id)
        if delay_s <= 0:
            self._fire(client_id, will)
            return
        loop = asyncio.get_running_loop()
        handle = loop.call_later(delay_s, self._due, client_id)
        self._pending[client_id] = (will, handle)

    def cancel(self, client_id: str) -> bool:
        """The session resumed: drop the pending will. True if there was one."""
        entry = self._pending.pop(client_id, None)
        if entry is None:
            return False
        entry[1].cancel()
        return True

    def fire_now(self, client_id: str) -> None:
        """The session ended before the delay passed: publish at once."""
        entry = self._pending.pop(client_id, None)
        if entry is not None:
            entry[1].cancel()
            self._fire(client_id, entry[0])

    def _due(self, client_id: str) -> None:
        entry = self._pending.pop(client_id, None)
        if entry is not None:
            self._fire(client_id, entry[0])

    def _fire(self, client_id: str, will: Will) -> None:
        task = asyncio.get_running_loop().create_task(self._run(client_id, will))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, client_id: str, will: Will) -> None:
        try:
            await self._publish(client_id, will)
        except Exception:
            log.exception("publishing the will of %r failed", client_id)

    async def drain(self) -> None:
        """Wait for wills being published right now (shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def cancel_all(self) -> None:
        for _, handle in self._pending.values():
            handle.cancel()
        self._pending.clear()
