"""SubscribeHandler: a client's SUBSCRIBE and UNSUBSCRIBE.

The handler parses the packet (replay requests included), asks access control, and hands the
session's side to SubscriptionLifecycle (gateway/lifecycle/subscriptions.py); the SUBACK leaves
once the subscriptions are durable and routed on every node, then the retained messages follow.
Where nothing of that waits but the fsync of the session's record (a single node, a store that
`waits` not: the embedded store; no replay), `subscribe_now` does it in the transport's read
callback, without a reader task: in sync flush mode the connection then holds its input and the
SUBACK leaves from the record's fsync future (`_answer_durable`); otherwise the reader task runs
`on_subscribe`. Both take the same steps: `_admit` (parse, access), `_take` (subscribe),
`_answer` (SUBACK, retained).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Final, Protocol

from gateway.access.control import AccessControl, Client
from gateway.connection.connect import closed_now
from gateway.connection.node import ClusterLink, SingleNode
from gateway.delivery.loop import DeliveryContext, DeliveryLoop
from gateway.lifecycle.subscriptions import SubscriptionLifecycle
from gateway.protocol import (
    Connection,
    Properties,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
)
from gateway.session.model import Session, SubscriptionState
from gateway.session.registry import SessionRegistry
from topicmap import (
    REPLAY_PREFIX,
    REPLAY_PROPERTY,
    TopicError,
    TopicFilter,
    parse_replay_from,
    split_replay,
)

__all__ = ["SubscribeHandler", "Subscribing"]

log = logging.getLogger("lmqtt.gateway")


class Subscribing(Client, Protocol):
    """The connection as SubscribeHandler sees it (gateway/connection/client.py
    ClientConnection); its delivery loop starts at its first message (it watches the queues
    for it until then: `arrived`, the ArrivalHub's Watcher)."""

    conn: Connection
    closed: bool
    writable: bool
    delivery: DeliveryLoop | None

    @property
    def session(self) -> Session | None: ...

    def write(self, data: bytes) -> None: ...

    def abort(self, reason: int) -> None: ...

    def arrived(self, queue: str, end: int) -> None: ...

    def fail(self, reason: int, message: str) -> None:
        """A rule the gateway enforces was broken: MQTT 5 DISCONNECT `reason`, close."""

    def hold(self, pending: asyncio.Future[None]) -> None:
        """Handle none of the client's input until `release()` (a SUBACK waits for
        `pending`); closing the connection cancels `pending`."""

    def release(self) -> None:
        """`hold` is over: handle the input that arrived meanwhile."""


# What _admit hands on: the filter, the replay's start (ms, and as requested), the QoS.
_Request = tuple[TopicFilter, int | None, str | None, int]
_FAILED: Final[_Request] = (TopicFilter("failed"), None, None, 0)  # the client was failed


class _Reply:
    """What a SUBSCRIBE's handling gathers for its SUBACK."""

    __slots__ = ("codes", "level", "look", "notes", "prop_from", "retained_for", "sub_id")

    def __init__(self, level: int | None, ev: Subscribe) -> None:
        self.level = level
        self.codes: list[int] = []
        self.look = False  # the delivery loop looks at the session's queues after the SUBACK
        self.retained_for: list[tuple[SubscriptionState, TopicFilter]] = []
        self.notes: list[str] = []  # MQTT 5 SUBACK reason string (replay cut off by retention)
        self.sub_id: int | None = None
        self.prop_from: str | None = None  # the replay-from user property
        props = ev.properties
        if props is not None:
            if props.subscription_identifiers:
                self.sub_id = props.subscription_identifiers[0]
            if props.user_properties:
                self.prop_from = next(
                    (v for k, v in props.user_properties if k == REPLAY_PROPERTY), None
                )


class SubscribeHandler:
    """Subscribes and unsubscribes a connected client."""

    __slots__ = (
        "_access",
        "_at_once",
        "_cluster",
        "_delivery",
        "_max_qos",
        "_registry",
        "_subscriptions",
    )

    def __init__(
        self,
        subscriptions: SubscriptionLifecycle,
        registry: SessionRegistry,
        access: AccessControl,
        delivery: DeliveryContext,
        cluster: ClusterLink,
        max_qos: int,
    ) -> None:
        """`delivery`: what a connection's delivery loop uses; `max_qos`: the QoS granted at
        most (settings.max_qos)."""
        self._subscriptions = subscriptions
        self._registry = registry
        self._access = access
        self._delivery = delivery
        self._cluster = cluster
        self._max_qos = max_qos
        # subscribe_now can take SUBSCRIBEs: nothing on their way waits.
        self._at_once = isinstance(cluster, SingleNode) and not subscriptions.store_waits

    def delivery_loop(self, client: Subscribing) -> DeliveryLoop:
        """The client's delivery loop, started now if it has none: it stood by until now
        (gateway/delivery/loop.py, "Standby"), the connection watching its queues for it."""
        delivery = client.delivery
        if delivery is None:
            assert client.session is not None
            delivery = client.delivery = DeliveryLoop(self._delivery, client.session, client)
            delivery.start(standby=client)
        return delivery

    def stand_down(self, client: Subscribing, session: Session) -> None:
        """The connection closes without having started its loop: it lets go of the queues
        it watched for it (those of the session's own subscriptions)."""
        if session.by_queue:
            arrivals = self._delivery.arrivals
            for queue in session.by_queue:
                arrivals.unwatch(queue, client)
            # Nothing arrived since these subscriptions started at their queues' ends (an
            # arrival would have started the loop): nothing owed to look at.
            self._delivery.account.offline(session, owes=False)

    async def on_subscribe(self, client: Subscribing, ev: Subscribe) -> None:
        session = client.session
        assert session is not None
        # None until this session's first message or a subscription that needs it at once
        # (a shared one, a replay, a re-subscription, retained messages to send).
        delivery = client.delivery
        subscriptions = self._subscriptions
        cluster = self._cluster
        reply = _Reply(client.conn.protocol_level, ev)
        for req in ev.subscriptions:
            request = self._admit(client, session, req, reply)
            if request is None:
                continue
            if request is _FAILED:
                return
            tf, since, start, qos = request
            await subscriptions.open_queue(session, tf, since)
            delivery = self._take(client, session, delivery, req, reply, tf, since, start, qos)
        single = isinstance(cluster, SingleNode)
        if not single:
            await cluster.subscribed()  # every node routes to the new filters
        if session.persistent:
            await self._registry.save(session)  # the subscription must survive a crash
        else:
            self._registry.touch(session)
        if client.closed:
            return
        if reply.retained_for and not single:
            await cluster.retained_caught_up()  # set through another node a moment ago
            if closed_now(client):
                return
        self._answer(client, ev, reply)

    def subscribe_now(self, client: Subscribing, ev: Subscribe) -> bool:
        """Handle `ev` at once, in the transport's callback (no reader task), when nothing
        it does can wait but its record's fsync: a single node, a store that `waits` not
        (gateway/storage/port.py), no replay asked. False: nothing was done (on_subscribe is
        for it). In sync flush mode the SUBACK leaves once the record is durable, and the
        client's input is held until then (`client.hold`)."""
        if not self._at_once:
            return False
        reply = _Reply(client.conn.protocol_level, ev)
        if reply.prop_from is not None:
            return False
        for req in ev.subscriptions:
            if req.topic_filter.startswith(REPLAY_PREFIX):
                return False
        session = client.session
        assert session is not None
        delivery = client.delivery
        for req in ev.subscriptions:
            request = self._admit(client, session, req, reply)
            if request is None:
                continue
            if request is _FAILED:
                return True
            tf, since, start, qos = request
            delivery = self._take(client, session, delivery, req, reply, tf, since, start, qos)
        if session.persistent:
            # The subscription must survive a crash: in sync flush mode its SUBACK waits for
            # the fsync of its record, and the client's next packets wait with it.
            pending = self._registry.save_written(session)
            if pending is not None:
                client.hold(pending)
                pending.add_done_callback(partial(self._answer_durable, client, ev, reply))
                return True
        else:
            self._registry.touch(session)
        if not client.closed:
            self._answer(client, ev, reply)
        return True

    def _answer_durable(
        self, client: Subscribing, ev: Subscribe, reply: _Reply, saved: asyncio.Future[None]
    ) -> None:
        """subscribe_now's record is durable (or its fsync failed, or the connection closed):
        the SUBACK, then what the client sent after the SUBSCRIBE."""
        if saved.cancelled():  # the connection closed (closing cancels what it holds)
            return
        error = saved.exception()
        if error is not None:
            log.error("%r: SUBSCRIBE not saved: %s", client.client_id, error)
            client.abort(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
            return
        if not client.closed:
            self._answer(client, ev, reply)
        client.release()

    def _admit(
        self, client: Subscribing, session: Session, req: Subscription, reply: _Reply
    ) -> _Request | None:
        """One requested filter parsed (a replay request included) and checked against the
        access rules: what to subscribe, or None (its refusal is in `reply`), or _FAILED
        (the client broke a rule and is being closed)."""
        level = reply.level
        try:
            # `$replay/{from}/{filter}` or the replay-from property: a replay of `filter`.
            replay = split_replay(req.topic_filter)
            tf = replay.filter if replay is not None else TopicFilter(req.topic_filter)
            start = replay.start if replay is not None else reply.prop_from
            since = parse_replay_from(start) if start is not None else None
            if since is not None and tf.is_shared:
                raise TopicError(
                    "a shared subscription cannot replay",
                    reason_code=ReasonCode.TOPIC_FILTER_INVALID,
                )
        except TopicError as e:
            log.info("%r: SUBSCRIBE %r refused: %s", client.client_id, req.topic_filter, e)
            reply.codes.append(
                ReasonCode.TOPIC_FILTER_INVALID if level == 5 else ReasonCode.UNSPECIFIED_ERROR
            )
            if level == 5:
                reply.notes.append(str(e))
            return None
        if req.no_local and tf.is_shared:
            client.fail(ReasonCode.PROTOCOL_ERROR, "no-local on a shared subscription")
            return _FAILED
        new = tf.text not in session.subscriptions
        n = len(session.subscriptions)
        refusal = self._access.subscribe_refusal(client, tf.filter, tf.text, new, n)
        if refusal:
            reply.codes.append(refusal if level == 5 else ReasonCode.UNSPECIFIED_ERROR)
            return None
        return tf, since, start, min(req.qos, self._max_qos)

    def _take(
        self,
        client: Subscribing,
        session: Session,
        delivery: DeliveryLoop | None,
        req: Subscription,
        reply: _Reply,
        tf: TopicFilter,
        since: int | None,
        start: str | None,
        qos: int,
    ) -> DeliveryLoop | None:
        """Subscribe to one admitted filter (its queue open) and note the SUBACK's code; the
        client's delivery loop, if it has one now."""
        subscriptions = self._subscriptions
        new = tf.text not in session.subscriptions
        # Whether the delivery loop must look at the session's queues after the SUBACK: not
        # when every subscription is new, own (not shared) and live (no replay): each starts
        # at its queue's end, and what arrives from then on wakes the loop by itself. Until
        # then a loop is not needed: the connection stands by for it.
        at_once = not new or since is not None or tf.is_shared
        reply.look = reply.look or at_once
        if delivery is None and at_once and not client.closed:
            delivery = self.delivery_loop(client)
        sub, cutoff = subscriptions.subscribe(
            session, delivery, tf, req, qos, reply.sub_id, since, start
        )
        if delivery is None and not client.closed and sub.share_group is None:
            # The connection watches the new queue for its loop-to-be.
            # (The account watches nothing of this session: a session it sampled offline
            # has subscriptions, so its loop started at CONNECT, and that told it.)
            self._delivery.arrivals.watch(sub.queue, client)
        reply.codes.append(qos)
        if cutoff is not None:
            log.warning("%r: %s", session.client_id, cutoff.text(tf.filter))
            reply.notes.append(cutoff.text(tf.filter))
        if since is None and subscriptions.wants_retained(tf, req, new):
            reply.retained_for.append((sub, tf))
        return delivery

    def _answer(self, client: Subscribing, ev: Subscribe, reply: _Reply) -> None:
        """The SUBACK (the subscriptions are durable and routed), then the retained messages."""
        notes = reply.notes
        props = Properties(reason_string="; ".join(notes)) if notes and reply.level == 5 else None
        client.write(client.conn.send(SubAck(ev.packet_id, reply.codes, props)))
        if reply.retained_for:  # they start the loop, and wake it
            self._subscriptions.send_retained(
                lambda: self.delivery_loop(client), reply.retained_for
            )
        if reply.look:
            self.delivery_loop(client).wake()

    def on_unsubscribe(self, client: Subscribing, ev: Unsubscribe) -> None:
        session = client.session
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
            if client.delivery is None and sub.share_group is None:
                self._delivery.arrivals.unwatch(sub.queue, client)  # watched for the loop-to-be
            self._subscriptions.unsubscribe(session, sub, client.delivery)
            codes.append(0)
        self._registry.touch(session)
        client.write(client.conn.send(UnsubAck(ev.packet_id, codes)))
