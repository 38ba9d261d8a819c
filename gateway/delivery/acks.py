"""Acknowledgements of a delivery loop's messages, their re-send after a reconnect, and the
offset commits they lead to.

`pending` (per subscription) holds the queue offsets sent at QoS > 0 and not yet acknowledged;
the committed offset (store.offsets, group = client id) is the smallest of them, or
`next_offset` when none: the highest contiguously acknowledged position. An acknowledgement
marks its subscription uncommitted; the next pass commits it, once per pass rather than once
per PUBACK.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.delivery.overlap import covering
from gateway.delivery.rules import identifiers, retain_flag
from gateway.delivery.send import Sender
from gateway.messages.records import read_record
from gateway.protocol import PubRel
from gateway.session.model import Inflight, SubscriptionState


class Acknowledgements(Sender):
    """PUBACK / PUBREC / PUBCOMP handling, re-sends and commits of a DeliveryLoop."""

    __slots__ = ()

    def on_puback(self, packet_id: int) -> None:
        """PUBACK (QoS 1) or PUBCOMP (QoS 2): the message is done."""
        self.on_pubacks((packet_id,))

    def on_pubacks(self, packet_ids: Sequence[int]) -> None:
        """on_puback() for the PUBACKs of one read, with one progress mark and one pass asked
        for: a fan-out subscriber acknowledges a pass's packets in one write."""
        session = self.session
        inflight = session.inflight
        by_queue = session.by_queue
        uncommitted = self._uncommitted  # committed by the next pass
        done = False
        for packet_id in packet_ids:
            inf = inflight.pop(packet_id, None)
            if inf is None:
                continue
            done = True
            queue = inf.queue
            if inf.group is not None:
                inf.group.ack(inf.offset)
            elif queue is not None:
                sub = by_queue.get(queue)
                if sub is not None:
                    pending = sub.pending
                    offset = inf.offset
                    if pending.get(offset) == packet_id:
                        del pending[offset]
                        if uncommitted is None:
                            uncommitted = self._uncommitted = {}
                        uncommitted[queue] = sub
        if not done:
            return
        self.ctx.sessions.mark_progress(session)
        if self._behind:
            self.wake()
        elif self._ready or self._scheduled or self._pass_timer is not None or self._stopped:
            self._schedule()  # that pass commits them
        else:
            # Nothing waits to be sent: commit here rather than in a pass of its own, so a
            # subscriber that gets a message now and then does not pay a callback and an
            # empty pass per acknowledgement.
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
        self.ctx.sessions.mark_progress(self.session)
        return True

    def on_transport_resumed(self) -> None:
        self.wake()
        for group in self.groups:
            group.schedule_pump()

    # -- commits -----------------------------------------------------------------------------

    def _commit(self, sub: SubscriptionState) -> None:
        if self._uncommitted is not None:
            self._uncommitted.pop(sub.queue, None)
        committed = sub.committed()
        if committed != sub.last_commit:  # QoS 1 sends behind an unacked one change nothing
            sub.last_commit = committed
            self.ctx.store.offsets.commit(
                self.session.client_id, sub.queue, committed, durable=self.session.persistent
            )
            self.ctx.account.moved(self.session, sub)

    def _commit_acknowledged(self) -> None:
        """`_commit` of every subscription marked uncommitted (acknowledged, or read by the
        pass that ends), in one loop: one commit stage per pass, not a call chain per queue."""
        uncommitted = self._uncommitted
        if not uncommitted:
            return
        self._uncommitted = None
        session = self.session
        by_queue = session.by_queue
        for queue, sub in uncommitted.items():
            if by_queue.get(queue) is not sub:
                continue  # unsubscribed meanwhile
            committed = sub.committed()
            if committed != sub.last_commit:  # QoS 1 sends behind an unacked one change nothing
                sub.last_commit = committed
                ctx = self.ctx
                ctx.store.offsets.commit(
                    session.client_id, queue, committed, durable=session.persistent
                )
                ctx.account.moved(session, sub)

    # -- re-sends after a reconnect ----------------------------------------------------------

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
            others = covering(self.session.by_queue, sub, msg)
            subs = [sub, *others] if others else [sub]
            sent = self.send(
                rec,
                inf.qos,
                retain_flag(rec, subs, self.level),
                identifiers(subs),
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
        self.ctx.sessions.mark_progress(self.session)
