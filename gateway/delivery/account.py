"""The gateway side of the delivery account (format and reader: store.delivery_account).

Every subscription, persistent or clean, and every shared group leaves durable ranges behind:
what it was sent and what was acknowledged, per light queue, so the fan-out report can count
deliveries to clean sessions too (they leave no committed offsets once they end).

Cost on the hot path: the delivery loop already commits a subscription's offset once per pass
when it moved; that commit also calls `moved()`, one dict store. Nothing is encoded or written
there. Off the hot path:
  - every `record_s` the subscriptions that moved are written as one batch (one write() per
    file), each as its cumulative state (start, acknowledged end, sent end, queue end): a
    busy subscription costs one 64-byte record per record_s, however many messages it got;
  - when a subscription ends (unsubscribe, clean session over, expiry) its closing record,
    carrying the queue end it saw last, is written within `flush_s`;
  - every `sample_s` the subscriptions that may lag without moving are written too when their
    queue grew, so the report can draw lag over time for a subscriber that stopped
    acknowledging: those of offline persistent sessions, and those of online sessions whose
    delivery loop left something unsent since the last cycle (`behind`, once per such pass).
    Nothing is found by walking sessions: an offline persistent session's queues are watched
    (ArrivalHub, as its delivery loop watched them while it ran), so a cycle looks at the
    queues that grew since the last one and at the sessions that changed (a loop stopping
    with something maybe owed, or falling behind), whatever the number offline; those it
    asks the store for a queue's end are walked in slices between flushes, remembering one
    end per queue;
  - `close()` writes everything at shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from gateway.delivery.arrivals import ArrivalHub, table_add, table_discard
from gateway.storage.port import FLAG_CLEAN, FLAG_CLOSED, FLAG_SHARED, AccountRecord, AccountWriter

if TYPE_CHECKING:
    from gateway.delivery.shared import SharedGroup
    from gateway.session.model import Session, SubscriptionState

log = logging.getLogger("lmqtt.gateway")

FLUSH_S = 0.5
RECORD_S = 5.0  # a subscription that keeps moving is written at most this often
SAMPLE_S = 10.0
SAMPLE_SLICE = 2_000  # subscriptions a sampling cycle looks at per flush, at most
SAMPLE_WRITES = 1_000  # records it adds per flush, at most
# ... in this many steps of looks and writes, yielding to the event loop in between: 2,000
# looks in one step held it for ~3 ms at 10,000 devices (each look may ask the store for a
# queue's end).
SAMPLE_STEPS = 4


class DeliveryAccount:
    """Batches subscription progress into the account file (see the module docstring)."""

    def __init__(
        self,
        writer: AccountWriter | CountedAccount,
        max_offset: Callable[[str], int],
        arrivals: ArrivalHub,
        flush_s: float = FLUSH_S,
        record_s: float = RECORD_S,
        sample_s: float = SAMPLE_S,
    ) -> None:
        self._writer = writer
        self._max_offset = max_offset
        self._arrivals = arrivals
        arrivals.sampler = self
        self.flush_s = flush_s
        self.record_s = record_s
        self.sample_s = sample_s
        self._dirty: dict[int, tuple[Session, SubscriptionState]] = {}
        self._dirty_groups: dict[int, SharedGroup] = {}
        self._pending: list[AccountRecord] = []  # written by the next flush
        self._queue_seen: dict[str, int] = {}  # queue -> its end at the last sampling cycle
        self._group_qos: dict[tuple[str, str], int] = {}
        # The offline persistent sessions, by the queues of theirs this account watches (a
        # queue read by one of them maps to it, by more to a set): filled as sessions go
        # offline, and by the first cycle with those restored offline at start.
        self._offline: dict[str, Session | set[Session]] = {}
        self._seeded = False
        self._grown: set[str] = set()  # watched queues that grew since the last cycle
        # What the next cycle asks the store about, by client id: sessions whose loop stopped
        # (it may have left something owed) and online ones whose loop fell behind.
        self._look: dict[str, Session] = {}
        self._lagging: dict[str, Session] = {}

    # -- hot path ------------------------------------------------------------------------------

    def moved(self, session: Session, sub: SubscriptionState) -> None:
        """`sub`'s committed offset moved (called from the delivery loop's commit)."""
        self._dirty[id(sub)] = (session, sub)

    def group_moved(self, group: SharedGroup) -> None:
        self._dirty_groups[id(group)] = group

    # -- what sampling looks at (delivery loops call these; not per message) --------------------

    def online(self, session: Session) -> None:
        """`session`'s delivery loop started: it is sampled only while it falls behind."""
        self._look.pop(session.client_id, None)
        self._forget(session)

    def offline(self, session: Session, owes: bool = True) -> None:
        """`session`'s delivery loop stopped: a persistent session's queues go on growing,
        and are watched from now on. `owes`: the loop may have left something unsent or
        unacknowledged (the next cycle looks at its queues' ends once); not so for a
        connection that closed before its loop was needed (nothing arrived since its
        subscriptions started at their queues' ends)."""
        if not session.persistent:
            return
        for queue in session.by_queue:
            if table_add(self._offline, queue, session):
                self._arrivals.watch(queue, self)
        if owes:
            self._look[session.client_id] = session

    def arrived(self, queue: str, end: int) -> None:
        """ArrivalHub: a queue of an offline session grew."""
        self._grown.add(queue)

    def _forget(self, session: Session) -> None:
        """`session`'s queues are no longer watched for it (online again, or ended)."""
        for queue in session.by_queue:
            self._unwatch(queue, session)

    def _unwatch(self, queue: str, session: Session) -> None:
        if table_discard(self._offline, queue, session):
            self._arrivals.unwatch(queue, self)

    def behind(self, session: Session) -> None:
        """`session`'s delivery loop left something unsent (once per such pass)."""
        self._lagging[session.client_id] = session

    # -- ends ----------------------------------------------------------------------------------

    def ended(self, session: Session, sub: SubscriptionState) -> None:
        """`sub` is removed from `session` (unsubscribe or session over)."""
        if sub.share_group is not None:
            return  # the group's account ends with the group (group_ended)
        self._unwatch(sub.queue, session)  # over while offline (expiry, a new clean session)
        self._dirty.pop(id(sub), None)
        self._pending.append(self._session_record(session, sub, FLAG_CLOSED))

    def group_ended(self, group: SharedGroup) -> None:
        self._dirty_groups.pop(id(group), None)
        self._pending.append(self._group_record(group, FLAG_CLOSED))
        self._group_qos.pop((group.consumer, group.queue), None)

    # -- writing -------------------------------------------------------------------------------

    def flush(self, moved: bool = True) -> int:
        """Write what ended and what was sampled, and (`moved`) the subscriptions that moved;
        returns the records written."""
        records = self._pending
        self._pending = []
        dirty: dict[int, tuple[Session, SubscriptionState]] = {}
        groups: dict[int, SharedGroup] = {}
        if moved:
            dirty, self._dirty = self._dirty, dirty
            groups, self._dirty_groups = self._dirty_groups, groups
        for session, sub in dirty.values():
            records.append(self._session_record(session, sub, 0))
        for group in groups.values():
            records.append(self._group_record(group, 0))
        if not records:
            return 0
        try:
            return self._writer.append(records)
        except OSError as e:
            log.error("delivery account: cannot write %d records: %s", len(records), e)
            return 0

    def sample(self, sessions: Iterable[Session], groups: Iterable[SharedGroup]) -> int:
        """One whole sampling cycle at once (see `_cycle`), then flush."""
        for _ in self._cycle(list(sessions), list(groups)):
            pass
        return self.flush()

    async def run(
        self, sessions: Mapping[str, Session], groups: Callable[[], Iterable[SharedGroup]]
    ) -> None:
        """Flush every flush_s; every sample_s start a sampling cycle over the sessions that
        may lag (`_due`), walked SAMPLE_SLICE subscriptions per flush (a million offline
        sessions must not stall the loop). `sessions`: the registry's, by client id."""
        self.restored(sessions)
        cycle: Iterator[bool] | None = None
        next_cycle = time.monotonic() + self.sample_s
        next_record = time.monotonic() + self.record_s
        while True:
            await asyncio.sleep(self.flush_s)
            now = time.monotonic()
            if cycle is None and now >= next_cycle:
                next_cycle = now + self.sample_s
                cycle = self.start_cycle(sessions, list(groups()))
            for step in range(SAMPLE_STEPS):
                if cycle is None:
                    break
                if step:
                    await asyncio.sleep(0)
                if not _advance(cycle, SAMPLE_SLICE // SAMPLE_STEPS, SAMPLE_WRITES // SAMPLE_STEPS):
                    cycle = None
            moved = now >= next_record
            if moved:
                next_record = now + self.record_s
            self.flush(moved)

    def restored(self, sessions: Mapping[str, Session]) -> None:
        """Once, before anything else is sampled: the persistent sessions offline now (those
        restored at start) are watched from now on, and looked at by the next cycle."""
        if self._seeded:
            return
        self._seeded = True
        for s in sessions.values():
            if s.persistent and s.connection is None:
                self.offline(s)

    def start_cycle(
        self, sessions: Mapping[str, Session], groups: list[SharedGroup]
    ) -> Iterator[bool]:
        """A sampling cycle (`_cycle`) over what is due (`_due`), to be walked in steps.
        `sessions`: the registry's, by client id."""
        due, grown = self._due(sessions)
        return self._cycle(due, groups, grown)

    def _due(
        self, sessions: Mapping[str, Session]
    ) -> tuple[list[Session], list[tuple[Session, SubscriptionState]]]:
        """What a sampling cycle looks at: the sessions whose queues' ends it asks the store
        for (restored offline at start; a loop stopped; fallen behind),
        and the subscriptions of offline sessions whose queue grew since the last cycle. A
        session ended or replaced since it was listed is dropped (it is no longer
        `sessions`'), and so is one online again."""
        self.restored(sessions)
        look, self._look = self._look, {}
        lagging, self._lagging = self._lagging, {}
        due = [
            s
            for cid, s in look.items()
            if sessions.get(cid) is s and s.connection is None and cid not in lagging
        ]
        due += [s for cid, s in lagging.items() if sessions.get(cid) is s]
        grown, self._grown = self._grown, set()
        pairs: list[tuple[Session, SubscriptionState]] = []
        offline = self._offline
        for queue in grown:
            found = offline.get(queue)
            readers = () if found is None else found if isinstance(found, set) else (found,)
            for s in readers:
                cid = s.client_id
                sub = s.by_queue.get(queue)
                if (
                    sub is not None
                    and sessions.get(cid) is s
                    and s.connection is None
                    and cid not in look
                    and cid not in lagging
                ):
                    pairs.append((s, sub))
        return due, pairs

    def close(self, sessions: Iterable[Session], groups: Iterable[SharedGroup]) -> None:
        """Write the final state of every open subscription and close the files. Clean
        sessions do not outlive the gateway: their subscriptions end here."""
        try:
            sessions = list(sessions)
            for session in sessions:
                if not session.persistent:
                    for sub in session.subscriptions.values():
                        self.ended(session, sub)
            self.sample([s for s in sessions if s.persistent], groups)
        finally:
            self._writer.close()

    def _cycle(
        self,
        sessions: list[Session],
        groups: list[SharedGroup],
        grown: Sequence[tuple[Session, SubscriptionState]] = (),
    ) -> Iterator[bool]:
        """Queue a record for every subscription not written since its queue grew: `grown`'s
        (their queues were watched), and those of `sessions` and `groups` whose queue's end
        differs from the previous cycle's (on a first look: it owes messages). Memory is
        one int per queue, not per subscription. Yields once per subscription looked at:
        whether it queued a record."""
        for session, sub in grown:
            if id(sub) not in self._dirty:
                self._pending.append(self._session_record(session, sub, 0))
                yield True
        before = self._queue_seen
        now: dict[str, int] = {}

        def grew(queue: str, done: int) -> bool:
            end = now.get(queue)
            if end is None:
                end = now[queue] = self._max_offset(queue)
            last = before.get(queue)
            return end != last and (last is not None or end > done)

        for session in sessions:
            for sub in session.subscription_list():
                if (
                    sub.share_group is None
                    and id(sub) not in self._dirty
                    and grew(sub.queue, sub.committed())
                ):
                    self._pending.append(self._session_record(session, sub, 0))
                    yield True
                else:
                    yield False
        for group in groups:
            if id(group) not in self._dirty_groups and grew(group.queue, group.committed()):
                self._pending.append(self._group_record(group, 0))
                yield True
            else:
                yield False
        self._queue_seen = now

    # -- records -------------------------------------------------------------------------------

    def _session_record(
        self, session: Session, sub: SubscriptionState, flags: int
    ) -> AccountRecord:
        if not session.persistent:
            flags |= FLAG_CLEAN
        return AccountRecord(
            subscriber=session.client_id,
            queue=sub.queue,
            flags=flags,
            qos=sub.qos,
            start=sub.start_offset,
            acked=max(sub.committed(), sub.start_offset),
            sent=sub.next_offset,
            queue_end=self._max_offset(sub.queue),
            time_ms=int(time.time() * 1000),
        )

    def _group_record(self, group: SharedGroup, flags: int) -> AccountRecord:
        key = (group.consumer, group.queue)
        qos = self._group_qos.get(key, 0)
        for member in group.members:
            sub = member.session.subscriptions.get(group.subscription)
            if sub is not None and sub.qos > qos:
                qos = sub.qos
        self._group_qos[key] = qos
        return AccountRecord(
            subscriber=group.consumer,
            queue=group.queue,
            flags=flags | FLAG_SHARED,
            qos=qos,
            start=group.start_offset,
            acked=max(group.committed(), group.start_offset),
            sent=group.next_offset,
            queue_end=self._max_offset(group.queue),
            time_ms=int(time.time() * 1000),
        )


class CountedAccount:
    """An AccountWriter whose records' offsets are first mapped by `count(queue, offset)`: a
    RocketMQ deployment spread over several brokers numbers a queue's messages with merged
    offsets (gateway/storage/rocketmq/spread.py), far past the account's signed 64-bit fields and
    meaningless as differences; mapped to the messages read (the sum of the per-broker
    offsets), the report's differences count messages again. Only such a store is wrapped."""

    def __init__(self, writer: AccountWriter, count: Callable[[str, int], int]) -> None:
        self._writer = writer
        self._count = count

    def append(self, records: Iterable[AccountRecord]) -> int:
        count = self._count
        return self._writer.append(
            [
                dataclasses.replace(
                    r,
                    start=count(r.queue, r.start),
                    acked=count(r.queue, r.acked),
                    sent=count(r.queue, r.sent),
                    queue_end=count(r.queue, r.queue_end),
                )
                for r in records
            ]
        )

    def sync(self) -> None:
        self._writer.sync()

    def close(self) -> None:
        self._writer.close()


class NoDeliveryAccount(DeliveryAccount):
    """The account turned off (settings.delivery_account = False): no files, nothing kept;
    each call the gateway makes returns at once. What a gateway costs without the account is
    what the fleet bench compares against (bench fleet --account-cost)."""

    def __init__(self) -> None:  # no writer: nothing is ever written
        self.flush_s = FLUSH_S
        self.record_s = RECORD_S
        self.sample_s = SAMPLE_S

    def moved(self, session: Session, sub: SubscriptionState) -> None:
        pass

    def group_moved(self, group: SharedGroup) -> None:
        pass

    def online(self, session: Session) -> None:
        pass

    def offline(self, session: Session, owes: bool = True) -> None:
        pass

    def behind(self, session: Session) -> None:
        pass

    def ended(self, session: Session, sub: SubscriptionState) -> None:
        pass

    def group_ended(self, group: SharedGroup) -> None:
        pass

    def flush(self, moved: bool = True) -> int:
        return 0

    def sample(self, sessions: Iterable[Session], groups: Iterable[SharedGroup]) -> int:
        return 0

    async def run(
        self, sessions: Mapping[str, Session], groups: Callable[[], Iterable[SharedGroup]]
    ) -> None:
        return

    def close(self, sessions: Iterable[Session], groups: Iterable[SharedGroup]) -> None:
        pass


def _advance(cycle: Iterator[bool], looks: int, writes: int) -> bool:
    """Walk `cycle` for up to `looks` subscriptions or `writes` records; False once it is
    exhausted."""
    for _ in range(looks):
        wrote = next(cycle, _DONE)
        if wrote is _DONE:
            return False
        if wrote:
            writes -= 1
            if writes <= 0:
                break
    return True


_DONE = object()
