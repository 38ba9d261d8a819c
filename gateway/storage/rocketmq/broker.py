"""The one RocketMQ broker a gateway stores on: its client, address and namespace, and what
the other rocketmq_* modules share: the plain range read and a pulled record as the port's
StoredMessage (`to_stored`).

Light queues are per broker (docs/rocketmq.md): the gateway writes and reads ONE broker (named
by `rocketmq_broker`, else the one already holding the parent topic, else the first in the
cluster by name: RemotingClient.home_broker), so each light queue has one
home, one offset sequence and a total order. Spreading over brokers needs per-broker offsets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from gateway.storage.port import StoredMessage
from gateway.storage.rocketmq.names import LightQueueNames
from rocketmq_remoting import OffsetMovedError, PullResult, RemotingClient
from rocketmq_remoting.message import BROKER_PROPERTIES, MessageRecord
from topicmap.rocketmq import EMPTY_BODY_PROPERTY

log = logging.getLogger("lmqtt.rocketmq")

#: Consumer group of the gateway's own pulls. `%LMQ%` groups need no creation on the broker
#: (LmqSubscriptionGroupManager synthesizes them); pulls carry their subscription, so no
#: consumer registration either.
PULL_GROUP = "%LMQ%lmqtt-gateway"
PULL_BATCH = 32
#: How often a read asks again where the broker answers nothing below the queue's end and
#: gives no way on (RangeRead), and the pause before each (times the attempt).
EMPTY_RETRIES = 3
EMPTY_RETRY_S = 0.05
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
    # Seconds a send the broker did not take while it was away (a restart) is sent again
    # before it fails (settings.rocketmq_send_retry; gateway/storage/rocketmq/sender.py).
    resend_s: float = 30.0
    names: LightQueueNames = field(init=False)

    def __post_init__(self) -> None:
        self.names = LightQueueNames(self.topic)

    def read(self, lmq: str, offset: int, end: int) -> RangeRead:
        """The messages of light queue `lmq` from `offset` up to `end` (or until the queue
        has no more), a pull answer at a time (see RangeRead)."""
        return RangeRead(self, lmq, offset, end)


class RangeRead:
    """One read of a queue's range, a pull answer at a time (`async for`); `reached` is where
    it got to: `end`, or where the queue ends, or where the broker kept answering nothing.

    An answer without messages is not the queue's end by itself: the broker answers so below
    its end too (`after_empty`), and the read goes on from the answer's nextBeginOffset. Data
    deleted by age is skipped (a warning)."""

    __slots__ = ("_broker", "_end", "_lmq", "reached")

    def __init__(self, broker: Broker, lmq: str, offset: int, end: int) -> None:
        self._broker = broker
        self._lmq = lmq
        self._end = end
        self.reached = offset

    async def __aiter__(self) -> AsyncIterator[list[MessageRecord]]:
        client, addr, lmq, end = self._broker.client, self._broker.addr, self._lmq, self._end
        offset = self.reached
        stalled = 0
        while offset < end:
            try:
                res = await client.pull(
                    addr, lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
                )
            except OffsetMovedError as exc:
                log.warning(
                    "queue %s: offset %d moved (broker range %d..%d), reading on from %d",
                    lmq, offset, exc.min_offset, exc.max_offset, exc.next_begin_offset,
                )  # fmt: skip
                if exc.next_begin_offset == offset:
                    return  # nothing to follow (never spin)
                offset = self.reached = exc.next_begin_offset
                continue
            if res.messages:
                stalled = 0
                offset = self.reached = res.next_begin_offset
                yield res.messages
                continue
            nxt = after_empty(offset, res)
            if nxt is None:
                return  # the queue ends here
            if nxt > offset:
                log.warning(
                    "queue %s: offsets %d..%d hold no readable message (pull code %d, broker "
                    "range %d..%d; deleted by age?), reading on from %d",
                    lmq, offset, nxt, res.code, res.min_offset, res.max_offset, nxt,
                )  # fmt: skip
                offset = self.reached = nxt
                stalled = 0
                continue
            stalled += 1
            if stalled > EMPTY_RETRIES:
                log.warning(
                    "queue %s: the broker answers nothing at offset %d below its end %d "
                    "(pull code %d, %d times): this read stops there",
                    lmq, offset, res.max_offset, res.code, stalled,
                )  # fmt: skip
                return
            await asyncio.sleep(EMPTY_RETRY_S * stalled)


def after_empty(offset: int, res: PullResult) -> int | None:
    """Where a reader of a queue goes on after a pull from `offset` answered without messages
    (PULL_NOT_FOUND, PULL_RETRY_IMMEDIATELY; the broker's GetMessageStatus in its remark):
    None when the queue ends there, else the answer's nextBeginOffset, which is `offset`
    itself when the broker gave no way on (ask again).

    A 5.3.3 master (DefaultMessageStore.getMessage, PullMessageProcessor.composeResponseHeader)
    answers empty below the queue's end (its maxOffset) when
      MESSAGE_WAS_REMOVING  RETRY_IMMEDIATELY  the units' CommitLog file is deleted (by age or
                                               disk space) and the queue's min not yet moved:
                                               next = past the units passed over (up to the
                                               consume-queue file's end or maxFilterMessageSize)
      OFFSET_FOUND_NULL     NOT_FOUND          no consume-queue file at `offset` (deleted, the
                                               min not yet moved): next = the next file's start
      NO_MATCHED_MESSAGE    RETRY_IMMEDIATELY  nothing matched the subscription (`*` matches
                                               all): next = past the units passed over
    and at the end OFFSET_OVERFLOW_ONE (NOT_FOUND, next = offset = maxOffset), or an empty queue
    (NOT_FOUND at offset 0, maxOffset 0); a slave answers RETRY_IMMEDIATELY for all of them."""
    if res.max_offset <= offset:
        return None
    return max(offset, res.next_begin_offset)


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


def trim_window(msgs: dict[int, StoredMessage], limit: int) -> None:
    """Past `limit` messages, drop the oldest of a window of read messages (keyed by queue
    offset: a mirror's, a history's), down to three quarters of `limit`, so that the offsets
    are sorted once per quarter of the window, not once per message. A reader of a dropped
    offset pulls it again."""
    if len(msgs) > limit:
        for off in sorted(msgs)[: len(msgs) - limit * 3 // 4]:
            del msgs[off]
