"""Shared subscriptions `$share/<group>/<filter>`: competing consumers of one light queue.

A SharedGroup reads the filter's queue with ONE offset (store.offsets group "$share/<group>")
and pushes each message to one connected member, round-robin among members with window space.
A message sent at QoS > 0 stays `pending` until the member acknowledges it (not when the bytes
were written: a socket write is no delivery); when a member leaves with messages in flight they
go back to `returned` and are given to another member. Members that are offline get nothing;
the backlog waits in the store. The committed group offset is the smallest offset not yet done.

A group whose members cannot take its messages as fast as they come (windows full, slow
acknowledgements) is a subscriber falling behind like any other: a pump that leaves messages
unsent reports the group to the overload guard (gateway/connection/overload.py), which asks for the
age of its oldest unsent message and holds publishers as for a normal subscriber's backlog; as a
delivery loop does, only once the group has been caught up since it was created (a group
resumed with a backlog after a restart catches up without stopping the fleet).

In cluster mode (gateway/cluster/shared.py) a group does not read its queue itself: one node
of the cluster assigns each message to a node, and a group hands out the offsets *granted* to
its node; acknowledgements and messages its members give up go back through its `link`, and
the dispatcher, not the group, commits the position.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import deque
from typing import Protocol

from gateway.delivery.arrivals import ArrivalHub
from gateway.delivery.backlog import BacklogWatch
from gateway.session.model import Session, SubscriptionState
from gateway.storage.cursor import Gone, QueueCursor
from gateway.storage.port import Storage, StoredMessage

log = logging.getLogger("lmqtt.gateway")

BATCH = 32


def consumer_of(group: str) -> str:
    """The consumer (store.offsets group) of share group `group`: its committed position."""
    return f"$share/{group}"


class Member(Protocol):
    """A connected member of a group: its session's delivery loop (gateway/delivery/loop.py)."""

    session: Session
    groups: tuple[SharedGroup, ...]  # replaced, not changed in place (see LoopState)

    def capacity(self) -> int: ...

    def can_send(self) -> bool: ...

    def deliver_shared(
        self, group: SharedGroup, sub: SubscriptionState, off: int, msg: StoredMessage
    ) -> str: ...


class GroupLink(Protocol):
    """The cluster's side of a group (gateway/cluster/shared.py ClusterShares)."""

    def created(self, group: SharedGroup) -> None: ...

    def ended(self, group: SharedGroup) -> None: ...

    def members_changed(self, group: SharedGroup) -> None:
        """A member joined or left (with none left the node gives back what it holds)."""
        ...

    def acked(self, group: SharedGroup, offsets: list[int]) -> None:
        """Granted messages done: acknowledged, or finished without an acknowledgement."""
        ...


class GroupAccount(Protocol):
    """Where a group's progress is accounted (gateway/delivery/account.py DeliveryAccount)."""

    def group_moved(self, group: SharedGroup) -> None: ...

    def group_ended(self, group: SharedGroup) -> None: ...


