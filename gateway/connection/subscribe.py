"""SubscribeHandler: a client's SUBSCRIBE and UNSUBSCRIBE.

The handler parses the packet (replay requests included), asks access control, and hands the
session's side to SubscriptionLifecycle (gateway/lifecycle/subscriptions.py); the SUBACK leaves
once the subscriptions are durable and routed on every node, then the retained messages follow.
"""

from __future__ import annotations

import logging
from typing import Protocol

from gateway.access.control import AccessControl, Client
from gateway.connection.node import ClusterLink, SingleNode
from gateway.delivery.loop import DeliveryContext, DeliveryLoop
from gateway.lifecycle.subscriptions import SubscriptionLifecycle
from gateway.protocol import (
    Connection,
    Properties,
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)
from gateway.session.model import Session, SubscriptionState
from gateway.session.registry import SessionRegistry
from topicmap import REPLAY_PROPERTY, TopicError, TopicFilter, parse_replay_from, split_replay

__all__ = ["SubscribeHandler", "Subscribing"]

log = logging.getLogger("lmqtt.gateway")


class Subscribing(Client, Protocol):
    """The connection as SubscribeHandler sees it (gateway/connection/client.py
    ClientConnection); its delivery loop starts at its first SUBSCRIBE."""

    conn: Connection
    closed: bool
    writable: bool
    delivery: DeliveryLoop | None

    @property
    def session(self) -> Session | None: ...

    def write(self, data: bytes) -> None: ...

    def abort(self, reason: int) -> None: ...

    def fail(self, reason: int, message: str) -> None:
        """A rule the gateway enforces was broken: MQTT 5 DISCONNECT `reason`, close."""


class SubscribeHandler:
    """Subscribes and unsubscribes a connected client."""

    __slots__ = ("_access", "_cluster", "_delivery", "_max_qos", "_registry", "_subscriptions")

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

    def _delivery_loop(self, client: Subscribing) -> DeliveryLoop:
        delivery = client.delivery
        if delivery is None:
            assert client.session is not None
            delivery = client.delivery = DeliveryLoop(self._delivery, client.session, client)
            delivery.start()
        return delivery

    async def on_subscribe(self, client: Subscribing, ev: Subscribe) -> None:
        session = client.session
        assert session is not None
        delivery = self._delivery_loop(client)
        subscriptions = self._subscriptions
        registry = self._registry
        cluster = self._cluster
        level = client.conn.protocol_level
        sub_id: int | None = None
        if ev.properties is not None and ev.properties.subscription_identifiers:
            sub_id = ev.properties.subscription_identifiers[0]
        codes: list[int] = []
        # Whether the delivery loop must look at the session's queues after the SUBACK: not
        # when every subscription is new, own (not shared) and live (no replay): each starts
        # at its queue's end, and what arrives from then on wakes the loop by itself.
        look = False
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
                log.info("%r: SUBSCRIBE %r refused: %s", client.client_id, req.topic_filter, e)
                codes.append(
                    ReasonCode.TOPIC_FILTER_INVALID if level == 5 else ReasonCode.UNSPECIFIED_ERROR
                )
                if level == 5:
                    notes.append(str(e))
                continue
            shared = tf.is_shared
            if shared and req.no_local:
                client.fail(ReasonCode.PROTOCOL_ERROR, "no-local on a shared subscription")
                return
            new = tf.text not in session.subscriptions
            n = len(session.subscriptions)
            refusal = self._access.subscribe_refusal(client, tf.filter, tf.text, new, n)
            if refusal:
                codes.append(refusal if level == 5 else ReasonCode.UNSPECIFIED_ERROR)
                continue
            qos = min(req.qos, self._max_qos)
            look = look or not new or since is not None or shared
            await subscriptions.open_queue(session, tf, since)
            sub, cutoff = subscriptions.subscribe(
                session, delivery, tf, req, qos, sub_id, since, start
            )
            codes.append(qos)
            if cutoff is not None:
                log.warning("%r: %s", client.client_id, cutoff.text(tf.filter))
                notes.append(cutoff.text(tf.filter))
            if since is None and subscriptions.wants_retained(tf, req, new):
                retained_for.append((sub, tf))
        single = isinstance(cluster, SingleNode)
        if not single:
            await cluster.subscribed()  # every node routes to the new filters

        if session.persistent:
            await registry.save(session)  # the subscription must survive a crash once SUBACKed
        else:
            registry.touch(session)
        if client.closed:
            return
        if retained_for and not single:
            await cluster.retained_caught_up()  # set through another node a moment ago
            if client.closed:
                return
        props = Properties(reason_string="; ".join(notes)) if notes and level == 5 else None
        client.write(client.conn.send(SubAck(ev.packet_id, codes, props)))
        subscriptions.send_retained(delivery, retained_for)  # wakes the loop if any
        if look:
            delivery.wake()

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
            self._subscriptions.unsubscribe(session, sub, client.delivery)
            codes.append(0)
        self._registry.touch(session)
        client.write(client.conn.send(UnsubAck(ev.packet_id, codes)))
