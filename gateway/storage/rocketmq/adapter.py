"""Apache RocketMQ 5 as the gateway's Storage (gateway/storage/port.py): the second adapter.

Messages live on a RocketMQ broker with `enableLmq=true` and `enableMultiDispatch=true`, spoken
to with rocketmq_remoting (docs/rocketmq.md has the verified protocol facts this relies on).
This module composes the parts, each in its own module, and opens them (`open_rocketmq`):

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

Retained messages are the %RETAIN% light queue (RETAIN_PRELOAD of them read at start). Nothing
in `data_dir` matters: a local embedded store is opened there only for its property encoder
(its state log and offsets table stay empty), and the delivery account (an analytics output,
gateway/delivery/account.py) is written there: docs/rocketmq.md says why it stays local.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
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
    StoreError,
)
from gateway.storage.rocketmq.broker import Broker
from gateway.storage.rocketmq.history import ParentHistory
from gateway.storage.rocketmq.inbound import InboundConsumer
from gateway.storage.rocketmq.mirrors import Mirrors
from gateway.storage.rocketmq.names import PROBE_QUEUE
from gateway.storage.rocketmq.offsets import BrokerOffsets
from gateway.storage.rocketmq.sender import Sender
from gateway.storage.rocketmq.spread import (
    SEP,
    SLOTS_KEY,
    MergedReads,
    Routing,
    SpreadOffsets,
    log_max_now,
    mqtt_topic,
    slots_from_state,
    spread_queue,
)
from gateway.storage.rocketmq.spread import phys as spread_phys
from gateway.storage.rocketmq.state import STATE_QUEUE, StateLog
from rocketmq_remoting import BrokerError, BrokerNotFoundError, RemotingClient, RemotingError
from rocketmq_remoting.message import decode_message_id
from topicmap.record import TOPIC
from topicmap.rocketmq import encode_lmq

if TYPE_CHECKING:
    from gateway.config import GatewaySettings
    from topicmap import TopicFilter

log = logging.getLogger("lmqtt.rocketmq")

#: %RETAIN% messages read at start for the retained index's catch-up (gateway/messages/retained.py).
RETAIN_PRELOAD = 20_000
RETAIN_QUEUE = "%RETAIN%"
CONFIG_KEY_PREFIX = "config/"
DRAIN_S = 10.0  # a graceful stop waits this long at most for the sends in flight
#: How often a spread deployment asks the name server for brokers that joined (RocketMQ's own
#: clients poll routes every 30 s: pollNameServerInterval).
ROUTE_POLL_S = 30.0
START_RETRY_S = 0.5  # a start waiting for RocketMQ asks the name server again this often
START_LOG_S = 5.0  # ... and says what it waits for this often


class _StateWake:
    """Arrival listener: wakes the state log's tail when the state queue has news."""

    def __init__(self, state_log: StateLog) -> None:
        self._state_log = state_log

    def on_arrival(self, queue: str, max_offset: int) -> None:
        if queue == STATE_QUEUE:
            self._state_log.wake()


class _Renamed:
    """Arrival listener of a broker's parent-topic history other than the home broker's:
    its notices name that broker's history queue (`topic SEP broker`)."""

    def __init__(self, listener: ArrivalListener, topic: str, name: str) -> None:
        self._listener = listener
        self._topic = topic
        self._name = name

    def on_arrival(self, queue: str, max_offset: int) -> None:
        self._listener.on_arrival(self._name if queue == self._topic else queue, max_offset)