class SharedGroup:
    """One share group on one filter (so one light queue)."""

    def __init__(
        self, owner: SharedSubscriptions, group: str, topic_filter: str, queue: str
    ) -> None:
        self.owner = owner
        self.group = group
        self.topic_filter = topic_filter  # underlying filter, without $share/<group>/
        self.subscription = f"$share/{group}/{topic_filter}"
        self.queue = queue
        self.consumer = consumer_of(group)
        self.refs = 0  # sessions (live or offline) holding this subscription
        self.members: list[Member] = []
        self.next_offset = 0
        self.start_offset = 0  # where the group began reading (the delivery account's range)
        self.pending: dict[int, Member] = {}
        self.returned: list[int] = []  # heap of offsets to hand out again
        self._buffer: deque[tuple[int, StoredMessage]] = deque()
        self._rr = 0
        self._scheduled = False
        self._live = False  # caught up once since created: its backlog counts as overload
        self.link = owner.link  # cluster mode: the cluster's side of the group (or None)
        self.granted: list[int] = []  # heap: offsets the dispatcher gave this node (cluster)

    def committed(self) -> int:
        candidates = [self.next_offset]
        if self._buffer:
            candidates.append(self._buffer[0][0])
        if self.pending:
            candidates.append(min(self.pending))
        if self.returned:
            candidates.append(self.returned[0])
        return min(candidates)

    def _commit(self) -> None:
        owner = self.owner
        if self.link is None:  # cluster mode: the dispatcher commits (cluster_shared.py)
            owner.store.offsets.commit(self.consumer, self.queue, self.committed())
        owner.account.group_moved(self)

    # -- membership --------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        if member not in self.members:
            self.members.append(member)
            if self not in member.groups:
                member.groups = (*member.groups, self)
            if self.link is not None:
                self.link.members_changed(self)
        if len(self.members) == 1:
            self.owner.arrivals.watch(self.queue, self)
        self.schedule_pump()

    def leave(self, member: Member) -> None:
        """A member disconnected or unsubscribed: its in-flight messages go to the others."""
        was_member = member in self.members
        if was_member:
            self.members.remove(member)
        if self in member.groups:
            member.groups = tuple(g for g in member.groups if g is not self)
        inflight = member.session.inflight
        for pid, inf in list(inflight.items()):
            if inf.group is self:
                del inflight[pid]
        for off, m in list(self.pending.items()):
            if m is member:
                del self.pending[off]
                heapq.heappush(self.returned, off)
        if not self.members:
            self.owner.arrivals.unwatch(self.queue, self)
            if self.link is not None:  # all it holds goes back to the cluster's dispatcher
                self.granted.clear()
                self.returned.clear()
                self._buffer.clear()
        if was_member and self.link is not None:
            self.link.members_changed(self)
        self.schedule_pump()

    def grant(self, offsets: list[int]) -> None:
        """Cluster mode: the dispatcher assigned these offsets to this node's members."""
        for off in offsets:
            heapq.heappush(self.granted, off)
        self.schedule_pump()

    def give_back(self, offset: int) -> None:
        """An in-flight message will not be acknowledged by its member: hand it out again."""
        if self.pending.pop(offset, None) is not None:
            heapq.heappush(self.returned, offset)
            self.schedule_pump()

    def ack(self, offset: int) -> None:
        if self.pending.pop(offset, None) is not None:
            if self.link is not None:
                self.link.acked(self, [offset])
            self._commit()
        self.schedule_pump()

    # -- pumping -----------------------------------------------------------------------------

    def arrived(self, queue: str, end: int) -> None:
        """The ArrivalHub's notice: the group's queue grew (to at least `end`)."""
        self.schedule_pump()

    def schedule_pump(self) -> None:
        if not self._scheduled and self.members:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _next_message(self) -> tuple[int, StoredMessage] | None:
        cursor = self.owner.cursor
        if self.link is not None:
            return self._next_granted()
        while self.returned:
            off = heapq.heappop(self.returned)
            msg = cursor.one(self.queue, off)
            if msg is not None:
                return off, msg
        if self._buffer:
            return self._buffer.popleft()
        if self.next_offset >= cursor.end(self.queue):
            return None
        messages, start, next_offset = cursor.read(self.queue, self.next_offset, BATCH)
        if start < self.next_offset:
            return None  # the queue ends below the group's position (a lost tail)
        self._buffer.extend((m.queue_offset, m) for m in messages)
        self.next_offset = next_offset
        return self._buffer.popleft() if self._buffer else None

    def _next_granted(self) -> tuple[int, StoredMessage] | None:
        """Cluster mode: the lowest offset given back by a member here, or granted to this
        node, that this node's copy of the queue has. One it does not have yet (beyond the
        end it knows, or a miss the store is reading now) waits for the arrival notice; one
        deleted by retention is done."""
        for heap in (self.returned, self.granted):
            while heap:
                off = heap[0]
                msg = self._read(off)
                if msg is None:
                    return None
                heapq.heappop(heap)
                if isinstance(msg, str):  # GONE: deleted by retention, nothing to deliver
                    assert self.link is not None
                    self.link.acked(self, [off])
                    continue
                return off, msg
        return None

    def _read(self, off: int) -> StoredMessage | Gone | None:
        """The message at `off`; GONE when retention deleted it; None: not here yet."""
        cursor = self.owner.cursor
        if off >= cursor.end(self.queue):
            return None
        return cursor.lookup(self.queue, off)

    def _unsent(self) -> bool:
        if self.link is not None:
            return bool(self.returned or self.granted)
        return bool(self.returned or self._buffer) or (
            self.next_offset < self.owner.cursor.end(self.queue)
        )

    def oldest_unsent_ms(self) -> int | None:
        """Store timestamp (ms) of the oldest message not handed to a member yet, or None
        (the overload guard's question, per guard tick; an offline group is not behind the
        load of the moment: its backlog waits in the store)."""
        if not self.members:
            return None
        cursor = self.owner.cursor
        oldest: int | None = None
        if self.returned:
            msg = cursor.one(self.queue, self.returned[0])
            if msg is not None:
                oldest = msg.store_timestamp
        if self.link is not None:
            msg = cursor.one(self.queue, self.granted[0]) if self.granted else None
            if msg is not None and (oldest is None or msg.store_timestamp < oldest):
                oldest = msg.store_timestamp
            return oldest
        first = (
            self._buffer[0][1]
            if self._buffer
            else cursor.one(self.queue, self.next_offset)
            if self.next_offset < cursor.end(self.queue)
            else None
        )
        if first is not None and (oldest is None or first.store_timestamp < oldest):
            oldest = first.store_timestamp
        return oldest

    def _pump(self) -> None:
        self._scheduled = False
        if not self.members:
            return
        self._hand_out()
        if self._unsent():
            if self._live:
                self.owner.overload.behind(self)
        else:
            self._live = True

    def _hand_out(self) -> None:
        """Give messages to members with window space, round robin, until none has any."""
        changed = False
        done: list[int] = []  # cluster mode: finished without an acknowledgement
        try:
            while True:
                candidates = [m for m in self.members if m.capacity() > 0 and m.can_send()]
                if not candidates:
                    return
                item = self._next_message()
                if item is None:
                    return
                off, msg = item
                delivered = False
                for i in range(len(candidates)):
                    member = candidates[(self._rr + i) % len(candidates)]
                    sub = member.session.subscriptions.get(self.subscription)
                    if sub is None:
                        continue
                    outcome = member.deliver_shared(self, sub, off, msg)
                    if outcome == "full":
                        continue
                    self._rr = (self._rr + i + 1) % max(1, len(self.members))
                    if outcome == "pending":
                        self.pending[off] = member
                    elif self.link is not None:
                        done.append(off)
                    delivered = True
                    changed = True
                    break
                if not delivered:
                    if self.link is not None:
                        heapq.heappush(self.returned, off)
                    else:
                        self._buffer.appendleft((off, msg))
                    return
        finally:
            if done and self.link is not None:
                self.link.acked(self, done)
            if changed:
                self._commit()


