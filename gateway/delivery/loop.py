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
A pass first stores the publishes the event loop's turn read and has not stored yet (the
ingest batch, gateway/connection/ingest.py, otherwise stored by a callback queued behind the
pass): a device's message read just before a pass goes with it, where it would make a pass, a
socket write and an acknowledgement read of its own one turn later.
A queue still behind after its read (batch limit) stays ready, and a pass that made progress
schedules the next one (call_soon, so publishers and other sessions run in between).

Behind. A read takes BATCH messages. A queue with more than that waiting (a long turn of the
event loop left a backlog while some twenty messages a millisecond kept arriving) is read
again in the same pass, BATCH at a time, while its window has a free slot (QoS > 0), up to
PASS_LIMIT messages of it, and while the pass's packets are under PASS_BYTES (so the transport
takes at most that beyond one read past its high-water mark). Draining a backlog one BATCH per
turn stretched every hiccup several times over for a subscriber that gets every message; the
limits keep a pass short enough that the next turn's reads (the devices' PUBLISHes and
acknowledgements) come soon. A queue not behind pays nothing for it: the further reads start
only where a read already ended before the queue's end. A queue
left behind because the window or the transport was full is looked at again by the full pass
that the next acknowledgement or resume_writing triggers (`_behind`; otherwise an
acknowledgement only commits offsets, without looking at every queue). The store calls the
listener synchronously on the loop thread after dispatch, and a pass runs to completion
without yielding, so no notice can fall between "found nothing" and "sleep". What one pass
sends leaves with one transport.write().

The loop is composed of parts, each in its own module over the shared LoopState (state.py);
the parts (pacing, send, acks, replay) extend one another in that order, and DeliveryLoop
extends replay's (state.py says why):

    pacing.py     when a pass runs (at once, with the next arrival for a busy subscriber, or
                  under load paced to one per PASS_INTERVAL; load.py: whether the event
                  loop is short of time)
    send.py       the send paths of a queue's batch (plain run, plain, general)
    overlap.py    which of a session's overlapping subscriptions delivers a message
    acks.py       acknowledgements, re-sends after a reconnect, offset commits
    replay.py     a subscription's replayed history before its light queue
    rules.py      the delivery rule every path applies (`decide`)

This module holds the pass itself, the loop's lifecycle, and the two paths that do not read a
light queue of the session: shared groups (shared.py pushes to a member) and retained messages
sent on SUBSCRIBE.