class _Slot:
    """One broker of a spread deployment other than the home broker: its sends, mirrors,
    parent-topic history and committed offsets (gateway/storage/rocketmq/spread.py)."""

    def __init__(self, broker: Broker, *, sync: bool, routing: Routing, notify: bool) -> None:
        self.broker = broker
        self.history_queue = broker.topic + SEP + broker.name
        self.history = ParentHistory(broker)
        self.sender = Sender(broker, self.history, sync=sync, failover=routing)
        self.mirrors = Mirrors(broker, self.sender.saw_phys, notify=notify)
        self.offsets = BrokerOffsets(broker)


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
        self._notify_pulls = notify_pulls
        self._mirrors = Mirrors(broker, self._sender.saw_phys, notify=notify_pulls)
        self._state_log = StateLog(broker, self._sender.send, node_id)
        self._state_tail: asyncio.Task[None] | None = None
        self._home_offsets = BrokerOffsets(broker)
        self._offsets: BrokerOffsets | SpreadOffsets = self._home_offsets
        self._sync = sync
        # Spread (add_slot): slot 0 is this home broker, the others follow.
        self._slots: list[_Slot] = []
        self._names: list[str] = [broker.name]  # broker names by slot
        self._routing = Routing(self._names, self._sender_named, self._sends_in_flight)
        self._merged: MergedReads | None = None
        self._by_history: dict[str, _Slot] = {}
        self._listeners: list[ArrivalListener] = []
        self._tickets: dict[int, list[tuple[Sender, int]]] = {}
        self._ticket = 0
        self._route_poll: asyncio.Task[None] | None = None
        self._inbound: InboundConsumer | None = None

    # -- spread over several brokers (gateway/storage/rocketmq/spread.py)
    # --------------------------------

    @property
    def brokers(self) -> list[str]:
        """The deployment's brokers by slot (the home broker first)."""
        return list(self._names)

    def add_slot(self, broker: Broker) -> None:
        """Spread messages to `broker` too from now on (its copies read from offset 0)."""
        slot = _Slot(broker, sync=self._sync, routing=self._routing, notify=self._notify_pulls)
        self._sender.failover = self._routing
        self._slots.append(slot)
        self._names.append(broker.name)
        self._by_history[slot.history_queue] = slot
        if self._merged is None:
            self._merged = MergedReads([self._mirrors])
            self._offsets = SpreadOffsets([self._home_offsets])
        self._merged.mirrors.append(slot.mirrors)
        assert isinstance(self._offsets, SpreadOffsets)
        self._offsets.add(slot.offsets)
        for listener in self._listeners:
            slot.mirrors.add_listener(listener)
            slot.history.add_listener(_Renamed(listener, broker.topic, slot.history_queue))
        for queue in self._mirrors.queues():
            if spread_queue(queue):
                slot.mirrors.mirror(queue)  # held pulls on the new broker's copies too

    def poll_routes(self, settings: GatewaySettings, interval: float = ROUTE_POLL_S) -> None:
        """Every `interval` s: a broker registered since joins the deployment (`_spread`)."""

        async def poll() -> None:
            while not self._closed:
                await asyncio.sleep(interval)
                try:
                    await _spread(self._broker.client, self, settings)
                except (StorageUnavailable, StoreError, RemotingError) as exc:
                    log.warning("brokers not updated from the name server: %s", exc)

        self._route_poll = asyncio.get_running_loop().create_task(poll())

    @property
    def account_offset(self) -> Callable[[str, int], int] | None:
        """Spread: a merged offset as the messages read up to it, for the delivery account
        (gateway/delivery/account.py CountedAccount); None with one broker (offsets as they are)."""
        merged = self._merged
        if merged is None:
            return None
        return merged.count

    @property
    def routing(self) -> Routing:
        """Where spread messages go: the live brokers (gateway/storage/rocketmq/spread.py)."""
        return self._routing

    def _sender_named(self, name: str) -> Sender:
        if name == self.broker_name:
            return self._sender
        return next(s.sender for s in self._slots if s.broker.name == name)

    def _sends_in_flight(self) -> list[asyncio.Future[None]]:
        out = self._sender.in_flight_sends()
        for slot in self._slots:
            out += slot.sender.in_flight_sends()
        return out

    def _sender_for(self, topic: str, queues: Sequence[str]) -> Sender:
        """The broker a message goes to: by MQTT topic; the home broker for a message of a
        home-only queue (%RETAIN%, %CLUSTER%: one total order each)."""
        if not self._slots or any(not spread_queue(q) for q in queues):
            return self._sender
        return self._routing.sender(topic)

    # -- the port: properties --------------------------------------------------------------------

    @property
    def offsets(self) -> CommittedOffsets:
        return self._offsets

    async def load_offsets(self, keys: Iterable[tuple[str, str]]) -> None:
        await self._offsets.load(keys)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tail_may_be_lost(self) -> bool:
        # Acknowledged messages are the broker's to keep; our saved positions are never past
        # what it acknowledged.
        return False

    def encode_properties(self, properties: dict[str, str]) -> bytes:
        # The embedded store's block is RocketMQ's own property format (`k \x01 v \x02`).
        return self._local.encode_properties(properties)

    # -- the port: append ------------------------------------------------------------------------

    def append_encoded(self, messages: Sequence[EncodedMessage]) -> list[PutResult]:
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        # The ticket as end_offset (wait_durable); light offsets unknown until read back.
        send = self._send_spread if self._slots else self._sender.send_batch
        ticket = send(messages)
        result = PutResult(ticket, -1, {}, ticket, now_ms())
        return [result] * len(messages)

    def _send_spread(self, messages: Sequence[EncodedMessage]) -> int:
        """One batch per broker (each pipelined on its connection); one ticket for all."""
        parts: dict[int, tuple[Sender, list[EncodedMessage]]] = {}
        for message in messages:
            sender = self._sender_for(mqtt_topic(message[3], message[0]), message[1])
            parts.setdefault(id(sender), (sender, []))[1].append(message)
        self._ticket += 1
        gate = self._routing.gate()
        self._tickets[self._ticket] = [
            (s, s.send_batch(batch, gate)) for s, batch in parts.values()
        ]
        if len(self._tickets) > 100_000:
            self._tickets.pop(next(iter(self._tickets)))
        return self._ticket

    async def wait_durable(self, end_offset: int) -> None:
        if not self._slots:
            await self._sender.wait_durable(end_offset)
            return
        for sender, ticket in self._tickets.pop(end_offset, ()):
            await sender.wait_durable(ticket)

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
        sender = self._sender_for((properties or {}).get(TOPIC, topic), queues)
        res = await sender.send(queues, body, block, self._routing.gate() if self._slots else None)
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
        sender = self._sender_for(properties.get(TOPIC, topic), queues)
        await sender.send_delayed(queues, body, block, deliver_ms)

    # -- the port: read --------------------------------------------------------------------------

    # The parent topic (named like the gateway queue of its history) is read by replays only
    # (gateway/storage/rocketmq/history.py); every other queue is a light queue's mirror.

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        if self._merged is not None:
            if spread_queue(queue):
                return self._merged.get(queue, offset, max_messages)
            hist = self._history_of(queue)
            if hist is not None:
                return self._spread_history(hist, offset, max_messages)
        if queue == self._broker.topic:
            return self._history.get(offset, max_messages)
        return self._mirrors.get(queue, offset, max_messages)

    def _history_of(self, queue: str) -> tuple[int, ParentHistory, str] | None:
        if queue == self._broker.topic:
            return 0, self._history, queue
        slot = self._by_history.get(queue)
        if slot is None:
            return None
        return self._slots.index(slot) + 1, slot.history, queue

    def _spread_history(
        self, hist: tuple[int, ParentHistory, str], offset: int, max_messages: int
    ) -> GetResult:
        """A broker's history with time-major physical offsets: replays merge the brokers'
        histories by them, in store-time order (gateway/storage/rocketmq/spread.py)."""
        k, history, queue = hist
        got = history.get(offset, max_messages)
        if not got.messages:
            return got
        # Named like the queue read (gateway/session/replay.py hands over a parent's own messages).
        msgs = [m._replace(topic=queue, physical_offset=spread_phys(k, m)) for m in got.messages]
        return GetResult(got.status, msgs, got.next_offset, got.min_offset, got.max_offset)

    def min_offset(self, queue: str) -> int:
        if self._merged is not None:
            if spread_queue(queue):
                return self._merged.min_offset(queue)
            if (hist := self._history_of(queue)) is not None:
                return hist[1].min_offset()
        if queue == self._broker.topic:
            return self._history.min_offset()
        return self._mirrors.min_offset(queue)

    def max_offset(self, queue: str) -> int:
        if self._merged is not None:
            if spread_queue(queue):
                return self._merged.max_offset(queue)
            if (hist := self._history_of(queue)) is not None:
                return hist[1].max_offset()
        if queue == self._broker.topic:
            return self._history.max_offset()
        return self._mirrors.max_offset(queue)

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int:
        if self._merged is not None and (hist := self._history_of(queue)) is not None:
            return hist[1].offset_by_time(timestamp_ms)
        if queue == self._broker.topic:
            return self._history.offset_by_time(timestamp_ms)
        return self.max_offset(queue)  # light queues are never searched by time

    def history_queues(self, tf: TopicFilter) -> list[str]:
        # Every message is in the one parent topic (gateway/storage/rocketmq/history.py) of the
        # broker it was sent to: one history queue per broker when spread.
        return [self._broker.topic, *(s.history_queue for s in self._slots)]

    async def open_history(self, queues: Sequence[str], since_ms: int) -> None:
        todo = [(self.broker_name, self._history)] if self._broker.topic in queues else []
        todo += [(s.broker.name, s.history) for s in self._slots if s.history_queue in queues]
        for name, history in todo:
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
        if self._merged is not None:
            return log_max_now()
        return self._sender.log_max

    def add_listener(self, listener: ArrivalListener) -> None:
        self._listeners.append(listener)
        self._mirrors.add_listener(listener)
        self._history.add_listener(listener)
        for slot in self._slots:
            slot.mirrors.add_listener(listener)
            slot.history.add_listener(_Renamed(listener, self._broker.topic, slot.history_queue))

    def _copies(self, queue: str) -> list[Mirrors]:
        """The mirrors holding `queue`: every broker's for a spread queue, else the home's."""
        if self._slots and spread_queue(queue):
            return [self._mirrors, *(s.mirrors for s in self._slots)]
        return [self._mirrors]

    async def open_queue(self, queue: str) -> None:
        copies = self._copies(queue)
        if self._routing.lost and len(copies) > 1:
            # A lost broker's copy is read once it is back (its mirror keeps asking).
            copies = [m for k, m in enumerate(copies) if self._names[k] not in self._routing.lost]
        await asyncio.gather(*(m.open_queue(queue) for m in copies))

    def close_queue(self, queue: str) -> None:
        for m in self._copies(queue):
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
        await self._sender.settle()
        for slot in self._slots:
            await slot.sender.settle()

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

    async def catch_up_queue(self, queue: str) -> None:
        """`queue`'s mirror read up to the broker's end now (Mirrors.catch_up)."""
        try:
            await asyncio.gather(*(m.catch_up(queue) for m in self._copies(queue)))
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading {queue}: {exc}") from exc

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None:
        """The messages at `offsets` of `queue` read now (Mirrors.prefetch)."""
        try:
            if self._merged is not None and spread_queue(queue):
                mirrors = self._copies(queue)
                parts = self._merged.split(queue, list(offsets))
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
            *self._sender.in_flight(),
            *(f for slot in self._slots for f in slot.sender.in_flight()),
            *self._state_log.in_flight(),
        ]
        if pending:
            _done, late = await asyncio.wait(pending, timeout=DRAIN_S)
            if late:
                log.error("%d write(s) to RocketMQ still unanswered at stop", len(late))
        await self._offsets.flush()  # answered: the next gateway reads them back

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
        self._offsets.close()
        self._mirrors.close()
        self._history.close()
        for slot in self._slots:
            slot.mirrors.close()
            slot.history.close()
        self._broker.client.close_nowait()
        if not keep_local:
            self._local.close()


