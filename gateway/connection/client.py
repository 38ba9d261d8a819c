"""ClientConnection: one MQTT network connection, between the transport and the session.

The asyncio Protocol (gateway/net/server.py) only moves bytes: it feeds `feed()` and reports flow
control. A connected client's plain PUBLISHes and PUBACKs are handled right in that callback,
with no task: the publishes join the turn's ingest batch (gateway/connection/ingest.py), stored
with one append for every connection; so are a CONNECT, a SUBSCRIBE and a DISCONNECT whose
handling cannot wait (ConnectHandler.connect_now, SubscribeHandler.subscribe_now). Anything
else starts a reader task that pulls events out
of the sans-IO `Connection` and hands them, in order, to their handlers (PacketDispatch,
gateway/connection/dispatch.py); runs of plain publishes it reads go to the store with one call.

The inline path (`_read_inline`, `_plain_publish`, `_pubacks`) and what the ingest batch calls
back (`publish_blocks`, `acknowledge_stored`, `store_failed`) run per read or per message: they
stay methods of this one object (the acknowledgements and the overload guard's holds are its
base ClientTransport's), so no call, attribute hop or allocation is added there per message.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.access.acl import ClientAccess
from gateway.connection.context import ClientContext
from gateway.connection.ingest import IngestBatch
from gateway.connection.reader import EVENTS_PER_TURN, ReaderTask
from gateway.connection.transport import MAX_UNPARSED
from gateway.delivery.loop import DeliveryLoop
from gateway.messages.records import PublishProperties
from gateway.protocol import (
    BATCHED,
    NEED_DATA,
    Connect,
    Disconnect,
    LocalProtocolError,
    PubAck,
    Publish,
    ReasonCode,
    RemoteProtocolError,
    Subscribe,
    Will,
)
from gateway.session.model import Session
from gateway.storage.port import StoreError
from topicmap import TopicError

log = logging.getLogger("lmqtt.gateway")


class ClientConnection(ReaderTask):
    """One network connection: who the client is, its session, the reader task, the inline
    publish path, keep-alive and closing. What is written and when it is read is
    ClientTransport's, its deadlines KeepAlive's."""

    # Slots: an idle connection's footprint is what limits how many devices fit. A new
    # attribute must be listed here (or in ClientTransport's).
    __slots__ = (
        "_abnormal",
        "_blocks",
        "_cleaned",
        "_eof",
        "_plain_acl",
        "_plain_topic",
        "ack_chain",
        "acl",
        "client_id",
        "delivery",
        "session",
        "username",
        "will",
    )

    def __init__(self, context: ClientContext, transport: asyncio.Transport) -> None:
        super().__init__(context, transport)
        self.client_id = ""
        self.username: str | None = None  # authenticated (or asserted, without password file)
        self.acl: ClientAccess | None = None  # None: no ACL file, everything allowed
        self.session: Session | None = None
        self.will: Will | None = None
        self.delivery: DeliveryLoop | None = None
        self._cleaned = False
        self._eof = False
        self._abnormal = True
        # The last sync-flush acknowledgement task: the next one waits for it (PUBACKs leave in
        # the order of their PUBLISHes; gateway/connection/publish.py).
        self.ack_chain: asyncio.Task[None] | None = None
        self._blocks: PublishProperties | None = None  # made at the first batched PUBLISH
        # The topic of this client's last plain publish and the ACL it was allowed by
        # (_plain_publish): a device publishes to the same topic again and again, and the
        # verdict stands while its ACL object does (a reload hands the client a new one).
        self._plain_topic: str | None = None
        self._plain_acl: ClientAccess | None = None

    # -- what the live view reads (gateway/ops/live_view.py) -----------------------------------

    @property
    def messages_sent(self) -> int:
        """PUBLISH packets sent on this connection (counted by its delivery loop)."""
        delivery = self.delivery
        return delivery.sent if delivery is not None else 0

    # -- called by the asyncio Protocol -------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self.closed:
            return
        n = len(data)
        self.ctx.stats.bytes_received += n
        self.bytes_in += n
        self._last_rx = self._loop.time()
        ingest = self._ingest
        first: Publish | None = None
        if (
            ingest is not None
            and self._reader is None
            and self.quota is None
            and self.acl is self._plain_acl
            and self.session is not None
            and (not data or data[0] >> 4 in BATCHED)  # else the general path (BATCHED)
        ):
            # A device's read of plain publishes on the topic it published before (the ACL
            # decision stands while its ACL object does), or a subscriber's run of PUBACKs: in
            # one C call, the publishes to the batch, the PUBACKs to `acked`. What follows
            # them, if anything, takes the path below from where it stopped.
            # A plain publish on another topic (the device's first) ends the C call's run in
            # `other`: checked and routed here (_plain_publish), or handed to the reader task.
            pubs = ingest.pubs
            before = len(pubs)
            topic = self._plain_topic
            acked: list[int] = []
            other: list[Publish] = []
            left = self.conn.take_plain(
                data, topic, pubs, ingest.owners, self, ingest.blocks,
                self._blocks or self.publish_blocks() if topic is not None else None, acked, other,
            )  # fmt: skip
            if other:
                if self._plain_publish(other[0]):
                    ingest.add(self, other[0])
                else:
                    first = other[0]  # refused or not plain here: the reader task's, first
            taken = len(pubs) - before
            if taken:
                ingest.added()
                self.msgs_in += taken
                if self._held or self.ctx.overload.overloaded:
                    self.published(taken, pubs[-1].qos == 0)
            if acked:
                delivery = self.delivery
                if delivery is not None:
                    delivery.on_pubacks(acked)
            if not left and first is None:
                self._unparsed = 0
                if self._reading_paused:
                    self._resume_reading()
                return
        else:
            self.conn.receive_data(data)
            left = len(data)
        self._unparsed += left  # what the connection buffered unparsed
        if self._unparsed > MAX_UNPARSED + self.ctx.settings.max_packet_size:
            self._pause_reading()
        if first is not None:
            self._kick(first)
        elif self._reader is not None:
            self._kick()
        elif self.session is None:
            self._connect_inline(ingest)
        elif ingest is not None:
            self._read_inline(ingest)
        else:
            self._read_inline_sync()

    def feed_eof(self) -> None:
        if self.closed:
            self.transport.close()  # a lingering close: the client has stopped sending too
            return
        if not self._eof:
            self._eof = True
            try:
                self.conn.receive_data(b"")
            except LocalProtocolError:
                pass
            self._kick()

    def resume_writing(self) -> None:
        self.writable = True
        if self.delivery is not None:
            self.delivery.on_transport_resumed()

    def arrived(self, queue: str, end: int) -> None:
        """ArrivalHub: a queue watched for the delivery loop-to-be grew (gateway/delivery/loop.py,
        "Standby"): the loop starts and takes the notice."""
        self.ctx.packets.subscribe.delivery_loop(self).arrived(queue, end)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cleanup()
        if self._reader is not None:
            self._reader.cancel()

    def hold(self, pending: asyncio.Future[None]) -> None:
        """Handle none of this connection's input until `release()`: a SUBACK waits for
        `pending`, its record's fsync, and what the client sent after the SUBSCRIBE is
        answered after it. Meanwhile `pending` stands in for the reader task: input is
        buffered, and closing cancels it."""
        self._reader = pending

    def release(self) -> None:
        """`hold` is over: handle what arrived meanwhile, as a read would."""
        self._reader = None
        if self.closed:
            return
        ingest = self._ingest
        if ingest is not None:
            self._read_inline(ingest)
        else:
            self._read_inline_sync()

    def _connect_inline(self, ingest: IngestBatch | None) -> None:
        """A client's first read, with no reader task: its CONNECT handled here when nothing
        it does waits (ConnectHandler.connect_now), then what followed it as a connected
        client's read. Anything else goes to the reader task, as it would have."""
        try:
            ev = self.conn.next_event()
        except RemoteProtocolError as err:
            self._protocol_error(err)
            return
        if ev is NEED_DATA:  # a CONNECT not complete yet
            self._unparsed = 0
            if self._reading_paused:
                self._resume_reading()
            return
        if type(ev) is not Connect:
            self._kick(ev)
            return
        assert isinstance(ev, Connect)
        try:
            if not self.ctx.packets.connect.connect_now(self, ev):
                self._kick(ev)
                return
        except Exception:
            log.exception("%r: internal error handling a packet", self.client_id or self.peer)
            self.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
            return
        if self.closed:
            return
        if self.session is None:
            self._kick()
        elif ingest is not None:
            self._read_inline(ingest)
        else:
            self._read_inline_sync()

    def _read_inline(self, ingest: IngestBatch) -> None:
        """The common case of a connected client, handled in the transport's callback with no
        task: plain PUBLISHes go to the turn's ingest batch (gateway/connection/ingest.py),
        PUBACKs free window slots. The first packet that needs anything else, and whatever
        follows it, goes to the reader task, which runs after the batch is stored."""
        conn = self.conn
        quota = self.quota
        added = 0  # publishes this read added to the batch (counted here: len() is a call)
        acked: list[int] = []  # PUBACKs of this read: one delivery-loop call for all of them
        try:
            budget = EVENTS_PER_TURN
            while budget > 0:
                budget -= 1
                try:
                    ev = conn.next_event()
                except RemoteProtocolError as err:
                    ingest.flush()  # what came before the bad packet is stored and acknowledged
                    added = 0
                    self._pubacks(acked)
                    acked = []
                    self._protocol_error(err)
                    return
                # NEED_DATA first (once per read), then by exact type: no isinstance() calls.
                if ev is NEED_DATA:
                    self._unparsed = 0
                    if self._reading_paused:  # checked here: once per device read
                        self._resume_reading()
                    return
                if type(ev) is Publish:
                    if (
                        ev.qos < 2
                        and not ev.retain
                        and (
                            (ev.topic == self._plain_topic and self.acl is self._plain_acl)
                            or self._plain_publish(ev)
                        )
                    ):
                        if quota is not None and quota.take(len(ev.payload), self._loop.time()):
                            self._kick(ev)  # over quota: the reader task waits or refuses it
                            return
                        ingest.add(self, ev)
                        added += 1
                        continue
                elif type(ev) is PubAck:
                    acked.append(ev.packet_id)
                    budget -= conn.take_pubacks(acked, budget)  # the run of PUBACKs after it
                    continue
                elif type(ev) is Disconnect or type(ev) is Subscribe:
                    # Handled here, without a reader task, when nothing it does waits (a
                    # DISCONNECT only closes; see SubscribeHandler.subscribe_now), once what
                    # came before it is done as the task would find it (it runs after the
                    # batch): the publishes stored and acknowledged, the PUBACKs applied.
                    if added:  # counted now: the batch is stored below
                        self.msgs_in += added
                        if self._held or self.ctx.overload.overloaded:
                            self.published(added, ingest.last_qos() == 0)
                        added = 0
                    if ingest.scheduled:
                        ingest.flush()
                    if acked:
                        self._pubacks(acked)
                        acked = []
                    if type(ev) is Disconnect:
                        self.ctx.packets.connect.on_disconnect(self, ev)
                        return
                    assert isinstance(ev, Subscribe)
                    if self.ctx.packets.subscribe.subscribe_now(self, ev):
                        if self.closed or self._reader is not None:
                            return  # or held until its SUBACK is out (see hold)
                        continue
                self._kick(ev)  # the task runs after this: the acknowledgements come first
                return
            self._kick()  # a flood: the reader task goes on after the turn
        finally:
            if acked:
                self._pubacks(acked)
            if added:
                self.msgs_in += added
                if self._held or self.ctx.overload.overloaded:
                    self.published(added, ingest.last_qos() == 0)

    def _read_inline_sync(self) -> None:
        """`_read_inline` in sync flush mode (no ingest batch: publishes wait for their
        fsync in tasks): a SUBSCRIBE (its SUBACK sent once its record is durable, the
        input held until then: SubscribeHandler.subscribe_now) and a DISCONNECT are handled
        here; the first other packet, and whatever follows it, goes to the reader task."""
        conn = self.conn
        budget = EVENTS_PER_TURN
        while budget > 0:
            budget -= 1
            try:
                ev = conn.next_event()
            except RemoteProtocolError as err:
                self._protocol_error(err)
                return
            if ev is NEED_DATA:
                self._unparsed = 0
                if self._reading_paused:
                    self._resume_reading()
                return
            if type(ev) is Disconnect:
                self.ctx.packets.connect.on_disconnect(self, ev)
                return
            if type(ev) is Subscribe and self.ctx.packets.subscribe.subscribe_now(self, ev):
                if self.closed or self._reader is not None:
                    return  # or held until its SUBACK is out (see hold)
                continue
            self._kick(ev)
            return
        self._kick()

    def _pubacks(self, packet_ids: list[int]) -> None:
        if packet_ids and self.delivery is not None:
            self.delivery.on_pubacks(packet_ids)

    def _handled(self) -> ClientConnection:
        return self

    def _plain_publish(self, pub: Publish) -> bool:
        """True if `pub` may join a batched run: connected, a valid topic name this client may
        publish to. Otherwise PublishHandler.on_publish handles it (and its refusal) on its own."""
        if self.session is None or pub.topic.startswith("$"):
            return False
        try:
            self.ctx.route(pub.topic)  # validates; the batch's append finds the route
            self.ctx.access.check_publish(self, pub.topic)
        except TopicError:
            return False
        self._plain_topic = pub.topic
        self._plain_acl = self.acl
        return True

    # -- the ingest batch's side (gateway/connection/ingest.py) -------------------------------

    def publish_blocks(self) -> PublishProperties:
        blocks = self._blocks
        if blocks is None:
            blocks = self._blocks = PublishProperties(
                self.client_id, self.ctx.publisher.store.encode_properties
            )
        return blocks

    def store_failed(self, pub: Publish, err: StoreError) -> None:
        self.ctx.packets.publish.store_failed(self, pub, err)

    # -- closing -----------------------------------------------------------------------------

    def close(
        self, reason: int | None = None, *, abnormal: bool = True, linger: bool = True
    ) -> None:
        """Close now; MQTT 5 clients get DISCONNECT `reason` first when given. `linger`: the
        client has not said it is done (see _close_transport)."""
        if self.closed:
            if self.ctx.server.stopping:
                self.transport.close()  # a graceful stop cuts a lingering close short
            return
        self._flush_out()
        self._out = None
        self._abnormal = abnormal
        if reason is not None and self.conn.protocol_level == 5:
            try:
                self.write(self.conn.send(Disconnect(reason_code=reason)))
            except LocalProtocolError:
                pass
        self.closed = True
        self._cleanup()
        if linger:
            self._close_transport()
        else:
            self.transport.close()
        if self._reader is not None and asyncio.current_task() is not self._reader:
            self._reader.cancel()

    def abort(self, reason: int) -> None:
        self.close(reason)

    def _cleanup(self) -> None:
        """Detach from the session exactly once; decides about the will."""
        if self._cleaned:
            return
        self._cleaned = True
        self.closed = True
        if self._ingest is not None:
            self._ingest.settle()  # its publishes in a lingering batch come before its will
        self.ctx.timers.cancel(self)  # the wheel lets go of a closed connection at once
        session = self.session
        if self.delivery is not None:
            self.delivery.stop()
            self.delivery = None
        elif session is not None:
            self.ctx.packets.subscribe.stand_down(self, session)
        if session is None or session.connection is not self:
            return
        session.connection = None
        will = self.will if self._abnormal else None
        self.ctx.packets.connect.connection_ended(self, session, will)

    def fail(self, reason: int, message: str) -> None:
        """A rule the gateway (not the codec) enforces was broken: MQTT 5 DISCONNECT, close."""
        log.warning("%s (%r): 0x%02X: %s", self.peer, self.client_id, reason, message)
        self.close(reason)