Standby. Most devices of a fleet subscribe to their own command topic and receive nothing for
hours, and memory per idle device is what limits how many fit: a loop each (its state, its
queue tuple, the session's own in-flight dict: about 390 bytes) would sit idle. So a new
subscriber's loop starts at its first message, not at its SUBSCRIBE: until then its connection
(gateway/connection/client.py), which exists anyway, watches the session's own queues with the
ArrivalHub, and the hub's first notice for one of them starts the loop (`start(standby=...)`),
which takes the watches over and the notice. Whatever else needs a loop starts it at once: a
shared subscription, a replay, retained messages to send, a re-subscription, a session resumed
with subscriptions or messages in flight. A started loop runs as it always did: nothing is
added to the message path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from gateway.delivery.arrivals import Watcher
from gateway.delivery.pacing import PASS_INTERVAL
from gateway.delivery.replay import Replaying
from gateway.delivery.rules import decide
from gateway.delivery.shared import SharedGroup
from gateway.delivery.state import NO_ALIASES, UNKNOWN_END, DeliveryContext, Subscriber
from gateway.messages.records import RecordedPublish, read_record
from gateway.messages.retained import RetainedMessage
from gateway.protocol import ReasonCode
from gateway.session.model import Inflight, Session, SubscriptionState, pending_of
from gateway.storage.port import StoredMessage, StoreError

__all__ = ["BATCH", "PASS_BYTES", "PASS_LIMIT", "DeliveryContext", "DeliveryLoop", "Subscriber"]

log = logging.getLogger("lmqtt.gateway")

# Messages one read of a queue takes. A queue still behind after it is read again in the same
# pass (module docstring, "Behind"): up to PASS_LIMIT messages for one queue (PASS_LIMIT - BATCH
# over the pass's further reads), while the pass's packets are under PASS_BYTES (a quarter of
# the transport's high-water mark).
BATCH = 32
PASS_LIMIT = 256
PASS_BYTES = 64 * 1024
# A new loop's last write: long enough ago that it is not busy (one float for every loop).
_NEVER_WROTE = -PASS_INTERVAL
# A pass's ready queues when none is (a wake for the retained backlog): shared, never written.
_NOTHING_READY: dict[str, int] = {}


class DeliveryLoop(Replaying):
    """Sends a connected session's messages within its window; see the module docstring."""

    __slots__ = ()

    def __init__(self, context: DeliveryContext, session: Session, client: Subscriber) -> None:
        self.ctx = context
        self.session = session
        session.inflight_of()  # what this loop sends is written to the session's own dict
        session.by_queue_of()  # and its queues are looked up in a dict of the session's own
        self.client = client
        conn = client.conn
        self.level = conn.protocol_level or 4
        self.window = max(1, min(conn.client_receive_maximum or 65535, context.max_inflight))
        self.max_packet = conn.client_max_packet_size
        alias_max = conn.client_topic_alias_maximum or 0
        self.alias_max = alias_max if context.outbound_topic_aliases else 0
        self._plain = not self.alias_max and self.max_packet is None
        # Memory per idle device is what limits how many fit: what most loops never use is
        # shared (NO_ALIASES, the empty tuples) or None until first used.
        self.aliases = {} if self.alias_max else NO_ALIASES
        self.retained_backlog = None  # allocated on first use: most subscribers never need it
        self.groups = ()
        self._loop = asyncio.get_running_loop()
        self._scheduled = False
        self._stopped = False
        self._last_write = _NEVER_WROTE
        self._busy = False
        self._pass_timer = None
        self._waiting = False
        self._arrived_at = self._gap = self._gap_before = 0.0
        self._full = False
        self._ready = None
        self._behind = False
        self._live = False
        self._watched = ()
        self._batch = None
        self._uncommitted = None
        self._replay_timer = None
        self._held = None
        self.sent = 0

    def start(self, standby: Watcher | None = None) -> None:
        """Watch the session's queues and look at what it missed. `standby`: the connection
        that watched them for this loop until now (module docstring, "Standby"): it lets go
        of them, nothing was missed, and the notice that started the loop is handed to it."""
        arrivals = self.ctx.arrivals
        for sub in self.session.by_queue.values():
            if standby is not None:
                arrivals.unwatch(sub.queue, standby)
            self.watch(sub.queue)
        self.ctx.account.online(self.session)
        self._resend_inflight()
        if standby is None and (self.session.subscriptions or self.session.inflight):
            self.wake()
        else:
            # Started by its session's first SUBSCRIBE or first message: nothing missed,
            # nothing to look at until a message arrives (a new subscription starts at its
            # queue's end, and the arrival notices of the queues it watches from then on
            # schedule the passes).
            self._live = True

    def stop(self) -> None:
        self._stopped = True
        self.ctx.account.offline(self.session)
        if self._pass_timer is not None:
            self._pass_timer.cancel()
            self._pass_timer = None
        if self._replay_timer is not None:
            self._replay_timer.cancel()
            self._replay_timer = None
        self._commit_acknowledged()
        for q in self._watched:
            self.ctx.arrivals.unwatch(q, self)
        self._watched = ()
        for group in self.groups:
            group.leave(self)
        self.groups = ()

    def watch(self, queue: str) -> None:
        if queue not in self._watched:
            self._watched = (*self._watched, queue)
            self.ctx.arrivals.watch(queue, self)

    def unwatch(self, queue: str) -> None:
        if queue in self._watched:
            self._watched = tuple(q for q in self._watched if q != queue)
            self.ctx.arrivals.unwatch(queue, self)
            if self._ready is not None:
                self._ready.pop(queue, None)

    def capacity(self) -> int:
        return self.window - len(self.session.inflight)

    def can_send(self) -> bool:
        return self.client.writable and not self.client.closed

    def _step(self) -> None:
        """One pass; another is scheduled (after whatever else is ready) while it progresses.
        What this turn of the event loop read and has not stored yet is stored first: its
        messages for this subscriber join this pass (marked ready, not scheduled anew)
        rather than making a pass and a write of their own in the next turn."""
        ingest = self.ctx.ingest
        if ingest is not None and ingest.pubs:
            self._scheduled = True  # this flush's arrivals here are marked ready, not scheduled
            try:
                ingest.flush()
            except Exception:
                log.exception("storing this turn's publishes before a delivery pass failed")
        self._scheduled = False
        self._waiting = False
        if self._pass_timer is not None:  # this pass does what it was waiting for
            self._pass_timer.cancel()
            self._pass_timer = None
        if self._stopped:
            return
        try:
            if self._pass() and (self._ready or self._full or self.retained_backlog):
                self._scheduled = True
                self._loop.call_soon(self._step)
            if self._ready or self._behind:
                # Something left unsent: the overload guard watches how far behind this is,
                # once this loop has been caught up (before that it is catching up on what
                # the session missed while away, not falling behind the load of the moment).
                if self._live:
                    self.ctx.overload.behind(self)
                    self.ctx.account.behind(self.session)  # its lag is sampled
            elif not self._live:
                self._live = True
        except Exception:
            log.exception("delivery to %r failed; closing the connection", self.session.client_id)
            self.client.abort(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)

    def _pass(self) -> bool:
        """Read the ready queues (or all of them) and send what the window allows, with one
        write; the acknowledged and the read positions are committed in one stage at its end."""
        if not self.can_send():
            self._behind = True
            self._commit_acknowledged()
            return False
        by_queue = self.session.by_queue
        # The queues to read and where they end: the ready dict itself (taken: a queue marked
        # ready during the pass goes into a new one), or every queue asking the store.
        ready = self._ready
        self._ready = None
        if self._full:
            self._full = False
            self._behind = False
            ready = dict.fromkeys(by_queue, UNKNOWN_END)
        elif ready is None:
            ready = _NOTHING_READY
        progressed = False
        batch: list[bytes] = []
        self._batch = batch
        # A QoS 2 PUBLISH of a persistent session leaves only once the record of its packet id
        # is saved (see _write_saved): checked per subscription read, QoS 2 ones only.
        qos2 = False
        try:
            if self.retained_backlog:
                before = len(self.session.inflight)
                progressed = self._send_retained()
                qos2 = self._new_qos2(before)
            max_offset = self.ctx.store.max_offset
            codec = self._plain_outbound()
            inflight = self.session.inflight
            client = self.client
            window = self.window
            room = PASS_LIMIT - BATCH  # what reads past a queue's first may still take
            for queue, end in ready.items():
                sub = by_queue.get(queue)
                if sub is None:  # unsubscribed since it was marked ready
                    continue
                if window - len(inflight) <= 0 or not client.writable or client.closed:
                    self._behind = True
                    break
                if sub.replay is not None:  # history first: the light queue waits (replay.py)
                    before = len(self.session.inflight)
                    moved = self._replay(sub)
                    if moved and sub.qos == 2 and not qos2:
                        qos2 = self._new_qos2(before)
                    progressed = progressed or moved
                    if sub.replay is not None:
                        if not moved and self._replay_timer is None:
                            self._behind = True
                        continue
                if end == UNKNOWN_END:
                    end = max_offset(sub.queue)
                # With a notice's end: caught up with every append notified so far (a later
                # one brings its own notice), so the store is not asked.
                if sub.next_offset >= end:
                    continue
                before = sub.next_offset
                if self._read(sub, codec):
                    progressed = True
                    if sub.next_offset < end and room > 0:  # behind: more in this pass
                        room = self._catch_up(sub, codec, end, room)
                    if sub.qos == 2 and not qos2:
                        qos2 = self._sent_qos2(sub, before)
                    if sub.next_offset < end:
                        self._mark_ready(sub.queue, end)  # batch limit: the rest next pass
                elif sub.next_offset < end:
                    self._behind = True
        finally:
            self._batch = None
            self._commit_acknowledged()  # the queues acknowledged and read, in one stage
            if batch:
                self.wrote()
                if self._held is not None or (qos2 and self.session.persistent):
                    self._hold(batch)
                else:
                    self.client.write(batch[0] if len(batch) == 1 else b"".join(batch))
        if progressed:  # positions or the in-flight window moved: one mark per pass
            self.ctx.sessions.mark_progress(self.session)
        return progressed

    # -- QoS 2: the packet id is saved before the PUBLISH leaves ------------------------------

    def _sent_qos2(self, sub: SubscriptionState, before: int) -> bool:
        """Whether the read of `sub` from offset `before` sent a message at QoS 2."""
        inflight = self.session.inflight
        pending = sub.pending
        for off in reversed(pending):
            if off < before:
                break
            inf = inflight.get(pending[off])
            if inf is not None and inf.qos == 2:
                return True
        return False

    def _new_qos2(self, before: int) -> bool:
        """Whether the in-flight entries added after the first `before` include a QoS 2 one
        (the retained copies and replayed messages of a pass: not on the per-message path)."""
        inflight = self.session.inflight
        if len(inflight) <= before:
            return False
        return any(inf.qos == 2 for inf in list(inflight.values())[before:])

    def _hold(self, batch: list[bytes]) -> None:
        """Write `batch` once the session record naming its packet ids is saved. A receiver
        that got a QoS 2 PUBLISH treats another one with the same packet id as a duplicate
        until PUBREL ([MQTT-4.3.3-9]), and only that: after a crash or a takeover the message
        must come again with the same id (and DUP), so the id must be on record before the
        client can see it. Later passes' packets queue behind (PUBLISH order is kept)."""
        held = self._held
        if held is None:
            self._held = held = []
            self._loop.create_task(self._write_saved())
        held.extend(batch)

    async def _write_saved(self) -> None:
        held = self._held
        assert held is not None
        try:
            while held:
                covered = len(held)  # save() encodes the record now: these are in it
                await self.ctx.sessions.save(self.session)
                if self._stopped or self.client.closed:
                    return  # re-sent from the session's in-flight window after a reconnect
                self.client.write(b"".join(held[:covered]))
                del held[:covered]
        except StoreError as err:
            # Not on record: not sent. The reconnect re-sends it from the session's window.
            cid = self.session.client_id
            log.warning("%r: QoS 2 delivery not recorded (%s); closing", cid, err)
            self.client.abort(ReasonCode.UNSPECIFIED_ERROR)
        except Exception:
            log.exception("saving %r before a QoS 2 delivery failed", self.session.client_id)
            self.client.abort(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
        finally:
            self._held = None

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

    def _read(self, sub: SubscriptionState, codec: tuple[dict[int, int], int] | None) -> bool:
        pending_of(sub)  # what the batch sends at QoS > 0 is recorded in its own dict
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
            self.ctx.sessions.mark_progress(self.session)
        if messages:
            return self._deliver_batch(sub, messages, codec)
        return start > offset

    def _catch_up(
        self, sub: SubscriptionState, codec: tuple[dict[int, int], int] | None, end: int, room: int
    ) -> int:
        """Further reads of `sub`'s queue, behind after its first read of this pass, while it
        is (up to `end`), each of BATCH: up to `room` more messages, while its window has a
        free slot (QoS > 0) and the pass's packets are under PASS_BYTES (module docstring,
        "Behind"). Returns what is left of `room`."""
        batch = self._batch
        assert batch is not None
        inflight = self.session.inflight
        window = self.window if sub.qos else 0
        size = 0
        counted = 0
        while room > 0 and sub.next_offset < end:
            if window and window - len(inflight) <= 0:
                break
            size += sum(map(len, batch[counted:]))
            counted = len(batch)
            if size >= PASS_BYTES:
                break
            before = sub.next_offset
            if not self._read(sub, codec):
                break
            room -= sub.next_offset - before
        return room

    # -- shared subscriptions ----------------------------------------------------------------

    def deliver_shared(
        self, group: SharedGroup, sub: SubscriptionState, off: int, msg: StoredMessage
    ) -> str:
        """Send one message for a shared subscription: "pending" (awaits ack), "done" or
        "full" (no window space: the group gives it to someone else)."""
        rec = read_record(msg.topic, msg.body, msg.properties, msg.store_timestamp)
        if rec is None:
            return "done"
        out = decide(rec, sub, self.session.client_id, self.level)
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
            out = decide(rec, sub, self.session.client_id, self.level, on_subscribe=True)
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