async def open_rocketmq(
    settings: GatewaySettings, local: Storage, *, node_id: str = ""
) -> RocketMqStorage:
    """Connect to the cluster of `settings.namesrv`, check the broker, and return the storage.

    StorageUnavailable (with what to fix) when the name server does not answer, no broker is
    registered, or the broker does not index light queues (enableLmq / enableMultiDispatch).
    """
    namesrv = settings.namesrv
    if not namesrv:
        raise StorageUnavailable("store = rocketmq needs the name server address (--namesrv)")
    # Tried again every START_RETRY_S while the name server or a broker is not there yet, for
    # `rocketmq_start_timeout` seconds (the gateway and RocketMQ usually start together); what
    # it waits for is logged every START_LOG_S. Then the last reason, as StorageUnavailable.
    deadline = time.monotonic() + settings.rocketmq_start_timeout
    logged = -START_LOG_S
    # The client id names this process in consumer groups (the inbound topic's): unique per
    # node even for several gateways in one process.
    client_id = f"{socket.gethostname()}@{os.getpid()}@{node_id or 'lmqtt'}"
    while True:
        client = RemotingClient(
            [namesrv], client_id=client_id, request_timeout=5.0, connect_timeout=3.0
        )
        try:
            return await _open(client, settings, local, node_id)
        except _NotYet as exc:
            client.close_nowait()
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageUnavailable(str(exc)) from None
            if time.monotonic() - logged >= START_LOG_S:
                logged = time.monotonic()
                log.warning("waiting for RocketMQ (%.0f s left): %s", left, exc)
            await asyncio.sleep(min(START_RETRY_S, left))
        except BaseException:
            client.close_nowait()
            raise


