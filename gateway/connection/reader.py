"""ReaderTask: the reader task of a client connection, for what the read callback does not
handle inline (gateway/connection/client.py): it pulls events out of the sans-IO `Connection`
and hands them, in order, to their handlers (PacketDispatch, gateway/connection/dispatch.py);
runs of plain publishes it reads go to the store with one call.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.connection.context import ClientContext
from gateway.connection.dispatch import Handled
from gateway.connection.keep_alive import KeepAlive
from gateway.protocol import (
    NEED_DATA,
    ConnectionClosed,
    PingReq,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    ReasonCode,
    RemoteProtocolError,
)

__all__ = ["ReaderTask"]

log = logging.getLogger("lmqtt.gateway")

# Packets handled before the reader task yields to the event loop (a run of plain PUBLISHes
# among them is one store append): a flooding client's turn stays short.
EVENTS_PER_TURN = 128

# Packets whose handling never waits (in async flush mode the store append does not either):
# their replies are collected and written once per run of input (see ClientTransport._out).
_COLLECTED = frozenset({Publish, PubAck, PubComp, PingReq})


class ReaderTask(KeepAlive):
    """The reader task of one connection (the base of ClientConnection, which supplies the
    plain-publish check and itself as the handlers' connection)."""

    __slots__ = ("_reader",)

    def __init__(self, context: ClientContext, transport: asyncio.Transport) -> None:
        super().__init__(context, transport)
        # The reader task exists only while there are bytes to handle: an idle connection
        # costs no task (memory per connection is what limits how many devices fit). Or
        # what the input is held for (ClientConnection.hold): it is handled once that is done.
        self._reader: asyncio.Future[None] | None = None

    def _plain_publish(self, pub: Publish) -> bool:
        raise NotImplementedError  # ClientConnection._plain_publish

    def _handled(self) -> Handled:
        """This connection as the packet handlers take it (ClientConnection answers itself)."""
        raise NotImplementedError

    def _kick(self, first: object = None) -> None:
        """Start the reader task (it handles `first`, then what is buffered) unless it runs.
        A lingering ingest batch is stored first (IngestBatch.settle)."""
        if self._reader is None and not self.closed:
            if self._ingest is not None:
                self._ingest.settle()
            self._reader = self._loop.create_task(self._read_loop(first))

    async def _read_loop(self, first: object = None) -> None:
        """Handle every complete packet buffered (and arriving meanwhile), then end.

        Batched ingest: consecutive plain PUBLISHes (QoS 0/1, not retained, topic and ACL
        checks passed) are collected in `run` and stored with one store call when anything
        else comes (another packet kind, a PUBLISH needing the per-message path, the end of
        the input, the end of the turn), so every other packet sees them stored and their
        PUBACKs leave in order, before any later reply. Consecutive PUBRECs (of the gateway's
        QoS 2 deliveries) are collected the same way: one session save for all of them before
        their PUBRELs (PublishHandler.on_pubrecs).
        """
        client = self._handled()
        handled = 0
        run: list[Publish] = []
        recs: list[PubRec] = []  # PUBRECs of this turn: one durable save before their PUBRELs
        self._out = []
        try:
            while not self.closed:
                if handled >= EVENTS_PER_TURN:
                    # A flooding client must not hold the event loop: let delivery (which then
                    # still finds the messages in RecentMessages) and other clients run.
                    handled = 0
                    if run:
                        await self.ctx.packets.publish.store_run(client, run)
                        run = []
                    if recs:
                        await self.ctx.packets.publish.on_pubrecs(client, recs)
                        recs = []
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
                        await self.ctx.packets.publish.store_run(client, run)
                        run = []
                    self._protocol_error(err)
                    return
                kind = type(ev)
                if kind is Publish:
                    assert isinstance(ev, Publish)
                    self.msgs_in += 1
                    quota = self.quota
                    if quota is not None:
                        wait = quota.take(len(ev.payload), self._loop.time())
                        if wait:
                            if run:
                                await self.ctx.packets.publish.store_run(client, run)
                                run = []
                            if not await self._over_quota(quota, ev, wait):
                                continue  # refused (reject): not stored
                    if ev.qos < 2 and not ev.retain and self._plain_publish(ev):
                        run.append(ev)
                        continue
                elif kind is PubRec:
                    assert isinstance(ev, PubRec)
                    recs.append(ev)
                    continue
                if recs:
                    await self.ctx.packets.publish.on_pubrecs(client, recs)
                    recs = []
                if run:
                    await self.ctx.packets.publish.store_run(client, run)
                    run = []
                if ev is NEED_DATA:
                    break
                if kind is ConnectionClosed:
                    log.debug("%r: connection closed by peer", self.client_id or self.peer)
                    self.close(linger=False)
                    return
                if kind in _COLLECTED:
                    await self.ctx.dispatch(client, ev)
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
            # This is the reader task (_kick starts one only while none runs): no
            # current_task(), which asks the running loop (a getpid() system call) each time.
            self._reader = None

    def _protocol_error(self, err: RemoteProtocolError) -> None:
        log.warning(
            "%s (%r): protocol error 0x%02X: %s",
            self.peer, self.client_id, err.reason_code, err.message,
        )  # fmt: skip
        self.write(self.conn.error_packet(err))
        self.close()

    async def _handle_waiting(self, ev: object) -> None:
        # This handler may wait (session save, fsync, authentication): what the reader
        # collected is sent now, and what is written meanwhile goes out directly.
        self._flush_out()
        self._out = None
        try:
            await self.ctx.dispatch(self._handled(), ev)
        finally:
            self._out = []
