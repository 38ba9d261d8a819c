"""The inbound topic, consumed by the deployment's consumer group (RocketMQ's clustering model).

Any RocketMQ producer sends to the inbound topic (settings.rocketmq_inbound_topic); every gateway
node of the deployment consumes it as a member of one consumer group, and each message is
handed to the node's InboundHandler (gateway/storage/inbound.py), which stores it as an MQTT
publish or rejects it:

    members   each node's RemotingClient joins the group (HEART_BEAT with a ConsumerData, every
              heartbeat after); GET_CONSUMER_LIST_BY_GROUP lists the members' client ids
    queues    the topic's read queues on every broker of its route, sorted (broker, queue id)
    share     `allocate_averagely` (AllocateMessageQueueAveragely) over the sorted queues and
              sorted client ids, every LOOK_S: each queue has one member, so each message is
              handled by one node; a queue changing hands (a node joined, left or died) is
              taken by its new owner at its second look with the same share (the old owner
              gave it up and committed at its look in between) and read from the group's
              committed offset, so only what a dead owner handled after its last commit is
              handled again (at least once, never lost)
    per queue a held pull (PULL_MESSAGE, suspended up to HOLD_S); each message handed over in
              order; the position advances past a message only once the handler stored it,
              or it was rejected and its copy in the dead-letter topic was stored (SEND_OK)
    commit    UPDATE_CONSUMER_OFFSET of the positions that advanced: one-way every LOOK_S,
              answered when a queue is given up and at a graceful stop

A dead-lettered message keeps its body and properties (the broker's own left out) and gets
DEAD_LETTER_REASON, DLQ_ORIGIN_TOPIC and DLQ_ORIGIN_MESSAGE_ID (RocketMQ's names for where a
dead letter came from).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from gateway.storage.inbound import InboundHandler, InboundMessage, Rejected
from gateway.storage.port import StoreError
from rocketmq_remoting import OffsetMovedError, RemotingClient, RemotingError, TopicNotExistError
from rocketmq_remoting.admin import create_topic
from rocketmq_remoting.codes import PERM_READ
from rocketmq_remoting.consumer_group import consumer_ids, join_group, leave_group
from rocketmq_remoting.message import (
    BROKER_PROPERTIES,
    PROPERTY_PRODUCER_GROUP,
    PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX,
    MessageRecord,
    user_properties,
)

log = logging.getLogger("lmqtt.rocketmq")

LOOK_S = 1.0  # membership look, rebalance and one-way commit period
ROUTE_EVERY = 10  # the topic's route is read again every ROUTE_EVERY looks
HOLD_S = 15.0  # a pull finding nothing is held this long by the broker
RETRY_S = 1.0  # after a failed pull, store or dead-letter send
BATCH = 32
INBOUND_QUEUES = 4  # queues of an inbound topic the gateway creates
DEAD_LETTER_REASON = "lmqttDeadLetterReason"

Queue = tuple[str, int]  # (broker name, queue id)


def allocate_averagely(queues: Sequence[Queue], members: Sequence[str], me: str) -> list[Queue]:
    """RocketMQ's AllocateMessageQueueAveragely: `me`'s share of `queues` among `members`
    (both sorted the same way on every member): contiguous runs, the first `len % members`
    members one queue more; none when `me` is not a member."""
    if me not in members or not queues:
        return []
    n, m = len(queues), len(members)
    index = members.index(me)
    mod = n % m
    if n <= m:
        size = 1
    elif mod > 0 and index < mod:
        size = n // m + 1
    else:
        size = n // m
    start = index * size if mod > 0 and index < mod else index * size + mod
    return [queues[(start + i) % n] for i in range(max(0, min(size, n - start)))]


class _Stopping(Exception):
    """The reader was told to stop while a message waited for the store."""


class _Reader:
    """One owned queue: its held pulls, its messages handed over in order, its position."""

    def __init__(self, consumer: InboundConsumer, queue: Queue, addr: str, offset: int) -> None:
        self._consumer = consumer
        self.queue = queue
        self.addr = addr
        self.handled = offset  # every message below was stored or dead-lettered
        self.committed = offset
        self.stopping = False
        self._busy = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        c = self._consumer
        broker, qid = self.queue
        offset = self.handled
        while not self.stopping:
            try:
                result = await c.client.pull(
                    self.addr,
                    c.topic,
                    offset,
                    consumer_group=c.group,
                    queue_id=qid,
                    max_messages=BATCH,
                    suspend_timeout=HOLD_S,
                )
            except OffsetMovedError as exc:
                log.warning(
                    "inbound %s queue %s/%d: offset %d moved to %d (messages removed unread)",
                    c.topic, broker, qid, offset, exc.next_begin_offset,
                )  # fmt: skip
                offset = self.handled = exc.next_begin_offset
                continue
            except RemotingError as exc:
                log.warning("inbound %s queue %s/%d: pull failed: %s", c.topic, broker, qid, exc)
                await asyncio.sleep(RETRY_S)
                continue
            self._busy = True
            try:
                for record in result.messages:
                    if record.queue_offset < self.handled:
                        continue
                    await c.deliver(record, self)
                    self.handled = record.queue_offset + 1
            except _Stopping:
                return
            finally:
                self._busy = False
            if result.found or result.next_begin_offset > offset:
                offset = max(result.next_begin_offset, self.handled)

    async def stop(self) -> None:
        """Stop reading; a message being stored is finished first."""
        self.stopping = True
        if not self._busy:
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class InboundConsumer:
    """A member of the deployment's consumer group on the inbound topic (module docstring);
    `start`, then `stop` (graceful) or `close`."""

    def __init__(
        self,
        client: RemotingClient,
        handler: InboundHandler,
        *,
        topic: str,
        dead_letter_topic: str,
        group: str,
        home_addr: str,
    ) -> None:
        self.client = client
        self.topic = topic
        self.group = group
        self._handler = handler
        self._dead_letter_topic = dead_letter_topic
        self._home = home_addr
        self._addrs: dict[str, str] = {}  # broker name -> address, from the topic's route
        self._all: list[Queue] = []
        self._readers: dict[Queue, _Reader] = {}
        self._offered: set[Queue] = set()  # this member's share at the last look
        self._looks = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def queues(self) -> int:
        return len(self._readers)

    async def start(self) -> None:
        """Create the topics when missing, join the group, take this member's queues."""
        await self._create(self.topic, INBOUND_QUEUES)
        await self._create(self._dead_letter_topic, 1)
        await join_group(self.client, self.group, [self.topic], [self._home])
        with contextlib.suppress(RemotingError):
            await self.look()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _create(self, topic: str, queues: int) -> None:
        """UPDATE_AND_CREATE_TOPIC on the home broker unless the topic is there: an operator's
        topic (more queues, another permission) is left as it is."""
        with contextlib.suppress(TopicNotExistError):
            route = await self.client.get_route(topic)
            if any(q.read_queue_nums > 0 for q in route.queues):
                return
        await create_topic(self.client, self._home, topic, queues=queues)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(LOOK_S)
            try:
                await self.look()
            except RemotingError as exc:
                log.warning(
                    "inbound %s: consumer group %s not read: %s", self.topic, self.group, exc
                )
            await self._commit(oneway=True)

    async def look(self) -> None:
        """Read the members (and now and then the route) and take or give up queues."""
        if self._looks % ROUTE_EVERY == 0 or not self._all:
            route = await self.client.get_route(self.topic)
            self._addrs = route.master_addrs()
            self._all = sorted(
                (q.broker_name, i)
                for q in route.queues
                if q.perm & PERM_READ and q.broker_name in self._addrs
                for i in range(q.read_queue_nums)
            )
            for addr in self._addrs.values():
                if addr != self._home:
                    await self.client.heartbeat(addr)  # a member on each broker of the topic
        self._looks += 1
        if not self._addrs:
            return
        ask = self._addrs[min(self._addrs)]
        members = sorted(await consumer_ids(self.client, ask, self.group))
        me = self.client.client_id
        if me not in members:
            await self.client.heartbeat(ask)  # the broker forgot us (restarted): next look
            members = []
        mine = set(allocate_averagely(self._all, members, me))
        for queue in [q for q in self._readers if q not in mine]:
            await self._give_up(queue)
        # A queue is taken once it was this member's at two looks in a row: its previous
        # owner, which sees the same members, has given it up (and committed) at its own look
        # in between, so the two do not read it at once.
        for queue in sorted((mine & self._offered) - self._readers.keys()):
            await self._take(queue)
        self._offered = mine

    async def _take(self, queue: Queue) -> None:
        broker, qid = queue
        addr = self._addrs[broker]
        offset = await self.client.query_consumer_offset(addr, self.group, self.topic, qid)
        if offset is None or offset < 0:
            offset = await self.client.get_min_offset(addr, self.topic, qid)
        log.info("inbound %s: reading queue %s/%d from offset %d", self.topic, broker, qid, offset)
        self._readers[queue] = _Reader(self, queue, addr, offset)

    async def _give_up(self, queue: Queue) -> None:
        reader = self._readers.pop(queue)
        await reader.stop()
        await self._commit_one(reader, oneway=False)
        log.info("inbound %s: queue %s/%d handed to another member", self.topic, *queue)

    async def _commit(self, *, oneway: bool) -> None:
        for reader in list(self._readers.values()):
            await self._commit_one(reader, oneway=oneway)

    async def _commit_one(self, reader: _Reader, *, oneway: bool) -> None:
        offset = reader.handled
        if offset == reader.committed:
            return
        try:
            await self.client.update_consumer_offset(
                reader.addr, self.group, self.topic, offset, reader.queue[1], oneway=oneway
            )
        except RemotingError as exc:
            log.warning("inbound %s: offset not committed: %s", self.topic, exc)
            return
        reader.committed = offset

    # -- one message -------------------------------------------------------------------------

    async def deliver(self, record: MessageRecord, reader: _Reader) -> None:
        """Hand `record` to the handler until it is stored or dead-lettered (a store or broker
        failing is retried; a reader told to stop gives up: the message is read again)."""
        props = record.properties
        message = InboundMessage(
            body=record.body,
            properties=user_properties(props),
            producer_group=props.get(PROPERTY_PRODUCER_GROUP, ""),
            born_host=record.born_host[0],
            msg_id=props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) or record.msg_id,
        )
        while True:
            try:
                await self._handler.handle(message)
                return
            except Rejected as rejected:
                await self._dead_letter(record, message, rejected.reason, reader)
                return
            except StoreError as exc:
                log.warning(
                    "inbound %s: message %s not stored: %s", self.topic, message.msg_id, exc
                )
            if reader.stopping:
                raise _Stopping
            await asyncio.sleep(RETRY_S)

    async def _dead_letter(
        self, record: MessageRecord, message: InboundMessage, reason: str, reader: _Reader
    ) -> None:
        props = {
            k: v.encode("utf-8", "replace").decode()
            for k, v in record.properties.items()
            if k not in BROKER_PROPERTIES
        }
        props[DEAD_LETTER_REASON] = reason
        props["DLQ_ORIGIN_TOPIC"] = self.topic
        props["DLQ_ORIGIN_MESSAGE_ID"] = message.msg_id
        while True:
            try:
                await self.client.send_message(
                    self._home, self._dead_letter_topic, record.body, properties=props
                )
                break
            except RemotingError as exc:
                log.warning("inbound %s: dead letter not sent: %s", self.topic, exc)
            if reader.stopping:
                raise _Stopping
            await asyncio.sleep(RETRY_S)
        self._handler.dead_lettered(message, reason)

    # -- stopping ----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Graceful: stop reading, commit what was handled, leave the group (the other
        members take the queues at their next look)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        readers = list(self._readers.values())
        for reader in readers:
            await reader.stop()
        await self._commit(oneway=False)
        self._readers.clear()
        with contextlib.suppress(RemotingError):
            await leave_group(self.client, self.group, set(self._addrs.values()) | {self._home})

    def close(self) -> None:
        """Abrupt: the tasks cancelled, nothing committed (what was handled since the last
        commit is handled again by the next owner)."""
        if self._task is not None:
            self._task.cancel()
        for reader in self._readers.values():
            reader.task.cancel()
        self._readers.clear()
