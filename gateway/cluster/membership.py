"""Node membership: which gateway nodes of the deployment are alive, by leases on the bus.

Every node sends a heartbeat record ("hb") to the cluster bus (gateway/cluster/bus.py) every
`heartbeat_s`; any record read from a node renews that node's lease in the reader's eyes for
`lease_s` from the moment it was read. A node whose lease ran out is *lost*: the survivors
drop it from their acknowledgement sets (gateway/cluster/filter_registry.py) and the leader
publishes the wills of its clients (gateway/cluster/node_wills.py).

Fencing: a node is valid only while it keeps reading its own heartbeats back: its lease runs
from the moment it *sent* the newest heartbeat it has read back, for `lease_s - margin`.
Every other node read that heartbeat after it was sent, so it judges the node alive at least
until that same moment + `lease_s`: a node always stops before the others declare it lost.
A node that cannot renew (broker unreachable, its tail stuck, its process stalled) is fenced:
it refuses publishes from then on and the gateway stops (crash-only: it comes back as a new
node, with a new id). Time is each process's monotonic clock: only durations are compared,
so the nodes' clocks need not agree, only run at about the same rate (`margin` covers that).

Joining: a new node tails the bus from its end, sends "join", and waits 1.5 heartbeat periods
for the heartbeats of the nodes already there; each of them answers the join with "hello"
(its filters, gateway/cluster/filter_registry.py). The node is ready (and starts listening for
clients) once it has the hello of every node it heard. "bye" is a graceful stop.

Leader: the live node with the smallest id (in each node's view). It alone compacts the state
log and takes over the wills of lost nodes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from gateway.cluster.bus import ClusterBus, Record

log = logging.getLogger("lmqtt.cluster")

DEFAULT_LEASE_S = 5.0
DEFAULT_HEARTBEAT_S = 1.0


def new_node_id() -> str:
    """A node id no earlier process had: host, process id and random bits (a restarted
    process is a new node: its predecessor's lease must run out on its own)."""
    host = socket.gethostname().split(".")[0][:24] or "node"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class Membership:
    """Leases of every node, this one's included (see the module docstring)."""

    def __init__(
        self,
        bus: ClusterBus,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        if heartbeat_s * 2 >= lease_s:
            raise ValueError("the lease must cover at least two heartbeats")
        self.bus = bus
        self.node_id = bus.node_id
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        # Own lease: a fifth of it (at least one heartbeat) is the margin of clock rates and
        # of reading our own heartbeat later than the others did.
        self._margin = max(heartbeat_s, lease_s / 5)
        self._peers: dict[str, float] = {}  # node -> monotonic time its last record was read
        self._hellos: set[str] = set()  # nodes that answered our join
        # Lost or gone nodes: a late record of theirs (sent before they stopped) does not
        # bring them back; a node that returns does so with a new id.
        self._gone: set[str] = set()
        self.lost: set[str] = set()  # those of them whose lease ran out (not a "bye")
        self._sent_at: dict[int, float] = {}  # our heartbeat seq -> when it was sent
        self.valid_until = time.monotonic() + lease_s - self._margin  # until the first read
        self.fenced = False
        self.on_lost: list[Callable[[str], None]] = []  # a node's lease ran out
        self.on_fenced: list[Callable[[], None]] = []
        self.on_join: list[Callable[[str], None]] = []  # a node joined (answer it)
        self.on_left: list[Callable[[str], None]] = []  # a node stopped gracefully ("bye")
        self._tasks: list[asyncio.Task[None]] = []
        self._hello_arrived = asyncio.Event()
        for kind in ("hb", "join", "hello", "ack", "flt", "conn"):
            bus.on(kind, self._renew)
        bus.on("hb", self._on_heartbeat)
        bus.on("join", self._on_join)
        bus.on("hello", self._on_hello)
        bus.on("bye", self._on_bye)

    # -- views -------------------------------------------------------------------------------

    def live_peers(self) -> dict[str, float]:
        """Other live nodes -> when their lease ends (monotonic)."""
        now = time.monotonic()
        return {n: t + self.lease_s for n, t in self._peers.items() if t + self.lease_s > now}

    def is_leader(self) -> bool:
        return not self.fenced and all(self.node_id < n for n in self.live_peers())

    def is_fenced(self) -> bool:
        """True once this node's own lease ran out (checked per publish: a clock read)."""
        if not self.fenced and time.monotonic() > self.valid_until:
            self._fence()
        return self.fenced

    # -- lifecycle ---------------------------------------------------------------------------

    async def join(self) -> None:
        """Announce this node and learn the others (see the module docstring)."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._heartbeats()))
        self._tasks.append(loop.create_task(self._watch()))
        await self.bus.sent(self.bus.send("join"), timeout=self.lease_s)
        await asyncio.sleep(self.heartbeat_s * 1.5)
        deadline = time.monotonic() + self.lease_s
        while True:
            missing = set(self.live_peers()) - self._hellos
            if not missing or time.monotonic() > deadline:
                break
            self._hello_arrived.clear()
            try:
                await asyncio.wait_for(self._hello_arrived.wait(), 0.1)
            except TimeoutError:
                pass
        if missing:
            log.warning("cluster: joined without the filters of %s (no hello)", sorted(missing))
        log.info(
            "cluster: node %s joined; live nodes: %s",
            self.node_id, ", ".join(sorted([self.node_id, *self.live_peers()])),
        )  # fmt: skip

    async def leave(self) -> None:
        for task in self._tasks:
            task.cancel()
        if not self.fenced:
            self.bus.send("bye")
            await self.bus.drain()

    # -- records -----------------------------------------------------------------------------

    def _renew(self, rec: Record) -> None:
        node = rec["n"]
        if node != self.node_id and node not in self._gone:
            self._peers[node] = time.monotonic()

    def _on_heartbeat(self, rec: Record) -> None:
        if rec["n"] != self.node_id:
            return
        sent = self._sent_at.pop(rec["i"], None)
        if sent is not None and not self.fenced:
            self.valid_until = max(self.valid_until, sent + self.lease_s - self._margin)
        for seq in [s for s in self._sent_at if s < rec["i"]]:
            del self._sent_at[seq]  # lost sends (not stored): never read back

    def _on_join(self, rec: Record) -> None:
        node = rec["n"]
        if node == self.node_id:
            return
        log.info("cluster: node %s joined", node)
        for callback in self.on_join:
            callback(node)

    def _on_hello(self, rec: Record) -> None:
        if rec.get("to") == self.node_id:
            self._hellos.add(rec["n"])
            self._hello_arrived.set()

    def _on_bye(self, rec: Record) -> None:
        node = rec["n"]
        if node != self.node_id and self._peers.pop(node, None) is not None:
            log.info("cluster: node %s left", node)
            self._lost(node, graceful=True)

    # -- timers ------------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        bus = self.bus
        while not self.fenced:
            self._sent_at[bus.send("hb")] = time.monotonic()
            await asyncio.sleep(self.heartbeat_s)

    async def _watch(self) -> None:
        """Expire peers whose lease ran out; fence ourselves when ours did."""
        while not self.fenced:
            await asyncio.sleep(min(0.2, self.heartbeat_s / 4))
            if self.is_fenced():
                return
            now = time.monotonic()
            for node, seen in list(self._peers.items()):
                if seen + self.lease_s <= now:
                    del self._peers[node]
                    log.warning(
                        "cluster: node %s lost (nothing read from it for %.1f s)",
                        node, now - seen,
                    )  # fmt: skip
                    self._lost(node, graceful=False)

    def _lost(self, node: str, *, graceful: bool) -> None:
        self._gone.add(node)
        if not graceful:
            self.lost.add(node)
        for callback in self.on_left if graceful else self.on_lost:
            try:
                callback(node)
            except Exception:
                log.exception("cluster: handling the loss of %s failed", node)

    def _fence(self) -> None:
        self.fenced = True
        log.error(
            "cluster: node %s could not renew its lease (%.1f s): fenced, refusing publishes"
            " and stopping",
            self.node_id, self.lease_s,
        )  # fmt: skip
        for callback in self.on_fenced:
            try:
                callback()
            except Exception:
                log.exception("cluster: fencing callback failed")