class _NotYet(StorageUnavailable):
    """What a start waits for: the name server answering, the brokers registered."""


async def _open(
    client: RemotingClient, settings: GatewaySettings, local: Storage, node_id: str
) -> RocketMqStorage:
    namesrv = settings.namesrv
    topic = settings.rocketmq_topic
    try:
        home = await client.home_broker(topic, settings.rocketmq_broker)
    except BrokerNotFoundError as exc:
        raise _NotYet(str(exc)) from None
    except RemotingError as exc:
        raise _NotYet(f"RocketMQ name server {namesrv} unreachable: {exc}") from exc
    name, addr = home.name, home.addr
    if settings.rocketmq_spread and not settings.rocketmq_broker and len(home.serving) > 1:
        # Spread puts the topic on every broker: the home is the one holding the state.
        name, addr = await _state_holder(client, topic, home.serving, (name, addr))
    others = [b for b in home.serving if b != name]
    if others and not settings.rocketmq_spread:
        # A deployment reads and writes its home broker only (docs/rocketmq.md "Several
        # brokers"): what an earlier run stored elsewhere (another rocketmq_broker) is not read.
        log.warning(
            "topic %s is also on broker(s) %s: this gateway stores on and reads %s only;"
            " messages and sessions kept there are not read",
            topic, ", ".join(others), name,
        )  # fmt: skip
    await _prepare_broker(client, name, addr, topic, sync=settings.flush == "sync")
    storage = RocketMqStorage(
        Broker(client, name, addr, topic, settings.rocketmq_topic_property),
        local,
        sync=settings.flush == "sync",
        node_id=node_id,
        notify_pulls=settings.rocketmq_notify_pulls,
    )
    try:
        await _probe_light_queues(client, name, addr, topic)
        await storage.preload(RETAIN_QUEUE, RETAIN_PRELOAD)
        await storage.load_state()
        if settings.rocketmq_spread:
            await _spread(client, storage, settings)
        # Saved replays resume with the queues' bounds.
        await storage.open_history(storage.history_queues(None), 0)  # type: ignore[arg-type]
    except _NotYet:
        storage.close(keep_local=True)  # tried again (open_rocketmq)
        raise
    except BaseException:
        storage.close()
        raise
    if settings.rocketmq_spread:
        log.info("storage: messages spread over brokers %s", ", ".join(storage.brokers))
        storage.poll_routes(settings, settings.rocketmq_route_poll)
    log.info(
        "storage: RocketMQ broker %s (%s) via name server %s, topic %s, %s sends",
        name, addr, namesrv, topic, "sync" if settings.flush == "sync" else "async",
    )  # fmt: skip
    return storage


