"""PublishPath: a PUBLISH from a client (or the gateway itself) into the store.

    topic name -> validated, parent topic (cached)
               -> light queues of every registered filter matching it (router, cached)
               -> one store record dispatched to those queues (plus %RETAIN%)
               -> the recent cache (delivery reads it from there), the retained index

One PUBLISH is one store record: parent topic = first topic level, dispatched to the light
queues of every registered filter matching the topic (plus %RETAIN% when retained). The
router lives here because the route cache does: a filter added or removed (the subscription
lifecycle, gateway/lifecycle/subscriptions.py) goes through `add_filter` / `remove_filter`,
which clear it.
"""

from __future__ import annotations

from collections.abc import Callable

import accelerators
from gateway.clock import now_ms
from gateway.messages.recent import RecentMessages
from gateway.messages.records import (
    KIND_MIDDLES,
    PID_BLOCK,
    PID_HEAD,
    PID_TAIL,
    PROPERTY_BLOCKS_SIZE,
    TOPIC_HEAD,
    PublishProperties,
    message_properties,
)
from gateway.messages.retained import RetainedIndex, RetainedMessage
from gateway.messages.will_log import WILLS_QUEUE
from gateway.protocol import Publish, remember_topic
from gateway.stats import GatewayStats
from gateway.storage.port import EncodedMessage, PutResult, Storage, StoreError
from topicmap import Router, TopicFilter, check_topic_name, parent_of_name
from topicmap.record import CLIENT, QOS, RETAIN, TOPIC, WILL_ID

# Validated topic names and their parent topics remembered (cleared when full): validating
# and naming the parent cost more per PUBLISH than the rest of the gateway's put path.
TOPIC_CACHE_SIZE = 16_384


def encode_publishes_py(
    pubs: list[Publish],
    blocks: list[PublishProperties],
    routes: dict[str, tuple[str, tuple[str, ...]]],
    messages: list[EncodedMessage],
    props: list[dict[str, str]],
    i: int,
) -> int:
    """PublishPath.append_publishes's loop, its common case: from `pubs[i]` on, while a
    PUBLISH has no MQTT 5 properties, its topic a cached route and its publisher
    (`blocks[k]`) the block of its (topic, QoS, retain) or one it makes without the store
    (PublishProperties.new_plain: a device's first publish to its topic), append (parent,
    light queues, payload, block + the packet id pair for QoS > 0) to `messages` and the
    block's properties to `props`; returns the index of the first PUBLISH left (the caller
    routes it and has its block encoded). The reference of gateway/messages/_batch.c
    `encode_publishes`, which must do exactly this (tests/gateway/messages/
    test_encode_publishes.py)."""
    if len(blocks) != len(pubs):
        raise ValueError("encode_publishes: pubs and blocks differ in length")
    n = len(pubs)
    while i < n:
        pub = pubs[i]
        if type(pub) is not Publish or pub.properties is not None:
            break
        route = routes.get(pub.topic)
        if route is None:
            break
        publisher = blocks[i]
        hit = publisher.blocks.get((pub.topic, pub.qos, pub.retain))
        if hit is None:
            hit = publisher.new_plain(pub.topic, pub.qos, pub.retain)
            if hit is None:
                break
        block = (
            hit[0] + PID_BLOCK % pub.packet_id if pub.qos and pub.packet_id is not None else hit[0]
        )
        messages.append((route[0], route[1], pub.payload, block))
        props.append(hit[1])
        i += 1
    return i


def _load_encode_publishes() -> Callable[..., int]:
    """The C `encode_publishes` (gateway/messages/_batch.c) when it was built, else
    encode_publishes_py; LMQTT_PURE_PYTHON_APPEND (the append path's switch) keeps the
    reference."""
    kernel = accelerators.load("gateway.messages._batch", "LMQTT_PURE_PYTHON_APPEND")
    if kernel is None:
        return encode_publishes_py
    kernel.configure(Publish, "blocks", PID_HEAD, PID_TAIL)
    kernel.configure_new(
        "_client_id", "_client_raw", KIND_MIDDLES, TOPIC_HEAD, (TOPIC, QOS, RETAIN, CLIENT),
        PROPERTY_BLOCKS_SIZE,
    )  # fmt: skip
    return kernel.encode_publishes


_ENCODE_PUBLISHES = _load_encode_publishes()


