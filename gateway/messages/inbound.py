"""InboundPublisher: a backend producer's message (gateway/storage/inbound.py) as an MQTT publish.

A RocketMQ application sends to the inbound topic with these user properties:

    mqttTopic   the MQTT topic name (required): valid UTF-8, no wildcard, not a `$`-topic,
                at most max_topic_length bytes
    mqttQos     "0" | "1" | "2" (default 0)
    mqttRetain  "true" | "false" (default false; also "1" | "0")
    mqttPublisher  the name the fan-out report gives the publisher (below)
    any other   an MQTT 5 user property of the publish (RocketMQ's Java client keeps a
                message's properties in a HashMap: their order is not the order set)

The body is the payload. The publish then goes through the path every device's publish takes
(PublishPath.store_publish): routed to every matching filter, retained, in the replay history
and the fan-out report, where its publisher (the record's client id) is `rocketmq:<name>`:
the producer group when the message carries it (PGROUP: transactional messages only; the Java
producer sends its group in the request header, which the broker does not store), else
mqttPublisher, else the producer's host address. A message that breaks a rule above is
Rejected (the consumer moves it to the dead-letter topic).
"""

from __future__ import annotations

import logging

from gateway.messages.publishing import PublishPath
from gateway.protocol import Properties, Publish
from gateway.stats import GatewayStats
from gateway.storage.inbound import InboundMessage, Rejected
from topicmap import TopicError
from topicmap.rocketmq import TOPIC_PROPERTY

log = logging.getLogger("lmqtt.gateway")

MQTT_TOPIC = TOPIC_PROPERTY
MQTT_QOS = "mqttQos"
MQTT_RETAIN = "mqttRetain"
MQTT_PUBLISHER = "mqttPublisher"
CONTROL = frozenset({MQTT_TOPIC, MQTT_QOS, MQTT_RETAIN, MQTT_PUBLISHER})
#: The publisher the fan-out report names for a message of producer group G.
PUBLISHER_PREFIX = "rocketmq:"
_RETAIN = {"true": True, "1": True, "false": False, "0": False}


def publisher_of(message: InboundMessage) -> str:
    """The client id an inbound message is recorded with (module docstring)."""
    name = message.producer_group or message.properties.get(MQTT_PUBLISHER) or message.born_host
    return PUBLISHER_PREFIX + name


class InboundPublisher:
    """The InboundHandler of the gateway: checks, converts, stores (module docstring)."""

    def __init__(
        self,
        publisher: PublishPath,
        stats: GatewayStats,
        *,
        max_topic_length: int,
        retain_available: bool,
    ) -> None:
        self._publisher = publisher
        self._stats = stats
        self._max_topic_length = max_topic_length
        self._retain_available = retain_available

    async def handle(self, message: InboundMessage) -> None:
        pub = self.publish_of(message)
        await self._publisher.store_publish(pub, publisher_of(message))
        self._stats.inbound_consumed += 1

    def dead_lettered(self, message: InboundMessage, reason: str) -> None:
        self._stats.inbound_dead_lettered += 1
        log.warning(
            "inbound message %s (from %s) dead-lettered: %s",
            message.msg_id, publisher_of(message), reason,
        )  # fmt: skip

    def publish_of(self, message: InboundMessage) -> Publish:
        """The PUBLISH `message` stands for; Rejected with the reason when there is none."""
        props = message.properties
        topic = props.get(MQTT_TOPIC)
        if topic is None:
            raise Rejected(f"no {MQTT_TOPIC} property")
        try:
            size = len(topic.encode("utf-8"))
        except UnicodeEncodeError:
            raise Rejected(f"{MQTT_TOPIC} is not valid UTF-8") from None
        if size > self._max_topic_length:
            raise Rejected(f"{MQTT_TOPIC} is {size} bytes, over {self._max_topic_length}")
        if topic.startswith("$"):
            raise Rejected(f"{MQTT_TOPIC} {topic!r} is a $-topic (reserved for the server)")
        try:
            self._publisher.check_topic(topic)
        except TopicError as exc:
            raise Rejected(f"{MQTT_TOPIC}: {exc}") from None
        qos_text = props.get(MQTT_QOS, "0")
        if qos_text not in ("0", "1", "2"):
            raise Rejected(f"{MQTT_QOS} {qos_text!r} is not 0, 1 or 2")
        retain = _RETAIN.get(props.get(MQTT_RETAIN, "false").lower())
        if retain is None:
            raise Rejected(f"{MQTT_RETAIN} {props[MQTT_RETAIN]!r} is not true or false")
        user: list[tuple[str, str]] = []
        for k, v in props.items():
            if k in CONTROL:
                continue
            try:
                k.encode("utf-8")
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise Rejected(f"user property {k!r} is not valid UTF-8") from None
            user.append((k, v))
        return Publish(
            topic=topic,
            payload=message.body,
            qos=int(qos_text),
            retain=retain and self._retain_available,
            properties=Properties(user_properties=user) if user else None,
        )