async def _spread(
    client: RemotingClient, storage: RocketMqStorage, settings: GatewaySettings
) -> None:
    """Add every registered master broker to the deployment (gateway/storage/rocketmq/spread.py):
    the slots recorded in the state (`meta/brokers`) in their order, then new ones by name; each
    gets the parent topic and the same checks as the home broker."""
    topic = settings.rocketmq_topic
    try:
        masters = (await client.get_cluster_info()).master_addrs()
    except RemotingError as exc:
        raise StorageUnavailable(f"RocketMQ name server {settings.namesrv}: {exc}") from exc
    home = storage.broker_name
    recorded = storage.state_value(SLOTS_KEY)
    try:
        names = slots_from_state(recorded, home, list(masters))
    except ValueError as exc:
        raise StorageUnavailable(str(exc)) from None
    if names[0] != home:
        raise StorageUnavailable(
            f"topic {topic!r} was spread with home broker {names[0]} (state record"
            f" {SLOTS_KEY}), not {home}: set rocketmq_broker = {names[0]}"
        )
    if names[: len(storage.brokers)] != storage.brokers:
        # Another node numbered brokers that joined at once in another order.
        raise StorageUnavailable(
            f"brokers of topic {topic!r} numbered {names} in the state, {storage.brokers} here"
        )
    for name in names[len(storage.brokers) :]:
        addr = masters.get(name)
        if addr is None:
            raise _NotYet(
                f"broker {name} holds part of topic {topic!r} (state record {SLOTS_KEY}) but is"
                " not registered with the name server: start it (or its slave) again"
            )
        await _prepare_broker(client, name, addr, topic, sync=settings.flush == "sync")
        await _probe_light_queues(client, name, addr, topic)
        storage.add_slot(Broker(client, name, addr, topic, settings.rocketmq_topic_property))
        log.info("broker %s (%s) holds part of topic %s now", name, addr, topic)
    storage.routing.set_registered(masters)
    with contextlib.suppress(RemotingError):
        route = await client.get_route(topic)
        writable = route.writable_brokers()
        drained = [q.broker_name for q in route.queues if q.broker_name not in writable]
        storage.routing.set_drained(drained)
    value = json.dumps(names).encode()
    if recorded != value:
        await storage.wait_state_durable(storage.append_state([(SLOTS_KEY, value)]))


