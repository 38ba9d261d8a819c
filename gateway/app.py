"""Gateway: the MQTT server, joining the protocol core, the topic router and the store.

    client bytes -> MqttServerProtocol -> ClientConnection -> Gateway.store_publish
                                                 |                 |  router.route(topic)
                                                 |                 v
                                            DeliveryLoop <- store arrival notice (ArrivalHub)

One PUBLISH is one store record: parent topic = first topic level; INNER_MULTI_DISPATCH = the
light queues of every registered filter matching the topic (plus %RETAIN% when retained).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.access import AccessControl
from gateway.client import ClientConnection
from gateway.config import GatewaySettings
from gateway.delivery import ArrivalHub, DeliveryLoop, PreparedCache, RecentMessages
from gateway.delivery_account import DeliveryAccount, NoDeliveryAccount
from gateway.embedded import open_account, open_storage
from gateway.gc_monitor import GcMonitor
from gateway.ingest import IngestBatch
from gateway.listeners import ExtraListeners
from gateway.outbound import identifiers, retain_flag
from gateway.overload import OverloadGuard
from gateway.protocol import Publish, ReasonCode, Will
from gateway.records import PublishProperties, RecordedPublish, message_properties
from gateway.replay import ReplayPacer
from gateway.retained import RetainedIndex, RetainedMessage
from gateway.server import MqttServerProtocol
from gateway.session import Session, SessionRegistry, SubscriptionState, now_ms
from gateway.shared import SharedSubscriptions
from gateway.stats import GatewayStats
from gateway.storage import EncodedMessage, GetStatus, PutResult, Storage
from gateway.timers import TimerWheel
from gateway.will import WillScheduler
from topicmap import Router, Topic, TopicFilter, parent_topic

log = logging.getLogger("lmqtt.gateway")

HOUSEKEEPING_INTERVAL_S = 1.0
STOP_DRAIN_S = 2.0
# Validated topic names and their parent topics remembered (cleared when full): validating
# and naming the parent cost more per PUBLISH than the rest of the gateway's put path.
TOPIC_CACHE_SIZE = 16_384


class Gateway:
    """An MQTT 3.1/3.1.1/5.0 server over the store; `start()`, then `stop()`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.stats = GatewayStats()
        self.router = Router()
        self.connections: set[ClientConnection] = set()
        self.prepared = PreparedCache()
        self.recent = RecentMessages()
        self.replay_pacer = ReplayPacer()  # the loop share replays may use (gateway/replay.py)
        self.shared = SharedSubscriptions(self)
        self.wills = WillScheduler(self._publish_will)
        self.gc = GcMonitor()  # GC pause figures, gc.freeze after connect bursts
        self.stopping = False
        # Checks the security settings and files now: a bad one stops us before start().
        self.access = AccessControl(settings)
        self.listeners = ExtraListeners(self)  # TLS, WebSocket, admin HTTP (gateway/listeners.py)
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sys: object | None = None
        self._topics: dict[str, tuple[Topic, str]] = {}  # name -> (Topic, parent topic)
        # name -> (parent topic, light queues): valid until the router changes (cleared then).
        self._routes: dict[str, tuple[str, tuple[str, ...]]] = {}
        # Set by start():
        self.store: Storage
        self.retained: RetainedIndex
        self.sessions: SessionRegistry
        self.arrivals: ArrivalHub
        self.ingest: IngestBatch | None  # None in sync flush mode (see gateway/ingest.py)
        self.overload: OverloadGuard
        self.timers: TimerWheel  # connect timeouts and keep-alive (gateway/timers.py)
        self.account: DeliveryAccount

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = open_storage(s)
        self.arrivals = ArrivalHub(loop)
        self.ingest = IngestBatch(loop, self.append_publishes) if s.flush == "async" else None
        self.overload = OverloadGuard(loop)
        self.store.add_listener(self.arrivals)
        self.timers = TimerWheel(loop)
        self.gc.start(loop, self.connections.__len__)
        self.sessions = SessionRegistry(self.store, self.end_session)
        self.account = (
            DeliveryAccount(open_account(s), self.store.max_offset)
            if s.delivery_account
            else NoDeliveryAccount()
        )
        clamp = self.store.tail_may_be_lost  # a clean stop saved no position past a queue end
        for session, subs in self.sessions.load(materialize_all=clamp):
            if session is not None and clamp:
                self._clamp_to_store(session)
            for sub in subs:
                self.router.add(sub.topic_filter)
                if sub.share_group is not None:
                    tf = TopicFilter(sub.topic_filter)
                    self.shared.acquire(sub.share_group, tf.filter, sub.queue, resume=True)
                self.stats.subscriptions += 1
            if session is not None:  # None: dormant (gateway/session.py), expiry kept there
                self.sessions.schedule_expiry(session)
        self._routes.clear()
        # The state log was read once, by the session load: the retained snapshot is in it.
        self.retained = RetainedIndex.open(self.store, self.sessions.other_records())
        self._restore_wills()
        self.stats.retained_count = len(self.retained)
        port = s.default_port
        self._server = await loop.create_server(
            lambda: MqttServerProtocol(self), s.host, port, reuse_address=True
        )
        await self.listeners.start()
        self.overload.start()
        self._tasks.append(loop.create_task(self._housekeeping()))
        self.timers.start()
        self._tasks.append(
            loop.create_task(
                self.account.run(self.sessions.sessions.values, self.shared.groups.values)
            )
        )
        self._tasks.append(
            loop.create_task(self.retained.snapshot_periodically(s.retained_snapshot_interval))
        )
        if s.sys_interval > 0:
            from gateway.sys_topics import SysPublisher

            sys_pub = SysPublisher(self)
            sys_pub.start()
            self._sys = sys_pub
        log.info(
            "lmqtt gateway listening on %s:%d (data %s, flush %s, %d sessions restored)",
            s.host,
            self.port,
            s.data_dir,
            s.flush,
            len(self.sessions),
        )

    def _restore_wills(self) -> None:
        """Wills survive restarts: delayed ones keep their due time; those of connections the
        previous run lost without a DISCONNECT (a crash) start their delay now."""
        now = now_ms()
        for cid, orphan in self.sessions.orphan_wills:
            self.wills.schedule(cid, orphan, 0)
        self.sessions.orphan_wills.clear()
        for session in self.sessions.sessions.values():
            will = session.will
            if will is None:
                continue
            if session.will_due_ms is None:
                delay = (will.properties.will_delay_interval or 0) if will.properties else 0
                session.will_due_ms = now + delay * 1000
            due = session.will_due_ms
            expires = session.expires_at_ms()
            if expires is not None:
                due = min(due, expires)
            self.wills.schedule(session.client_id, will, max(0, due - now) / 1000)

    def _clamp_to_store(self, session: Session) -> None:
        """After an async-flush crash the log may end before positions the session record saved:
        read again from the queue's real end, or new messages would land below the cursor."""
        for sub in session.subscriptions.values():
            end = self.store.max_offset(sub.queue)
            if sub.next_offset > end:
                log.warning(
                    "session %r: %s position %d is past the queue end %d (lost tail); resuming"
                    " at %d",
                    session.client_id,
                    sub.queue,
                    sub.next_offset,
                    end,
                    end,
                )
                sub.next_offset = end
                sub.start_offset = min(sub.start_offset, end)
            for off in [o for o in sub.pending if o >= end]:
                session.inflight.pop(sub.pending.pop(off), None)

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Graceful: stop accepting, DISCONNECT 0x8B (MQTT 5), flush, save sessions, close."""
        if self.stopping:
            await self._stopped.wait()
            return
        self.stopping = True
        if self._server is not None:
            self._server.close()
        self.listeners.close()
        if self._sys is not None:
            from gateway.sys_topics import SysPublisher

            assert isinstance(self._sys, SysPublisher)
            await self._sys.stop()
        # Publishes already read get stored and acknowledged before the DISCONNECT.
        if self.ingest is not None:
            self.ingest.flush()
        pending = [t for c in self.connections for t in c.pending_puts()]
        if pending:
            await asyncio.wait(pending, timeout=STOP_DRAIN_S)
        self.overload.stop()
        for client in list(self.connections):
            client.close(ReasonCode.SERVER_SHUTTING_DOWN, abnormal=False)
        await self.timers.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.wills.drain()
        self.wills.cancel_all()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        try:
            self.account.close(self.sessions.sessions.values(), self.shared.groups.values())
            await self.sessions.close()
            self.retained.close()
        finally:
            # close() stops the flusher, then flushes and checkpoints (a separate flush() here
            # would race the flusher thread on the checkpoint file).
            self.store.close()
            self._stopped.set()
        self.gc.uninstall()
        log.info("lmqtt gateway stopped; garbage collector: %s", self.gc.summary())

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                await self.sessions.save_if_dirty()
                self.stats.retained_count = len(self.retained)
            except Exception:
                log.exception("housekeeping failed")

    # -- publishing --------------------------------------------------------------------------

    def topic(self, name: str) -> Topic:
        """The validated Topic of a published name (TopicError if invalid), cached."""
        entry = self._topics.get(name)
        return entry[0] if entry is not None else self._topic_entry(name)[0]

    def _topic_entry(self, name: str) -> tuple[Topic, str]:
        entry = self._topics.get(name)
        if entry is None:
            topic = Topic(name)
            entry = (topic, parent_topic(topic))
            if len(self._topics) >= TOPIC_CACHE_SIZE:
                self._topics.clear()
            self._topics[name] = entry
        return entry

    def publish_route(self, name: str) -> tuple[str, tuple[str, ...]]:
        """(parent topic, light queues of every matching filter) of a topic name, sorted,
        cached until a filter is added or removed. TopicError if the name is invalid."""
        route = self._routes.get(name)
        if route is None:
            topic, parent = self._topic_entry(name)
            route = (parent, tuple(sorted(self.router.route(topic))))
            if len(self._routes) >= TOPIC_CACHE_SIZE:
                self._routes.clear()
            self._routes[name] = route
        return route

    def append_publishes(
        self, pubs: list[Publish], blocks: list[PublishProperties]
    ) -> list[PutResult]:
        """Append non-retained PUBLISHes (topics validated) with one store call; `blocks[i]`
        encodes the properties of `pubs[i]` (its publisher's cache).

        Does not wait for the fsync (sync mode: the caller awaits store.wait_durable of the
        last end offset before acknowledging). StoreError: none of them was stored.
        """
        routes = self._routes
        messages: list[EncodedMessage] = []
        add = messages.append
        props: list[dict[str, str]] = []
        for pub, publisher in zip(pubs, blocks, strict=True):
            route = routes.get(pub.topic)
            if route is None:
                route = self.publish_route(pub.topic)
            block, p = publisher.of(pub)
            add((route[0], route[1], pub.payload, block))
            props.append(p)
        results = self.store.append_encoded(messages)
        self.recent.add_many(messages, props, results)
        self.stats.messages_received += len(results)
        return results

    async def store_publish(self, pub: Publish, client_id: str) -> None:
        """Append one PUBLISH to the store (awaits the covering fsync in sync mode). The topic
        name's validation and parent topic come from the same cache `topic()` fills."""
        parent, routed = self._routes.get(pub.topic) or self.publish_route(pub.topic)
        queues = list(routed)
        if pub.retain:
            queues.append(RetainedIndex.QUEUE)
        props = message_properties(pub, client_id)
        r = await self.store.put_async(
            topic=parent, body=pub.payload, queues=queues, properties=props
        )
        self.recent.add(parent, pub.payload, props, r)
        self.stats.messages_received += 1
        if pub.retain:
            expiry = pub.properties.message_expiry_interval if pub.properties else None
            self.retained.apply(
                RetainedMessage(
                    topic=pub.topic,
                    payload=pub.payload,
                    qos=pub.qos,
                    properties=props,
                    stored_at_ms=r.store_timestamp or now_ms(),
                    expiry_interval_s=expiry,
                    offset=r.light_offsets.get(RetainedIndex.QUEUE),
                )
            )

    async def publish_internal(
        self, topic: str, payload: bytes, retain: bool = False, qos: int = 0
    ) -> None:
        """Publish from the gateway itself ($SYS): stored and routed like a client publish."""
        await self.store_publish(Publish(topic=topic, payload=payload, qos=qos, retain=retain), "")

    async def _publish_will(self, client_id: str, will: Will) -> None:
        if self.stopping:
            return
        session = self.sessions.get(client_id)
        if session is not None and session.will is will:
            session.will = None
            session.will_due_ms = None
            self.sessions.mark_dirty(session)
        log.info("publishing the will of %r to %r", client_id, will.topic)
        props = will.properties
        pub = Publish(
            topic=will.topic,
            payload=will.payload,
            qos=will.qos,
            retain=will.retain,
            properties=props,
        )
        await self.store_publish(pub, client_id)

    # -- subscriptions and sessions ----------------------------------------------------------

    def add_subscription(self, session: Session, tf: TopicFilter, qos: int) -> SubscriptionState:
        """Register a new subscription; it starts at the queue's current end."""
        queue = self.router.add(tf)
        self._routes.clear()
        start = self.store.max_offset(queue)
        sub = SubscriptionState(
            topic_filter=tf.text,
            queue=queue,
            share_group=tf.share_group,
            qos=qos,
            start_offset=start,
            next_offset=start,
            start_phys=self.store.log_max_offset,
        )
        session.add_subscription(sub)
        if tf.share_group is not None:
            self.shared.acquire(tf.share_group, tf.filter, queue, resume=False)
        else:
            # A clean session's position ends with it: not written at every flush.
            self.store.offsets.commit(session.client_id, queue, start, durable=session.persistent)
        self.stats.subscriptions += 1
        return sub

    def remove_subscription(
        self,
        session: Session,
        sub: SubscriptionState,
        loop: DeliveryLoop | None,
        *,
        keep_inflight: bool = True,
    ) -> None:
        """Drop one subscription. Its QoS 1/2 deliveries already started stay in flight
        (MQTT-3.10.4-3): each keeps a copy of its message for a resend after a reconnect,
        unless `keep_inflight` is False (the whole session is ending)."""
        self.account.ended(session, sub)
        session.remove_subscription(sub.topic_filter)
        self.router.remove(sub.topic_filter)
        self._routes.clear()
        self.stats.subscriptions -= 1
        # Acks for messages in flight on this subscription only free their packet ids now.
        for inf in session.inflight.values():
            if inf.topic_filter == sub.topic_filter or (
                sub.share_group is None and inf.group is None and inf.queue == sub.queue
            ):
                if inf.group is not None:
                    inf.group.give_back(inf.offset)  # another member delivers it
                elif keep_inflight and not inf.pubrel and inf.queue is not None:
                    copy = inf.message = self._read_inflight(inf.queue, inf.offset)
                    level = session.protocol_level
                    inf.retain = copy is not None and retain_flag(copy, (sub,), level)
                    inf.sub_ids = identifiers((sub,))
                inf.queue = None
                inf.group = None
        if sub.share_group is not None:
            tf = TopicFilter(sub.topic_filter)
            group = self.shared.get(sub.share_group, tf.filter)
            if group is not None and loop is not None:
                group.leave(loop)
            self.shared.release(sub.share_group, tf.filter)
        else:
            self.store.offsets.remove(session.client_id, sub.queue)

    def _read_inflight(self, queue: str, offset: int) -> RecordedPublish | None:
        got = self.store.get(queue, offset, 1)
        if got.status is not GetStatus.FOUND or not got.messages:
            return None
        return self.recent.record(got.messages[0])

    def end_session(self, session: Session) -> None:
        """The session is over (clean start, expiry, clean disconnect): drop its state."""
        for sub in list(session.subscriptions.values()):
            self.remove_subscription(session, sub, None, keep_inflight=False)
        if self.sessions.get(session.client_id) is session:
            self.sessions.remove(session.client_id)
        self.wills.fire_now(session.client_id)

    def connection_ended(self, session: Session, will: Will | None) -> None:
        """A connection of `session` closed; `will` is set when it closed abnormally."""
        cid = session.client_id
        session.will = None
        session.will_due_ms = None
        if self.stopping:
            # Closed by our own graceful shutdown: no will; the session resumes after restart.
            session.disconnected_at_ms = now_ms()
            return
        if not session.persistent:
            self.end_session(session)
            if will is not None:
                self.wills.schedule(cid, will, 0)
        else:
            session.disconnected_at_ms = now_ms()
            self.sessions.schedule_expiry(session)
            if will is not None:
                delay = 0
                if session.protocol_level == 5 and will.properties is not None:
                    delay = will.properties.will_delay_interval or 0
                delay = min(delay, session.expiry_interval)
                session.will = will
                session.will_due_ms = now_ms() + delay * 1000
                self.wills.schedule(cid, will, delay)
        self.sessions.touch(session)
