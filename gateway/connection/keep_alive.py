"""KeepAlive: a client connection's deadlines, kept in the gateway's timer wheel.

A socket must send its CONNECT within settings.connect_timeout; a connected client must not
stay silent for 1.5 x its keep-alive (MQTT 3.1.1 3.1.2.10, 5.0 3.1.2.10; the server keep-alive
when the gateway imposed one). Each connection has one entry in the wheel
(gateway/connection/timers.py), not a timer of its own: reading a packet only moves
`_last_rx`, and the wheel asks `on_due` when the entry comes round, which answers the next
deadline to look again or closes the connection.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.connection.context import ClientContext
from gateway.connection.transport import ClientTransport
from gateway.protocol import ReasonCode
from gateway.session.model import Session

__all__ = ["KeepAlive"]

log = logging.getLogger("lmqtt.gateway")


class KeepAlive(ClientTransport):
    """The deadlines of one connection (the base of ClientConnection, which reads `_last_rx`'s
    moves into its read path and supplies `session`, `client_id` and `close`)."""

    __slots__ = ("_last_rx", "_opened", "timer_due")

    # ClientConnection's, read here.
    session: Session | None
    client_id: str

    def __init__(self, context: ClientContext, transport: asyncio.Transport) -> None:
        super().__init__(context, transport)
        self._opened = self._last_rx = self._loop.time()  # one float until the first packet
        self.timer_due: float | None = None
        context.timers.schedule(self, self._opened + context.settings.connect_timeout)

    @property
    def opened(self) -> float:
        """Event-loop time the connection was accepted (the live view reads it)."""
        return self._opened

    def close(
        self, reason: int | None = None, *, abnormal: bool = True, linger: bool = True
    ) -> None:
        raise NotImplementedError  # ClientConnection.close

    def start_keep_alive(self) -> None:
        """The CONNECT was answered: the keep-alive deadline runs from now. The wheel keeps
        the CONNECT deadline's entry when that comes first: on_due then answers the
        keep-alive deadline (the wheel's lazy re-check), so a connection that closes before
        it (a session created and left) never moves its entry."""
        self._last_rx = now = self._loop.time()
        keep_alive = self.conn.keep_alive_timeout
        if keep_alive is not None:
            due = self.timer_due
            if due is None or now + keep_alive < due:
                self.ctx.timers.schedule(self, now + keep_alive)

    def on_due(self, now: float) -> float | None:
        """Timer wheel: close a socket that sent no CONNECT in time, or a client silent for
        1.5 x its keep-alive (the server keep-alive when we imposed one); else the next
        deadline to look again (the wheel's lazy re-check)."""
        if self.closed:
            return None
        if self.conn.protocol_level is None:
            timeout = self.ctx.settings.connect_timeout
            if now - self._opened >= timeout:
                log.info("%s: no CONNECT within %.1f s; closing", self.peer, timeout)
                self.close()
                return None
            return self._opened + timeout
        if self.session is None:
            return now + 1.0  # CONNECT still being handled (authentication)
        keep_alive = self.conn.keep_alive_timeout
        if keep_alive is None:
            return None
        if self._reading_paused or self._held:
            # We stopped reading it (overload guard, backlog) or hold the PUBACKs its window
            # waits for (overload guard): its silence is ours.
            self._last_rx = now
        idle = now - self._last_rx
        if idle >= keep_alive:
            log.info("%r: keep-alive timeout (%.1f s idle); closing", self.client_id, idle)
            self.close(ReasonCode.KEEP_ALIVE_TIMEOUT)
            return None
        return self._last_rx + keep_alive
