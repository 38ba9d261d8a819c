"""What a connection sees of the node it runs on: the server's graceful stop (ServerStatus) and
cluster mode (ClusterLink; SingleNode when the gateway is the only node)."""

from __future__ import annotations

from typing import Protocol

from gateway.session.model import Connected, Session

__all__ = ["ClusterLink", "ServerStatus", "SingleNode"]


class ServerStatus(Protocol):
    """What a connection reads of the server's state (gateway/net/server.py ServerState)."""

    @property
    def stopping(self) -> bool:
        """A graceful stop has begun: no new CONNECT, closes are not drawn out."""
        ...


class ClusterLink(Protocol):
    """What a connection sees of cluster mode (gateway/cluster/node.py Cluster); SingleNode when
    the gateway is the only node."""

    async def before_connect(self, client_id: str, conn: Connected, clean_start: bool) -> None:
        """A CONNECT arrived: the session records other nodes wrote so far applied here (a
        session connected on another node handed over by it)."""
        ...

    async def connected(
        self, client_id: str, conn: Connected, clean_start: bool, session: Session
    ) -> None:
        """Before CONNACK: the id claimed on every node (takeover), the session record
        durable, its in-flight messages read for their resend."""
        ...

    def answered(self, client_id: str, conn: Connected) -> None:
        """`conn`'s CONNACK was written (a takeover read meanwhile closes it now)."""
        ...

    def released(self, client_id: str, conn: Connected) -> None: ...

    async def subscribed(self) -> None:
        """Before SUBACK: every node routes to this node's new filters."""
        ...

    async def retained_caught_up(self) -> None:
        """Before a SUBSCRIBE's retained messages: those set through other nodes known."""
        ...

    def connection_ended(self, session: Session) -> None:
        """After SessionLifecycle.connection_ended: the other nodes learn it."""
        ...


class SingleNode:
    """No cluster: nothing to tell anyone."""

    async def before_connect(self, client_id: str, conn: Connected, clean_start: bool) -> None:
        return None

    async def connected(
        self, client_id: str, conn: Connected, clean_start: bool, session: Session
    ) -> None:
        return None

    def answered(self, client_id: str, conn: Connected) -> None:
        return None

    def released(self, client_id: str, conn: Connected) -> None:
        return None

    async def subscribed(self) -> None:
        return None

    async def retained_caught_up(self) -> None:
        return None

    def connection_ended(self, session: Session) -> None:
        return None
