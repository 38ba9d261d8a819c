"""Cluster mode: several gateway nodes on one RocketMQ namespace (`rocketmq_topic`), as one server.

The parts, each in its module:

    gateway/cluster_bus.py      the %CLUSTER% light queue every node writes and tails
    gateway/membership.py       node ids, heartbeats, leases, fencing, the leader
    gateway/filter_registry.py  every node routes to every node's filters; SUBACK waits for
                                the live nodes' acknowledgements (no gap after SUBACK)
    gateway/takeover.py         a client id connecting on one node closes it on the others
    gateway/node_wills.py       the wills of a lost node's clients, published by the leader
    gateway/rocketmq_storage.py the state log: records stamped with their writer, tailed by
                                every node, compacted by the leader only

`Cluster` joins them for the composition root (gateway/app.py) and is what a connection sees
of the cluster (gateway/client.py ClusterLink). On the embedded store there is one node and
no cluster (client.py's SingleNode). docs/rocketmq.md, "Several gateway nodes", has the
design, the guarantees and what is not done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.cluster_bus import ClusterBus
from gateway.filter_registry import ClusterFilters
from gateway.membership import Membership
from gateway.node_wills import NodeWills
from gateway.publishing import PublishPath
from gateway.session import Connected
from gateway.storage import Storage
from gateway.takeover import ClusterTakeover

log = logging.getLogger("lmqtt.cluster")


class ClusterStorage(Storage, Protocol):
    """What cluster mode needs of storage beyond the port (RocketMqStorage has it)."""

    node_id: str

    async def settle(self) -> None:
        """Wait until every append made so far was answered (stored or refused)."""
        ...

    def written_by(self, node: str) -> list[tuple[str, bytes]]: ...

    def writer_of(self, key: str) -> str | None:
        """The node whose record of `key` is the newest (None: unknown or deleted)."""
        ...

    def set_compaction_gate(self, allowed: Callable[[], bool]) -> None: ...

    def follow_state(self) -> None:
        """Tail the state log, applying the other nodes' records."""
        ...


def supports_cluster(store: Storage) -> bool:
    return callable(getattr(store, "settle", None)) and hasattr(store, "node_id")


class Cluster:
    """This node's membership of the cluster (see the module docstring)."""

    def __init__(
        self,
        store: ClusterStorage,
        publisher: PublishPath,
        *,
        lease_s: float,
        heartbeat_s: float,
    ) -> None:
        self.store = store
        self.bus = ClusterBus(store, store.node_id)
        self.membership = Membership(self.bus, lease_s=lease_s, heartbeat_s=heartbeat_s)
        self.filters = ClusterFilters(
            self.bus, self.membership, publisher, store.settle, store.close_queue
        )
        self._cancel_will: Callable[[str], None] = lambda _cid: None
        self.takeover = ClusterTakeover(self.bus, lambda cid: self._cancel_will(cid))
        self.wills = NodeWills(self.bus, self.membership, store, publisher.store_publish)
        publisher.fenced = self.membership.is_fenced
        store.set_compaction_gate(self.membership.is_leader)

    @property
    def node_id(self) -> str:
        return self.bus.node_id

    async def join(self) -> None:
        """Tail the bus and announce this node; returns when it knows the other nodes and
        their filters (before the gateway listens for clients)."""
        self.store.follow_state()
        await self.bus.start()
        await self.membership.join()

    def foreign(self, client_id: str) -> bool:
        """True when a live node other than this one wrote `client_id`'s session record last:
        that node serves it; this one does not restore it."""
        writer = self.store.writer_of("session/" + client_id)
        return writer is not None and writer in self.membership.live_peers()

    def set_will_canceller(self, cancel: Callable[[str], None]) -> None:
        self._cancel_will = cancel

    def on_fenced(self, callback: Callable[[], None]) -> None:
        self.membership.on_fenced.append(callback)

    # -- ClusterLink (gateway/client.py) -----------------------------------------------------

    async def connected(
        self,
        client_id: str,
        conn: Connected,
        clean_start: bool,
        save: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """Before CONNACK: claim the id cluster-wide (takeover) and, for a will, make the
        session record durable (a survivor publishes it if this node dies)."""
        if save is not None:
            await asyncio.gather(self.takeover.claim(client_id, conn, clean_start), save())
        else:
            await self.takeover.claim(client_id, conn, clean_start)

    def answered(self, client_id: str, conn: Connected) -> None:
        self.takeover.answered(client_id, conn)

    def released(self, client_id: str, conn: Connected) -> None:
        self.takeover.release(client_id, conn)

    async def subscribed(self) -> None:
        await self.filters.settled()

    # -- stop ------------------------------------------------------------------------------

    async def leave(self) -> None:
        self.wills.stop()
        await self.membership.leave()

    def close(self) -> None:
        self.bus.close()