class SharedSubscriptions:
    """Share groups by (group, filter), created with their first subscriber."""

    def __init__(
        self,
        store: Storage,
        cursor: QueueCursor,
        arrivals: ArrivalHub,
        account: GroupAccount,
        overload: BacklogWatch,
    ) -> None:
        self.store = store
        self.overload = overload  # told when a group falls behind (gateway/connection/overload.py)
        self.cursor = cursor
        self.arrivals = arrivals
        self.account = account
        self.groups: dict[tuple[str, str], SharedGroup] = {}
        self.link: GroupLink | None = None  # cluster mode (gateway/cluster/shared.py)

    def acquire(self, group: str, topic_filter: str, queue: str, resume: bool) -> SharedGroup:
        """Take a reference; a new group starts at the queue's end, or at its saved offset
        when `resume` (restart with persistent members)."""
        key = (group, topic_filter)
        g = self.groups.get(key)
        if g is None:
            g = SharedGroup(self, group, topic_filter, queue)
            end = self.store.max_offset(queue)
            saved = self.store.offsets.get(g.consumer, queue) if resume else None
            g.next_offset = min(saved, end) if saved is not None else end
            g.start_offset = g.next_offset
            self.groups[key] = g
            if g.link is not None:
                g.link.created(g)
            g._commit()
        g.refs += 1
        return g

    def get(self, group: str, topic_filter: str) -> SharedGroup | None:
        return self.groups.get((group, topic_filter))

    def release(self, group: str, topic_filter: str) -> None:
        g = self.groups.get((group, topic_filter))
        if g is None:
            return
        g.refs -= 1
        if g.refs <= 0:
            for m in list(g.members):
                g.leave(m)
            if g.link is not None:
                g.link.ended(g)
            self.account.group_ended(g)
            del self.groups[(group, topic_filter)]