async def _state_holder(
    client: RemotingClient, topic: str, serving: Sequence[str], default: tuple[str, str]
) -> tuple[str, str]:
    """The broker of `serving` whose %STATE% light queue holds records (the first by name),
    else `default`: a spread deployment's topic is on every broker, so "the broker already
    holding the topic" no longer tells the home broker apart (a broker added later whose
    name sorts first would become it, and the sessions stay behind)."""
    try:
        masters = (await client.get_cluster_info()).master_addrs()
    except RemotingError:
        return default
    lmq = encode_lmq(STATE_QUEUE, topic)
    for name in sorted(serving):
        addr = masters.get(name)
        if addr is None:
            continue
        with contextlib.suppress(RemotingError):
            if await client.get_max_offset(addr, lmq) > 0:
                return name, addr
    return default


async def _prepare_broker(
    client: RemotingClient, name: str, addr: str, topic: str, *, sync: bool
) -> None:
    """The parent topic created on a broker the deployment stores on, and its configuration
    checked (light queues on, the send thread count): the home broker and every spread slot."""
    try:
        await client.create_topic(addr, topic, queues=1)
    except RemotingError as exc:
        raise StorageUnavailable(
            f"broker {name} ({addr}) refused to create topic {topic!r}: {exc}"
        ) from exc
    await _check_broker_config(client, name, addr, sync=sync)


