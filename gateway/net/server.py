"""The listener's asyncio Protocol: it only moves bytes and flow-control signals.

Parsing, sessions and delivery live in ClientConnection; this class is the seam with the event
loop (uvicorn's h11_impl shape). Write-buffer limits make `pause_writing` fire when a slow
subscriber's socket backs up, which pauses that subscriber's delivery loop, so memory per
connection stays bounded by the high-water mark plus one batch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from gateway.access.limits import socket_limit
from gateway.connection.client import ClientConnection
from gateway.connection.context import ClientContext

log = logging.getLogger("lmqtt.gateway")

WRITE_HIGH_WATER = 256 * 1024
WRITE_LOW_WATER = 64 * 1024


@dataclass(slots=True)
class ServerState:
    """What the listeners and every connection share (uvicorn's ServerState): whether a
    graceful stop has begun, and the open connections."""

    stopping: bool = False
    connections: set[ClientConnection] = field(default_factory=set)


def _unread(data: bytes) -> None:
    """A refused connection's reads (its transport is aborted: none come)."""


class MqttServerProtocol(asyncio.Protocol):
    # One per connection: no __dict__. `data_received` is a slot, not a method: it holds the
    # connection's `feed` (see connection_made).
    __slots__ = ("client", "ctx", "data_received", "state")

    def __init__(self, context: ClientContext, state: ServerState) -> None:
        self.ctx = context
        self.state = state
        self.client: ClientConnection | None = None
        self.data_received = _unread  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # uvloop's transports implement the interface without subclassing asyncio.Transport
        # (typed so here: no typing.cast call per connection).
        # Up to socket_limit(), CONNECT is answered with "quota exceeded"
        # (gateway/access/control.py); beyond it, sockets are closed unread.
        ctx = self.ctx
        connections = self.state.connections
        limit = socket_limit(ctx.settings.max_connections)
        if len(connections) >= limit or self.state.stopping:
            log.warning("connection refused: %d connections open", len(connections))
            transport.abort()
            return
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        client = self.client = ClientConnection(ctx, transport)
        connections.add(client)
        # Every read goes straight to the connection: the transport calls the bound method it
        # caches at set_protocol (uvloop) or looks up per read (asyncio, TLS, WebSocket), and
        # either way finds `feed`: no forwarding method, a Python call less per read.
        self.data_received = client.feed  # type: ignore[method-assign]
        try:
            transport.set_protocol(self)
        except NotImplementedError:
            pass  # a transport of our own (WebSocketTransport): it looks the method up per read

    def eof_received(self) -> bool:
        if self.client is not None:
            self.client.feed_eof()
        return True  # keep the transport until the reader has handled what was buffered

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client is not None:
            self.state.connections.discard(self.client)
            self.client.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.client is not None:
            self.client.pause_writing()

    def resume_writing(self) -> None:
        if self.client is not None:
            self.client.resume_writing()
