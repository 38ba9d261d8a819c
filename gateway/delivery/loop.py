"""Delivery by long-polling light queues: one DeliveryLoop per connected session.

Theory of operation. A session's non-shared subscriptions each read their own light queue from
`next_offset`. One pass of the loop reads a batch from every queue that has something new
(store.max_offset > next_offset) and sends what the client's receive window allows. The loop
sleeps (no task, no timer) until woken by:
  - the store's arrival notice for one of its queues (ArrivalHub), i.e. long polling: that
    queue is marked ready and the next pass reads only the ready queues (a session with a
    hundred exact subscriptions must not look at all of them per message);
  - an acknowledgement freeing window space, the transport draining below its low-water mark
    (resume_writing), a new subscription or retained messages: the next pass looks at every
    queue (`wake()`).
A queue still behind after its read (batch limit) stays ready, and a pass that made progress
schedules the next one (call_soon, so publishers and other sessions run in between). A queue
left behind because the window or the transport was full is looked at again by the full pass
that the next acknowledgement or resume_writing triggers (`_behind`; otherwise an
acknowledgement only commits offsets, without looking at every queue). The store calls the listener
synchronously on the loop thread after dispatch, and a pass runs to completion without
yielding, so no notice can fall between "found nothing" and "sleep". What one pass sends
leaves with one transport.write().

Overlapping subscriptions. A message matching several filters of one session sits in several of
its queues. It is delivered once, at the highest QoS of the matching subscriptions and with all
their subscription identifiers, from its "owner" queue: the first (by name) of the session's
queues that contains it at or after that subscription's start. The record's
INNER_MULTI_DISPATCH / INNER_MULTI_QUEUE_OFFSET tell every queue and offset it sits at, so the
decision needs no memory and is the same after a restart; the other queues skip it, but not
before the owner has read it (they wait for it like for a full window): were the owner
unsubscribed first, nothing would deliver it any more.

Offsets. `pending` (per subscription) holds the queue offsets sent at QoS > 0 and not yet
acknowledged; the committed offset (store.offsets, group = client id) is the smallest of them,
or `next_offset` when none: the highest contiguously acknowledged position.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from accelerators import pure_python
from gateway.access.acl import ClientAccess
from gateway.delivery.account import DeliveryAccount
from gateway.delivery.arrivals import ArrivalHub
from gateway.delivery.backlog import BacklogWatch
from gateway.delivery.rules import decide, decide_one, identifiers, retain_flag
from gateway.delivery.shared import SharedGroup
from gateway.messages.recent import PreparedCache, RecentMessages
from gateway.messages.records import RecordedPublish, read_record
from gateway.messages.retained import RetainedMessage
from gateway.protocol import (
    ENCODED_TOPICS,
    Connection,
    PreparedPublish,
    Properties,
    Publish,
    PubRel,
    ReasonCode,
)
from gateway.session.model import Inflight, Session, SubscriptionState
from gateway.session.registry import SessionRegistry
from gateway.session.replay import Replay, ReplayPacer
from gateway.stats import GatewayStats
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage, StoredMessage

log = logging.getLogger("lmqtt.gateway")

BATCH = 32
# Pacing of the passes that arrivals and acknowledgements ask for (_schedule): a subscriber
# written to less than PASS_INTERVAL ago gets that pass from a timer (at most that much
# later), unless a later notice finds the interval over first. A busy gateway turns its loop
# every few hundred microseconds with a few messages each; a pass per turn made a fan-out
# subscriber cost a pass and a socket write for every 3 packets (2,000 devices at 10,000
# msg/s: 64k writes for 210k deliveries). Not paced: a subscriber not written to in the last
# interval, `wake()` (window or transport freed after they stopped a pass, a subscription,
# retained messages) and a pass stopped at the batch limit (call_soon in _step), so neither
# low-rate latency nor a window-bound subscriber's throughput pays. uvloop's clock and timers
# move in whole milliseconds: 1 ms is the finest step.
PASS_INTERVAL = 0.001
# Below this the interval is not over: uvloop's times are whole ms in binary floating point,
# and 10322.494 - 10322.493 < 0.001.
_PASS_NOT_OVER = PASS_INTERVAL - 1e-6
# A replay waiting for the backend to read its history (RocketMQ: a pull) asks again after this.
REPLAY_WAIT_S = 0.005
# A replay pass (gateway/session/replay.py) looks at up to REPLAY_STEP records and stops after
# REPLAY_SLICE_S of wall-clock time: a live message waits at most about one slice behind it.
REPLAY_STEP = 256
REPLAY_SLICE_S = 0.0005


class Subscriber(Protocol):
    """The connection a delivery loop writes to (gateway/connection/client.py ClientConnection)."""

    conn: Connection
    acl: ClientAccess | None
    writable: bool
    closed: bool

    def write(self, data: bytes) -> None: ...

    def abort(self, reason: int) -> None: ...


@dataclass(slots=True)
class DeliveryContext:
    """What every delivery loop uses, built once by the composition root (gateway/app.py) and
    shared by all of them (the shape of uvicorn's ServerState): one attribute hop to each
    collaborator, as when the loops held the whole gateway, but only these."""

    store: Storage  # max_offset, log_max_offset, committed offsets
    cursor: QueueCursor  # every queue read (gateway/storage/cursor.py)
    arrivals: ArrivalHub  # long polling
    recent: RecentMessages  # decoded records of fan-outs
    prepared: PreparedCache  # encoded packets of fan-outs
    stats: GatewayStats
    sessions: SessionRegistry  # progress to persist
    account: DeliveryAccount
    replay_pacer: ReplayPacer
    # told when a pass leaves something unsent (gateway/connection/overload.py)
    overload: BacklogWatch
    max_inflight: int  # settings.max_inflight
    outbound_topic_aliases: bool  # settings.outbound_topic_aliases


class DeliveryLoop:
    """Sends a connected session's messages within its window; see the module docstring."""

    __slots__ = (
        "_batch",
        "_behind",
        "_full",
        "_last_write",
        "_live",
        "_loop",
        "_pass_timer",
        "_plain",
        "_ready",
        "_replay_timer",
        "_scheduled",
        "_stopped",
        "_uncommitted",
        "_watched",
        "alias_max",
        "aliases",
        "client",
        "ctx",
        "groups",
        "level",
        "max_packet",
        "retained_backlog",
        "session",
        "window",
    )

    def __init__(self, context: DeliveryContext, session: Session, client: Subscriber) -> None:
        self.ctx = context
        self.session = session
        self.client = client
        conn = client.conn
        self.level = conn.protocol_level or 4
        self.window = max(1, min(conn.client_receive_maximum or 65535, context.max_inflight))
        self.max_packet = conn.client_max_packet_size
        alias_max = conn.client_topic_alias_maximum or 0
        self.alias_max = alias_max if context.outbound_topic_aliases else 0
        # Neither topic aliases nor a packet size limit: _deliver_plain() may send.
        self._plain = not self.alias_max and self.max_packet is None
        self.aliases: dict[str, int] = {}
        # Allocated on first use: most subscribers never need them.
        self.retained_backlog: deque[tuple[RetainedMessage, SubscriptionState]] | None = None
        self.groups: list[SharedGroup] = []
        # Stepped with call_soon rather than a task: an idle subscriber costs no task.
        self._loop = asyncio.get_running_loop()
        self._scheduled = False
        self._stopped = False
        self._last_write = -PASS_INTERVAL  # loop time of the last pass that wrote
        self._pass_timer: asyncio.TimerHandle | None = None  # a paced pass (see _schedule)
        # Next pass: every queue (_full) or only those the store reported (_ready).
        self._full = False
        self._ready: dict[str, None] = {}  # an ordered set: 64 bytes empty, a set is 216
        # A pass stopped at a full window or transport: the next acknowledgement looks at all.
        self._behind = False
        self._live = False  # caught up once since it started (see _step)
        self._watched: list[str] = []  # queues watched with the ArrivalHub (a session has few)
        # Packets of the batch being read, written with one transport.write() at its end.
        self._batch: list[bytes] | None = None
        # Subscriptions whose acknowledged position moved since it was last committed: one
        # store commit per pass instead of one per PUBACK.
        self._uncommitted: dict[str, SubscriptionState] = {}
        # Set while a replay waits for its share of the loop (gateway/session/replay.py
        # ReplayPacer).
        self._replay_timer: asyncio.TimerHandle | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for sub in self.session.by_queue.values():
            self.watch(sub.queue)
        self._resend_inflight()
        self.wake()

    def stop(self) -> None:
        self._stopped = True
        if self._pass_timer is not None:
            self._pass_timer.cancel()
            self._pass_timer = None
        if self._replay_timer is not None:
            self._replay_timer.cancel()
            self._replay_timer = None
        self._commit_acknowledged()
        for q in self._watched:
            self.ctx.arrivals.unwatch(q, self)
        self._watched.clear()
        for group in list(self.groups):
            group.leave(self)
        self.groups.clear()

    def watch(self, queue: str) -> None:
        if queue not in self._watched:
            self._watched.append(queue)
            self.ctx.arrivals.watch(queue, self)

    def unwatch(self, queue: str) -> None:
        if queue in self._watched:
            self._watched.remove(queue)
            self.ctx.arrivals.unwatch(queue, self)
            self._ready.pop(queue, None)

    def wake(self) -> None:
        """Schedule a pass over every queue, in this turn's callbacks (not paced: the window
        or the transport had stopped this subscriber, or it has something new to look at)."""
        self._full = True
        if not self._scheduled and not self._stopped:
            self._scheduled = True
            self._loop.call_soon(self._step)

    def _schedule(self) -> None:
        """Schedule a pass over the ready queues (and the offset commits): in this turn's
        callbacks, or at most PASS_INTERVAL later when a pass wrote less than that ago."""
        if self._scheduled or self._stopped:
            return
        loop = self._loop
        if loop.time() - self._last_write < _PASS_NOT_OVER:
            if self._pass_timer is None:
                self._pass_timer = loop.call_later(PASS_INTERVAL, self._paced)
            return
        self._scheduled = True
        loop.call_soon(self._step)

    def _paced(self) -> None:
        self._pass_timer = None
        if not self._scheduled:
            self._step()

    def arrived(self, queue: str) -> None:
        """The store's notice: `queue` grew."""
        self._ready[queue] = None
        self._schedule()

    def capacity(self) -> int:
        return self.window - len(self.session.inflight)

    def can_send(self) -> bool:
        return self.client.writable and not self.client.closed

    def _step(self) -> None:
        """One pass; another is scheduled (after whatever else is ready) while it progresses."""
        self._scheduled = False
        if self._pass_timer is not None:  # this pass does what it was waiting for
            self._pass_timer.cancel()
            self._pass_timer = None
        if self._stopped:
            return
        try:
            if self._uncommitted:
                self._commit_acknowledged()
            if self._pass() and (self._ready or self._full or self.retained_backlog):
                self._scheduled = True
                self._loop.call_soon(self._step)
            if self._ready or self._behind:
                # Something left unsent: the overload guard watches how far behind this is,
                # once this loop has been caught up (before that it is catching up on what
                # the session missed while away, not falling behind the load of the moment).
                if self._live:
                    self.ctx.overload.behind(self)
            elif not self._live:
                self._live = True
        except Exception:
            log.exception("delivery to %r failed; closing the connection", self.session.client_id)
            self.client.abort(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)

    def _pass(self) -> bool:
        if not self.can_send():
            self._behind = True
            return False
        by_queue = self.session.by_queue
        ready = self._ready
        if self._full:
            self._full = False
            self._behind = False
            subs = list(by_queue.values())
            ready.clear()
        elif ready:
            self._ready = {}
            subs = [sub for q in ready if (sub := by_queue.get(q)) is not None]
        else:
            subs = []
        progressed = False
        batch: list[bytes] = []
        self._batch = batch
        try:
            if self.retained_backlog:
                progressed = self._send_retained()
            max_offset = self.ctx.store.max_offset
            for sub in subs:
                if self.capacity() <= 0 or not self.can_send():
                    self._behind = True
                    break
                if sub.replay is not None:  # history first: the light queue waits (replay.py)
                    moved = self._replay(sub)
                    progressed = progressed or moved
                    if sub.replay is not None:
                        if not moved and self._replay_timer is None:
                            self._behind = True
                        continue
                end = max_offset(sub.queue)
                if sub.next_offset >= end:
                    continue
                if self._read(sub):
                    progressed = True
                    if sub.next_offset < end:
                        self._ready[sub.queue] = None  # batch limit: the rest in the next pass
                elif sub.next_offset < end:
                    self._behind = True
        finally:
            self._batch = None
            if batch:
                self._last_write = self._loop.time()
                self.client.write(batch[0] if len(batch) == 1 else b"".join(batch))
        return progressed

    def oldest_unsent_ms(self) -> int | None:
        """Store timestamp (ms) of the oldest message of a live subscription (not replaying)
        that was not sent yet, or None when there is none (the overload guard's measure of
        how far this subscriber is behind; called per guard tick, not per message)."""
        if self._stopped or self.client.closed:
            return None
        max_offset = self.ctx.store.max_offset
        one = self.ctx.cursor.one
        oldest: int | None = None
        for sub in self.session.by_queue.values():
            if sub.replay is not None or sub.next_offset >= max_offset(sub.queue):
                continue
            first = one(sub.queue, sub.next_offset)  # the recent cache first, as delivery reads
            if first is None:
                continue
            ts = first.store_timestamp
            if oldest is None or ts < oldest:
                oldest = ts
        return oldest

    # -- reading queues ----------------------------------------------------------------------

    def _read(self, sub: SubscriptionState) -> bool:
        offset = sub.next_offset
        messages, start, _ = self.ctx.cursor.read(sub.queue, offset, BATCH)
        if start != offset:
            if start > offset:
                log.warning(
                    "%r: queue %s offsets %d..%d were deleted by retention before delivery",
                    self.session.client_id,
                    sub.queue,
                    offset,
                    start,
                )
            else:  # the queue ends below the position (a lost tail): resume at its end
                sub.start_offset = min(sub.start_offset, start)
            sub.next_offset = start
            sub.read_phys = None
        if messages:
            return self._deliver_batch(sub, messages)
        return start > offset

    def _replay(self, sub: SubscriptionState) -> bool:
        """Hand `sub`'s replayed messages over within the window (a short slice per pass, and
        only within the replays' share of the loop, so live traffic runs in between); when it
        is done the light queue takes over. Sent QoS 1/2 messages are in flight as copies:
        their parent-queue position is not one the session reads."""
        replay = sub.replay
        assert replay is not None
        pacer = self.ctx.replay_pacer
        wait = pacer.wait()
        if wait > 0:  # live traffic first: come back when the replays' share allows
            if self._replay_timer is None:
                self._replay_timer = self._loop.call_later(wait, self._replay_due)
            return False
        started = time.monotonic()
        try:
            return self._replay_some(sub, replay, started + REPLAY_SLICE_S)
        finally:
            pacer.spent(started)

    def _replay_due(self) -> None:
        self._replay_timer = None
        self.wake()

    def _replay_some(self, sub: SubscriptionState, replay: Replay, until: float) -> bool:
        store = self.ctx.store
        session = self.session
        moved = False
        for i in range(REPLAY_STEP):
            if i & 7 == 7 and time.monotonic() > until:
                break
            msg = replay.peek(self.ctx.cursor)
            if msg is None:
                if replay.waiting:  # the backend's read is on its way (RocketMQ: a pull)
                    if self._replay_timer is None:
                        self._replay_timer = self._loop.call_later(REPLAY_WAIT_S, self._replay_due)
                    break
                sub.replay = None
                sub.start_phys = store.log_max_offset  # covers from here (see _covering)
                # Passed over as the light queue is read (_pass_replayed), whenever its
                # messages reach the store's reads: on RocketMQ they may not be there yet.
                sub.replayed_phys = replay.last_phys
                log.info("%r: replay of %r done, live now", session.client_id, sub.topic_filter)
                self.ctx.sessions.touch(session)
                return True
            rec = replay.record(msg)
            out = decide(rec, (sub,), session.client_id, self.level) if rec is not None else None
            if rec is not None and out is not None:
                qos = out.qos
                if (qos > 0 and self.capacity() <= 0) or not self.can_send():
                    break
                # History is not a retained message: RETAIN 0 whatever the subscription says.
                pid = self.send(rec, qos, False, out.sub_ids, out.expiry_left, None)
                if pid:
                    session.inflight[pid] = Inflight(
                        pid, None, 0, qos, message=rec, retain=False, sub_ids=out.sub_ids
                    )
            replay.advance()
            moved = True
        if moved:
            self.ctx.sessions.mark_progress()
            self._ready[sub.queue] = None  # more to replay (paced: see _replay)
        return moved

    def _pass_replayed(
        self, sub: SubscriptionState, messages: list[StoredMessage]
    ) -> list[StoredMessage]:
        """Pass over the leading `messages` the replay of `sub` handed over (stored at or
        before `sub.replayed_phys`, see gateway/session/replay.py; the queue is in store order, so
        they come first) and return the rest. The first message past it ends the check."""
        last = sub.replayed_phys
        skip = 0
        for msg in messages:
            if msg.physical_offset > last:
                sub.replayed_phys = -1
                break
            if msg.queue_offset >= sub.next_offset:
                sub.next_offset = msg.queue_offset + 1
                sub.read_phys = msg.physical_offset + 1
            skip += 1
        return messages[skip:] if skip else messages

    def _deliver_batch(self, sub: SubscriptionState, messages: list[StoredMessage]) -> bool:
        """Send what the window allows of `messages` (written at the end of the pass)."""
        moved = None
        passed = False
        if sub.replayed_phys >= 0:  # just after a replay (one int test per batch otherwise)
            before = sub.next_offset
            messages = self._pass_replayed(sub, messages)
            passed = sub.next_offset != before
        # Whether other loops read this queue too, asked once per batch: nothing in it awaits,
        # so the answer holds for every message (per message it cost ~5% of a fan-out's CPU).
        shared = self.ctx.arrivals.watchers(sub.queue) > 1
        codec = self._plain_outbound(sub)
        if codec is not None and type(messages) is list:
            moved = self._deliver_run(sub, messages, shared, *codec)
        else:
            for msg in messages:
                off = msg.queue_offset
                if off < sub.next_offset:
                    continue
                if not self._deliver(sub, off, msg, shared):
                    break
                sub.next_offset = off + 1
                moved = msg
        if moved is not None:
            sub.read_phys = moved.physical_offset + 1
        self._commit(sub)
        return passed or moved is not None

    def _plain_outbound(self, sub: SubscriptionState) -> tuple[dict[int, int], int] | None:
        """The codec's outbound packet ids when this batch may go by `PLAIN_RUN` (what
        `_deliver_plain` sends without a check of its own: no ACL, topic aliases, packet size
        limit or subscription identifier, the pass's batch open), else None."""
        if not self._plain or sub.subscription_identifier or self._batch is None:
            return None
        client = self.client
        if client.acl is not None or client.conn.protocol_level != self.level:
            return None
        return client.conn.prepared_outbound()

    def _deliver_run(
        self,
        sub: SubscriptionState,
        messages: list[StoredMessage],
        shared: bool,
        outbound: dict[int, int],
        unacked: int,
    ) -> StoredMessage | None:
        """`_deliver_batch`'s loop with the plain path in one `PLAIN_RUN` call per run of
        messages it takes; `_deliver` takes the message a run stops at (then the next run
        goes on). Returns the last message passed, or None."""
        session = self.session
        ctx = self.ctx
        conn = self.client.conn
        batch = self._batch
        assert batch is not None
        single = len(session.by_queue) == 1
        state = [sub.next_offset, session.next_packet_id, 0, -1]
        moved: StoredMessage | None = None
        i = 0
        n = len(messages)
        while i < n:
            try:
                i, full = PLAIN_RUN(
                    messages, i, state, single, self.window, self.level, sub.qos, sub.no_local,
                    sub.retain_as_published, session.client_id, sub.queue, session.inflight,
                    sub.pending, Inflight, ENCODED_TOPICS, outbound,
                    conn.client_receive_maximum, unacked, batch,
                )  # fmt: skip
            finally:
                sub.next_offset, session.next_packet_id, sent, last = state
                ctx.stats.messages_sent += sent
                state[2] = 0
                if last >= 0:
                    moved = messages[last]
            if full or i >= n:
                break
            msg = messages[i]  # what the run does not take: the general path
            if not self._deliver(sub, msg.queue_offset, msg, shared):
                break
            sub.next_offset = msg.queue_offset + 1
            moved = msg
            i += 1
            state[0] = sub.next_offset
            state[1] = session.next_packet_id
            state[3] = -1
        return moved

    def _commit(self, sub: SubscriptionState) -> None:
        self._uncommitted.pop(sub.queue, None)
        committed = sub.committed()
        if committed != sub.last_commit:  # QoS 1 sends behind an unacked one change nothing
            sub.last_commit = committed
            self.ctx.store.offsets.commit(
                self.session.client_id, sub.queue, committed, durable=self.session.persistent
            )
            self.ctx.account.moved(self.session, sub)

    def _commit_acknowledged(self) -> None:
        uncommitted = self._uncommitted
        while uncommitted:
            _, sub = uncommitted.popitem()
            if self.session.by_queue.get(sub.queue) is sub:  # not unsubscribed meanwhile
                self._commit(sub)

    def _covering(
        self, sub: SubscriptionState, msg: StoredMessage
    ) -> list[SubscriptionState] | None:
        """The session's subscriptions this message is delivered for (`sub` first), or None
        if another of the session's queues owns the delivery: the lowest queue name among
        those covering it, so overlapping subscriptions deliver a message once."""
        by_queue = self.session.by_queue
        if len(by_queue) == 1 or len(msg.queues) <= 1:
            return [sub]
        # A plain loop: this runs per delivery for every session with several subscriptions,
        # and most messages are covered by just one of them.
        phys = msg.physical_offset
        mine = sub.queue
        # Stored while `sub` was replaying (see gateway/session/replay.py): the others delivered it.
        late = phys < sub.start_phys
        covering = [sub]
        for q in msg.queues:
            s = by_queue.get(q)
            if s is None or s is sub or phys < s.start_phys:
                continue
            if q < mine or late:
                return None
            covering.append(s)
        return covering

    def _owner_has_read(self, sub: SubscriptionState, msg: StoredMessage) -> bool:
        """`msg` is delivered for another of the session's subscriptions (the owner, see
        _covering). `sub` may pass it by only once the owner has read it: were the owner
        unsubscribed first, nothing would deliver it any more. False: `sub` waits (as for a
        full window) and is looked at again in the next pass."""
        by_queue = self.session.by_queue
        phys = msg.physical_offset
        owner: SubscriptionState | None = None
        for q in msg.queues:
            s = by_queue.get(q)
            if s is not None and phys >= s.start_phys and (owner is None or q < owner.queue):
                owner = s
        if owner is None or owner is sub:
            return True
        read = owner.read_phys
        if read is None:
            read = owner.read_phys = self._read_position(owner)
        if read > phys or owner.next_offset >= self.ctx.store.max_offset(owner.queue):
            return True
        self._ready[sub.queue] = None
        return False

    def _read_position(self, sub: SubscriptionState) -> int:
        """`read_phys` of `sub` from the store: just past the message before `next_offset`."""
        if sub.next_offset <= sub.start_offset:
            return sub.start_phys  # nothing read since subscribing
        msg = self.ctx.cursor.one(sub.queue, sub.next_offset - 1)
        if msg is not None:
            return msg.physical_offset + 1
        return 1 << 62  # gone (retention): everything before it was read

    def _deliver(self, sub: SubscriptionState, off: int, msg: StoredMessage, shared: bool) -> bool:
        """Send one queue message; False when the window is full (retry later). `shared`:
        other delivery loops read `sub.queue` too."""
        # A fan-out decodes and encodes each message once for all its subscribers; a message
        # only this loop reads skips both caches (they would cost more than they save).
        fanout = shared or len(msg.queues) > 1
        if fanout:
            rec = self.ctx.recent.record(msg)
        else:
            rec = read_record(msg.topic, msg.body, msg.properties, msg.store_timestamp)
        if rec is None:
            return True
        session = self.session
        if len(session.by_queue) == 1 or len(msg.queues) <= 1:
            if (
                rec.expiry is None
                and not sub.subscription_identifier
                and self._plain
                and self.client.acl is None
            ):
                return self._deliver_plain(sub, off, msg, rec, fanout)
            # Only `sub` covers it (what _covering() answers), without building a list.
            out = decide_one(rec, sub, session.client_id, self.level)
        else:
            covering = self._covering(sub, msg)
            if covering is None:
                return self._owner_has_read(sub, msg)
            out = decide(rec, covering, session.client_id, self.level)
        if out is None:
            return True
        qos = out.qos
        if qos > 0 and self.window - len(session.inflight) <= 0:
            return False
        pid = self.send(
            rec,
            qos,
            out.retain,
            out.sub_ids,
            out.expiry_left,
            msg.physical_offset if fanout else None,
        )
        if pid:
            session.inflight[pid] = Inflight(pid, sub.queue, off, qos)
            sub.pending[off] = pid
        return True

    def _deliver_plain(
        self,
        sub: SubscriptionState,
        off: int,
        msg: StoredMessage,
        rec: RecordedPublish,
        fanout: bool,
    ) -> bool:
        """_deliver() -> decide_one() -> send() in one frame, for the common case: one
        subscription covers the message, which has no expiry, the subscription no identifier,
        and the connection no ACL, topic aliases or packet size limit. What it sends, caches
        and records is exactly what that chain does (tests/gateway/delivery/test_delivery_plain.py
        runs both); it saves their calls and the per-delivery Outbound, list and tuple. Most
        such deliveries go by PLAIN_RUN (see _deliver_run); this takes what a run leaves
        with these conditions met (a topic the writers have not encoded yet, a packet id in
        use, a record of another shape)."""
        session = self.session
        if sub.no_local and rec.client_id == session.client_id:  # decide_one's rules
            return True
        qos = rec.qos
        if sub.qos < qos:
            qos = sub.qos
        if qos > 0 and self.window - len(session.inflight) <= 0:
            return False
        level = self.level
        retain = rec.retain and level == 5 and sub.retain_as_published
        topic = rec.topic
        if fanout:
            # send()'s key, with no alias, no identifiers (tuple([]) is ()) and no expiry.
            key = (msg.physical_offset, level, qos, retain, topic, None, (), None)
            cache = self.ctx.prepared
            prepared = cache.lookup(key)
            if prepared is None:
                prepared = _prepare(rec, level, qos, retain, topic, None, [], None)
                cache.put(key, prepared)
        else:
            prepared = _prepare(rec, level, qos, retain, topic, None, [], None)
        if qos > 0:
            pid = session.allocate_packet_id()
            data = self.client.conn.send_prepared(prepared, pid, False)
            session.inflight[pid] = Inflight(pid, sub.queue, off, qos)
            sub.pending[off] = pid
        else:
            data = self.client.conn.send_prepared(prepared, None, False)
        batch = self._batch
        if batch is not None:
            batch.append(data)
        else:
            self.client.write(data)
        self.ctx.stats.messages_sent += 1
        return True

    # -- shared subscriptions ----------------------------------------------------------------

    def deliver_shared(
        self, group: SharedGroup, sub: SubscriptionState, off: int, msg: StoredMessage
    ) -> str:
        """Send one message for a shared subscription: "pending" (awaits ack), "done" or
        "full" (no window space: the group gives it to someone else)."""
        rec = read_record(msg.topic, msg.body, msg.properties, msg.store_timestamp)
        if rec is None:
            return "done"
        out = decide(rec, (sub,), self.session.client_id, self.level)
        if out is None:
            return "done"
        qos = out.qos
        if (qos > 0 and self.capacity() <= 0) or not self.can_send():
            return "full"
        pid = self.send(rec, qos, out.retain, out.sub_ids, out.expiry_left, msg.physical_offset)
        if pid:
            inf = Inflight(pid, sub.queue, off, qos, group=group, topic_filter=sub.topic_filter)
            self.session.inflight[pid] = inf
            return "pending"
        return "done"

    # -- retained messages on subscribe -------------------------------------------------------

    def queue_retained(self, messages: list[RetainedMessage], sub: SubscriptionState) -> None:
        if self.retained_backlog is None:
            self.retained_backlog = deque()
        for m in messages:
            self.retained_backlog.append((m, sub))
        self.wake()

    def _send_retained(self) -> bool:
        sent = False
        backlog = self.retained_backlog
        while backlog and self.can_send():
            m, sub = backlog[0]
            if min(m.qos, sub.qos) > 0 and self.capacity() <= 0:
                break
            backlog.popleft()
            rec = RecordedPublish(
                topic=m.topic,
                payload=m.payload,
                qos=m.qos,
                retain=True,
                client_id="",  # not a publisher's message: no-local does not apply
                expiry=m.expiry_interval_s,
                stored_at_ms=m.stored_at_ms,
                props=m.properties,
            )
            out = decide(rec, (sub,), self.session.client_id, self.level, on_subscribe=True)
            if out is None:
                continue
            pid = self.send(rec, out.qos, True, out.sub_ids, out.expiry_left, None)
            if pid:
                # No queue position to re-read a retained copy from: keep it for a resend.
                self.session.inflight[pid] = Inflight(
                    pid, None, 0, out.qos, message=rec, retain=True, sub_ids=out.sub_ids
                )
            sent = True
        return sent

    # -- acknowledgements --------------------------------------------------------------------

    def on_puback(self, packet_id: int) -> None:
        """PUBACK (QoS 1) or PUBCOMP (QoS 2): the message is done."""
        self.on_pubacks((packet_id,))

    def on_pubacks(self, packet_ids: Sequence[int]) -> None:
        """on_puback() for the PUBACKs of one read, with one progress mark and one pass asked
        for: a fan-out subscriber acknowledges a pass's packets in one write."""
        session = self.session
        inflight = session.inflight
        by_queue = session.by_queue
        done = False
        for packet_id in packet_ids:
            inf = inflight.pop(packet_id, None)
            if inf is None:
                continue
            done = True
            if inf.group is not None:
                inf.group.ack(inf.offset)
            elif inf.queue is not None:
                sub = by_queue.get(inf.queue)
                if sub is not None and sub.pending.get(inf.offset) == packet_id:
                    del sub.pending[inf.offset]
                    self._uncommitted[sub.queue] = sub  # committed by the next pass
        if not done:
            return
        self.ctx.sessions.mark_progress()
        if self._behind:
            self.wake()
        elif self._ready or self._scheduled or self._pass_timer is not None or self._stopped:
            self._schedule()  # that pass commits them
        else:
            # Nothing waits to be sent: commit here rather than in a pass of its own. A
            # subscriber that gets a message now and then (site/{k}/# in the fleet bench)
            # otherwise paid a callback and an empty pass per acknowledgement.
            self._commit_acknowledged()
        for group in self.groups:
            group.schedule_pump()

    def on_pubrec(self, packet_id: int, failed: bool) -> bool:
        """PUBREC for an outbound QoS 2 message; True when PUBREL should be sent."""
        inf = self.session.inflight.get(packet_id)
        if inf is None:
            return False
        if failed:  # MQTT 5: reason >= 0x80 ends the flow
            self.on_puback(packet_id)
            return False
        inf.pubrel = True
        self.ctx.sessions.mark_progress()
        return True

    def on_transport_resumed(self) -> None:
        self.wake()
        for group in self.groups:
            group.schedule_pump()

    # -- sending -----------------------------------------------------------------------------

    def send(
        self,
        rec: RecordedPublish,
        qos: int,
        retain: bool,
        sub_ids: list[int],
        expiry_left: int | None,
        physical_offset: int | None,
        dup: bool = False,
        packet_id: int | None = None,
    ) -> int:
        """Encode (cached per fan-out: `physical_offset` None skips the cache) and write one
        PUBLISH; returns the packet id used
        (0 for QoS 0 or when the packet was dropped as larger than the client accepts, or as
        not readable by this client under the ACL: wildcard subscriptions are checked here)."""
        acl = self.client.acl
        if acl is not None and not acl.may_read(rec.topic):
            self.ctx.stats.publish_dropped += 1
            return 0
        level = self.level
        topic = rec.topic
        alias: int | None = None
        new_alias = False
        if level == 5 and self.alias_max:
            alias = self.aliases.get(topic)
            if alias is not None:
                topic = ""
            elif len(self.aliases) < self.alias_max:
                alias = len(self.aliases) + 1
                new_alias = True
        # No closure per call: the fan-out hits the cache 99 times out of 100.
        if physical_offset is None:
            prepared = _prepare(rec, level, qos, retain, topic, alias, sub_ids, expiry_left)
        else:
            key = (physical_offset, level, qos, retain, topic, alias, tuple(sub_ids), expiry_left)
            cache = self.ctx.prepared
            found = cache.lookup(key)
            if found is None:
                found = _prepare(rec, level, qos, retain, topic, alias, sub_ids, expiry_left)
                cache.put(key, found)
            prepared = found
        pid = 0
        if qos > 0:
            pid = packet_id if packet_id is not None else self.session.allocate_packet_id()
        if self.max_packet is not None:
            size = len(prepared.packet(pid or None, dup))
            if size > self.max_packet:
                self.ctx.stats.publish_dropped += 1
                log.info(
                    "%r: %d-byte PUBLISH on %r dropped: client maximum packet size is %d",
                    self.session.client_id,
                    size,
                    rec.topic,
                    self.max_packet,
                )
                return 0
        data = self.client.conn.send_prepared(prepared, pid or None, dup)
        if new_alias and alias is not None:
            self.aliases[rec.topic] = alias
        if self._batch is not None:
            self._batch.append(data)
        else:
            self.client.write(data)
        self.ctx.stats.messages_sent += 1
        return pid

    def _resend_inflight(self) -> None:
        """After a reconnect: re-send what was unacknowledged, with DUP, in the original order."""
        one = self.ctx.cursor.one
        for inf in list(self.session.inflight.values()):
            if inf.pubrel:
                self.client.write(self.client.conn.send(PubRel(packet_id=inf.packet_id)))
                continue
            if inf.queue is None:
                self._resend_copy(inf)
                continue
            msg = one(inf.queue, inf.offset)
            sub = self.session.by_queue.get(inf.queue)
            if msg is None or sub is None:
                self._forget(inf)
                continue
            rec = read_record(msg.topic, msg.body, msg.properties, msg.store_timestamp)
            if rec is None:
                self._forget(inf)
                continue
            # The QoS decided when it was first sent; the flags as decide() makes them.
            covering = self._covering(sub, msg) or [sub]
            sent = self.send(
                rec,
                inf.qos,
                retain_flag(rec, covering, self.level),
                identifiers(covering),
                rec.remaining_expiry(),
                None,
                dup=True,
                packet_id=inf.packet_id,
            )
            if not sent:
                # Larger than this connection's Maximum Packet Size, or no longer readable
                # under the ACL: done as if sent ([MQTT-3.1.2-25]), not held in the window.
                self._forget(inf)

    def _resend_copy(self, inf: Inflight) -> None:
        """Re-send a message kept with its in-flight entry (a retained copy sent on SUBSCRIBE,
        or a delivery whose subscription was removed) as it was sent, with DUP
        ([MQTT-4.4.0-1]); one that expired meanwhile is done as if sent."""
        copy = inf.message
        expiry_left = copy.remaining_expiry() if copy is not None else None
        if copy is None or (expiry_left is not None and expiry_left <= 0):
            self._forget(inf)
            return
        sent = self.send(
            copy, inf.qos, inf.retain, inf.sub_ids, expiry_left, None, dup=True,
            packet_id=inf.packet_id,
        )  # fmt: skip
        if not sent:
            self._forget(inf)

    def _forget(self, inf: Inflight) -> None:
        """Drop an inflight message of a resumed session that will not be re-sent."""
        self.session.inflight.pop(inf.packet_id, None)
        # restore_outbound() told the codec it is in flight.
        self.client.conn.forget_outbound(inf.packet_id)
        sub = self.session.by_queue.get(inf.queue) if inf.queue else None
        if sub is not None:
            sub.pending.pop(inf.offset, None)
            self._commit(sub)


def _prepare(
    rec: RecordedPublish,
    level: int,
    qos: int,
    retain: bool,
    topic: str,
    alias: int | None,
    sub_ids: list[int],
    expiry_left: int | None,
) -> PreparedPublish:
    """Encode one outbound PUBLISH variant (everything but packet id and DUP)."""
    props = rec.mqtt5_properties(sub_ids, expiry_left) if level == 5 else None
    if alias is not None:
        if props is None:
            props = Properties()
        props.topic_alias = alias
    pub = Publish(topic=topic, payload=rec.payload, qos=qos, retain=retain, properties=props)
    return PreparedPublish(level, pub)


def plain_run_py(
    messages: list[StoredMessage],
    i: int,
    state: list[int],
    single: bool,
    window: int,
    level: int,
    sub_qos: int,
    no_local: bool,
    rap: bool,
    client_id: str,
    queue: str,
    inflight: dict[int, Inflight],
    pending: dict[int, int],
    inflight_new: Callable[[int, str, int, int], Inflight],
    topics: dict[str, bytes],
    outbound: dict[int, int],
    receive_maximum: int,
    unacked: int,
    batch: list[bytes],
) -> tuple[int, bool]:
    """The plain path (`_deliver` -> `_deliver_plain` -> `Connection.send_prepared`) over
    `messages[i:]` for one subscription, for records of the canonical shape, until a message
    it does not take: the reference of `plain_run` in gateway/protocol/_speedups.c, which
    must do exactly this without the RecordedPublish and the PreparedPublish (the same dict
    changes, the same bytes; tests/gateway/delivery/test_delivery_plain_run.py compares them).

    Stops without touching the message at `i` (the general path takes it, with every rule)
    unless one subscription covers it (`single`, or one queue), its "mqtt.qos" is "0", "1"
    or "2" (or absent), it has no "mqtt.expiry" and at level 5 none of _MQTT5_KEYS, its topic
    is in the writers' encoded-topic cache `topics` (valid, encoded), its body is bytes, and
    for QoS > 0 the next packet id is free (in flight, or in the codec's `outbound`) and the
    codec's Receive Maximum not reached. Stops with `full` = True when it needs a window slot
    and none is free. `state` is [next offset, next packet id, packets sent, index of the
    last message passed] and is written back on every exit, errors included. Returns (index
    of the first message not taken, full)."""
    next_offset, next_pid, sent, moved = state
    n = len(messages)
    full = False
    try:
        while i < n:
            msg = messages[i]
            off = msg[3]
            if off < next_offset:
                i += 1
                continue
            props = msg[2]
            if not single and len(msg[8]) > 1:
                break
            qos_text = props.get("mqtt.qos", "0")
            if type(qos_text) is not str or qos_text not in ("0", "1", "2"):
                break
            if "mqtt.expiry" in props or (level == 5 and any(k in props for k in _MQTT5_KEYS)):
                break
            topic = props.get("mqtt.topic", msg[0])
            if type(topic) is not str or topic not in topics or type(msg[1]) is not bytes:
                break
            if not (no_local and props.get("mqtt.client", "") == client_id):
                qos = int(qos_text)
                if sub_qos < qos:
                    qos = sub_qos
                if qos > 0 and window - len(inflight) <= 0:
                    full = True
                    break
                retain = level == 5 and rap and props.get("mqtt.retain") == "1"
                pid = None
                if qos > 0:
                    pid = next_pid
                    if pid in inflight or pid in outbound or len(outbound) >= receive_maximum:
                        break
                packet = PreparedPublish(level, Publish(topic, msg[1], qos, retain)).packet(pid)
                if pid is not None:
                    outbound[pid] = unacked
                    next_pid = pid % 65535 + 1
                    inflight[pid] = inflight_new(pid, queue, off, qos)
                    pending[off] = pid
                batch.append(packet)
                sent += 1
            next_offset = off + 1
            moved = i
            i += 1
    finally:
        state[:] = (next_offset, next_pid, sent, moved)
    return i, full


# The stored properties an MQTT 5 PUBLISH carries out (RecordedPublish.mqtt5_properties).
_MQTT5_KEYS = ("mqtt.pfi", "mqtt.ct", "mqtt.rt", "mqtt.cd", "mqtt.up")
_MISSING = object()


def _load_plain_run() -> PlainRun:
    """The C `plain_run` when it was built, else the reference; LMQTT_PURE_PYTHON (every
    accelerator) or LMQTT_PURE_PYTHON_DELIVERY (this one, for A/B runs) keep the reference."""
    if pure_python("LMQTT_PURE_PYTHON_DELIVERY"):
        return plain_run_py
    try:
        from gateway.protocol import _speedups
    except ImportError:
        return plain_run_py
    return _speedups.plain_run


PlainRun = Callable[..., tuple[int, bool]]
PLAIN_RUN: PlainRun = _load_plain_run()
