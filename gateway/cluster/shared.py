"""Shared groups across cluster nodes: each message of a group to one member cluster-wide.

On one node a share group (gateway/delivery/shared.py SharedGroup) reads its light queue with one
position and hands each message to one member. With several nodes, each node's group would
read the same queue and every message would go to one member *per node*. Here one node, the
*dispatcher*, reads the queue and assigns each message (its offset) to a node with members;
that node hands it to one of its members as before. The assignments and the acknowledgements
are records on the cluster bus (gateway/cluster/bus.py), so every node holds the same table of
who has which message, and the node that takes the dispatch over (its dispatcher died) knows
what was unacknowledged where.

    record   fields (besides "k", "n": sending node, "i")
    "shm"    g group, f filter, q queue, c members connected at n, s offset n's group
             started at (where a new group begins)
    "shd"    g, f, o [[offset, node], ...] assigned, c the dispatcher's committed position,
             p the bus offset the records about offsets >= c start at (q: the queue, in the
             dispatcher's "shd" for a node that joined, which may know nothing of the group)
    "sha"    g, f, o [offset, ...] acknowledged (or finished without an ack, QoS 0) at n
    "shr"    g, f, x node, o [offset, ...] given back: x's members will not acknowledge them

Every node applies the records in the bus's one order, the sender's own on read-back, to the
group's table (gateway/cluster/share_table.py: first assignment wins, done stays done, an
offset below a dispatcher's committed position is done). Two dispatchers, which membership's
fencing should prevent, still hand a message once; a stale proposal read after the
acknowledgement of the same offset is no second delivery.

A node hands out the offsets assigned to itself (read back: the dispatcher's own members too).
QoS 1/2 stay assigned until the member's PUBACK/PUBCOMP, so at most the window is in flight.

The dispatcher is the *oldest* live node: the one whose "join" every other live node's "join"
followed on the bus (judged only once membership's join heard the nodes already there). Every
node can tell whether it is the oldest (it read the others' joins after its own), no two nodes
can both be, and the oldest has read every record any live node read: its table is the most
complete. It gives each node at most WINDOW messages per member connected there, to the node
least loaded per member, and commits the group's position on the broker (the smallest offset
not done) for a restart of the whole cluster.

Handover:
- A member leaves (disconnect, unsubscribe): its node gives its unacknowledged messages to its
  other members; with none left it sends "shr" for all the offsets it holds, and "shm" c=0.
- A node is lost (lease ran out: it fenced itself first, its clients are cut) or left: the
  dispatcher sends "shr" for everything assigned to it and assigns those offsets again, to
  the others (members see them with DUP only if they had them before: a new member gets a
  first delivery).
- The dispatcher is lost: the next oldest node becomes dispatcher. Its table lacks what was
  assigned and acknowledged before it joined, so it reads the bus back from "p" (the newest
  it read: every "shd" carries it, and the dispatcher sends one when a node joins) and
  rebuilds the table from those records: what was acknowledged then is not delivered again.
  It starts from the newest committed position ("c"), re-assigns what the table shows on dead
  nodes, and every offset between that position and the highest assigned one that the table
  does not show as done or held. Only if the records cannot be read back (retention deleted
  them) or no "p" was read (the dispatcher died before a node's join was answered) are
  offsets acknowledged before the join assigned again (at least once), never lost.

Memory: per group, the assigned table (at most WINDOW per connected member), the offsets
acknowledged above the committed position and the bus offsets of their first assignments
(pruned as it moves).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from typing import Any

from gateway.cluster.bus import ClusterBus, Record
from gateway.cluster.membership import Membership
from gateway.cluster.share_table import ShareTable
from gateway.delivery.arrivals import ArrivalHub
from gateway.delivery.shared import SharedGroup, SharedSubscriptions, consumer_of
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage, StoreError

log = logging.getLogger("lmqtt.cluster")

#: Messages a node holds per connected member of a group before the dispatcher gives it more.
WINDOW = 32
#: Assignments per "shd" record (a burst is several records in one bus message).
ASSIGN_BATCH = 256
#: The dispatcher re-checks who dispatches and re-pumps this often (a notice lost costs this).
TICK_S = 0.5
#: Assignments sent and not read back after this long (their bus send failed) are assigned
#: again.
PROPOSAL_TIMEOUT_S = 10.0

Key = tuple[str, str]  # (group, filter)


class ClusterGroup(ShareTable):
    """One share group's cluster-wide table (gateway/cluster/share_table.py), and its dispatch
    when this node dispatches."""

    def __init__(self, shares: ClusterShares, key: Key, queue: str) -> None:
        super().__init__()
        self.shares = shares
        self.key = key
        self.queue = queue
        self.members: dict[str, int] = {}  # node -> members connected there
        self.start: int | None = None  # smallest start offset announced (a new group)
        self.local: SharedGroup | None = None
        # Dispatch (this node dispatches): None until started.
        self.next_offset: int | None = None
        self.returned: list[int] = []  # heap: offsets to assign again
        self.proposed: dict[int, str] = {}  # assignments sent, not read back yet
        self._opening = False
        self._scheduled = False
        self._committed = -1
        # The lowest assignment not read back, and since when it is (lost sends, below).
        self._stuck: tuple[int, float] | None = None

    # -- the table (every node) --------------------------------------------------------------

    def held_by(self, node: str) -> list[int]:
        return [o for o, n in self.assigned.items() if n == node]

    def apply_assign(self, pairs: list[list[Any]], c: int, p: int | None) -> None:
        shares = self.shares
        me = shares.node_id
        for off, _node in pairs:
            self.proposed.pop(int(off), None)
        taken = self.take_assign(pairs, c, p, shares.bus.position)
        mine: list[int] = []
        # Assigned to a node lost since (the dispatcher read the loss first): given back.
        live = shares.live_nodes() if shares.dispatching else None
        dead: dict[str, list[int]] = {}
        for off, node in taken:
            if node == me:
                mine.append(off)
            elif live is not None and node not in live:
                dead.setdefault(node, []).append(off)
        for node, offs in dead.items():
            shares.send_returned(self, node, offs)
        if mine:
            shares.hand_to_members(self, mine)
        self.schedule()

    def apply_done(self, node: str, offsets: list[int]) -> None:
        self.take_done(node, offsets)
        self.schedule()

    def apply_returned(self, node: str, offsets: list[int]) -> None:
        back = self.take_returned(node, offsets)
        if self.next_offset is not None:
            for off in back:
                heapq.heappush(self.returned, off)
        self.schedule()

    # -- dispatch (the dispatcher only) ------------------------------------------------------

    def schedule(self) -> None:
        if not self._scheduled and self.shares.dispatching:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def arrived(self, queue: str, end: int) -> None:
        """The ArrivalHub's notice: the queue grew (to at least `end`)."""
        self.schedule()

    def stop_dispatch(self) -> None:
        if self.next_offset is not None or self._opening:
            self.shares.arrivals.unwatch(self.queue, self)
        self.next_offset = None
        self.returned = []
        self.proposed.clear()

    def _start_dispatch(self) -> None:
        """Become this group's dispatcher: open its queue, then start where the table says."""
        if self._opening or self.next_offset is not None:
            return
        self._opening = True
        task = asyncio.get_running_loop().create_task(self._open())
        self.shares.tasks.add(task)
        task.add_done_callback(self.shares.tasks.discard)

    async def _open(self) -> None:
        shares = self.shares
        store = shares.store
        try:
            await store.open_queue(self.queue)
            if self.p is not None and self.p < shares.bus.origin:
                # Assigned and acknowledged before this node joined: read back.
                await self._read_back(self.p)
            base = self.c
            if base is None:
                # No dispatcher's position read since this node joined: the broker's (it
                # may lag a flush behind), but not below where the members started (a
                # new group starts at the queue's end, its broker offset may be older).
                consumer = consumer_of(self.key[0])
                with contextlib.suppress(StoreError):
                    store.offsets.remove(consumer, self.queue)
                    await store.load_offsets([(consumer, self.queue)])
                saved = store.offsets.get(consumer, self.queue)
                found = [v for v in (saved, self.start) if v is not None]
                base = max(found) if found else store.max_offset(self.queue)
        except Exception:
            log.exception("shared group %s/%s: opening its queue failed", *self.key)
            self._opening = False
            return
        self._opening = False
        if not shares.dispatching:
            return
        live = shares.live_nodes()
        # Held by dead nodes: given back (read back, they are assigned again).
        by_dead: dict[str, list[int]] = {}
        for off, node in self.assigned.items():
            if node not in live:
                by_dead.setdefault(node, []).append(off)
        for node, offs in by_dead.items():
            shares.send_returned(self, node, offs)
        # Between the position and the highest assignment, neither held nor done: assigned
        # before this node joined, to nodes gone since. Again (at least once).
        top = max(self.hi, base)
        self.returned = [
            o for o in range(base, top) if o not in self.assigned and o not in self.done
        ]
        heapq.heapify(self.returned)
        self.next_offset = top
        shares.arrivals.watch(self.queue, self)
        log.info(
            "shared group %s/%s: dispatched by this node from offset %d (%d to assign again)",
            self.key[0], self.key[1], base, len(self.returned) + sum(map(len, by_dead.values())),
        )  # fmt: skip
        self.schedule()

    async def _read_back(self, start: int) -> None:
        """Rebuild the table from the bus records from `start`, the ones stored before this
        node joined included: what was acknowledged then is not assigned again. Unreadable
        (deleted by retention): the table as it is (those may come a second time)."""
        try:
            history = await self.shares.bus.history(start)
        except StoreError as exc:
            log.warning(
                "shared group %s/%s: the records before this node joined: %s", *self.key, exc
            )
            return
        g, f = self.key
        mine = [
            (at, str(rec["k"]), rec)
            for at, rec in history
            if rec.get("k") in ("shd", "sha", "shr") and rec.get("g") == g and rec.get("f") == f
        ]
        self.take_history(mine)
        log.info(
            "shared group %s/%s: %d record(s) from bus offset %d read back", g, f, len(mine), start
        )

    def retry_lost_proposals(self) -> None:
        """Assignments never read back (their bus send failed): assign them again (one read
        back late is the first assignment; the new one is then ignored)."""
        if not self.proposed:
            self._stuck = None
            return
        lowest, now = min(self.proposed), time.monotonic()
        if self._stuck is None or self._stuck[0] != lowest:
            self._stuck = (lowest, now)
        elif now - self._stuck[1] > PROPOSAL_TIMEOUT_S:
            for off in self.proposed:
                heapq.heappush(self.returned, off)
            self.proposed.clear()
            self._stuck = None
            self.schedule()

    def committed(self) -> int:
        assert self.next_offset is not None
        candidates = [self.next_offset]
        if self.assigned:
            candidates.append(min(self.assigned))
        if self.proposed:
            candidates.append(min(self.proposed))
        if self.returned:
            candidates.append(self.returned[0])
        return min(candidates)

    def _pump(self) -> None:
        self._scheduled = False
        shares = self.shares
        if not shares.dispatching:
            return
        live = shares.live_nodes()
        nodes = {n: c for n, c in self.members.items() if c > 0 and n in live}
        if not nodes:
            return
        if self.next_offset is None:
            self._start_dispatch()
            return
        load: dict[str, int] = dict.fromkeys(nodes, 0)
        for held in (self.assigned, self.proposed):
            for n in held.values():
                if n in load:
                    load[n] += 1
        end = shares.store.max_offset(self.queue)
        out: list[list[Any]] = []
        while True:
            room = [(load[n] / c, n) for n, c in nodes.items() if load[n] < WINDOW * c]
            if not room:
                break
            off = self._next(end)
            if off is None:
                break
            node = min(room)[1]
            load[node] += 1
            self.proposed[off] = node
            out.append([off, node])
            if len(out) >= ASSIGN_BATCH:
                shares.send_assign(self, out, self.committed())
                out = []
        if out:
            shares.send_assign(self, out, self.committed())
        c = self.committed()
        if c != self._committed:
            self._committed = c
            shares.store.offsets.commit(consumer_of(self.key[0]), self.queue, c)

    def _next(self, end: int) -> int | None:
        returned = self.returned
        while returned:
            off = heapq.heappop(returned)
            if off not in self.assigned and off not in self.proposed:
                return off
        assert self.next_offset is not None
        if self.next_offset < end:
            off = self.next_offset
            self.next_offset += 1
            return off
        return None


