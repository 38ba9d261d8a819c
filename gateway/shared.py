"""Shared subscriptions `$share/<group>/<filter>`: competing consumers of one light queue.

A SharedGroup reads the filter's queue with ONE offset (store.offsets group "$share/<group>")
and pushes each message to one connected member, round-robin among members with window space.
A message sent at QoS > 0 stays `pending` until the member acknowledges it (not when the bytes
were written: rocketmq-mqtt #248); when a member leaves with messages in flight they go back to
`returned` and are given to another member. Members that are offline get nothing; the backlog
waits in the store. The committed group offset is the smallest offset not yet done.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import deque
from typing import Protocol

from gateway.arrivals import ArrivalHub
from gateway.cursor import QueueCursor
from gateway.session import Session, SubscriptionState
from gateway.storage import Storage, StoredMessage

log = logging.getLogger("lmqtt.gateway")

BATCH = 32


def consumer_of(group: str) -> str:
    """The consumer (store.offsets group) of share group `group`: its committed position."""
    return f"$share/{group}"


class Member(Protocol):
    """A connected member of a group: its session's delivery loop (gateway/delivery.py)."""

    session: Session
    groups: list[SharedGroup]

    def capacity(self) -> int: ...

    def can_send(self) -> bool: ...

    def deliver_shared(
        self, group: SharedGroup, sub: SubscriptionState, off: int, msg: StoredMessage
    ) -> str: ...


class GroupAccount(Protocol):
    """Where a group's progress is accounted (gateway/delivery_account.py DeliveryAccount)."""

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
        owner.store.offsets.commit(self.consumer, self.queue, self.committed())
        owner.account.group_moved(self)

    # -- membership --------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        if member not in self.members:
            self.members.append(member)
            if self not in member.groups:
                member.groups.append(self)
        if len(self.members) == 1:
            self.owner.arrivals.watch(self.queue, self)
        self.schedule_pump()

    def leave(self, member: Member) -> None:
        """A member disconnected or unsubscribed: its in-flight messages go to the others."""
        if member in self.members:
            self.members.remove(member)
        if self in member.groups:
            member.groups.remove(self)
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
        self.schedule_pump()

    def give_back(self, offset: int) -> None:
        """An in-flight message will not be acknowledged by its member: hand it out again."""
        if self.pending.pop(offset, None) is not None:
            heapq.heappush(self.returned, offset)
            self.schedule_pump()

    def ack(self, offset: int) -> None:
        if self.pending.pop(offset, None) is not None:
            self._commit()
        self.schedule_pump()

    # -- pumping -----------------------------------------------------------------------------

    def arrived(self, queue: str) -> None:
        """The ArrivalHub's notice: the group's queue grew."""
        self.schedule_pump()

    def schedule_pump(self) -> None:
        if not self._scheduled and self.members:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _next_message(self) -> tuple[int, StoredMessage] | None:
        cursor = self.owner.cursor
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

    def _pump(self) -> None:
        self._scheduled = False
        if not self.members:
            return
        changed = False
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
                    delivered = True
                    changed = True
                    break
                if not delivered:
                    self._buffer.appendleft((off, msg))
                    return
        finally:
            if changed:
                self._commit()


class SharedSubscriptions:
    """Share groups by (group, filter), created with their first subscriber."""

    def __init__(
        self, store: Storage, cursor: QueueCursor, arrivals: ArrivalHub, account: GroupAccount
    ) -> None:
        self.store = store
        self.cursor = cursor
        self.arrivals = arrivals
        self.account = account
        self.groups: dict[tuple[str, str], SharedGroup] = {}

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
            self.account.group_ended(g)
            del self.groups[(group, topic_filter)]
