"""PublishHandler: a client's PUBLISH, PUBREL and PUBREC, and the acknowledgements that wait
for the store.

A connected client's plain PUBLISHes (QoS 0/1, not retained, topic and ACL checks passed) are
read by ClientConnection in the transport callback and join the turn's ingest batch
(gateway/connection/ingest.py). What its reader task reads comes here: runs of plain publishes
(`store_run`, one store call each) and every other PUBLISH (`on_publish`: QoS 2, retained,
refused, or a $-topic). In `sync` flush mode the acknowledgements are pipelined: each store call
gets a task that awaits its fsync and then the previous acknowledgement (the connection's
`ack_chain`), so PUBACKs leave in the order the PUBLISH packets arrived while many share one
group commit.

One PublishHandler serves every connection: what it keeps of one (the acknowledgement chain,
the count of publishes awaiting their fsync) lives on that connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from gateway.access.control import AccessControl, Client
from gateway.delivery.loop import DeliveryLoop
from gateway.messages.delayed import DELAYED_PREFIX, DelayedPublishes, parse_delayed
from gateway.messages.publishing import PublishPath
from gateway.messages.records import PublishProperties
from gateway.protocol import Connection, PubAck, PubComp, Publish, PubRec, PubRel, ReasonCode
from gateway.session.model import Session
from gateway.session.registry import SessionRegistry
from gateway.stats import GatewayStats
from gateway.storage.port import StoreError
from topicmap import TopicError

__all__ = ["PublishHandler", "Publishing"]

log = logging.getLogger("lmqtt.gateway")


class Publishing(Client, Protocol):
    """The connection as PublishHandler sees it (gateway/connection/client.py
    ClientConnection)."""

    conn: Connection
    closed: bool
    delivery: DeliveryLoop | None
    # The last sync-flush acknowledgement task: the next one waits for it (PUBACKs in order).
    ack_chain: asyncio.Task[None] | None

    @property
    def session(self) -> Session | None: ...

    def write(self, data: bytes) -> None: ...

    def close(
        self, reason: int | None = None, *, abnormal: bool = True, linger: bool = True
    ) -> None: ...

    def fail(self, reason: int, message: str) -> None:
        """A rule the gateway enforces was broken: MQTT 5 DISCONNECT `reason`, close."""

    def put_started(self) -> None:
        """A sync-flush publish began waiting for its fsync (too many: reading pauses)."""

    def put_task(self, task: asyncio.Task[None]) -> None:
        """`task` acknowledges after an fsync: a graceful stop waits for it."""

    def put_done(self) -> None:
        """A publish waiting for its fsync was acknowledged (or failed)."""

    def release_acks(self) -> None:
        """PUBACKs held by the overload guard go out now, before the next one."""

    def acknowledge_stored(self, packet_ids: list[int]) -> None: ...

    def published(self, n: int, qos0: bool) -> None:
        """`n` publishes were handed in (the overload guard may hold the connection)."""

    def publish_blocks(self) -> PublishProperties: ...

    def write_through(self) -> bool:
        """Send what the reader collected and write directly until collect_again()."""
        ...

    def collect_again(self, collecting: bool) -> None: ...


class PublishHandler:
    """Stores what a client publishes and acknowledges it; PUBREL and PUBREC."""

    __slots__ = (
        "_access",
        "_delayed",
        "_loop",
        "_max_delay",
        "_publisher",
        "_registry",
        "_stats",
        "_sync",
        "_topic",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        publisher: PublishPath,
        access: AccessControl,
        registry: SessionRegistry,
        stats: GatewayStats,
        sync: bool,
        delayed: DelayedPublishes | None = None,
        max_delay: int = 0,
    ) -> None:
        """`sync`: acknowledge after the fsync (settings.flush == "sync"). `delayed`: where
        `$delayed/{seconds}/{topic}` goes, seconds up to `max_delay`."""
        self._loop = loop
        self._delayed = delayed
        self._max_delay = max_delay
        self._publisher = publisher
        self._access = access
        self._registry = registry
        self._stats = stats
        self._sync = sync
        # publisher.check_topic, bound once: every PUBLISH's topic is validated with it.
        self._topic: Callable[[str], str] = publisher.check_topic

    async def store_run(self, client: Publishing, run: list[Publish]) -> None:
        """Store a run of plain publishes with one store call, then acknowledge the QoS 1
        ones in order (sync flush: after the fsync covering the run's last record)."""
        try:
            results = self._publisher.append_publishes(run, [client.publish_blocks()] * len(run))
        except StoreError:
            # Nothing of the run was stored: one by one, so only the bad message fails, and
            # exactly as it would have without batching.
            for pub in run:
                if client.closed:
                    return
                await self.on_publish(client, pub)
            return
        client.published(len(run), run[-1].qos == 0)
        acked = [pub for pub in run if pub.qos]
        if self._sync:
            if not acked:
                return
            client.put_started()
            task = self._loop.create_task(
                self._ack_when_durable(client, results[-1].end_offset, acked, client.ack_chain)
            )
            client.put_task(task)
            client.ack_chain = task
            return
        if client.closed:
            return
        ids = [pub.packet_id for pub in acked if pub.packet_id is not None]
        if ids:
            client.acknowledge_stored(ids)

    async def _ack_when_durable(
        self,
        client: Publishing,
        end: int,
        acked: list[Publish],
        prev: asyncio.Task[None] | None,
    ) -> None:
        try:
            try:
                await self._publisher.wait_durable(end)
                failed: StoreError | None = None
            except StoreError as e:
                failed = e
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            for pub in acked:
                if client.closed:
                    return
                if failed is not None:
                    self.store_failed(client, pub, failed)
                elif pub.packet_id is not None:
                    client.write(client.conn.send(PubAck(pub.packet_id)))
        finally:
            client.put_done()

    async def on_publish(self, client: Publishing, pub: Publish) -> None:
        """A PUBLISH on its own: checked, stored, acknowledged (or refused)."""
        session = client.session
        assert session is not None
        client.release_acks()
        pid = pub.packet_id
        try:
            if pub.topic.startswith("$"):
                if pub.topic.startswith(DELAYED_PREFIX) and self._delayed is not None:
                    await self._on_delayed(client, pub)
                    return
                raise TopicError(
                    "clients cannot publish to $-topics", reason_code=ReasonCode.NOT_AUTHORIZED
                )
            self._topic(pub.topic)  # validates (TopicError); store_publish reuses the entry
            self._access.check_publish(client, pub.topic)  # limits (0x90) and ACL (0x87)
        except TopicError as e:
            if e.reason_code != ReasonCode.NOT_AUTHORIZED:
                client.fail(ReasonCode.TOPIC_NAME_INVALID, f"invalid topic {pub.topic!r}: {e}")
                return
            # Denied, not malformed: acknowledge (3.1.1 has no negative ack) and drop.
            self._refuse(client, pub, ReasonCode.NOT_AUTHORIZED, f"denied: {e}")
            return
        if pub.qos == 2 and pid is not None:
            if pid in session.qos2_inbound:
                # Re-sent before our PUBREC arrived: stored already (state survives restarts).
                client.write(client.conn.send(PubRec(pid)))
                return
            if session.qos2_since is not None:
                # A QoS 2 PUBLISH of this client has an unknown outcome (gateway/session/qos2.py).
                if not pub.dup:
                    session.qos2_since = None  # the resends come before any new PUBLISH
                elif await self._registry.qos2.stored_before(session, pub):
                    chain = client.ack_chain
                    if chain is not None and not chain.done():
                        await asyncio.gather(chain, return_exceptions=True)
                    await self._acknowledge(client, pub)
                    return
            # Until its id joins qos2_inbound, the session's saved records say where in the
            # log a restart looks for it (gateway/session/qos2.py).
            self._registry.qos2.storing(client.client_id, pid)
        if self._sync:
            # Tasks start in creation order, so appends keep the arrival order; each awaits
            # its fsync concurrently (group commit) and acknowledges after its predecessor.
            client.put_started()
            prev = client.ack_chain
            task = self._loop.create_task(
                self._store_then_ack(client, pub, prev if pub.qos else None)
            )
            client.put_task(task)
            if pub.qos > 0:
                client.ack_chain = task
            return
        try:
            await self._publisher.store_publish(pub, client.client_id)
        except StoreError as e:
            self.store_failed(client, pub, e)
            self._qos2_settled(client, pub)
            return
        except asyncio.CancelledError:
            self._qos2_settled(client, pub)  # the connection closed: outcome unknown
            raise
        if pub.qos == 1:
            # _acknowledge's QoS 1 case inline: no coroutine per publish of a QoS 1 flood.
            if pid is not None and not client.closed:
                client.write(client.conn.send(PubAck(pid)))
        elif pub.qos == 2:
            try:
                await self._acknowledge(client, pub)
            finally:
                self._qos2_settled(client, pub)

    def _refuse(self, client: Publishing, pub: Publish, code: int, why: str) -> None:
        """Drop `pub` with a log line: MQTT 5 gets `code` in its PUBACK / PUBREC; 3.1.1, which
        has no negative acknowledgement, a positive one ([MQTT-3.3.5-2]: acknowledge or
        close); the connection stays."""
        log.info("%r: PUBLISH to %r dropped: %s", client.client_id, pub.topic, why)
        self._stats.publish_dropped += 1
        pid = pub.packet_id
        session = client.session
        if client.conn.protocol_level != 5:
            code = 0
        if pub.qos == 1 and pid is not None:
            client.write(client.conn.send(PubAck(pid, code)))
        elif pub.qos == 2 and pid is not None:
            client.write(client.conn.send(PubRec(pid, code)))
            if code == 0 and session is not None:
                session.add_qos2(pid)
                self._registry.touch(session)

    async def _on_delayed(self, client: Publishing, pub: Publish) -> None:
        """`$delayed/{seconds}/{topic}`: checked like a PUBLISH to `{topic}` (a bad delay or
        topic: 0x90; the ACL on `{topic}`: 0x87), stored in the timer (DelayedPublishes),
        acknowledged once stored."""
        assert self._delayed is not None
        try:
            delay, target = parse_delayed(pub.topic, self._max_delay)
            self._topic(target)
            self._access.check_publish(client, target)
        except TopicError as e:
            code = e.reason_code or ReasonCode.TOPIC_NAME_INVALID
            if code != ReasonCode.NOT_AUTHORIZED:
                code = ReasonCode.TOPIC_NAME_INVALID
            self._refuse(client, pub, code, str(e))
            return
        session = client.session
        assert session is not None
        pid = pub.packet_id
        if pub.qos == 2 and pid is not None and pid in session.qos2_inbound:
            client.write(client.conn.send(PubRec(pid)))  # re-sent: stored already
            return
        chain = client.ack_chain
        try:
            await self._delayed.schedule(pub, client.client_id, delay, target)
        except StoreError as e:
            self.store_failed(client, pub, e)
            return
        if chain is not None and not chain.done():
            # Acknowledgements leave in the order the PUBLISH packets came.
            await asyncio.gather(chain, return_exceptions=True)
        await self._acknowledge(client, pub)

    async def _store_then_ack(
        self, client: Publishing, pub: Publish, prev: asyncio.Task[None] | None
    ) -> None:
        try:
            try:
                await self._publisher.store_publish(pub, client.client_id)
                failed: StoreError | None = None
            except StoreError as e:
                failed = e
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            if client.closed:
                return
            if failed is not None:
                self.store_failed(client, pub, failed)
            else:
                await self._acknowledge(client, pub)
        finally:
            self._qos2_settled(client, pub)
            client.put_done()

    def _qos2_settled(self, client: Publishing, pub: Publish) -> None:
        """A QoS 2 PUBLISH's id joined qos2_inbound, or never will (the store failed, the
        client left before its PUBREC): its mark goes (gateway/session/qos2.py)."""
        if pub.qos == 2 and (pid := pub.packet_id) is not None:
            session = client.session
            qos2 = self._registry.qos2
            if session is not None and pid not in session.qos2_inbound:
                qos2.unsure(session, pid)  # maybe stored: a resend is looked for
            qos2.stored(client.client_id, pid)

    async def _acknowledge(self, client: Publishing, pub: Publish) -> None:
        pid = pub.packet_id
        if pid is None or client.closed:
            return
        if pub.qos == 1:
            client.write(client.conn.send(PubAck(pid)))
        elif pub.qos == 2:
            session = client.session
            assert session is not None
            session.add_qos2(pid)
            self._registry.qos2.stored(session.client_id, pid)
            if session.persistent:
                # The PUBREC only once the session record holding its id is saved.
                collecting = client.write_through()
                try:
                    await self._registry.save(session)
                finally:
                    client.collect_again(collecting)
            if not client.closed:
                client.write(client.conn.send(PubRec(pid)))

    def store_failed(self, client: Publishing, pub: Publish, err: StoreError) -> None:
        """Storing `pub` failed: MQTT 5 gets a negative acknowledgement, 3.1.1 is closed."""
        client.release_acks()
        log.error("%r: storing a PUBLISH to %r failed: %s", client.client_id, pub.topic, err)
        self._stats.publish_dropped += 1
        if client.closed or pub.packet_id is None:
            return
        if client.conn.protocol_level == 5:
            ack = PubAck if pub.qos == 1 else PubRec
            client.write(client.conn.send(ack(pub.packet_id, ReasonCode.UNSPECIFIED_ERROR)))
        else:
            client.close()

    async def on_pubrel(self, client: Publishing, ev: PubRel) -> None:
        session = client.session
        assert session is not None
        chain = client.ack_chain
        if chain is not None and not chain.done():
            # PUBCOMP must not overtake the PUBREC of a publish still waiting for its fsync.
            await asyncio.gather(chain, return_exceptions=True)
        known = session.release_qos2(ev.packet_id)
        self._registry.touch(session)
        code = (
            0
            if known or client.conn.protocol_level != 5
            else ReasonCode.PACKET_IDENTIFIER_NOT_FOUND
        )
        if not client.closed:
            client.write(client.conn.send(PubComp(ev.packet_id, code)))

    async def on_pubrecs(self, client: Publishing, recs: list[PubRec]) -> None:
        """The PUBRECs the reader read in one turn, for outbound QoS 2 messages. Once a PUBREC
        is answered with PUBREL the message must never be sent again ([MQTT-4.3.3]: the
        receiver may forget the packet id at its PUBCOMP): a persistent session's record of
        "PUBREL pending" is made durable before the PUBRELs leave, one save (and, in sync
        flush mode, one shared fsync) for the whole turn, so a crash or a takeover resends
        the PUBREL, never the PUBLISH."""
        session = client.session
        if session is None:
            return
        delivery = client.delivery
        level5 = client.conn.protocol_level == 5
        rels: list[PubRel] = []
        recorded = False
        for ev in recs:
            failed = ev.reason_code >= ReasonCode.UNSPECIFIED_ERROR
            if delivery is not None and delivery.on_pubrec(ev.packet_id, failed):
                rels.append(PubRel(ev.packet_id))
                recorded = True
            elif not failed:
                code = ReasonCode.PACKET_IDENTIFIER_NOT_FOUND if level5 else 0
                rels.append(PubRel(ev.packet_id, code))
        if recorded and session.persistent:
            collecting = client.write_through()  # what came before goes out meanwhile
            try:
                await self._registry.save(session)
            except StoreError as err:
                # Not on record: no PUBREL. The client reconnects, and the PUBLISH is re-sent
                # (same packet id, DUP) from the record that preceded it.
                log.warning("%r: PUBREC not recorded (%s); closing", session.client_id, err)
                client.close(ReasonCode.UNSPECIFIED_ERROR)
                return
            finally:
                client.collect_again(collecting)
        if client.closed:
            return
        for rel in rels:
            client.write(client.conn.send(rel))
