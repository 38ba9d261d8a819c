"""The cluster-wide filter registry: a filter subscribed on one node routes every node's publishes.

Each node routes a PUBLISH with its own Router (gateway/messages/publishing.py): the light queues of
every filter it knows go into the one send (the store's dispatch properties). So every node must
know every node's filters, and must know a new one *before* the subscriber hears SUBACK, or a
message published on another node right after the SUBACK misses the subscriber's queue.

    node A (subscriber)                        node B (any other live node)
    filter's first local reference
      -> "flt" record {ops: [["+", f]]}  ---->  router.add(f)   (publishes routed from now on
                                                                 carry f's queue)
                                                wait until every send B started before is
                                                answered (Storage.settle)
                                       <----    "ack" {to: A, i: seq}
    A read its own "flt" back: the live nodes at that point must answer
    every one acked, or its lease ran out  ->  SUBACK

Why no message can slip through after SUBACK: a PUBLISH B receives after the SUBACK was
received after B's ack, so after B added the filter: it is routed with it. A node that never
acknowledged was declared lost because its lease ran out, and a node's own lease runs out
first (gateway/cluster/membership.py): it was already refusing publishes. B's wait for its sends in
flight makes the registration a clean cut in the log: no message routed without the filter
is stored after the SUBACK, so "published after SUBACK" and "stored after SUBACK" agree.
rocketmq-mqtt instead refreshes wildcard filters from its meta store on a timer: a message
published between a SUBACK and the next refresh on the publisher's node is not dispatched to
the new subscriber's queue (docs/rocketmq.md, "Several gateway nodes").

The last local reference going away sends ["-", f] (no acknowledgement: a message routed to
a queue nobody reads is only wasted). Operations are batched per event-loop pass into one
record, and a node's records are read in the order it sent them, so the per-node sets stay
exact. A joining node gets each node's whole set in its "hello". The filters of a node that
was lost stay registered (its persistent sessions' queues keep collecting their backlog).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.cluster.bus import ClusterBus, Record
from gateway.cluster.membership import Membership
from gateway.messages.publishing import PublishPath

log = logging.getLogger("lmqtt.cluster")

FILTERS_PER_RECORD = 2000
#: A live node that neither acknowledges nor loses its lease this long is logged (it keeps
#: renewing its lease, so it reads the bus: an acknowledgement is late, not lost).
ACK_WARN_S = 10.0


class _Pending:
    __slots__ = ("done", "waiting")

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.waiting: dict[str, float] = {}  # node -> its lease end when we started waiting


class ClusterFilters:
    """This node's side of the registry (see the module docstring)."""

    def __init__(
        self,
        bus: ClusterBus,
        membership: Membership,
        publisher: PublishPath,
        settle: Callable[[], Awaitable[None]],
        close_queue: Callable[[str], None],
    ) -> None:
        self._bus = bus
        self._close_queue = close_queue
        self._members = membership
        self._publisher = publisher
        self._settle = settle
        self._local: dict[str, int] = {}  # filter text -> references on this node
        self._remote: dict[str, set[str]] = {}  # node -> its filters (registered here)
        self._ops: list[tuple[str, str]] = []  # not sent yet
        self._flush_scheduled = False
        self._acks: dict[int, _Pending] = {}  # our "flt" seq -> acknowledgements awaited
        self._by_seq: dict[int, asyncio.Future[None]] = {}  # sent, not read back yet
        self._open: set[asyncio.Future[None]] = set()  # registrations not acknowledged yet
        bus.on("flt", self._on_filters)
        bus.on("ack", self._on_ack)
        bus.on("hello", self._on_hello)
        membership.on_join.append(self._answer_join)
        membership.on_lost.append(self._forget_node)
        membership.on_left.append(self._forget_node)
        publisher.on_filter = self._local_change

    # -- this node's filters -----------------------------------------------------------------

    def _local_change(self, text: str, added: bool) -> None:
        count = self._local.get(text, 0) + (1 if added else -1)
        if count > 0:
            self._local[text] = count
        else:
            self._local.pop(text, None)
        if (added and count == 1) or (not added and count == 0):
            self._queue(("+" if added else "-", text))

    def _queue(self, op: tuple[str, str]) -> None:
        self._ops.append(op)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the queued operations (one record per FILTERS_PER_RECORD); a record that adds
        filters is awaited by `settled` until the live nodes acknowledged it."""
        self._flush_scheduled = False
        ops, self._ops = self._ops, []
        loop = asyncio.get_running_loop()
        for i in range(0, len(ops), FILTERS_PER_RECORD):
            chunk = ops[i : i + FILTERS_PER_RECORD]
            seq = self._bus.send("flt", ops=[list(op) for op in chunk])
            if any(op == "+" for op, _ in chunk):
                fut: asyncio.Future[None] = loop.create_future()
                self._open.add(fut)
                self._by_seq[seq] = fut

    async def settled(self) -> None:
        """Wait until every filter this node added so far is known to every live node."""
        if self._ops:
            self._flush()
        if self._open:
            await asyncio.gather(*[asyncio.shield(f) for f in self._open])

    # -- records -----------------------------------------------------------------------------

    def _on_filters(self, rec: Record) -> None:
        node = rec["n"]
        if node == self._bus.node_id:
            self._read_back(rec["i"])
            return
        mine = self._remote.setdefault(node, set())
        publisher = self._publisher
        for op, text in rec.get("ops", ()):
            if op == "+" and text not in mine:
                mine.add(text)
                publisher.add_filter(text, remote=True)
            elif op == "-" and text in mine:
                mine.discard(text)
                self._remove_remote(text)
        if any(op == "+" for op, _ in rec.get("ops", ())):
            asyncio.get_running_loop().create_task(self._acknowledge(node, rec["i"]))

    async def _acknowledge(self, node: str, seq: int) -> None:
        started = time.monotonic()
        try:
            await self._settle()
        except Exception:  # a failed send is not stored: nothing to wait for
            log.debug("settle before an acknowledgement", exc_info=True)
        waited = time.monotonic() - started
        if waited > 1.0:
            log.warning("cluster: sends in flight took %.1f s to settle", waited)
        self._bus.send("ack", to=node, ack=seq)

    def _read_back(self, seq: int) -> None:
        """Our record is in the log: the nodes live now must acknowledge it."""
        fut = self._by_seq.pop(seq, None)
        if fut is None:
            return
        pending = _Pending(fut)
        pending.waiting = self._members.live_peers()
        if not pending.waiting:
            self._finish(fut)
            return
        self._acks[seq] = pending
        asyncio.get_running_loop().create_task(self._expire(seq))

    def _on_ack(self, rec: Record) -> None:
        if rec.get("to") != self._bus.node_id:
            return
        pending = self._acks.get(rec.get("ack", 0))
        if pending is None:
            return
        pending.waiting.pop(rec["n"], None)
        if not pending.waiting:
            del self._acks[rec["ack"]]
            self._finish(pending.done)

    async def _expire(self, seq: int) -> None:
        """A node that does not acknowledge is waited for until its lease, as we saw it when
        our record was read back, ends (or it is declared lost, whichever comes first)."""
        started = time.monotonic()
        warned = False
        while (pending := self._acks.get(seq)) is not None:
            now = time.monotonic()
            live = self._members.live_peers()
            for node, until in list(pending.waiting.items()):
                if until <= now and node not in live:
                    log.warning("cluster: filters registered without %s (lease ended)", node)
                    del pending.waiting[node]
                elif until <= now:
                    pending.waiting[node] = live[node]  # renewed: it reads; the ack is coming
            if not pending.waiting:
                del self._acks[seq]
                self._finish(pending.done)
                return
            if not warned and now - started > ACK_WARN_S:
                warned = True
                log.warning("cluster: still no acknowledgement from %s", sorted(pending.waiting))
            await asyncio.sleep(0.05)

    def _finish(self, fut: asyncio.Future[None]) -> None:
        self._open.discard(fut)
        if not fut.done():
            fut.set_result(None)

    def _on_hello(self, rec: Record) -> None:
        node = rec["n"]
        if node == self._bus.node_id or rec.get("to") != self._bus.node_id:
            return
        mine = self._remote.setdefault(node, set())
        theirs = set(rec.get("filters", ()))
        for text in theirs - mine:
            self._publisher.add_filter(text, remote=True)
        for text in mine - theirs:
            self._remove_remote(text)
        self._remote[node] = theirs

    def _remove_remote(self, text: str) -> None:
        queue = self._publisher.router.queue_of(text)
        if self._publisher.remove_filter(text, remote=True) and queue is not None:
            self._close_queue(queue)  # a local subscriber that left kept its mirror for us

    def _answer_join(self, node: str) -> None:
        self._bus.send("hello", to=node, filters=sorted(self._local))

    def _forget_node(self, node: str) -> None:
        for pending in list(self._acks.values()):
            pending.waiting.pop(node, None)
            if not pending.waiting:
                self._finish(pending.done)
        for seq in [s for s, p in self._acks.items() if p.done.done()]:
            del self._acks[seq]
