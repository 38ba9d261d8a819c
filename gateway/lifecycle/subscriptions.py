"""The subscription lifecycle: everything that happens to a subscription between the SUBSCRIBE
that creates it and the UNSUBSCRIBE (or the end of its session) that removes it.

    SUBSCRIBE (new)      -> filter registered with the router (its light queue), position =
                            the queue's end, the session's delivery loop watches the queue (or
                            joins the shared group), replay pinned, retained messages queued
    SUBSCRIBE (again)    -> options replaced; retained messages per Retain Handling
    UNSUBSCRIBE          -> filter released, position dropped; QoS 1/2 deliveries already
                            started stay in flight with a copy of their message
                            (MQTT-3.10.4-3); a shared one goes back to the group
    the session ends     -> every subscription removed, nothing kept in flight
    restart              -> every saved subscription registered again (`restore`)

SubscribeHandler (gateway/connection/subscribe.py) parses the packet, checks the ACL and limits and
answers SUBACK/UNSUBACK; what the subscription *is* is decided here, and the delivery account
(gateway/delivery/account.py) is told when one ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.delivery.account import DeliveryAccount
from gateway.delivery.loop import DeliveryLoop
from gateway.delivery.rules import identifiers, retain_flag
from gateway.delivery.shared import SharedSubscriptions, consumer_of
from gateway.messages.publishing import PublishPath
from gateway.messages.recent import RecentMessages
from gateway.messages.retained import RetainedIndex
from gateway.protocol import Subscription
from gateway.session.model import Session, SubscriptionState
from gateway.session.registry import SubscriptionEntry
from gateway.session.replay import REPLAYING, CutOff, iso_ms, start_replay
from gateway.stats import GatewayStats
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage
from topicmap import TopicFilter

log = logging.getLogger("lmqtt.gateway")


class SubscriptionLifecycle:
    """Creates, changes and removes subscriptions (see the module docstring)."""

    def __init__(
        self,
        publisher: PublishPath,
        store: Storage,
        shared: SharedSubscriptions,
        account: DeliveryAccount,
        stats: GatewayStats,
        cursor: QueueCursor,
        recent: RecentMessages,
    ) -> None:
        self._publisher = publisher
        self._store = store
        self.shared = shared
        self._account = account
        self._stats = stats
        self._cursor = cursor
        self._recent = recent
        # Set by the composition root once the index is open (after the sessions' filters
        # were restored: see gateway/app.py).
        self.retained: RetainedIndex | None = None
        # Shared groups saved by the previous run: resumed once their queues are open.
        self._to_resume: list[tuple[str, str, str]] = []

    @property
    def store_waits(self) -> bool:
        """Whether opening a queue or saving state may wait (the storage port's `waits`)."""
        return self._store.waits

    # -- restart -----------------------------------------------------------------------------

    def restore(self, sub: SubscriptionEntry | SubscriptionState) -> None:
        """Register a subscription saved by the previous run (its position is its own)."""
        self._publisher.add_filter(sub.topic_filter)
        if sub.share_group is not None:
            self._to_resume.append((sub.share_group, sub.topic_filter, sub.queue))
        self._stats.subscriptions += 1

    async def resume_shared(self) -> None:
        """Shared groups resume at their saved offsets, bounded by their queues' ends: opened
        first (RocketMQ: a queue's end is known once asked; the embedded store knows it)."""
        todo, self._to_resume = self._to_resume, []
        store = self._store
        await asyncio.gather(
            *(store.open_queue(q) for q in {q for _, _, q in todo}),
            # RocketMQ: the broker keeps the groups' positions
            # (gateway/storage/rocketmq/offsets.py).
            store.load_offsets((consumer_of(group), q) for group, _, q in todo),
        )
        for group, text, queue in todo:
            self.shared.acquire(group, TopicFilter(text).filter, queue, resume=True)

    async def open_queue(self, session: Session, tf: TopicFilter, since: int | None = None) -> None:
        """Before a new subscription starts at its queue's end: open the queue (RocketMQ
        learns the end from the broker; the embedded store knows it already); before a
        replay from `since` is pinned, the queues of its history likewise."""
        if tf.text not in session.subscriptions:
            await self._store.open_queue(self._publisher.router.queue_name(tf))
        if since is not None:
            store = self._store
            await store.open_history(store.history_queues(tf), since)

    def attach(self, session: Session, delivery: DeliveryLoop) -> None:
        """`session` connected with its loop: the loop joins its shared groups (its own queues
        it watches when it starts)."""
        for sub in session.subscriptions.values():
            if sub.share_group is not None:
                group = self.shared.get(sub.share_group, TopicFilter(sub.topic_filter).filter)
                if group is not None:
                    group.join(delivery)

    # -- SUBSCRIBE ---------------------------------------------------------------------------

    def subscribe(
        self,
        session: Session,
        delivery: DeliveryLoop | None,
        tf: TopicFilter,
        req: Subscription,
        qos: int,
        sub_id: int | None,
        since: int | None,
        start: str | None,
    ) -> tuple[SubscriptionState, CutOff | None]:
        """Subscribe `session` to `tf` (checked and allowed) with the request's options and
        the granted `qos`; `since` (with the request's `start` text): replay from then.
        Returns the subscription and, for a replay cut off by retention, where it starts.
        Retained messages are sent by `send_retained` once the SUBACK is written."""
        existing = session.subscriptions.get(tf.text)
        if existing is not None:
            sub = existing
            sub.qos = qos
        else:
            sub = self._add(session, tf, qos)
        sub.no_local = req.no_local
        sub.retain_as_published = req.retain_as_published
        sub.retain_handling = req.retain_handling
        sub.subscription_identifier = sub_id
        if existing is None and delivery is not None:  # None: the caller watches (loop.py)
            if sub.share_group is None:
                delivery.watch(sub.queue)
            else:
                group = self.shared.get(sub.share_group, tf.filter)
                if group is not None:
                    group.join(delivery)
        if since is None or start is None:
            return sub, None
        # In this event-loop step, right after the filter was registered: see the seam in
        # gateway/session/replay.py. Re-subscribing restarts the live side at the seam too.
        if existing is not None:
            sub.next_offset = self._store.max_offset(sub.queue)
            sub.read_phys = None
        sub.replay, cutoff = start_replay(self._store, tf, since, start)
        sub.start_phys = REPLAYING
        log.info(
            "%r: replay of %r from %s (%s): %d parent topic(s)",
            session.client_id, tf.filter, start, iso_ms(since), len(sub.replay.todo),
        )  # fmt: skip
        return sub, cutoff

    @staticmethod
    def wants_retained(tf: TopicFilter, req: Subscription, is_new: bool) -> bool:
        """Retained messages on subscribe (MQTT-3.3.1-9..11): not for a shared subscription
        nor a replay (they are part of the history replayed); Retain Handling 0 always,
        1 for a new subscription only, 2 never."""
        return not tf.is_shared and (
            req.retain_handling == 0 or (req.retain_handling == 1 and is_new)
        )

    def send_retained(
        self,
        delivery: Callable[[], DeliveryLoop],
        subs: list[tuple[SubscriptionState, TopicFilter]],
    ) -> None:
        """Queue the retained messages matching each new subscription (after the SUBACK) with
        the session's delivery loop, asked for only when there are some (it starts then)."""
        retained = self.retained
        if retained is None:
            return
        for sub, tf in subs:
            matches = retained.match(tf.filter)
            if matches:
                delivery().queue_retained(matches, sub)

    def _add(self, session: Session, tf: TopicFilter, qos: int) -> SubscriptionState:
        """Register a new subscription; it starts at the queue's current end."""
        store = self._store
        queue = self._publisher.add_filter(tf)
        start = store.max_offset(queue)
        sub = SubscriptionState(
            topic_filter=tf.text,
            queue=queue,
            share_group=tf.share_group,
            qos=qos,
            start_offset=start,
            next_offset=start,
            start_phys=store.log_max_offset,
        )
        session.add_subscription(sub)
        if tf.share_group is not None:
            self.shared.acquire(tf.share_group, tf.filter, queue, resume=False)
        elif session.persistent:
            # A clean session's position ends with it and nothing reads it back: it has none
            # until its delivery loop commits one (in memory: gateway/delivery/acks.py).
            store.offsets.commit(session.client_id, queue, start)
        self._stats.subscriptions += 1
        return sub

    # -- UNSUBSCRIBE and the end of a session ------------------------------------------------

    def unsubscribe(
        self, session: Session, sub: SubscriptionState, delivery: DeliveryLoop | None
    ) -> None:
        """UNSUBSCRIBE of one subscription of a connected session."""
        if sub.share_group is None and delivery is not None:
            delivery.unwatch(sub.queue)
        self.remove(session, sub, delivery)

    def end(self, session: Session) -> None:
        """The session is over: every subscription goes, nothing stays in flight."""
        for sub in session.subscription_list():
            self.remove(session, sub, None, keep_inflight=False)

    def remove(
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
        self._account.ended(session, sub)
        session.remove_subscription(sub.topic_filter)
        last = self._publisher.remove_filter(sub.topic_filter)
        self._stats.subscriptions -= 1
        # Acks for messages in flight on this subscription only free their packet ids now.
        for inf in session.inflight.values():
            if inf.topic_filter == sub.topic_filter or (
                sub.share_group is None and inf.group is None and inf.queue == sub.queue
            ):
                if inf.group is not None:
                    inf.group.give_back(inf.offset)  # another member delivers it
                elif keep_inflight and not inf.pubrel and inf.queue is not None:
                    msg = self._cursor.one(inf.queue, inf.offset)
                    copy = inf.message = self._recent.record(msg) if msg is not None else None
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
            self._store.offsets.remove(session.client_id, sub.queue)
        if last:  # no subscription reads the queue now (RocketMQ: its mirror and pull go)
            self._store.close_queue(sub.queue)