class ClusterShares:
    """This node's side of every share group in the cluster (see the module docstring)."""

    def __init__(
        self,
        bus: ClusterBus,
        membership: Membership,
        store: Storage,
    ) -> None:
        self.bus = bus
        self.membership = membership
        self.store = store
        self.cursor = QueueCursor(store)  # the store's reads, without this node's recent cache
        self.arrivals: ArrivalHub  # attach()
        self.node_id = bus.node_id
        self.groups: dict[Key, ClusterGroup] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.dispatching = False
        self._joined = False  # our own "join" read back
        self._younger: set[str] = set()  # nodes whose "join" we read after ours
        self._ticker: asyncio.Task[None] | None = None
        bus.on("join", self._on_join)
        bus.on("shm", self._on_members)
        bus.on("shd", self._on_assign)
        bus.on("sha", self._on_done)
        bus.on("shr", self._on_returned)
        membership.on_lost.append(self._node_gone)
        membership.on_left.append(self._node_gone)

    def attach(self, shared: SharedSubscriptions, arrivals: ArrivalHub) -> None:
        """Serve `shared`'s groups across the cluster (before any group is created)."""
        self.arrivals = arrivals
        shared.link = self
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        self._check()

    # -- who dispatches ----------------------------------------------------------------------

    def live_nodes(self) -> set[str]:
        return {self.node_id, *self.membership.live_peers()}

    def _check(self) -> None:
        was = self.dispatching
        now = (
            self._joined
            and self._ticker is not None  # attached: after membership.join heard the others
            and not self.membership.fenced
            and all(n in self._younger for n in self.membership.live_peers())
        )
        self.dispatching = now
        if now and not was:
            log.info("cluster: node %s dispatches the shared groups", self.node_id)
        if was and not now:
            for g in self.groups.values():
                g.stop_dispatch()
        if now:
            for g in self.groups.values():
                g.schedule()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._check()
            if self.dispatching:
                for g in self.groups.values():
                    g.retry_lost_proposals()

    def _node_gone(self, node: str) -> None:
        for g in self.groups.values():
            g.members.pop(node, None)
        self._check()
        if self.dispatching:
            for g in self.groups.values():
                if g.next_offset is not None:
                    held = g.held_by(node)
                    if held:
                        self.send_returned(g, node, held)

    def _on_join(self, rec: Record) -> None:
        node = rec["n"]
        if node == self.node_id:
            self._joined = True
            self._check()
            return
        if self._joined:
            self._younger.add(node)
        # The newcomer learns the committed position and where the records above it start
        # (it may dispatch one day: gateway/cluster/share_table.py).
        if self.dispatching:
            for g in self.groups.values():
                if g.next_offset is not None:
                    self.send_assign(g, [], g.committed(), q=g.queue)
        # The newcomer learns who has members (it may dispatch one day).
        for g in self.groups.values():
            if g.local is not None and g.local.members:
                self._announce(g)

    # -- records -----------------------------------------------------------------------------

    def _group(self, rec: Record) -> ClusterGroup | None:
        try:
            key = (str(rec["g"]), str(rec["f"]))
        except KeyError:
            return None
        g = self.groups.get(key)
        if g is None and "q" in rec:
            g = self.groups[key] = ClusterGroup(self, key, str(rec["q"]))
        return g

    def _on_members(self, rec: Record) -> None:
        g = self._group(rec)
        if g is None:
            return
        node = rec["n"]
        count = int(rec.get("c", 0))
        if count > 0 and node in self.live_nodes():
            g.members[node] = count
        else:
            g.members.pop(node, None)
        start = rec.get("s")
        if start is not None and (g.start is None or int(start) < g.start):
            g.start = int(start)
        g.schedule()

    def _on_assign(self, rec: Record) -> None:
        g = self._group(rec)
        if g is not None:
            p = rec.get("p")
            g.apply_assign(rec.get("o", []), int(rec.get("c", 0)), None if p is None else int(p))

    def _on_done(self, rec: Record) -> None:
        g = self._group(rec)
        if g is not None:
            g.apply_done(rec["n"], [int(o) for o in rec.get("o", [])])

    def _on_returned(self, rec: Record) -> None:
        g = self._group(rec)
        if g is not None:
            g.apply_returned(str(rec.get("x")), [int(o) for o in rec.get("o", [])])

    # -- sending -----------------------------------------------------------------------------

    def send_assign(self, g: ClusterGroup, pairs: list[list[Any]], c: int, **extra: Any) -> None:
        p = g.origin(c, self.bus.position)
        self.bus.send("shd", g=g.key[0], f=g.key[1], o=pairs, c=c, p=p, **extra)

    def send_returned(self, g: ClusterGroup, node: str, offsets: list[int]) -> None:
        self.bus.send("shr", g=g.key[0], f=g.key[1], x=node, o=sorted(offsets))

    def hand_to_members(self, g: ClusterGroup, offsets: list[int]) -> None:
        """Offsets assigned to this node: to its members, once its copy of the queue has them
        (a message below the queue's end this node never read, e.g. given back by a dead
        node, is read from the broker first)."""
        cursor = self.cursor
        end = cursor.end(g.queue)
        missing = [o for o in offsets if o < end and cursor.one(g.queue, o) is None]
        if not missing:
            self._grant(g, offsets)
            return
        task = asyncio.get_running_loop().create_task(self._fetch_and_grant(g, offsets, missing))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _fetch_and_grant(
        self, g: ClusterGroup, offsets: list[int], missing: list[int]
    ) -> None:
        prefetch = getattr(self.store, "prefetch", None)
        if prefetch is not None:
            try:
                await prefetch(g.queue, missing)
            except StoreError as exc:
                log.warning("shared group %s/%s: reading given-back messages: %s", *g.key, exc)
        self._grant(g, offsets)

    def _grant(self, g: ClusterGroup, offsets: list[int]) -> None:
        local = g.local
        mine = [o for o in offsets if g.assigned.get(o) == self.node_id]
        if local is not None and local.members:
            local.grant(mine)
        else:  # our members left meanwhile: back to the dispatcher
            self.give_back(g, mine)

    def give_back(self, g: ClusterGroup, offsets: list[int]) -> None:
        if offsets:
            self.send_returned(g, self.node_id, offsets)

    def _announce(self, g: ClusterGroup) -> None:
        local = g.local
        count = len(local.members) if local is not None else 0
        start = local.start_offset if local is not None else None
        self.bus.send("shm", g=g.key[0], f=g.key[1], q=g.queue, c=count, s=start)

    # -- the local group's link (gateway/delivery/shared.py GroupLink)
    # --------------------------------

    def _of(self, local: SharedGroup) -> ClusterGroup:
        key = (local.group, local.topic_filter)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = ClusterGroup(self, key, local.queue)
        return g

    def created(self, local: SharedGroup) -> None:
        self._of(local).local = local

    def ended(self, local: SharedGroup) -> None:
        g = self.groups.get((local.group, local.topic_filter))
        if g is not None and g.local is local:
            g.local = None
            self.members_changed(local)

    def members_changed(self, local: SharedGroup) -> None:
        """A member joined or left here: tell the cluster how many there are; with none
        left, give back everything this node holds of the group."""
        g = self._of(local)
        if not local.members:
            self.give_back(g, g.held_by(self.node_id))
        self._announce(g)

    def acked(self, local: SharedGroup, offsets: list[int]) -> None:
        g = self._of(local)
        self.bus.send("sha", g=g.key[0], f=g.key[1], o=offsets)

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self.tasks):
            task.cancel()
