"""The one RocketMQ broker a gateway stores on: its client, address and namespace, and what
the other rocketmq_* modules share: the plain range read and a pulled record as the port's
StoredMessage (`to_stored`).

Light queues are per broker (docs/rocketmq.md): the gateway writes and reads ONE broker (named
by `rocketmq_broker`, else the one already holding the parent topic, else the first in the
cluster by name: RemotingClient.home_broker), so each light queue has one
home, one offset sequence and a total order. Spreading over brokers needs per-broker offsets.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from gateway.storage.port import StoredMessage
from gateway.storage.rocketmq.names import LightQueueNames
from rocketmq_remoting import OffsetMovedError, RemotingClient
from rocketmq_remoting.message import BROKER_PROPERTIES, MessageRecord
from topicmap.rocketmq import EMPTY_BODY_PROPERTY

log = logging.getLogger("lmqtt.rocketmq")

#: Consumer group of the gateway's own pulls. `%LMQ%` groups need no creation on the broker
#: (LmqSubscriptionGroupManager synthesizes them); pulls carry their subscription, so no
#: consumer registration either.
PULL_GROUP = "%LMQ%lmqtt-gateway"
PULL_BATCH = 32
_tuple_new = tuple.__new__  # builds a StoredMessage without NamedTuple's Python __new__


@dataclass
class Broker:
    """Where this gateway's messages and state live: `topic` is the parent topic every message
    is sent to and the namespace of the deployment's light queues (`names`)."""

    client: RemotingClient
    name: str
    addr: str
    topic: str
    # Each MQTT message also carries its topic as TOPIC_PROPERTY, a name SQL92 filters of
    # native consumers can use (settings.rocketmq_topic_property; gateway/storage/rocketmq/
    # sender.py).
    topic_property: bool = False
    names: LightQueueNames = field(init=False)

    def __post_init__(self) -> None:
        self.names = LightQueueNames(self.topic)

    async def read(self, lmq: str, offset: int, end: int) -> AsyncIterator[list[MessageRecord]]:
        """The messages of light queue `lmq` from `offset` up to `end` (or until the queue
        has no more), a pull answer at a time; data deleted by age is skipped (a warning)."""
        while offset < end:
            try:
                res = await self.client.pull(
                    self.addr, lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
                )
            except OffsetMovedError as exc:
                log.warning(
                    "queue %s: offset %d moved (broker range %d..%d), reading on from %d",
                    lmq, offset, exc.min_offset, exc.max_offset, exc.next_begin_offset,
                )  # fmt: skip
                offset = exc.next_begin_offset
                continue
            if not res.messages:
                return
            yield res.messages
            offset = res.next_begin_offset


def to_stored(
    rec: MessageRecord,
    offset: int,
    queue_of: Callable[[str], str],
    lights: Iterable[str] | None = None,
) -> StoredMessage:
    """A pulled record as the port's StoredMessage: `offset` is its offset in the queue read
    (a light queue's, or the parent queue's), `queue_of` maps the light queues it was
    dispatched to (`lights`, if the caller parsed them already) back to gateway queue names.
    The broker's own properties are dropped and an empty MQTT payload (sent as one byte,
    topicmap/rocketmq.py) is read back empty."""
    if lights is None:
        lights = rec.light_queue_offsets()
    # What the broker added is not the MQTT message's: no reader of the gateway sees it.
    props = {k: v for k, v in rec.properties.items() if k not in BROKER_PROPERTIES}
    body = b"" if props.pop(EMPTY_BODY_PROPERTY, None) is not None else rec.body
    return _tuple_new(
        StoredMessage,
        (
            rec.topic,
            body,
            props,
            offset,
            rec.commitlog_offset,
            rec.store_timestamp,
            rec.born_timestamp,
            rec.queue_offset,
            tuple(map(queue_of, lights)),
        ),
    )


def at_offset(stored: StoredMessage, offset: int) -> StoredMessage:
    """`stored` as read from another light queue it was dispatched to, at `offset` there (the
    same topic, body and properties: one decoded record serves every queue of it)."""
    return _tuple_new(StoredMessage, (*stored[:3], offset, *stored[4:]))
