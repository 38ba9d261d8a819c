"""ClientTransport: what is written to one client and when it is read; the base of
ClientConnection.

What is written goes out at once, or, while the reader task handles a run of input, is
collected and sent with one transport.write() when it yields. The PUBACKs of stored publishes
go out at once too, unless the overload guard holds the connection (gateway/connection/
overload.py): then they wait for its turn. Reading pauses while too much input waits unparsed,
while the guard holds the connection past HELD_READ_MAX publishes (or one at QoS 0), or while too
many publishes wait for their fsync (sync flush), or while its publish quota's bucket refills
(gateway/access/quotas.py), and resumes once none of these holds it. A
close the gateway decides lingers: half-closed, what the client still sends is read and
discarded for LINGER_S.

ClientConnection extends it rather than holding one: its inline publish path acknowledges,
holds and pauses through these methods in the transport callback, and a second object per
connection would cost memory (which limits how many devices fit) and an attribute hop on every
call; as one object, the split costs nothing per message.
"""

from __future__ import annotations

import asyncio

from gateway.access.quotas import QuotaBucket
from gateway.connection.context import ClientContext
from gateway.protocol import Connection, PubAck, Publish, PubRec, ReasonCode

__all__ = ["HELD_READ_MAX", "LINGER_S", "MAX_PENDING_PUTS", "MAX_UNPARSED", "ClientTransport"]

# Sync-flush publishes awaiting their fsync before this connection stops reading.
MAX_PENDING_PUTS = 256
# Unparsed input beyond which reading pauses until the reader task catches up.
MAX_UNPARSED = 1 << 20
# Publishes a connection held by the overload guard may still hand in (their PUBACKs held) before
# its reading pauses too: a device whose in-flight window is at most this stops by itself, its
# window full of messages already delivered, and is read at once at its turn. A lower bound
# (pausing deep windows of 50 sooner) measured worse (docs/benchmarks.md, the overload runs).
HELD_READ_MAX = 64
# How long a connection the gateway closes stays half-closed, its input read and discarded
# (see ClientTransport._close_transport).
LINGER_S = 2.0