class PublishPath:
    """Routes and appends PUBLISHes; what ClientConnection, the will lifecycle and $SYS use
    to publish (see the module docstring)."""

    def __init__(self, store: Storage, recent: RecentMessages, stats: GatewayStats) -> None:
        self.store = store
        self.recent = recent
        self.stats = stats
        self.router = Router(cache_size=0)  # routes are cached per name here (_routes)
        # Set by the composition root once the index is open (it is rebuilt from the state
        # log after the sessions, whose filters must be routed first).
        self.retained: RetainedIndex | None = None
        self._topics: dict[str, str] = {}  # valid name -> parent topic
        # name -> (parent topic, light queues): valid until the router changes (cleared then).
        self._routes: dict[str, tuple[str, tuple[str, ...]]] = {}
        # Cluster mode (gateway/cluster/filter_registry.py): told of each local filter reference
        # added (True) or dropped (False), so other nodes route to it too.
        self.on_filter: Callable[[str, bool], None] | None = None
        # Cluster mode (gateway/cluster/membership.py): True once this node's lease ran out; a
        # fenced node may hold a stale filter registry, so it stores no publish any more.
        self.fenced: Callable[[], bool] | None = None

    # -- filters -----------------------------------------------------------------------------

    def add_filter(self, tf: TopicFilter | str, *, remote: bool = False) -> str:
        """Register a filter (one more subscriber of it); returns its light queue. `remote`:
        a subscriber on another node of the cluster."""
        queue = self.router.add(tf)
        self._routes.clear()
        if not remote and self.on_filter is not None:
            self.on_filter(tf if isinstance(tf, str) else tf.text, True)
        return queue

    def remove_filter(self, text: str, *, remote: bool = False) -> bool:
        """One subscriber less of a filter (registered with add_filter); True when it was the
        last one (nothing reads the filter's queue any more)."""
        last = self.router.remove(text)
        self._routes.clear()
        if not remote and self.on_filter is not None:
            self.on_filter(text, False)
        return last

    def _check_fence(self) -> None:
        if self.fenced is not None and self.fenced():
            raise StoreError("this gateway node is fenced (its cluster lease ran out)")

    # -- topics and routes -------------------------------------------------------------------

    def check_topic(self, name: str) -> str:
        """The parent topic of a published name, which it validates (TopicError if invalid);
        cached per name. No Topic object is made or kept: a fleet's device names each come
        once, and the check and the parent are all a publish needs of them."""
        parent = self._topics.get(name)
        if parent is None:
            parent = parent_of_name(check_topic_name(name))
            if len(self._topics) >= TOPIC_CACHE_SIZE:
                self._topics.clear()
            self._topics[name] = parent
        return parent

    def publish_route(self, name: str) -> tuple[str, tuple[str, ...]]:
        """(parent topic, light queues of every matching filter) of a topic name, sorted,
        cached until a filter is added or removed. TopicError if the name is invalid."""
        route = self._routes.get(name)
        if route is None:
            parent = self.check_topic(name)  # validates the name
            route = (parent, self.router.route_sorted(name))
            if route[1]:
                remember_topic(name)  # its deliveries will encode it: the first one too
            if len(self._routes) >= TOPIC_CACHE_SIZE:
                self._routes.clear()
            self._routes[name] = route
        return route

    # -- appending ---------------------------------------------------------------------------

    def append_publishes(
        self, pubs: list[Publish], blocks: list[PublishProperties]
    ) -> list[PutResult]:
        """Append non-retained PUBLISHes (topics validated) with one store call; `blocks[i]`
        encodes the properties of `pubs[i]` (its publisher's cache).

        Does not wait for the fsync (sync mode: the caller awaits wait_durable of the
        last end offset before acknowledging). StoreError: none of them was stored.
        """
        if self.fenced is not None:
            self._check_fence()
        routes = self._routes
        messages: list[EncodedMessage] = []
        props: list[dict[str, str]] = []
        n = len(pubs)
        i = 0
        while True:
            i = _ENCODE_PUBLISHES(pubs, blocks, routes, messages, props, i)
            if i >= n:
                break
            pub = pubs[i]  # a route or a block to make: this loop does it
            route = routes.get(pub.topic)
            if route is None:
                route = self.publish_route(pub.topic)
            block, p = blocks[i].of(pub)
            messages.append((route[0], route[1], pub.payload, block))
            props.append(p)
            i += 1
        results = self.store.append_encoded(messages)
        self.recent.add_many(messages, props, results)
        self.stats.messages_received += len(results)
        return results

    async def store_publish(self, pub: Publish, client_id: str, will: str | None = None) -> None:
        """Append one PUBLISH to the store (awaits the covering fsync in sync mode). The topic
        name's validation and parent topic come from the same cache `check_topic()` fills. `will`:
        the PUBLISH is that will (its id), recorded in the wills log (will_log.py)."""
        if self.fenced is not None:
            self._check_fence()
        parent, routed = self._routes.get(pub.topic) or self.publish_route(pub.topic)
        queues = list(routed)
        if pub.retain:
            queues.append(RetainedIndex.QUEUE)
        props = message_properties(pub, client_id)
        if will is not None:
            queues.append(WILLS_QUEUE)
            props[WILL_ID] = will
        r = await self.store.put_async(
            topic=parent, body=pub.payload, queues=queues, properties=props
        )
        self.recent.add(parent, pub.payload, props, r)
        self.stats.messages_received += 1
        if pub.retain and self.retained is not None:
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

    async def wait_durable(self, end_offset: int) -> None:
        """Sync flush: wait for the fsync covering an append that ended at `end_offset` (the
        store's method looked up per call: the metrics wrap it on the instance)."""
        await self.store.wait_durable(end_offset)

    async def publish_internal(
        self, topic: str, payload: bytes, retain: bool = False, qos: int = 0
    ) -> None:
        """Publish from the gateway itself ($SYS): stored and routed like a client publish."""
        await self.store_publish(Publish(topic=topic, payload=payload, qos=qos, retain=retain), "")
