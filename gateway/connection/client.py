"""ClientConnection: one MQTT network connection, between the transport and the session.

The asyncio Protocol (server.py) only moves bytes: it feeds `feed()` and reports flow control.
A connected client's plain PUBLISHes and PUBACKs are handled right in that callback, with no
task: the publishes join the turn's ingest batch (gateway/connection/ingest.py), stored with one
append for every connection. Anything else starts a reader task that pulls events out of the sans-IO
`Connection` and handles them in order;
packets that must wait for the store (QoS 1/2 publishes in `sync` flush mode) are pipelined:
each gets a task that awaits its fsync and then the previous acknowledgement, so PUBACKs leave in
the order the PUBLISH packets arrived while many share one group commit.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.access.acl import ClientAccess
from gateway.access.control import AccessControl
from gateway.config import GatewaySettings
from gateway.connection.ingest import IngestBatch
from gateway.connection.overload import OverloadGuard
from gateway.connection.timers import TimerWheel
from gateway.delivery.loop import DeliveryContext, DeliveryLoop
from gateway.lifecycle.sessions import SessionLifecycle
from gateway.lifecycle.subscriptions import SubscriptionLifecycle
from gateway.messages.publishing import PublishPath
from gateway.messages.records import PublishProperties
from gateway.protocol import (
    NEED_DATA,
    Auth,
    ConnAck,
    Connect,
    Connection,
    ConnectionClosed,
    Disconnect,
    LocalProtocolError,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    RemoteProtocolError,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    Will,
)
from gateway.session.model import Connected, Session, SubscriptionState
from gateway.stats import GatewayStats
from gateway.storage.port import StoreError
from topicmap import (
    REPLAY_PROPERTY,
    Topic,
    TopicError,
    TopicFilter,
    parse_replay_from,
    split_replay,
)

log = logging.getLogger("lmqtt.gateway")

# Sync-flush publishes awaiting their fsync before this connection stops reading.
MAX_PENDING_PUTS = 256
# Packets handled before the reader task yields to the event loop (a run of plain PUBLISHes
# among them is one store append; 128 keeps a flood client to about a millisecond a turn).
EVENTS_PER_TURN = 128
# Unparsed input beyond which reading pauses until the reader task catches up.
MAX_UNPARSED = 1 << 20
# Publishes a connection held by the overload guard may still hand in (their PUBACKs held) before
# its reading pauses too: a device whose in-flight window is at most this stops by itself, its
# window full of messages already delivered, and is read at once at its turn. (16 put windows of
# 50 back in the socket and made them worse: 2,000 devices at 33,750 msg/s, loaded host, W = 50
# p99 597 / 665 ms against 456 / 418 at 64, same runs.)
HELD_READ_MAX = 64
# How long a connection the gateway closes stays half-closed, its input read and discarded
# (see ClientConnection._close_transport).
LINGER_S = 2.0

# Packets whose handling never waits (in async flush mode the store append does not either):
# their replies are collected and written once per run of input (see ClientConnection._out).
_COLLECTED = frozenset({Publish, PubAck, PubComp, PubRec, PingReq})


@dataclass(slots=True)
class ServerState:
    """What the listeners and every connection share (uvicorn's ServerState): whether a
    graceful stop has begun, and the open connections."""

    stopping: bool = False
    connections: set[ClientConnection] = field(default_factory=set)


class ClusterLink(Protocol):
    """What a connection sees of cluster mode (gateway/cluster/node.py Cluster); SingleNode when
    the gateway is the only node."""

    async def before_connect(self, client_id: str, conn: Connected, clean_start: bool) -> None:
        """A CONNECT arrived: the session records other nodes wrote so far applied here (a
        session connected on another node handed over by it)."""
        ...

    async def connected(
        self, client_id: str, conn: Connected, clean_start: bool, session: Session
    ) -> None:
        """Before CONNACK: the id claimed on every node (takeover), the session record
        durable, its in-flight messages read for their resend."""
        ...

    def answered(self, client_id: str, conn: Connected) -> None:
        """`conn`'s CONNACK was written (a takeover read meanwhile closes it now)."""
        ...

    def released(self, client_id: str, conn: Connected) -> None: ...

    async def subscribed(self) -> None:
        """Before SUBACK: every node routes to this node's new filters."""
        ...

    async def retained_caught_up(self) -> None:
        """Before a SUBSCRIBE's retained messages: those set through other nodes known."""
        ...

    def connection_ended(self, session: Session) -> None:
        """After SessionLifecycle.connection_ended: the other nodes learn it."""
        ...


class SingleNode:
    """No cluster: nothing to tell anyone."""

    async def before_connect(self, client_id: str, conn: Connected, clean_start: bool) -> None:
        return None

    async def connected(
        self, client_id: str, conn: Connected, clean_start: bool, session: Session
    ) -> None:
        return None

    def answered(self, client_id: str, conn: Connected) -> None:
        return None

    def released(self, client_id: str, conn: Connected) -> None:
        return None

    async def subscribed(self) -> None:
        return None

    async def retained_caught_up(self) -> None:
        return None

    def connection_ended(self, session: Session) -> None:
        return None


@dataclass(slots=True)
class ClientContext:
    """What a connection uses, built once by the composition root (gateway/app.py) and shared
    by every connection: one attribute hop to each collaborator, as when connections held the
    whole gateway, but only these."""

    settings: GatewaySettings
    server: ServerState
    stats: GatewayStats
    access: AccessControl  # authentication, ACL, limits
    timers: TimerWheel  # connect timeout, keep-alive
    ingest: IngestBatch | None  # None in sync flush mode (gateway/connection/ingest.py)
    overload: OverloadGuard
    publisher: PublishPath
    sessions: SessionLifecycle
    subscriptions: SubscriptionLifecycle
    delivery: DeliveryContext  # handed to the session's delivery loop
    cluster: ClusterLink = field(default_factory=SingleNode)
    # publisher.topic, bound once: the inline path validates every PUBLISH's topic with it.
    topic: Callable[[str], Topic] = field(init=False)

    def __post_init__(self) -> None:
        self.topic = self.publisher.topic


class ClientConnection:
    """One network connection; owns the protocol state machine and the reader task."""

    # Slots: an idle connection's footprint is what limits how many devices fit. A new
    # attribute must be listed here.
    __slots__ = (
        "_abnormal",
        "_ack_chain",
        "_acks",
        "_blocks",
        "_cleaned",
        "_eof",
        "_held",
        "_held_reads",
        "_ingest",
        "_last_rx",
        "_loop",
        "_opened",
        "_out",
        "_pending_puts",
        "_put_tasks",
        "_reader",
        "_reading_paused",
        "_unparsed",
        "acl",
        "client_id",
        "closed",
        "conn",
        "ctx",
        "delivery",
        "peer",
        "session",
        "timer_due",
        "transport",
        "username",
        "will",
        "writable",
    )

    def __init__(self, context: ClientContext, transport: asyncio.Transport) -> None:
        self.ctx = context
        self.transport = transport
        self.conn = Connection(max_packet_size=context.settings.max_packet_size)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.client_id = ""
        self.username: str | None = None  # authenticated (or asserted, without password file)
        self.acl: ClientAccess | None = None  # None: no ACL file, everything allowed
        self.session: Session | None = None
        self.will: Will | None = None
        self.delivery: DeliveryLoop | None = None
        self.writable = True
        self.closed = False
        self._cleaned = False
        self._eof = False
        self._abnormal = True
        self._loop = asyncio.get_running_loop()
        self._last_rx = self._loop.time()
        self._unparsed = 0
        self._reading_paused = False
        self._pending_puts = 0
        self._ack_chain: asyncio.Task[None] | None = None
        self._put_tasks: set[asyncio.Task[None]] | None = None  # sync flush only
        self._blocks: PublishProperties | None = None  # made at the first batched PUBLISH
        # Where plain publishes read in a transport callback go (async flush mode only).
        self._ingest = context.ingest
        # Held by the overload guard (gateway/connection/overload.py): the PUBACKs of what it hands
        # in wait in _acks, and after HELD_READ_MAX publishes (at once for QoS 0) its reading
        # pauses.
        self._held = False
        self._held_reads = 0
        self._acks: list[int] | None = None
        # Connect timeout and keep-alive: one entry in the gateway's timer wheel (on_due),
        # not a timer per connection; packets only move _last_rx, never the wheel.
        self._opened = self._loop.time()
        self.timer_due: float | None = None
        context.timers.schedule(self, self._opened + context.settings.connect_timeout)
        # The reader task exists only while there are bytes to handle: an idle connection
        # costs no task (memory per connection is what limits how many devices fit).
        self._reader: asyncio.Task[None] | None = None
        # Packets written while the reader task handles a run of input (PUBACKs of a flood),
        # sent with one transport.write() when it yields; None: write through.
        self._out: list[bytes] | None = None

    # -- bytes in / out (called by the asyncio Protocol) --------------------------------------

    def feed(self, data: bytes) -> None:
        if self.closed:
            return
        self.ctx.stats.bytes_received += len(data)
        self._last_rx = self._loop.time()
        self.conn.receive_data(data)
        self._unparsed += len(data)
        if self._unparsed > MAX_UNPARSED + self.ctx.settings.max_packet_size:
            self._pause_reading()
        if self._reader is None and self._ingest is not None and self.session is not None:
            self._read_inline(self._ingest)
        else:
            self._kick()

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

    def pending_puts(self) -> list[asyncio.Task[None]]:
        """Publishes still waiting for their fsync (sync flush), for a graceful stop."""
        return list(self._put_tasks) if self._put_tasks else []

    def _kick(self, first: object = None) -> None:
        """Start the reader task (it handles `first`, then what is buffered) unless it runs."""
        if self._reader is None and not self.closed:
            self._reader = self._loop.create_task(self._read_loop(first))

    def _read_inline(self, ingest: IngestBatch) -> None:
        """The common case of a connected client, handled in the transport's callback with no
        task: plain PUBLISHes go to the turn's ingest batch (gateway/connection/ingest.py),
        PUBACKs free window slots. The first packet that needs anything else, and whatever
        follows it, goes to the reader task, which runs after the batch is stored."""
        conn = self.conn
        added = 0  # publishes this read added to the batch (counted here: len() is a call)
        acked: list[int] = []  # PUBACKs of this read: one delivery-loop call for all of them
        try:
            for _ in range(EVENTS_PER_TURN):
                try:
                    ev = conn.next_event()
                except RemoteProtocolError as err:
                    ingest.flush()  # what came before the bad packet is stored and acknowledged
                    added = 0
                    self._pubacks(acked)
                    acked = []
                    self._protocol_error(err)
                    return
                kind = type(ev)
                if kind is Publish:
                    assert isinstance(ev, Publish)
                    if ev.qos < 2 and not ev.retain and self._plain_publish(ev):
                        ingest.add(self, ev)
                        added += 1
                        continue
                elif ev is NEED_DATA:
                    self._unparsed = 0
                    if self._reading_paused:  # checked here: once per device read
                        self._resume_reading()
                    return
                elif kind is PubAck:
                    assert isinstance(ev, PubAck)
                    acked.append(ev.packet_id)
                    continue
                self._kick(ev)  # the task runs after this: the acknowledgements come first
                return
            self._kick()  # a flood: the reader task goes on after the turn
        finally:
            if acked:
                self._pubacks(acked)
            if added and (self._held or self.ctx.overload.overloaded):
                self._published(added, ingest.last_qos() == 0)

    def _pubacks(self, packet_ids: list[int]) -> None:
        if packet_ids and self.delivery is not None:
            self.delivery.on_pubacks(packet_ids)

    # -- the ingest batch's side (gateway/connection/ingest.py) ------------------------------------

    def publish_blocks(self) -> PublishProperties:
        blocks = self._blocks
        if blocks is None:
            blocks = self._blocks = PublishProperties(
                self.client_id, self.ctx.publisher.store.encode_properties
            )
        return blocks

    def _published(self, n: int, qos0: bool) -> None:
        """This connection just handed in `n` publishes (the last one at QoS 0: `qos0`): an
        overloaded gateway holds it (gateway/connection/overload.py).

        Held, a QoS 1 publisher is still read, but its PUBACKs wait for its turn in the
        guard's round robin (MQTT sets no deadline for them): a device with an in-flight
        window stops once the window is full of messages already stored and delivered, and
        what it sends after its turn is read at once, not left waiting in its socket. One that
        goes on sending regardless (a window over HELD_READ_MAX, or QoS 0, which has no
        acknowledgement to wait for) is no longer read until its turn; nor is any held
        connection while the backlog grows past the guard's read bound (`read_hold`: deep
        windows filling up faster than the subscribers drain)."""
        if self.closed:
            return
        overload = self.ctx.overload
        if not self._held:
            if not overload.overloaded:
                return
            overload.hold(self)
        self._held_reads += n
        if (
            qos0
            or self._held_reads >= HELD_READ_MAX
            or overload.read_hold
            or self._ingest is None  # sync flush: PUBACKs wait for fsync tasks, not here
        ):
            self._pause_reading()

    def hold_publishing(self) -> None:
        self._held = True
        self._held_reads = 0
        if self._acks is None:
            self._acks = []

    def release_publishing(self) -> int:
        """The guard's round robin came to this connection: send the PUBACKs held, read again.
        Returns how many were held (what a windowed device may now send)."""
        self._held = False
        acks, self._acks = self._acks, None
        if acks and not self.closed:
            self.write(self.conn.pubacks(acks))
        self._resume_reading()
        return len(acks) if acks else 0

    def _release_acks(self) -> None:
        """A PUBACK is about to be written outside the batch: the held ones go first (PUBACKs
        leave in the order of their PUBLISHes), the connection stays held."""
        acks = self._acks
        if acks:
            self._acks = []
            if not self.closed:
                self.write(self.conn.pubacks(acks))

    def acknowledge_stored(self, packet_ids: list[int]) -> None:
        acks = self._acks
        if acks is not None:
            acks.extend(packet_ids)
        else:
            self.write(self.conn.pubacks(packet_ids))

    def store_failed(self, pub: Publish, err: StoreError) -> None:
        self._store_failed(pub, err)

    def write(self, data: bytes) -> None:
        if data and not self.closed:
            self.ctx.stats.bytes_sent += len(data)
            out = self._out
            if out is not None:
                out.append(data)
            else:
                self.transport.write(data)

    def _flush_out(self) -> None:
        """Send what the reader collected; called before it yields and when it ends."""
        out = self._out
        if out:
            self._out = []
            if not self.closed:
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        if self.delivery is not None:
            self.delivery.on_transport_resumed()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cleanup()
        if self._reader is not None:
            self._reader.cancel()

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if (
            self._reading_paused
            and not self._held
            and not self.closed
            and self._pending_puts < MAX_PENDING_PUTS // 2
            and self._unparsed <= MAX_UNPARSED
        ):
            self._reading_paused = False
            self.transport.resume_reading()

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

    def _close_transport(self) -> None:
        """Half-close, then read and discard input for LINGER_S before closing the socket.

        A client does not stop sending the moment we decide to close: it is still answering
        what we sent before (the PUBRECs ahead of a DISCONNECT 0x93, say). A socket closed
        outright answers those bytes with a reset, the client's next write fails and it may
        never read our DISCONNECT or CONNACK. So our side only shuts down writing (the client
        reads everything we sent, then end of stream) and the socket is closed when the client
        closes its side or LINGER_S has passed. TLS and WebSocket transports cannot half-close:
        they close at once.
        """
        transport = self.transport
        try:
            half_close = transport.can_write_eof() and not self.ctx.server.stopping
        except NotImplementedError:
            half_close = False
        if not half_close:
            transport.close()
            return
        transport.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        self._loop.call_later(LINGER_S, transport.close)

    def abort(self, reason: int) -> None:
        self.close(reason)

    def _cleanup(self) -> None:
        """Detach from the session exactly once; decides about the will."""
        if self._cleaned:
            return
        self._cleaned = True
        self.closed = True
        if self.delivery is not None:
            self.delivery.stop()
            self.delivery = None
        session = self.session
        if session is None or session.connection is not self:
            return
        session.connection = None
        self.ctx.cluster.released(session.client_id, self)
        self.ctx.stats.clients_connected -= 1
        will = self.will if self._abnormal else None
        self.ctx.sessions.connection_ended(session, will)
        self.ctx.cluster.connection_ended(session)

    def on_due(self, now: float) -> float | None:
        """Timer wheel: close a socket that sent no CONNECT in time, or a client silent for
        1.5 x its keep-alive (the server keep-alive when we imposed one); else the next
        deadline to look again (the wheel's lazy re-check)."""
        if self.closed:
            return None
        if self.conn.protocol_level is None:
            timeout = self.ctx.settings.connect_timeout
            if now - self._opened >= timeout:
                log.info("%s: no CONNECT within %.1f s; closing", self.peer, timeout)
                self.close()
                return None
            return self._opened + timeout
        if self.session is None:
            return now + 1.0  # CONNECT still being handled (authentication)
        keep_alive = self.conn.keep_alive_timeout
        if keep_alive is None:
            return None
        if self._reading_paused or self._held:
            # We stopped reading it (overload guard, backlog) or hold the PUBACKs its window
            # waits for (overload guard): its silence is ours.
            self._last_rx = now
        idle = now - self._last_rx
        if idle >= keep_alive:
            log.info("%r: keep-alive timeout (%.1f s idle); closing", self.client_id, idle)
            self.close(ReasonCode.KEEP_ALIVE_TIMEOUT)
            return None
        return self._last_rx + keep_alive

    # -- the reader task ---------------------------------------------------------------------

    async def _read_loop(self, first: object = None) -> None:
        """Handle every complete packet buffered (and arriving meanwhile), then end.

        Batched ingest: consecutive plain PUBLISHes (QoS 0/1, not retained, topic and ACL
        checks passed) are collected in `run` and stored with one store call when anything
        else comes (another packet kind, a PUBLISH needing the per-message path, the end of
        the input, the end of the turn), so every other packet sees them stored and their
        PUBACKs leave in order, before any later reply.
        """
        handled = 0
        run: list[Publish] = []
        self._out = []
        try:
            while not self.closed:
                if handled >= EVENTS_PER_TURN:
                    # A flooding client must not hold the event loop: let delivery (which then
                    # still finds the messages in RecentMessages) and other clients run.
                    handled = 0
                    if run:
                        await self._store_run(run)
                        run = []
                    self._flush_out()
                    await asyncio.sleep(0)
                    continue
                handled += 1
                try:
                    if first is not None:
                        ev, first = first, None
                    else:
                        ev = self.conn.next_event()
                except RemoteProtocolError as err:
                    if run:
                        await self._store_run(run)
                        run = []
                    self._protocol_error(err)
                    return
                kind = type(ev)
                if kind is Publish:
                    assert isinstance(ev, Publish)
                    if ev.qos < 2 and not ev.retain and self._plain_publish(ev):
                        run.append(ev)
                        continue
                if run:
                    await self._store_run(run)
                    run = []
                if ev is NEED_DATA:
                    break
                if kind is ConnectionClosed:
                    log.debug("%r: connection closed by peer", self.client_id or self.peer)
                    self.close(linger=False)
                    return
                if kind in _COLLECTED:
                    await self._dispatch(ev)
                else:
                    await self._handle_waiting(ev)
            self._unparsed = 0
            self._resume_reading()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%r: internal error handling a packet", self.client_id or self.peer)
            self.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
        finally:
            self._flush_out()
            self._out = None
            if self._reader is asyncio.current_task():
                self._reader = None

    def _protocol_error(self, err: RemoteProtocolError) -> None:
        log.warning(
            "%s (%r): protocol error 0x%02X: %s",
            self.peer,
            self.client_id,
            err.reason_code,
            err.message,
        )
        self.write(self.conn.error_packet(err))
        self.close()

    def _fail(self, reason: int, message: str) -> None:
        """A rule the gateway (not the codec) enforces was broken: MQTT 5 DISCONNECT, close."""
        log.warning("%s (%r): 0x%02X: %s", self.peer, self.client_id, reason, message)
        self.close(reason)

    async def _handle_waiting(self, ev: object) -> None:
        # This handler may wait (session save, fsync, authentication): what the reader
        # collected is sent now, and what is written meanwhile goes out directly.
        self._flush_out()
        self._out = None
        try:
            await self._dispatch(ev)
        finally:
            self._out = []

    async def _dispatch(self, ev: object) -> None:
        kind = type(ev)
        if kind is Publish:
            assert isinstance(ev, Publish)
            await self._on_publish(ev)
        elif kind is PubAck:
            assert isinstance(ev, PubAck)
            if self.delivery is not None:
                self.delivery.on_puback(ev.packet_id)
        elif kind is PubRec:
            assert isinstance(ev, PubRec)
            self._on_pubrec(ev)
        elif kind is PubComp:
            assert isinstance(ev, PubComp)
            if self.delivery is not None:
                self.delivery.on_puback(ev.packet_id)
        elif kind is PubRel:
            assert isinstance(ev, PubRel)
            await self._on_pubrel(ev)
        elif kind is Subscribe:
            assert isinstance(ev, Subscribe)
            await self._on_subscribe(ev)
        elif kind is Unsubscribe:
            assert isinstance(ev, Unsubscribe)
            self._on_unsubscribe(ev)
        elif kind is PingReq:
            self.write(self.conn.send(PingResp()))
        elif kind is Connect:
            assert isinstance(ev, Connect)
            await self._on_connect(ev)
        elif kind is Disconnect:
            assert isinstance(ev, Disconnect)
            self._on_disconnect(ev)
        elif kind is Auth:
            self._fail(
                ReasonCode.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not supported"
            )

    # -- CONNECT -----------------------------------------------------------------------------

    async def _on_connect(self, ev: Connect) -> None:
        ctx = self.ctx
        s = ctx.settings
        level = ev.protocol_level
        cid = ev.client_id
        assigned: str | None = None
        if not cid:
            cid = "lmqtt-" + secrets.token_hex(8)
            if level == 5:
                assigned = cid
        self.client_id = cid
        if level == 5:
            requested = ev.properties.session_expiry_interval or 0
            expiry = min(requested, s.max_session_expiry)
        else:
            requested = expiry = 0 if ev.clean_start else s.default_session_expiry
        will = ev.will
        if will is not None:
            code = self._check_will(will)
            if code:
                self._refuse(code)
                return
        if ctx.server.stopping:
            self._refuse(ReasonCode.SERVER_BUSY if level == 5 else ReasonCode.SERVER_UNAVAILABLE)
            return
        code, self.username = await ctx.access.check_connect(ev, self, ctx.stats.clients_connected)
        if self.closed:
            return
        if code:
            self._refuse(code)
            return
        self.acl = ctx.access.client_access(cid, self.username)
        cluster = ctx.cluster
        clustered = not isinstance(cluster, SingleNode)
        if clustered:
            # The session as another node left it (or hands it over).
            await cluster.before_connect(cid, self, ev.clean_start)
            if self.closed:
                cluster.released(cid, self)  # a claim made while it waited for a hand-over
                return
        session, present = ctx.sessions.connect(
            cid, level, expiry, ev.clean_start, self, will, self.peer
        )
        self.session = session
        self.will = will
        if present and session.behind:
            # From the record of a node that crashed: acknowledged since are not sent again.
            await ctx.sessions.skip_acknowledged(session)
            if self.closed:
                return
        if present and session.inflight and not clustered:
            # Cluster mode reads them when the node claims the session (below).
            await ctx.sessions.read_inflight(session)
            if self.closed:
                return
        if clustered:
            try:
                await cluster.connected(cid, self, ev.clean_start, session)
            except (StoreError, TimeoutError) as exc:
                log.error("%r: CONNECT not announced to the cluster: %s", cid, exc)
                self._refuse(ReasonCode.SERVER_UNAVAILABLE)
                return
            if self.closed:
                return
        props: Properties | None = None
        if level == 5:
            server_ka: int | None = None
            if s.server_keep_alive is not None:
                server_ka = s.server_keep_alive
            elif ev.keep_alive > s.max_keep_alive or (ev.keep_alive == 0 and s.max_keep_alive):
                server_ka = s.max_keep_alive if ev.keep_alive > s.max_keep_alive else None
            props = Properties(
                receive_maximum=s.receive_maximum,
                maximum_packet_size=s.max_packet_size,
                topic_alias_maximum=s.topic_alias_maximum,
                retain_available=1 if s.retain_available else 0,
                wildcard_subscription_available=1,
                subscription_identifier_available=1,
                shared_subscription_available=1,
            )
            if s.max_qos < 2:
                props.maximum_qos = s.max_qos
            if assigned is not None:
                props.assigned_client_identifier = assigned
            if server_ka is not None:
                props.server_keep_alive = server_ka
            if expiry != requested:
                props.session_expiry_interval = expiry
        self.write(
            self.conn.send(ConnAck(session_present=present, reason_code=0, properties=props))
        )
        ctx.stats.clients_connected += 1
        ctx.stats.clients_total += 1
        log.info(
            "%r connected from %s (level %d, clean %s, keep-alive %d, expiry %d, present %s)",
            cid,
            self.peer,
            level,
            ev.clean_start,
            self.conn.keep_alive,
            expiry,
            present,
        )
        # The state machine must accept acks for ids of a previous connection of this session.
        self.conn.restore_inbound_qos2(session.qos2_inbound)
        self.conn.restore_outbound(
            [i.packet_id for i in session.inflight.values() if not i.pubrel],
            [i.packet_id for i in session.inflight.values() if i.pubrel],
        )
        self._last_rx = self._loop.time()
        keep_alive = self.conn.keep_alive_timeout
        if keep_alive is not None:
            ctx.timers.schedule(self, self._last_rx + keep_alive)
        if session.subscriptions or session.inflight:
            # A session with nothing to receive gets its loop at its first SUBSCRIBE.
            delivery = self.delivery = DeliveryLoop(ctx.delivery, session, self)
            ctx.subscriptions.attach(session, delivery)
            delivery.start()
        ctx.sessions.registry.touch(session)
        ctx.cluster.answered(cid, self)  # cluster mode: a takeover read meanwhile is done now

    def _delivery_loop(self) -> DeliveryLoop:
        delivery = self.delivery
        if delivery is None:
            assert self.session is not None
            delivery = self.delivery = DeliveryLoop(self.ctx.delivery, self.session, self)
            delivery.start()
        return delivery

    def _check_will(self, will: Will) -> int:
        s = self.ctx.settings
        try:
            Topic(will.topic)
        except TopicError:
            return ReasonCode.TOPIC_NAME_INVALID
        if will.topic.startswith("$"):
            return ReasonCode.TOPIC_NAME_INVALID
        if will.qos > s.max_qos:
            return ReasonCode.QOS_NOT_SUPPORTED
        if will.retain and not s.retain_available:
            return ReasonCode.RETAIN_NOT_SUPPORTED
        return 0

    def _refuse(self, code: int) -> None:
        log.info("%s: CONNECT refused with 0x%02X", self.peer, code)
        try:
            self.write(self.conn.send(ConnAck(reason_code=code)))
        except LocalProtocolError:
            pass
        self._abnormal = False
        self.close()

    # -- PUBLISH in --------------------------------------------------------------------------

    def _plain_publish(self, pub: Publish) -> bool:
        """True if `pub` may join a batched run: connected, a valid topic name this client may
        publish to. Otherwise _on_publish() handles it (and its refusal) on its own."""
        if self.session is None or pub.topic.startswith("$"):
            return False
        try:
            self.ctx.topic(pub.topic)
            self.ctx.access.check_publish(self, pub.topic)
        except TopicError:
            return False
        return True

    async def _store_run(self, run: list[Publish]) -> None:
        """Store a run of plain publishes with one store call, then acknowledge the QoS 1
        ones in order (sync flush: after the fsync covering the run's last record)."""
        ctx = self.ctx
        try:
            results = ctx.publisher.append_publishes(run, [self.publish_blocks()] * len(run))
        except StoreError:
            # Nothing of the run was stored: one by one, so only the bad message fails, and
            # exactly as it would have without batching.
            for pub in run:
                if self.closed:
                    return
                await self._on_publish(pub)
            return
        self._published(len(run), run[-1].qos == 0)
        acked = [pub for pub in run if pub.qos]
        if ctx.settings.flush == "sync":
            if not acked:
                return
            self._pending_puts += 1
            if self._pending_puts >= MAX_PENDING_PUTS:
                self._pause_reading()
            task = self._loop.create_task(
                self._ack_when_durable(results[-1].end_offset, acked, self._ack_chain)
            )
            if self._put_tasks is None:
                self._put_tasks = set()
            self._put_tasks.add(task)
            task.add_done_callback(self._put_tasks.discard)
            self._ack_chain = task
            return
        if self.closed:
            return
        ids = [pub.packet_id for pub in acked if pub.packet_id is not None]
        if ids:
            self.acknowledge_stored(ids)

    async def _ack_when_durable(
        self, end: int, acked: list[Publish], prev: asyncio.Task[None] | None
    ) -> None:
        try:
            try:
                await self.ctx.publisher.wait_durable(end)
                failed: StoreError | None = None
            except StoreError as e:
                failed = e
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            for pub in acked:
                if self.closed:
                    return
                if failed is not None:
                    self._store_failed(pub, failed)
                elif pub.packet_id is not None:
                    self.write(self.conn.send(PubAck(pub.packet_id)))
        finally:
            self._pending_puts -= 1
            self._resume_reading()

    async def _on_publish(self, pub: Publish) -> None:
        session = self.session
        assert session is not None
        if self._acks:
            self._release_acks()
        ctx = self.ctx
        level = self.conn.protocol_level
        pid = pub.packet_id
        try:
            if pub.topic.startswith("$"):
                raise TopicError(
                    "clients cannot publish to $-topics", reason_code=ReasonCode.NOT_AUTHORIZED
                )
            ctx.topic(pub.topic)  # validates (TopicError); store_publish reuses the cached entry
            ctx.access.check_publish(self, pub.topic)  # limits (0x90) and ACL (0x87)
        except TopicError as e:
            if e.reason_code != ReasonCode.NOT_AUTHORIZED:
                self._fail(ReasonCode.TOPIC_NAME_INVALID, f"invalid topic {pub.topic!r}: {e}")
                return
            # Denied, not malformed: acknowledge (3.1.1 has no negative ack) and drop.
            log.info("%r: PUBLISH to %r denied: %s", self.client_id, pub.topic, e)
            ctx.stats.publish_dropped += 1
            code = ReasonCode.NOT_AUTHORIZED if level == 5 else 0
            if pub.qos == 1 and pid is not None:
                self.write(self.conn.send(PubAck(pid, code)))
            elif pub.qos == 2 and pid is not None:
                self.write(self.conn.send(PubRec(pid, code)))
                if code == 0:
                    session.qos2_inbound.add(pid)
            return
        if pub.qos == 2 and pid is not None and pid in session.qos2_inbound:
            # Re-sent before our PUBREC arrived: stored already (state survives restarts).
            self.write(self.conn.send(PubRec(pid)))
            return
        if ctx.settings.flush == "sync":
            # Tasks start in creation order, so appends keep the arrival order; each awaits
            # its fsync concurrently (group commit) and acknowledges after its predecessor.
            self._pending_puts += 1
            if self._pending_puts >= MAX_PENDING_PUTS:
                self._pause_reading()
            prev = self._ack_chain
            task = self._loop.create_task(self._store_then_ack(pub, prev if pub.qos else None))
            if self._put_tasks is None:
                self._put_tasks = set()
            self._put_tasks.add(task)
            task.add_done_callback(self._put_tasks.discard)
            if pub.qos > 0:
                self._ack_chain = task
            return
        try:
            await ctx.publisher.store_publish(pub, self.client_id)
        except StoreError as e:
            self._store_failed(pub, e)
            return
        if pub.qos == 1:
            # _acknowledge's QoS 1 case inline: no coroutine per publish of a QoS 1 flood.
            if pid is not None and not self.closed:
                self.write(self.conn.send(PubAck(pid)))
        elif pub.qos == 2:
            await self._acknowledge(pub)

    async def _store_then_ack(self, pub: Publish, prev: asyncio.Task[None] | None) -> None:
        try:
            try:
                await self.ctx.publisher.store_publish(pub, self.client_id)
                failed: StoreError | None = None
            except StoreError as e:
                failed = e
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            if self.closed:
                return
            if failed is not None:
                self._store_failed(pub, failed)
            else:
                await self._acknowledge(pub)
        finally:
            self._pending_puts -= 1
            self._resume_reading()

    async def _acknowledge(self, pub: Publish) -> None:
        pid = pub.packet_id
        if pid is None or self.closed:
            return
        if pub.qos == 1:
            self.write(self.conn.send(PubAck(pid)))
        elif pub.qos == 2:
            session = self.session
            assert session is not None
            session.qos2_inbound.add(pid)
            if session.persistent:
                out, self._out = self._out, None
                if out and not self.closed:
                    self.transport.write(b"".join(out))
                try:
                    await self.ctx.sessions.registry.save(session)
                finally:
                    self._out = [] if out is not None else None
            if not self.closed:
                self.write(self.conn.send(PubRec(pid)))

    def _store_failed(self, pub: Publish, err: StoreError) -> None:
        if self._acks:
            self._release_acks()
        log.error("%r: storing a PUBLISH to %r failed: %s", self.client_id, pub.topic, err)
        self.ctx.stats.publish_dropped += 1
        if self.closed or pub.packet_id is None:
            return
        if self.conn.protocol_level == 5:
            ack = PubAck if pub.qos == 1 else PubRec
            self.write(self.conn.send(ack(pub.packet_id, ReasonCode.UNSPECIFIED_ERROR)))
        else:
            self.close()

    async def _on_pubrel(self, ev: PubRel) -> None:
        session = self.session
        assert session is not None
        if self._ack_chain is not None and not self._ack_chain.done():
            # PUBCOMP must not overtake the PUBREC of a publish still waiting for its fsync.
            await asyncio.gather(self._ack_chain, return_exceptions=True)
        known = ev.packet_id in session.qos2_inbound
        session.qos2_inbound.discard(ev.packet_id)
        self.ctx.sessions.registry.touch(session)
        code = (
            0 if known or self.conn.protocol_level != 5 else ReasonCode.PACKET_IDENTIFIER_NOT_FOUND
        )
        if not self.closed:
            self.write(self.conn.send(PubComp(ev.packet_id, code)))

    def _on_pubrec(self, ev: PubRec) -> None:
        if self.session is None:
            return
        delivery = self.delivery
        if delivery is not None and delivery.on_pubrec(
            ev.packet_id, ev.reason_code >= ReasonCode.UNSPECIFIED_ERROR
        ):
            self.write(self.conn.send(PubRel(ev.packet_id)))
        elif ev.reason_code < ReasonCode.UNSPECIFIED_ERROR:
            code = ReasonCode.PACKET_IDENTIFIER_NOT_FOUND if self.conn.protocol_level == 5 else 0
            self.write(self.conn.send(PubRel(ev.packet_id, code)))

    # -- SUBSCRIBE / UNSUBSCRIBE -------------------------------------------------------------

    async def _on_subscribe(self, ev: Subscribe) -> None:
        session = self.session
        assert session is not None
        delivery = self._delivery_loop()
        ctx = self.ctx
        subscriptions = ctx.subscriptions
        registry = ctx.sessions.registry
        level = self.conn.protocol_level
        sub_id: int | None = None
        if ev.properties is not None and ev.properties.subscription_identifiers:
            sub_id = ev.properties.subscription_identifiers[0]
        codes: list[int] = []
        retained_for: list[tuple[SubscriptionState, TopicFilter]] = []
        notes: list[str] = []  # MQTT 5 SUBACK reason string (replay cut off by retention)
        prop_from: str | None = None
        if ev.properties is not None and ev.properties.user_properties:
            prop_from = next(
                (v for k, v in ev.properties.user_properties if k == REPLAY_PROPERTY), None
            )
        for req in ev.subscriptions:
            try:
                # `$replay/{from}/{filter}` or the replay-from property: a replay of `filter`.
                replay = split_replay(req.topic_filter)
                tf = replay.filter if replay is not None else TopicFilter(req.topic_filter)
                start = replay.start if replay is not None else prop_from
                since = parse_replay_from(start) if start is not None else None
                if since is not None and tf.is_shared:
                    raise TopicError(
                        "a shared subscription cannot replay",
                        reason_code=ReasonCode.TOPIC_FILTER_INVALID,
                    )
            except TopicError as e:
                log.info("%r: SUBSCRIBE %r refused: %s", self.client_id, req.topic_filter, e)
                codes.append(
                    ReasonCode.TOPIC_FILTER_INVALID if level == 5 else ReasonCode.UNSPECIFIED_ERROR
                )
                if level == 5:
                    notes.append(str(e))
                continue
            if tf.is_shared and req.no_local:
                self._fail(ReasonCode.PROTOCOL_ERROR, "no-local on a shared subscription")
                return
            new = tf.text not in session.subscriptions
            n = len(session.subscriptions)
            refusal = ctx.access.subscribe_refusal(self, tf.filter, tf.text, new, n)
            if refusal:
                codes.append(refusal if level == 5 else ReasonCode.UNSPECIFIED_ERROR)
                continue
            qos = min(req.qos, ctx.settings.max_qos)
            await subscriptions.open_queue(session, tf, since)
            sub, cutoff = subscriptions.subscribe(
                session, delivery, tf, req, qos, sub_id, since, start
            )
            codes.append(qos)
            if cutoff is not None:
                log.warning("%r: %s", self.client_id, cutoff.text(tf.filter))
                notes.append(cutoff.text(tf.filter))
            if since is None and subscriptions.wants_retained(tf, req, new):
                retained_for.append((sub, tf))
        await ctx.cluster.subscribed()  # every node routes to the new filters (cluster mode)
        if session.persistent:
            await registry.save(session)  # the subscription must survive a crash once SUBACKed
        else:
            registry.touch(session)
        if self.closed:
            return
        if retained_for and not isinstance(ctx.cluster, SingleNode):
            await ctx.cluster.retained_caught_up()  # set through another node a moment ago
            if self.closed:
                return
        props = Properties(reason_string="; ".join(notes)) if notes and level == 5 else None
        self.write(self.conn.send(SubAck(ev.packet_id, codes, props)))
        subscriptions.send_retained(delivery, retained_for)
        delivery.wake()

    def _on_unsubscribe(self, ev: Unsubscribe) -> None:
        session = self.session
        assert session is not None
        codes: list[int] = []
        for text in ev.topic_filters:
            try:
                replay = split_replay(text)  # `$replay/{from}/f` is the subscription to `f`
            except TopicError:
                replay = None
            sub = session.subscriptions.get(replay.filter.text if replay else text)
            if sub is None:
                codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
                continue
            self.ctx.subscriptions.unsubscribe(session, sub, self.delivery)
            codes.append(0)
        self.ctx.sessions.registry.touch(session)
        self.write(self.conn.send(UnsubAck(ev.packet_id, codes)))

    # -- DISCONNECT --------------------------------------------------------------------------

    def _on_disconnect(self, ev: Disconnect) -> None:
        session = self.session
        if session is not None and ev.properties is not None:
            new_expiry = ev.properties.session_expiry_interval
            if new_expiry is not None:
                session.expiry_interval = min(new_expiry, self.ctx.settings.max_session_expiry)
        abnormal = ev.reason_code == ReasonCode.DISCONNECT_WITH_WILL_MESSAGE
        log.info("%r disconnected (0x%02X)", self.client_id, ev.reason_code)
        self.close(abnormal=abnormal, linger=False)