class ClientTransport:
    """Writes to one client's transport (its PUBACKs held while the overload guard holds it)
    and decides when it is read."""

    # Slots: an idle connection's footprint is what limits how many devices fit. A new
    # attribute must be listed here (or in ClientConnection's).
    __slots__ = (
        "_acks",
        "_held",
        "_held_reads",
        "_ingest",
        "_loop",
        "_out",
        "_pending_puts",
        "_put_tasks",
        "_reading_paused",
        "_unparsed",
        "bytes_in",
        "bytes_out",
        "closed",
        "conn",
        "ctx",
        "msgs_in",
        "quota",
        "transport",
        "writable",
    )

    def __init__(self, context: ClientContext, transport: asyncio.Transport) -> None:
        self.ctx = context
        self.transport = transport
        self.conn = Connection(max_packet_size=context.settings.max_packet_size)
        self.writable = True
        self.closed = False
        self._loop = context.loop
        self._unparsed = 0  # input received and not parsed yet
        self._reading_paused = False
        # Where plain publishes read in a transport callback go (async flush mode only).
        self._ingest = context.ingest
        # Held by the overload guard (gateway/connection/overload.py): the PUBACKs of what it
        # hands in wait in _acks, and after HELD_READ_MAX publishes (at once for QoS 0) its
        # reading pauses.
        self._held = False
        self._held_reads = 0
        self._acks: list[int] | None = None
        self._pending_puts = 0
        self._put_tasks: set[asyncio.Task[None]] | None = None  # sync flush only
        # Packets written while the reader task handles a run of input (PUBACKs of a flood),
        # sent with one transport.write() when it yields; None: write through.
        self._out: list[bytes] | None = None
        # The publish quota's buckets (gateway/access/quotas.py), set at CONNECT; None: none.
        self.quota: QuotaBucket | None = None
        # What the live view reads (gateway/ops/live_view.py): PUBLISH packets and bytes read,
        # bytes written. Plain integer increments, per read or per write.
        self.msgs_in = 0
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def peer(self) -> str:
        """The client's address (host:port), for logs and the live view: asked when needed,
        not kept per connection (an idle device's footprint limits how many fit)."""
        try:
            peer = self.transport.get_extra_info("peername")
        except Exception:  # a transport already torn down
            peer = None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    # -- out ---------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if data and not self.closed:
            n = len(data)
            self.ctx.stats.bytes_sent += n
            self.bytes_out += n
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

    def write_through(self) -> bool:
        """Send what the reader collected, and write directly until collect_again() (a
        handler is about to wait). Returns whether output was being collected."""
        out, self._out = self._out, None
        if out and not self.closed:
            self.transport.write(b"".join(out))
        return out is not None

    def collect_again(self, collecting: bool) -> None:
        """After write_through(): collect again if it was collecting."""
        self._out = [] if collecting else None

    def pause_writing(self) -> None:
        self.writable = False

    # -- when the client is read -------------------------------------------------------------

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if (
            self._reading_paused
            and not self._held
            and not self.closed
            and (self.quota is None or not self.quota.waiting)
            and self._pending_puts < MAX_PENDING_PUTS // 2
            and self._unparsed <= MAX_UNPARSED
        ):
            self._reading_paused = False
            self.transport.resume_reading()

    def put_started(self) -> None:
        """A sync-flush publish began waiting for its fsync; past MAX_PENDING_PUTS of them
        reading pauses."""
        self._pending_puts += 1
        if self._pending_puts >= MAX_PENDING_PUTS:
            self._pause_reading()

    def put_task(self, task: asyncio.Task[None]) -> None:
        """`task` acknowledges after an fsync: a graceful stop waits for it (pending_puts)."""
        if self._put_tasks is None:
            self._put_tasks = set()
        self._put_tasks.add(task)
        task.add_done_callback(self._put_tasks.discard)

    def put_done(self) -> None:
        """A publish waiting for its fsync was acknowledged (or failed)."""
        self._pending_puts -= 1
        self._resume_reading()

    def pending_puts(self) -> list[asyncio.Task[None]]:
        """Publishes still waiting for their fsync (sync flush), for a graceful stop."""
        return list(self._put_tasks) if self._put_tasks else []

    # -- the overload guard's holds ---------------------------------------------------------

    def published(self, n: int, qos0: bool) -> None:
        """This connection just handed in `n` publishes (the last one at QoS 0: `qos0`): an
        overloaded gateway holds it (gateway/connection/overload.py).

        Held, a QoS 1 publisher is still read, but its PUBACKs wait for its turn in the
        guard's round robin (MQTT sets no deadline for them): a device with an in-flight
        window stops once the window is full of messages already stored and delivered, and
        what it sends after its turn is read at once, not left waiting in its socket. One that
        goes on sending regardless (a window over HELD_READ_MAX, or QoS 0, which has no
        acknowledgement to wait for) is not read until its turn; nor is any held
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

    def release_acks(self) -> None:
        """A PUBACK is about to be written outside the batch: the held ones go first (PUBACKs
        leave in the order of their PUBLISHes), the connection stays held."""
        acks = self._acks
        if acks:
            self._acks = []
            if not self.closed:
                self.write(self.conn.pubacks(acks))

    def acknowledge_stored(self, packet_ids: list[int]) -> None:
        """The ingest batch stored these publishes: their PUBACKs now, or with the held ones."""
        acks = self._acks
        if acks is not None:
            acks.extend(packet_ids)
        elif not self.closed:
            # write()'s body inline: this runs once per publishing device per turn.
            data = self.conn.pubacks(packet_ids)
            n = len(data)
            self.ctx.stats.bytes_sent += n
            self.bytes_out += n
            out = self._out
            if out is not None:
                out.append(data)
            else:
                self.transport.write(data)

    # -- closing -----------------------------------------------------------------------------

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

    # -- the publish quota ------------------------------------------------------------------

    async def _over_quota(self, quota: QuotaBucket, pub: Publish, wait: float) -> bool:
        """`pub` is over this client's publish quota (gateway/access/quotas.py). Reject: MQTT 5
        QoS 1/2 get 0x97 (Quota exceeded), QoS 0 is dropped (False: not to be stored).
        Otherwise reading pauses and the reader waits until the bucket has refilled (True:
        store it now)."""
        level5 = self.conn.protocol_level == 5
        if quota.reject and (pub.qos == 0 or level5):
            quota.rejected()
            self.ctx.stats.publish_dropped += 1
            pid = pub.packet_id
            if pid is not None and pub.qos:
                self.release_acks()  # PUBACKs leave in the order of their PUBLISHes
                ack = PubAck if pub.qos == 1 else PubRec
                self.write(self.conn.send(ack(pid, ReasonCode.QUOTA_EXCEEDED)))
            return False
        quota.throttled()
        # What was collected goes out now, and deliveries written meanwhile go out directly.
        self._flush_out()
        self._out = None
        quota.waiting = True
        self._pause_reading()
        try:
            while wait and not self.closed:
                await asyncio.sleep(wait)
                wait = quota.take(len(pub.payload), self._loop.time())
        finally:
            quota.waiting = False
            self._out = []
        return not self.closed
