"""ClientContext: what every connection uses, built once by the composition root."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.access.control import AccessControl
from gateway.config import GatewaySettings
from gateway.connection.dispatch import Handled, PacketDispatch
from gateway.connection.ingest import IngestBatch
from gateway.connection.node import ServerStatus
from gateway.connection.overload import OverloadGuard
from gateway.connection.timers import TimerWheel
from gateway.messages.publishing import PublishPath
from gateway.stats import GatewayStats

__all__ = ["ClientContext"]


@dataclass(slots=True)
class ClientContext:
    """What a connection uses, built once by the composition root (gateway/app.py) and shared
    by every connection: one attribute hop to each collaborator, as when connections held the
    whole gateway, but only these."""

    settings: GatewaySettings
    server: ServerStatus  # graceful stop (gateway/net/server.py ServerState)
    stats: GatewayStats
    access: AccessControl  # authentication, ACL, limits
    timers: TimerWheel  # connect timeout, keep-alive
    ingest: IngestBatch | None  # None in sync flush mode (gateway/connection/ingest.py)
    overload: OverloadGuard
    publisher: PublishPath
    packets: PacketDispatch  # the packet handlers
    # publisher.publish_route, bound once: the inline path validates and routes a topic new to
    # a connection with it, so the batch's C loop (gateway/messages/_batch.c) finds the route.
    route: Callable[[str], tuple[str, tuple[str, ...]]] = field(init=False)
    # packets.dispatch, bound once: the reader task hands it every packet but plain publishes.
    dispatch: Callable[[Handled, object], Awaitable[None]] = field(init=False)
    # The gateway's event loop, asked once (built in it): asyncio.get_running_loop() makes a
    # getpid() system call, and every connection needs the loop.
    loop: asyncio.AbstractEventLoop = field(init=False)

    def __post_init__(self) -> None:
        self.route = self.publisher.publish_route
        self.dispatch = self.packets.dispatch
        self.loop = asyncio.get_running_loop()
