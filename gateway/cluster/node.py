"""Cluster mode: several gateway nodes on one RocketMQ namespace (`rocketmq_topic`), as one server.

The parts, each in its module:

    gateway/cluster/bus.py      the %CLUSTER% light queue every node writes and tails
    gateway/cluster/membership.py       node ids, heartbeats, leases, fencing, the leader
    gateway/cluster/filter_registry.py  every node routes to every node's filters; SUBACK waits for
                                the live nodes' acknowledgements (no gap after SUBACK)
    gateway/cluster/takeover.py         a client id connecting on one node closes it on the others
    gateway/cluster/handover.py         ... and that node hands the session's exact state over
    gateway/cluster/node_wills.py       the wills of a lost node's clients, published by the leader
    gateway/cluster/shared.py   a share group's members on every node get each message once
    gateway/cluster/sessions.py a persistent session resumes on any node (the other nodes'
                                session records adopted); retained messages caught up
    gateway/storage/rocketmq/adapter.py the state log: records stamped with their writer, tailed by
                                every node, compacted by the leader only

`Cluster` joins them for the composition root (gateway/app.py) and is what a connection sees
of the cluster (gateway/connection/node.py ClusterLink). On the embedded store there is one node
and no cluster (node.py's SingleNode). docs/rocketmq.md, "Several gateway nodes", has the
design, the guarantees and what is not done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from pydantic_core import from_json, to_json

from gateway.cluster.bus import ClusterBus, Record
from gateway.cluster.filter_registry import ClusterFilters
from gateway.cluster.handover import NO_HAND, Handover
from gateway.cluster.membership import Membership
from gateway.cluster.node_wills import NodeWills
from gateway.cluster.sessions import ClusterSessions, Counted
from gateway.cluster.shared import ClusterShares
from gateway.cluster.takeover import ClusterTakeover
from gateway.delivery.arrivals import ArrivalHub
from gateway.delivery.shared import SharedSubscriptions
from gateway.messages.publishing import PublishPath
from gateway.session.model import Connected, Session
from gateway.session.registry import SESSION_KEY_PREFIX, SessionRegistry
from gateway.storage.port import StateRecord, Storage, StoreError

log = logging.getLogger("lmqtt.cluster")

#: How long a CONNECT waits for the hand-over of a session connected on another node, in
#: heartbeat periods (at most the lease).
HANDOVER_HEARTBEATS = 3
#: A CONNECT of a lost node's session waits this long at most for that node's fence marker.
FENCED_WAIT_S = 10.0


class ClusterStorage(Storage, Protocol):
    """What cluster mode needs of storage beyond the port (RocketMqStorage has it)."""

    node_id: str

    async def settle(self) -> None:
        """Wait until every append made so far was answered (stored or refused)."""
        ...

    def written_by(self, node: str) -> list[tuple[str, bytes]]: ...

    def state_writers(self) -> set[str]: ...

    def writer_of(self, key: str) -> str | None:
        """The node whose record of `key` is the newest (None: unknown or deleted)."""
        ...

    def state_value(self, key: str) -> bytes | None:
        """The newest value of state record `key` (None: none)."""
        ...

    def set_compaction_gate(self, allowed: Callable[[], bool]) -> None: ...

    def follow_state(self) -> None:
        """Tail the state log, applying the other nodes' records."""
        ...

    def add_state_observer(self, observer: Callable[[str, list[StateRecord]], None]) -> None: ...

    async def catch_up_state(self) -> None: ...

    async def catch_up_queue(self, queue: str) -> None: ...

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None: ...

    def fence(self, node: str) -> None:
        """`node` is lost: the state log's readers ignore what it writes from now on."""
        ...

    async def fenced(self, node: str) -> None:
        """Once that fence is in the log and applied here."""
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
        self._publisher = publisher
        self.sessions: ClusterSessions | None = None  # share_sessions
        self.bus = ClusterBus(store, store.node_id)
        self.membership = Membership(self.bus, lease_s=lease_s, heartbeat_s=heartbeat_s)
        self.filters = ClusterFilters(
            self.bus, self.membership, publisher, store.settle, store.close_queue
        )
        self._cancel_will: Callable[[str], None] = lambda _cid: None
        # First of the loss handlers: the fence marker goes out before any takeover's writes
        # (gateway/storage/rocketmq/fences.py).
        self.membership.on_lost.append(store.fence)
        self.takeover = ClusterTakeover(self.bus, lambda cid: self._cancel_will(cid), self._moved)
        self.handover = Handover(self.bus, self._state_durable)
        self.wills = NodeWills(
            self.bus, self.membership, store, publisher.store_publish, self._adopt_own
        )
        # Built before the bus is tailed: it must read this node's own "join".
        self.shares = ClusterShares(self.bus, self.membership, store)
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

    def share_groups(self, shared: SharedSubscriptions, arrivals: ArrivalHub) -> None:
        """Share groups span the nodes (cluster_shared.py); before any group is created."""
        self.shares.attach(shared, arrivals)

    def set_will_canceller(self, cancel: Callable[[str], None]) -> None:
        self._cancel_will = cancel

    def share_sessions(self, registry: SessionRegistry, stats: Counted) -> None:
        """After the sessions were restored (without the live nodes' ones, `foreign`): adopt
        those and every session record other nodes write from now on (cluster_sessions.py).
        Called with no await since the restore, so no record falls in between."""
        store = self.store

        def newest(client_id: str) -> tuple[str | None, bytes | None]:
            key = SESSION_KEY_PREFIX + client_id
            writer = store.writer_of(key)
            if writer == self.node_id:
                return None, None  # this node's own: nothing to adopt
            return writer, store.state_value(key)

        sessions = self.sessions = ClusterSessions(
            store,
            registry,
            self._publisher,
            stats,
            newest=newest,
            cancel_will=lambda cid: self._cancel_will(cid),
            handover=self.handover,
            mine=lambda cid: store.writer_of(SESSION_KEY_PREFIX + cid) == self.node_id,
        )
        n = len(SESSION_KEY_PREFIX)
        for key, value in self.store.state_records():
            if key.startswith(SESSION_KEY_PREFIX) and self.foreign(key[n:]):
                sessions.adopt(key[n:], value)
        self.store.add_state_observer(sessions.observe)

        def claimed(rec: Record) -> None:  # after the takeover's handler (registered first)
            if rec["n"] == self.node_id:
                return
            prev = self.takeover.previous(rec["c"], rec["n"], rec["i"])
            if prev is not None and prev[0] != self.node_id:
                return  # the session is the previous claim's node's to hand over
            sessions.claimed_elsewhere(rec)

        self.bus.on("conn", claimed)

    def _adopt_own(self, client_id: str, value: bytes | None) -> None:
        """A record this node wrote for a gone node's session (node_wills.py): this node's copy
        follows it as the other nodes' do."""
        if self.sessions is not None:
            self.sessions.adopt(client_id, value)

    def _moved(self, client_id: str, claim: Record) -> None:
        if self.sessions is not None:
            self.sessions.taken_over(client_id, claim)

    async def _state_durable(self) -> None:
        store = self.store
        await store.wait_state_durable(store.append_state([]))

    def _connected_at(self, client_id: str) -> str | None:
        """The node other than this one on which `client_id` is connected by the newest record
        of its session, live or not (None: none, or not known here)."""
        key = SESSION_KEY_PREFIX + client_id
        writer = self.store.writer_of(key)
        if writer is None or writer == self.node_id:
            return None
        value = self.store.state_value(key)
        try:
            connected = value is not None and from_json(value).get("disconnected_at_ms") is None
        except ValueError:
            return None
        return writer if connected else None

    def on_fenced(self, callback: Callable[[], None]) -> None:
        self.membership.on_fenced.append(callback)

    # -- ClusterLink (gateway/connection/node.py)
    # -----------------------------------------------------

    async def before_connect(self, client_id: str, conn: Connected, clean_start: bool) -> None:
        """A CONNECT arrived: the state log applied to its end; a session connected on another
        live node is claimed now and handed over by that node (gateway/cluster/handover.py)."""
        sessions = self.sessions
        if sessions is None:
            return
        await sessions.before_connect(client_id)
        holder = None if clean_start else self._connected_at(client_id)
        if holder is None:
            return  # the record is exact (written at the disconnect)
        live = self.membership.live_peers
        if holder not in live():
            if holder in self.membership.lost:
                # Its record as every reader has it: what it wrote after its fence is no one's.
                try:
                    await asyncio.wait_for(self.store.fenced(holder), FENCED_WAIT_S)
                except (StoreError, TimeoutError) as exc:
                    log.warning("%r: the fence of lost node %s not read back: %s",
                                client_id, holder, exc)  # fmt: skip
            sessions.mark_behind(client_id)  # its node crashed: the broker's offsets are fresher
            return
        takeover, handover = self.takeover, self.handover
        wait = handover.expect(client_id)
        try:
            try:
                seq = await takeover.claim(client_id, conn, clean_start, handover=True)
            except (StoreError, TimeoutError):
                takeover.release(client_id, conn)  # connected() claims again (or refuses)
                return
            # A live holder answers within a broker round trip or two; one that does not
            # answer within a few heartbeats is most likely dead (a client reconnecting after
            # its node died must not wait out the whole lease): resume from the record then.
            members = self.membership
            timeout = min(members.lease_s, HANDOVER_HEARTBEATS * members.heartbeat_s)
            # The latest holder hands it: the node of the claim read just before ours, which
            # may have claimed it after the record this node saw (handover.py, racing CONNECTs).
            prev = takeover.previous(client_id, self.node_id, seq)
            giver = holder
            if prev is not None and prev[0] not in (holder, self.node_id):
                giver, timeout = prev[0], 2 * timeout  # it waits for its own holder first
            doc = await handover.receive(wait, seq, giver, timeout, lambda: giver in live())
        finally:
            handover.forget(client_id, wait)
        if doc is NO_HAND:
            log.warning(
                "%r: node %s did not hand the session over; resuming from its last record",
                client_id, giver,
            )  # fmt: skip
            sessions.mark_behind(client_id)
            return
        # Superseded meanwhile? Then the claim that did is handed this session at its end.
        sessions.adopt(client_id, None if doc is None else to_json(doc))

    async def connected(
        self, client_id: str, conn: Connected, clean_start: bool, session: Session
    ) -> None:
        """Before CONNACK: claim the id cluster-wide (takeover) and make the session record
        durable (the other nodes adopt it; a survivor publishes its will if this node dies),
        its in-flight messages read for their resend."""
        superseded = self.takeover.superseded(client_id, conn)
        claim = self.takeover.claim(client_id, conn, clean_start)
        if self.sessions is not None:
            await asyncio.gather(claim, self.sessions.claimed(session, superseded=superseded))
        else:
            await claim

    def answered(self, client_id: str, conn: Connected) -> None:
        self.takeover.answered(client_id, conn)

    def released(self, client_id: str, conn: Connected) -> None:
        self.takeover.release(client_id, conn)

    async def subscribed(self) -> None:
        await self.filters.settled()

    async def retained_caught_up(self) -> None:
        if self.sessions is not None:
            await self.sessions.retained_caught_up()

    def connection_ended(self, session: Session) -> None:
        if self.sessions is not None:
            self.sessions.connection_ended(session)

    # -- stop ------------------------------------------------------------------------------

    async def leave(self) -> None:
        self.wills.stop()
        await self.membership.leave()

    def close(self) -> None:
        self.shares.close()
        self.bus.close()
