"""Gateway: the composition root, joining the protocol core, the topic router and the store.

    client bytes -> MqttServerProtocol -> ClientConnection -> PublishPath.store_publish
                                                 |                 |  router.route(topic)
                                                 |                 v
                                            DeliveryLoop <- store arrival notice (ArrivalHub)

`start()` builds every collaborator once and hands each part what it uses (uvicorn's shape:
its Server gives protocols a small ServerState, not itself): connections get a ClientContext
(gateway/connection/context.py), delivery loops a DeliveryContext (gateway/delivery/loop.py), the
metrics their MetricsSources. Nothing but this module, the CLI and tests holds the Gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.access.control import AccessControl
from gateway.backends import open_backend
from gateway.cluster.node import Cluster, supports_cluster
from gateway.config import GatewaySettings
from gateway.connection.client import ClientConnection
from gateway.connection.connect import ConnectHandler
from gateway.connection.context import ClientContext
from gateway.connection.dispatch import PacketDispatch
from gateway.connection.ingest import IngestBatch, Linger
from gateway.connection.node import ClusterLink, SingleNode
from gateway.connection.overload import OverloadGuard
from gateway.connection.publish import PublishHandler
from gateway.connection.subscribe import SubscribeHandler
from gateway.connection.timers import TimerWheel
from gateway.delivery.account import CountedAccount, DeliveryAccount, NoDeliveryAccount
from gateway.delivery.arrivals import ArrivalHub
from gateway.delivery.shared import SharedSubscriptions
from gateway.delivery.state import DeliveryContext
from gateway.lifecycle.sessions import SessionLifecycle
from gateway.lifecycle.subscriptions import SubscriptionLifecycle
from gateway.messages.delayed import DelayedPublishes
from gateway.messages.inbound import InboundPublisher
from gateway.messages.publishing import PublishPath
from gateway.messages.recent import PreparedCache, RecentMessages
from gateway.messages.retained import RetainedIndex
from gateway.messages.sys_topics import SysPublisher
from gateway.net.listeners import ExtraListeners
from gateway.net.server import MqttServerProtocol, ServerState
from gateway.ops.admin_api import AdminApi, ApiAuth
from gateway.ops.ban_routes import ban_routes
from gateway.ops.gc_monitor import GcMonitor
from gateway.ops.live_view import LiveView
from gateway.ops.metrics import MetricsSources
from gateway.ops.stall_watch import StallWatch
from gateway.protocol import ReasonCode
from gateway.session.registry import SessionRegistry
from gateway.session.replay import ReplayPacer
from gateway.session.wills import Wills
from gateway.stats import GatewayStats
from gateway.storage.cursor import QueueCursor
from gateway.storage.embedded import open_account
from gateway.storage.inbound import InboundFeed, supports_inbound
from gateway.storage.port import AccountWriter, Storage, StorageUnavailable
from topicmap import Router

log = logging.getLogger("lmqtt.gateway")

HOUSEKEEPING_INTERVAL_S = 1.0
STOP_DRAIN_S = 2.0


class Gateway:
    """An MQTT 3.1/3.1.1/5.0 server over the store; `start()`, then `stop()`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.stats = GatewayStats()
        self.state = ServerState()  # graceful stop, open connections
        self.recent = RecentMessages()
        self.gc = GcMonitor()  # GC pause figures, gc.freeze after connect bursts
        # What holds the event loop when it is late (a diagnostic, off unless configured).
        self.stall_watch = (
            StallWatch(settings.stall_watch_ms, settings.stall_watch_file)
            if settings.stall_watch_ms > 0
            else None
        )
        # Checks the security settings and files now: a bad one stops us before start().
        self.access = AccessControl(settings)
        # TLS, WebSocket, admin HTTP (gateway/net/listeners.py); a bad certificate stops us here.
        self.listeners = ExtraListeners(settings)
        # The admin API's authentication (an unreadable token file stops us here); its routes
        # are added by start().
        access = self.access
        self.admin_api = AdminApi(
            ApiAuth.from_files(
                settings.admin_token_file, lambda: access.passwords, settings.admin_users
            )
        )
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sys: SysPublisher | None = None
        self.cluster: Cluster | None = None  # cluster mode (settings.cluster)
        self.inbound: InboundFeed | None = None  # RocketMQ: the inbound topic's consumer
        self.fenced = False  # cluster mode: this node's lease ran out (the gateway stops)
        # Set by start():
        self.store: Storage
        self.publisher: PublishPath
        self.retained: RetainedIndex
        self.delayed: DelayedPublishes
        self.sessions: SessionRegistry
        self.session_lifecycle: SessionLifecycle
        self.subscriptions: SubscriptionLifecycle
        self.shared: SharedSubscriptions
        self.wills: Wills
        # None in sync flush mode (see gateway/connection/ingest.py)
        self.ingest: IngestBatch | None
        self.overload: OverloadGuard
        self.timers: TimerWheel  # connect timeouts and keep-alive (gateway/connection/timers.py)
        self.account: DeliveryAccount
        self.live: LiveView

    @property
    def connections(self) -> set[ClientConnection]:
        return self.state.connections

    @property
    def stopping(self) -> bool:
        return self.state.stopping

    @property
    def router(self) -> Router:
        return self.publisher.router

    async def publish_internal(
        self, topic: str, payload: bytes, retain: bool = False, qos: int = 0
    ) -> None:
        """Publish as the gateway itself (gateway/messages/publishing.py)."""
        await self.publisher.publish_internal(topic, payload, retain, qos)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        store = self.store = await open_backend(s)
        arrivals = ArrivalHub(loop)
        store.add_listener(arrivals)
        cursor = QueueCursor(store, self.recent.run)
        publisher = self.publisher = PublishPath(store, self.recent, self.stats)
        cluster: Cluster | None = None
        if s.cluster:
            if not supports_cluster(store):
                raise StorageUnavailable("cluster = true needs store = rocketmq")
            cluster = self.cluster = Cluster(
                store,  # type: ignore[arg-type]
                publisher,
                lease_s=s.cluster_lease,
                heartbeat_s=s.cluster_heartbeat,
            )
            # Before anything is restored or routed: the other nodes' filters and sessions.
            await cluster.join()
            cluster.on_fenced(self._on_fenced)
        self.ingest = (
            IngestBatch(
                loop,
                publisher.append_publishes,
                Linger(s.ingest_linger_ms / 1000) if s.ingest_linger_ms else None,
            )
            if s.flush == "async"
            else None
        )
        stats = self.stats
        self.overload = OverloadGuard(loop, lambda: stats.messages_received)
        self.timers = TimerWheel(loop)
        self.gc.start(loop, self.state.connections.__len__)
        if self.stall_watch is not None:
            self.stall_watch.start(loop)
        account = self.account = (
            # The ends of the queues read here only (read_max_offset): on RocketMQ, sampling
            # another node's sessions opens no mirror of their queues on this one.
            DeliveryAccount(self._account_writer(store), store.read_max_offset, arrivals)
            if s.delivery_account
            else NoDeliveryAccount()
        )
        shared = self.shared = SharedSubscriptions(store, cursor, arrivals, account, self.overload)
        if cluster is not None:
            cluster.share_groups(shared, arrivals)
        registry = self.sessions = SessionRegistry(store)
        subscriptions = self.subscriptions = SubscriptionLifecycle(
            publisher, store, shared, account, self.stats, cursor, self.recent
        )
        wills = self.wills = Wills(registry, publisher.store_publish, store)
        lifecycle = self.session_lifecycle = SessionLifecycle(registry, subscriptions, wills, store)
        lifecycle.restore(cluster.foreign if cluster is not None else None)
        restored = len(registry)
        # The state log's records besides the sessions': the bans' and the retained index's.
        records = registry.other_records()
        bans = self.access.bans
        bans.open(store, records, lambda: self.state.connections, single_writer=cluster is None)
        if cluster is not None:
            # No await since restore(): no session record another node writes falls between.
            cluster.share_sessions(registry, self.stats)
            cluster.store.add_state_observer(bans.observe)  # bans made on other nodes
        await subscriptions.resume_shared()  # after their queues are open (RocketMQ)
        # The state log was read once, by the session load: the retained snapshot is in it.
        retained = self.retained = RetainedIndex.open(store, records)
        publisher.retained = subscriptions.retained = retained
        wills.restore()
        link: ClusterLink = SingleNode()
        if cluster is not None:
            cluster.set_will_canceller(wills.cancel)
            link = cluster
        self.stats.retained_count = len(retained)
        delivery = DeliveryContext(
            store=store,
            cursor=cursor,
            arrivals=arrivals,
            recent=self.recent,
            prepared=PreparedCache(),
            stats=self.stats,
            sessions=registry,
            account=account,
            # the loop share replays may use (gateway/session/replay.py)
            replay_pacer=ReplayPacer(),
            overload=self.overload,
            max_inflight=s.max_inflight,
            outbound_topic_aliases=s.outbound_topic_aliases,
            ingest=self.ingest,
        )
        # After the sessions' filters are routed: a due delayed message reaches them.
        delayed = self.delayed = DelayedPublishes(store, publisher, self.stats)
        packets = PacketDispatch(
            ConnectHandler(
                s, self.state, self.access, self.stats, lifecycle, subscriptions, delivery, link
            ),
            PublishHandler(
                loop,
                publisher,
                self.access,
                registry,
                self.stats,
                sync=s.flush == "sync",
                delayed=delayed,
                max_delay=s.max_delay,
            ),
            SubscribeHandler(subscriptions, registry, self.access, delivery, link, s.max_qos),
        )
        context = ClientContext(
            settings=s,
            server=self.state,
            stats=self.stats,
            access=self.access,
            timers=self.timers,
            ingest=self.ingest,
            overload=self.overload,
            publisher=publisher,
            packets=packets,
        )
        self._server = await loop.create_server(
            lambda: MqttServerProtocol(context, self.state),
            s.host,
            s.default_port,
            reuse_address=True,
            backlog=s.listen_backlog,
        )
        # The live view of this node's clients (/api/clients, /api/slow-subscriptions).
        live = self.live = LiveView(
            lambda: self.state.connections, registry, store, cursor,
            s.slow_subscription_threshold,
        )  # fmt: skip
        self.admin_api.add(live.routes())
        if s.store == "rocketmq" and s.rocketmq_inbound and supports_inbound(store):
            # Once retained messages and every filter are in place: the first inbound message
            # may be handled as soon as this returns.
            self.inbound = await store.open_inbound(  # type: ignore[attr-defined]
                InboundPublisher(
                    publisher,
                    self.stats,
                    max_topic_length=s.max_topic_length,
                    retain_available=s.retain_available,
                ),
                topic=s.rocketmq_inbound_topic or f"{s.rocketmq_topic}-in",
                dead_letter_topic=s.rocketmq_dead_letter_topic or f"{s.rocketmq_topic}-dlq",
                group=f"{s.rocketmq_topic}-gateway",
            )
        sources = MetricsSources(
            stats=self.stats,
            access=self.access,
            server=self.state,
            gc=self.gc,
            store=store,
            sessions=registry,
            retained=retained,
            loop_lag=self.overload,
            slow_subscriptions=live.count_slow,
            inbound=self.inbound,
            held_pulls=getattr(store, "held_pulls", None),  # RocketMQ only
        )
        self.admin_api.add(ban_routes(bans))
        await self.listeners.start(context, self.state, sources, self.admin_api)
        self.overload.start()
        self._tasks.append(loop.create_task(self._housekeeping()))
        self._tasks.append(loop.create_task(bans.run()))
        self.timers.start()
        self._tasks.append(loop.create_task(delayed.run()))
        self._tasks.append(loop.create_task(account.run(registry.sessions, shared.groups.values)))
        self._tasks.append(
            loop.create_task(retained.snapshot_periodically(s.retained_snapshot_interval))
        )
        if s.sys_interval > 0:
            self._sys = SysPublisher(
                self.stats,
                publisher.publish_internal,
                data_dir=s.data_dir,
                retained=retained,
                interval=s.sys_interval,
            )
            self._sys.start()
        log.info(
            "lmqtt gateway listening on %s:%d (data %s, flush %s, %d sessions restored%s)",
            s.host,
            self.port,
            s.data_dir,
            s.flush,
            restored,
            f", {len(registry) - restored} adopted from live nodes" if cluster is not None else "",
        )

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Graceful: stop accepting, DISCONNECT 0x8B (MQTT 5), flush, save sessions, close."""
        if self.state.stopping:
            await self._stopped.wait()
            return
        self.state.stopping = True
        self.session_lifecycle.stop()
        if self.cluster is not None:
            await self.cluster.leave()
        self.wills.stop_publishing()
        if self.inbound is not None:
            await self.inbound.stop()  # what it stored is committed before the store closes
        if self._server is not None:
            self._server.close()
        self.listeners.close()
        self.live.stop()
        if self._sys is not None:
            await self._sys.stop()
        # Publishes already read get stored and acknowledged before the DISCONNECT.
        if self.ingest is not None:
            self.ingest.flush()
        pending = [t for c in self.state.connections for t in c.pending_puts()]
        if pending:
            await asyncio.wait(pending, timeout=STOP_DRAIN_S)
        self.overload.stop()
        for client in list(self.state.connections):
            client.close(ReasonCode.SERVER_SHUTTING_DOWN, abnormal=False)
        await self.timers.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.wills.stop()
        if self.cluster is not None and self.cluster.sessions is not None:
            await self.cluster.sessions.stop()  # the records written at disconnects
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        try:
            self.account.close(self.sessions.sessions.values(), self.shared.groups.values())
            await self.sessions.close()
            self.retained.close()
            await self.delayed.stop()
            await self.store.drain()  # sends still in flight (RocketMQ)
        finally:
            if self.cluster is not None:
                self.cluster.close()
            # close() stops the flusher, then flushes and checkpoints (a separate flush() here
            # would race the flusher thread on the checkpoint file).
            self.store.close()
            self._stopped.set()
        self.gc.uninstall()
        if self.stall_watch is not None:
            self.stall_watch.stop()
        log.info("lmqtt gateway stopped; garbage collector: %s", self.gc.summary())

    def _account_writer(self, store: Storage) -> AccountWriter | CountedAccount:
        """The delivery account's file; its offsets counted in messages where the store
        numbers a queue's messages otherwise (RocketMQ spread: CountedAccount)."""
        writer = open_account(self.settings)
        count = getattr(store, "account_offset", None)
        return writer if count is None else CountedAccount(writer, count)

    def _on_fenced(self) -> None:
        """Cluster mode: our lease ran out, so the other nodes may already act for us (our
        clients' wills, their sessions). Stop: every connection closed, exit non-zero."""
        self.fenced = True
        for client in list(self.state.connections):
            client.close(ReasonCode.SERVER_SHUTTING_DOWN)
        asyncio.get_running_loop().create_task(self.stop())

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                await self.sessions.save_if_dirty()
                self.stats.retained_count = len(self.retained)
            except Exception:
                log.exception("housekeeping failed")
