"""How a delivery loop sends a batch of one subscription's queue: the send paths.

    plain run    gateway/delivery/run.py PLAIN_RUN (C when built): the messages of the
                 canonical shape, straight from stored properties to PUBLISH bytes
    plain        what a run leaves, for a connection without ACL, topic aliases or packet size
                 limit and a delivery without identifiers or expiry: `decide`, then the
                 encoded packet (cached per fan-out) without send()'s checks
    general      `decide`, then send(): ACL, topic alias, Maximum Packet Size

Every path applies gateway/delivery/rules.py `decide` (the runs as its specialisation for one
subscription). They share this module because they are the per-message path: each step is a
plain method call on the loop. What one pass sends leaves with one transport.write()
(`_batch`, written by DeliveryLoop._pass).
"""

from __future__ import annotations

import logging

from gateway.delivery import run
from gateway.delivery.overlap import covering, owner_has_read
from gateway.delivery.pacing import Pacing
from gateway.delivery.rules import decide, passed_over
from gateway.delivery.state import UNKNOWN_END
from gateway.messages.records import RecordedPublish, read_record
from gateway.protocol import ENCODED_TOPICS, PreparedPublish, Properties, Publish
from gateway.session.model import Inflight, SubscriptionState
from gateway.storage.port import StoredMessage

log = logging.getLogger("lmqtt.gateway")


class Sender(Pacing):
    """The send paths of a DeliveryLoop (see the module docstring)."""

    __slots__ = ()

    def _deliver_batch(
        self,
        sub: SubscriptionState,
        messages: list[StoredMessage],
        codec: tuple[dict[int, int], int] | None,
    ) -> bool:
        """Send what the window allows of `messages` (written at the end of the pass). `codec`:
        the pass's `_plain_outbound()`. The subscription is marked uncommitted when its
        committed position moved: the pass commits every such queue in one stage at its end
        (nothing awaits in between)."""
        moved = None
        passed = False
        if sub.replayed_phys >= 0:  # just after a replay (one int test per batch otherwise)
            before = sub.next_offset
            messages = self._pass_replayed(sub, messages)
            passed = sub.next_offset != before
        if codec is not None and not sub.subscription_identifier and type(messages) is list:
            moved = self._deliver_run(sub, messages, *codec)
        else:
            # Whether other loops read this queue too, asked once per batch: nothing in it
            # awaits, so the answer holds for every message.
            shared = self.ctx.arrivals.watchers(sub.queue) > 1
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
        # Only a read that moved the committed position has a commit to make: one that sent
        # behind a message in flight (or behind the last commit) leaves it where it was.
        if sub.committed() != sub.last_commit:
            uncommitted = self._uncommitted
            if uncommitted is None:
                self._uncommitted = {sub.queue: sub}
            else:
                uncommitted[sub.queue] = sub
        return passed or moved is not None

    def _plain_outbound(self) -> tuple[dict[int, int], int] | None:
        """The codec's outbound packet ids when this pass's batches may go by the plain run
        (what the plain path sends without a check of its own: no ACL, topic aliases or packet
        size limit, the pass's batch open; a subscription with an identifier does not), else
        None. Asked once per pass: nothing in a pass awaits, and a connection that closes
        meanwhile ends the pass (DeliveryLoop._pass checks `closed` per queue)."""
        if not self._plain or self._batch is None:
            return None
        client = self.client
        if client.acl is not None or client.conn.protocol_level != self.level:
            return None
        return client.conn.prepared_outbound()

    def _deliver_run(
        self,
        sub: SubscriptionState,
        messages: list[StoredMessage],
        outbound: dict[int, int],
        unacked: int,
    ) -> StoredMessage | None:
        """`_deliver_batch`'s loop with the plain run in one call per run of messages it
        takes; `_deliver` takes the message a run stops at (then the next run goes on).
        Returns the last message passed, or None. Whether other loops read the queue is
        asked only when a message goes to `_deliver` (once per batch: nothing awaits)."""
        shared: bool | None = None
        session = self.session
        ctx = self.ctx
        conn = self.client.conn
        batch = self._batch
        assert batch is not None
        # Messages in several of the session's queues go to overlap.py (the run stops at them).
        others = None if len(session.by_queue) == 1 else session.by_queue
        state = [sub.next_offset, session.next_packet_id, 0, -1]
        moved: StoredMessage | None = None
        plain_run = run.PLAIN_RUN
        skip_from = passed_over(sub.no_local, session.client_id)
        i = 0
        n = len(messages)
        while i < n:
            try:
                i, full = plain_run(
                    messages, i, state, others, self.window, self.level, sub.qos,
                    sub.retain_as_published, skip_from, sub.queue, session.inflight, sub.pending,
                    Inflight, ENCODED_TOPICS, outbound, conn.client_receive_maximum, unacked,
                    batch,
                )  # fmt: skip
            finally:
                sub.next_offset, session.next_packet_id, sent, last = state
                ctx.stats.messages_sent += sent
                self.sent += sent
                state[2] = 0
                if last >= 0:
                    moved = messages[last]
            if full or i >= n:
                break
            msg = messages[i]  # what the run does not take: the general path
            if shared is None:
                shared = ctx.arrivals.watchers(sub.queue) > 1
            if not self._deliver(sub, msg.queue_offset, msg, shared):
                break
            sub.next_offset = msg.queue_offset + 1
            moved = msg
            i += 1
            state[0] = sub.next_offset
            state[1] = session.next_packet_id
            state[3] = -1
        return moved

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
            # Only `sub` covers it (what covering() answers), without building a list.
            out = decide(rec, sub, session.client_id, self.level)
        else:
            others = covering(session.by_queue, sub, msg)
            if others is None:
                ctx = self.ctx
                if owner_has_read(session.by_queue, sub, msg, ctx.store, ctx.cursor):
                    return True
                self._mark_ready(sub.queue, UNKNOWN_END)
                return False
            out = decide(rec, sub, session.client_id, self.level, False, others)
        if out is None:
            return True
        qos = out.qos
        if qos > 0 and self.window - len(session.inflight) <= 0:
            return False
        if out.expiry_left is None and not out.sub_ids and self._plain and self.client.acl is None:
            # The plain path: send() with nothing for its checks to do (no ACL, alias, size
            # limit; the cache key without identifiers and expiry), in this frame.
            level = self.level
            retain = out.retain
            topic = rec.topic
            if fanout:
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
            self.sent += 1
            return True
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
        PUBLISH; returns the packet id used (0 for QoS 0 or when the packet was dropped as
        larger than the client accepts, or as not readable by this client under the ACL:
        wildcard subscriptions are checked here)."""
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
        # No closure per call: the fan-out hits the cache for all but its first subscriber.
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
        self.sent += 1
        return pid


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