async def _check_broker_config(client: RemotingClient, name: str, addr: str, *, sync: bool) -> None:
    """Refuse a broker whose configuration says light queues are off; warn when sync mode
    runs on a broker that acknowledges before its disk does. (The probe after this is the
    proof; the configuration gives the clearer message.)"""
    try:
        config = await client.get_broker_config(addr)
    except RemotingError as exc:
        log.debug("broker %s: configuration not readable (%s)", name, exc)
        return
    off = [k for k in ("enableLmq", "enableMultiDispatch") if config.get(k, "").lower() != "true"]
    if off:
        raise StorageUnavailable(
            f"broker {name} ({addr}) does not index light queues ({', '.join(off)} not true):"
            " set enableLmq=true and enableMultiDispatch=true in its broker.conf and restart it"
        )
    threads = config.get("sendMessageThreadPoolNums", "1")
    if threads.isdigit() and int(threads) > 1:
        # Sends are pipelined: with several send threads the broker may append two messages
        # in flight in either order, and MQTT keeps one publisher's messages in order.
        log.warning(
            "broker %s has sendMessageThreadPoolNums=%s: messages a client publishes back to"
            " back may be stored (and delivered) out of order; set sendMessageThreadPoolNums=1",
            name, threads,
        )  # fmt: skip
    if config.get("timerWheelEnable", "").lower() != "true":
        # The broker refuses timer messages then (WHEEL_TIMER_NOT_ENABLE): each is a failed
        # PUBLISH (0x80), never an early delivery.
        log.warning(
            "broker %s has timerWheelEnable=%s: delayed publishes ($delayed/...) will fail;"
            " set timerWheelEnable=true (and timerMaxDelaySec >= max_delay) there",
            name, config.get("timerWheelEnable", "?"),
        )  # fmt: skip
    flush = config.get("flushDiskType", "")
    if sync and flush != "SYNC_FLUSH":
        log.warning(
            "--flush sync on broker %s with flushDiskType=%s: its SEND_OK does not wait for"
            " the disk, so an acknowledged message can be lost with the broker's machine;"
            " set flushDiskType=SYNC_FLUSH there",
            name, flush or "?",
        )  # fmt: skip


async def _probe_light_queues(client: RemotingClient, name: str, addr: str, topic: str) -> None:
    """Send one message to PROBE_QUEUE and wait until the broker indexed it there: a broker
    without enableLmq/enableMultiDispatch stores it and silently indexes nothing."""
    try:
        before: int | None = await client.get_max_offset(addr, PROBE_QUEUE)
    except BrokerError:  # a broker without LMQ has no such topic
        before = None
    try:
        await client.send_message(addr, topic, b"lmqtt probe", light_queues=[PROBE_QUEUE])
    except RemotingError as exc:
        raise StorageUnavailable(f"broker {name} ({addr}): light-queue probe: {exc}") from exc
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with contextlib.suppress(RemotingError):
            if await client.get_max_offset(addr, PROBE_QUEUE) > (before or 0):
                return
        await asyncio.sleep(0.05)
    raise StorageUnavailable(
        f"broker {name} ({addr}) does not index light queues: set enableLmq=true and"
        " enableMultiDispatch=true in its broker.conf and restart it"
    )
