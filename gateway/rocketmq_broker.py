"""The one RocketMQ broker a gateway stores on: its client, address and namespace, and the
plain range read the other rocketmq_* modules share.

Light queues are per broker (docs/rocketmq.md): the gateway writes and reads ONE broker (named
by `rocketmq_broker`, else the first in the cluster by name), so each light queue has one
home, one offset sequence and a total order. Spreading over brokers needs per-broker offsets.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.rocketmq_names import LightQueueNames
from rocketmq_remoting import OffsetMovedError, RemotingClient
from rocketmq_remoting.message import MessageRecord

log = logging.getLogger("lmqtt.rocketmq")

#: Consumer group of the gateway's own pulls. `%LMQ%` groups need no creation on the broker
#: (LmqSubscriptionGroupManager synthesizes them); pulls carry their subscription, so no
#: consumer registration either.
PULL_GROUP = "%LMQ%lmqtt-gateway"
PULL_BATCH = 32


@dataclass
class Broker:
    """Where this gateway's messages and state live: `topic` is the parent topic every message
    is sent to and the namespace of the deployment's light queues (`names`)."""

    client: RemotingClient
    name: str
    addr: str
    topic: str
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
