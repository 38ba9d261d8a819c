"""Apache RocketMQ 5 as the gateway's Storage (gateway/storage/port.py): the second adapter.

Messages live on a RocketMQ broker with `enableLmq=true` and `enableMultiDispatch=true`, spoken
to with rocketmq_remoting (docs/rocketmq.md has the verified protocol facts this relies on).
This module composes the parts, each in its own module; start.py opens them (`open_rocketmq`):

    gateway/storage/rocketmq/broker.py   the one broker: client, address, namespace (parent topic)
    gateway/storage/rocketmq/names.py    gateway queue names <-> light queue names (the memo; the
                                 encoding: topicmap/rocketmq.py)
    gateway/storage/rocketmq/sender.py   append: SEND_MESSAGE_V2 with the light queues, tickets
    gateway/storage/rocketmq/mirrors.py  read: a mirror per opened light queue, its held long poll
                                 (rocketmq_notify_pulls off) or what the tail hands it
    gateway/storage/rocketmq/tail.py     read: one held pull at the parent topic's end per broker
    gateway/storage/rocketmq/history.py  read: the parent topic as the replays' history queue
    gateway/storage/rocketmq/offsets.py  committed offsets, copied to the broker's consumer offsets
    gateway/storage/rocketmq/state.py    the state log: the %STATE% light queue, replay, compaction
    gateway/storage/rocketmq/slots.py    brokers by slot: where a message goes, who holds a queue
    gateway/storage/rocketmq/start.py    start-up: wait for RocketMQ, check the brokers, open

Retained messages are the %RETAIN% light queue (start.py reads RETAIN_PRELOAD of them). Nothing
in `data_dir` matters: a local embedded store is opened there only for its property encoder
(its state log and offsets table stay empty), and the delivery account (an analytics output,
gateway/delivery/account.py) is written there: docs/rocketmq.md says why it stays local.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.clock import now_ms
from gateway.storage.inbound import InboundFeed, InboundHandler
from gateway.storage.port import (
    ArrivalListener,
    CommittedOffsets,
    EncodedMessage,
    GetResult,
    PutResult,
    StateRecord,
    Storage,
    StorageUnavailable,
    StoredMessage,
    StoreError,
)
from gateway.storage.rocketmq.broker import Broker, to_stored
from gateway.storage.rocketmq.history import ParentHistory
from gateway.storage.rocketmq.inbound import InboundConsumer
from gateway.storage.rocketmq.mirrors import Mirrors
from gateway.storage.rocketmq.offsets import BrokerOffsets
from gateway.storage.rocketmq.sender import Sender
from gateway.storage.rocketmq.slots import Slots
from gateway.storage.rocketmq.spread import (
    Routing,
    log_max_now,
    spread_queue,
)
from gateway.storage.rocketmq.state import STATE_QUEUE, StateLog
from rocketmq_remoting import RemotingError
from rocketmq_remoting.message import decode_message_id
from topicmap.record import TOPIC

if TYPE_CHECKING:
    from topicmap import TopicFilter

log = logging.getLogger("lmqtt.rocketmq")

RETAIN_QUEUE = "%RETAIN%"
CONFIG_KEY_PREFIX = "config/"
DRAIN_S = 10.0  # a graceful stop waits this long at most for the sends in flight
#: How often a spread deployment asks the name server for brokers that joined (RocketMQ's own
#: clients poll routes every 30 s: pollNameServerInterval).
ROUTE_POLL_S = 30.0


class _StateWake:
    """Arrival listener: wakes the state log's tail when the state queue has news."""

    def __init__(self, state_log: StateLog) -> None:
        self._state_log = state_log

    def on_arrival(self, queue: str, max_offset: int) -> None:
        if queue == STATE_QUEUE:
            self._state_log.wake()

    def on_arrivals(self, ends: dict[str, int]) -> None:
        if STATE_QUEUE in ends:
            self._state_log.wake()


class RocketMqStorage:
    """The Storage port on RocketMQ; create with :func:`open_rocketmq`. One broker (the home
    broker), or with `add_slot` several: messages spread over them by MQTT topic
    (gateway/storage/rocketmq/spread.py)."""

    def __init__(
        self,
        broker: Broker,
        local: Storage,
        *,
        sync: bool,
        node_id: str = "",
        notify_pulls: bool = True,
    ) -> None:
        self.node_id = node_id  # cluster mode: stamped on this process's state records
        self._broker = broker
        self.broker_name = broker.name
        self._local = local
        self._closed = False
        # The parent topic as replay history: told of every send (Sender's SendCounter).
        self._history = ParentHistory(broker)
        self._sender = Sender(broker, self._history, sync=sync)
        # notify_pulls: one tail of the parent topic per broker feeds the mirrors
        # (gateway/storage/rocketmq/tail.py) instead of a held pull per mirror.
        self._mirrors = Mirrors(broker, self._sender.saw_phys, notify=notify_pulls)
        self._state_log = StateLog(broker, self._sender.send, node_id)
        self._state_tail: asyncio.Task[None] | None = None
        # Spread (add_slot): slot 0 is this home broker, the others follow.
        self._slots = Slots(
            broker,
            self._sender,
            self._mirrors,
            self._history,
            BrokerOffsets(broker),
            sync=sync,
            notify=notify_pulls,
        )
        self._route_poll: asyncio.Task[None] | None = None
        self._inbound: InboundConsumer | None = None

    # -- spread over several brokers (gateway/storage/rocketmq/spread.py)
    # --------------------------------

    @property
    def brokers(self) -> list[str]:
        """The deployment's brokers by slot (the home broker first)."""
        return list(self._slots.names)

    def add_slot(self, broker: Broker) -> None:
        """Spread messages to `broker` too from now on (its copies read from offset 0)."""
        self._slots.add(broker)

    def poll_routes(
        self, refresh: Callable[[], Awaitable[None]], interval: float = ROUTE_POLL_S
    ) -> None:
        """Every `interval` s `refresh()`: a broker registered since joins the deployment
        (the start-up's `_spread`), until the storage closes."""

        async def poll() -> None:
            while not self._closed:
                await asyncio.sleep(interval)
                try:
                    await refresh()
                except (StorageUnavailable, StoreError, RemotingError) as exc:
                    log.warning("brokers not updated from the name server: %s", exc)

        self._route_poll = asyncio.get_running_loop().create_task(poll())

    @property
    def account_offset(self) -> Callable[[str, int], int] | None:
        """Spread: a merged offset as the messages read up to it, for the delivery account
        (gateway/delivery/account.py CountedAccount); None with one broker (offsets as they are)."""
        merged = self._slots.merged
        if merged is None:
            return None
        return merged.count

    @property
    def routing(self) -> Routing:
        """Where spread messages go: the live brokers (gateway/storage/rocketmq/spread.py)."""
        return self._slots.routing

    # -- the port: properties --------------------------------------------------------------------

    @property
    def offsets(self) -> CommittedOffsets:
        return self._slots.offsets

    async def load_offsets(self, keys: Iterable[tuple[str, str]]) -> None:
        await self._slots.offsets.load(keys)

    @property
    def closed(self) -> bool:
        return self._closed

    # Queues are opened at the broker, state is durable once it says so.
    waits = True
    # Acknowledged messages are the broker's to keep; our saved positions are never past what
    # it acknowledged.
    tail_may_be_lost = False

    def encode_properties(self, properties: dict[str, str]) -> bytes:
        # The embedded store's block is RocketMQ's own property format (`k \x01 v \x02`).
        return self._local.encode_properties(properties)

    # -- the port: append ------------------------------------------------------------------------

    def append_encoded(self, messages: Sequence[EncodedMessage]) -> list[PutResult]:
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        # The ticket as end_offset (wait_durable); light offsets unknown until read back.
        ticket = self._slots.send_batch(messages)
        result = PutResult(ticket, -1, {}, ticket, now_ms())
        return [result] * len(messages)

    async def wait_durable(self, end_offset: int) -> None:
        await self._slots.wait_durable(end_offset)

    async def put_async(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str] = (),
        properties: dict[str, str] | None = None,
        born_timestamp: int | None = None,
    ) -> PutResult:
        block = self.encode_properties(properties or {})
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        sender = self._slots.sender_for((properties or {}).get(TOPIC, topic), queues)
        res = await sender.send(queues, body, block, self._slots.gate())
        phys = decode_message_id(res.msg_id)[1]
        lights: dict[str, int] = {}
        if RETAIN_QUEUE in queues:
            # The retained index orders changes by their %RETAIN% offset, which only the read
            # back tells (the send answer has none).
            found = await self._mirrors.light_offset(RETAIN_QUEUE, phys, 5.0)
            if found is None:
                log.warning("%%RETAIN%% offset of a retained message not seen in 5 s")
            else:
                lights[RETAIN_QUEUE] = found
        # end_offset 0: already durable (tickets of append_encoded start at 1).
        return PutResult(phys, res.queue_offset, lights, 0, now_ms())

    @property
    def timers(self) -> None:
        """None: the broker's timer wheel holds delayed messages (put_delayed)."""
        return None

    async def put_delayed(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str],
        properties: dict[str, str],
        deliver_ms: int,
    ) -> None:
        """A RocketMQ timer message (timerWheelEnable=true on the broker), its light queues
        those of now: the broker re-puts it with them when due, so the delay outlives every
        gateway."""
        block = self.encode_properties(properties)
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        sender = self._slots.sender_for(properties.get(TOPIC, topic), queues)
        await sender.send_delayed(queues, body, block, deliver_ms)

    # -- the port: read --------------------------------------------------------------------------

    # The parent topic (named like the gateway queue of its history) is read by replays only
    # (gateway/storage/rocketmq/history.py); every other queue is a light queue's mirror.

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        if (merged := self._slots.merged) is not None:
            if spread_queue(queue):
                return merged.get(queue, offset, max_messages)
            if (hist := self._slots.history_of(queue)) is not None:
                return self._slots.history_get(hist, offset, max_messages)
        if queue == self._broker.topic:
            return self._history.get(offset, max_messages)
        return self._mirrors.get(queue, offset, max_messages)

    def min_offset(self, queue: str) -> int:
        if (merged := self._slots.merged) is not None:
            if spread_queue(queue):
                return merged.min_offset(queue)
            if (hist := self._slots.history_of(queue)) is not None:
                return hist[1].min_offset()
        if queue == self._broker.topic:
            return self._history.min_offset()
        return self._mirrors.min_offset(queue)

    def max_offset(self, queue: str) -> int:
        if (merged := self._slots.merged) is not None:
            if spread_queue(queue):
                return merged.max_offset(queue)
            if (hist := self._slots.history_of(queue)) is not None:
                return hist[1].max_offset()
        if queue == self._broker.topic:
            return self._history.max_offset()
        return self._mirrors.max_offset(queue)

    def read_max_offset(self, queue: str) -> int:
        """`max_offset` of a queue this process reads (its mirror is open); -1 for a queue it
        does not read, without opening one (max_offset would: a mirror, then every message
        of the queue decoded and kept here). For an observer of queue ends that must not
        become a reader: the delivery account samples every session this node knows, in a
        cluster also those adopted from other nodes (connected there, read there)."""
        if not any(m.mirrored(queue) for m in self._slots.copies(queue)):
            return -1
        return self.max_offset(queue)

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int:
        if self._slots.merged is not None and (hist := self._slots.history_of(queue)) is not None:
            return hist[1].offset_by_time(timestamp_ms)
        if queue == self._broker.topic:
            return self._history.offset_by_time(timestamp_ms)
        return self.max_offset(queue)  # light queues are never searched by time

    def history_queues(self, tf: TopicFilter) -> list[str]:
        # Every message is in the one parent topic (gateway/storage/rocketmq/history.py) of the
        # broker it was sent to: one history queue per broker when spread.
        return self._slots.history_queues()

    async def open_history(self, queues: Sequence[str], since_ms: int) -> None:
        for name, history in self._slots.histories(queues):
            try:
                await history.open(since_ms)
            except RemotingError as exc:
                raise StoreError(f"broker {name}: {exc}") from exc

    def queues(self) -> list[str]:
        return self._mirrors.queues()

    def held_pulls(self) -> int:
        """Pulls this gateway keeps held on the brokers now (mirrors or tails, the inbound
        consumer's)."""
        return self._broker.client.held_pulls

    @property
    def log_min_offset(self) -> int:
        return 0

    @property
    def log_max_offset(self) -> int:
        if self._slots.merged is not None:
            return log_max_now()
        return self._sender.log_max

    def add_listener(self, listener: ArrivalListener) -> None:
        self._slots.add_listener(listener)

    # -- PublishScan (gateway/session/qos2.py): the parent topic read back ----------------------

    @property
    def publish_position(self) -> int | None:
        if self._slots.merged is not None:
            return None  # spread: one parent queue per broker, no single position
        return self._history.position()

    async def publishes_since(self, position: int) -> AsyncIterator[StoredMessage]:
        broker = self._broker
        try:
            end = await broker.client.get_max_offset(broker.addr, broker.topic)
            async for batch in broker.read(broker.topic, position, end):
                for rec in batch:
                    yield to_stored(rec, rec.queue_offset, broker.names.queue)
        except RemotingError as exc:
            raise StoreError(f"broker {broker.name}: reading {broker.topic}: {exc}") from exc

    async def open_queue(self, queue: str) -> None:
        await asyncio.gather(*(m.open_queue(queue) for m in self._slots.live_copies(queue)))

    def close_queue(self, queue: str) -> None:
        for m in self._slots.copies(queue):
            m.release(queue)

    async def preload(self, queue: str, count: int) -> None:
        """Read the last `count` messages of `queue` now (see Mirrors.preload)."""
        await self._mirrors.preload(queue, count)

    # -- the port: durable gateway state (gateway/storage/rocketmq/state.py) -----------------------

    async def load_state(self) -> None:
        """Replay the state queue (open_rocketmq calls this before the gateway reads state)."""
        await self._state_log.load()

    def state_records(self) -> Iterable[StateRecord]:
        return list(self._state_log.records.items())

    def append_state(self, records: Iterable[StateRecord]) -> int:
        batch = list(records)
        if not batch:
            return self._state_log.ticket
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        return self._state_log.append(batch)

    async def wait_state_durable(self, position: int) -> None:
        await self._state_log.wait_durable(position)

    def state_durable(self, position: int) -> asyncio.Future[None] | None:
        return asyncio.ensure_future(self._state_log.wait_durable(position))

    async def compact_state(self) -> None:
        if not self._closed:
            await self._state_log.compact()

    def read_config(self, name: str) -> bytes | None:
        # Config documents are the embedded store's file forms of state (read to import them
        # once); on RocketMQ they are state records.
        return self._state_log.records.get(CONFIG_KEY_PREFIX + name)

    def write_config(self, name: str, data: bytes) -> None:
        self.append_state([(CONFIG_KEY_PREFIX + name, data)])

    # -- cluster mode (gateway/cluster/node.py ClusterStorage) -------------------------------------

    async def settle(self) -> None:
        await self._slots.settle()

    def written_by(self, node: str) -> list[tuple[str, bytes]]:
        return self._state_log.written_by(node)

    def state_writers(self) -> set[str]:
        return set(self._state_log.writers.values())

    def writer_of(self, key: str) -> str | None:
        return self._state_log.writers.get(key)

    def state_value(self, key: str) -> bytes | None:
        return self._state_log.records.get(key)

    def set_compaction_gate(self, allowed: Callable[[], bool]) -> None:
        self._state_log.may_compact = allowed

    def add_state_observer(self, observer: Callable[[str, list[StateRecord]], None]) -> None:
        """`observer(node, records)` for each state batch another node wrote, as it is read
        (after follow_state)."""
        self._state_log.observers.append(observer)

    def follow_state(self) -> None:
        """Tail the state log from where the replay ended, applying the other nodes' records."""
        if self._state_tail is not None or self._closed:
            return
        self._mirrors.add_listener(_StateWake(self._state_log))
        self._mirrors.mirror(STATE_QUEUE)
        self._state_tail = asyncio.get_running_loop().create_task(
            self._state_log.follow(self._mirrors.get)
        )

    async def catch_up_state(self) -> None:
        """Return once the tail (follow_state) applied every state batch stored before this
        call: a session record another node wrote a moment ago is known here (the broker's
        end is asked after the call; its dispatch to the light queue lags SEND_OK by
        milliseconds, docs/rocketmq.md quirk 3)."""
        try:
            end = await self._mirrors.catch_up(STATE_QUEUE)
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading the state queue: {exc}") from exc
        await self._state_log.reached(end)

    def fence(self, node: str) -> None:
        """`node` was declared lost: append the marker after which every reader ignores its
        state writes (gateway/storage/rocketmq/fences.py), before any takeover of its state."""
        self._state_log.fence(node)

    async def fenced(self, node: str) -> None:
        """Return once the marker fencing `node` is stored and applied here (so this node's view
        is the one every reader has); appends it first if this node did not yet."""
        await self._state_log.wait_durable(self._state_log.fence(node))
        await self.catch_up_state()

    async def catch_up_queue(self, queue: str) -> None:
        """`queue`'s mirror read up to the broker's end now (Mirrors.catch_up)."""
        try:
            await asyncio.gather(*(m.catch_up(queue) for m in self._slots.copies(queue)))
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading {queue}: {exc}") from exc

    async def read_range(self, queue: str, start: int, end: int) -> list[StoredMessage]:
        """The messages at `start` up to `end` of `queue` (an unspread queue: the cluster
        bus), read from its broker now (Mirrors.read_range)."""
        try:
            return await self._mirrors.read_range(queue, start, end)
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading {queue}: {exc}") from exc

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None:
        """The messages at `offsets` of `queue` read now (Mirrors.prefetch)."""
        try:
            if (merged := self._slots.merged) is not None and spread_queue(queue):
                mirrors = self._slots.copies(queue)
                parts = merged.split(queue, list(offsets))
                await asyncio.gather(*(mirrors[k].prefetch(queue, o) for k, o in parts.items()))
            else:
                await self._mirrors.prefetch(queue, offsets)
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading {queue}: {exc}") from exc

    async def open_inbound(
        self, handler: InboundHandler, *, topic: str, dead_letter_topic: str, group: str
    ) -> InboundFeed:
        """Consume the inbound topic (gateway/storage/rocketmq/inbound.py), its topics on the
        home broker."""
        consumer = InboundConsumer(
            self._broker.client,
            handler,
            topic=topic,
            dead_letter_topic=dead_letter_topic,
            group=group,
            home_addr=self._broker.addr,
        )
        try:
            await consumer.start()
        except RemotingError as exc:
            consumer.close()
            raise StorageUnavailable(f"inbound topic {topic!r}: {exc}") from exc
        self._inbound = consumer
        return consumer

    async def drain(self) -> None:
        pending: list[asyncio.Future[Any]] = [
            *self._slots.in_flight(),
            *self._state_log.in_flight(),
        ]
        if pending:
            _done, late = await asyncio.wait(pending, timeout=DRAIN_S)
            if late:
                log.error("%d write(s) to RocketMQ still unanswered at stop", len(late))
        await self._slots.offsets.flush()  # answered: the next gateway reads them back

    def close(self, *, keep_local: bool = False) -> None:
        """Stop every pull and drop the connections; the local store too unless `keep_local`
        (a start that waits for a broker opens the storage again on it)."""
        if self._closed:
            return
        self._closed = True
        if self._state_tail is not None:
            self._state_tail.cancel()
        if self._route_poll is not None:
            self._route_poll.cancel()
        if self._inbound is not None:
            self._inbound.close()
        self._slots.offsets.close()
        self._mirrors.close()
        self._history.close()
        self._slots.close()
        self._broker.client.close_nowait()
        if not keep_local:
            self._local.close()
