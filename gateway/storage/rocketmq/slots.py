"""The brokers of a deployment by slot (gateway/storage/rocketmq/spread.py): the home broker's
parts in slot 0, each broker added by `Slots.add` in the next one.

`Slots` answers where a message goes (by MQTT topic; one ticket for a batch sent over several
brokers), which brokers hold a copy of a queue and which history queue is which broker's. With
one broker it hands everything to the home broker's parts as they are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from gateway.bounded import trim_oldest
from gateway.storage.port import ArrivalListener, EncodedMessage, GetResult
from gateway.storage.rocketmq.broker import Broker
from gateway.storage.rocketmq.history import ParentHistory
from gateway.storage.rocketmq.mirrors import Mirrors
from gateway.storage.rocketmq.offsets import BrokerOffsets
from gateway.storage.rocketmq.sender import Sender
from gateway.storage.rocketmq.spread import (
    SEP,
    MergedReads,
    Routing,
    SpreadOffsets,
    mqtt_topic,
    spread_queue,
)
from gateway.storage.rocketmq.spread import phys as spread_phys

#: A broker's history queue as `Slots.history_of` finds it: (slot, its history, queue name).
History = tuple[int, ParentHistory, str]


class Renamed:
    """Arrival listener of a broker's parent-topic history other than the home broker's:
    its notices name that broker's history queue (`topic SEP broker`)."""

    def __init__(self, listener: ArrivalListener, topic: str, name: str) -> None:
        self._listener = listener
        self._topic = topic
        self._name = name

    def on_arrival(self, queue: str, max_offset: int) -> None:
        self._listener.on_arrival(self._name if queue == self._topic else queue, max_offset)


class MergedEnds:
    """Arrival listener of a broker's mirrors in a spread deployment: a notice tells where its
    queue ends (delivery reads up to there without asking), so a spread queue's notice carries
    the merged end over every broker (the core's one offset), never one broker's own offset;
    other queues (home-only) pass as they are."""

    def __init__(self, listener: ArrivalListener, slots: Slots) -> None:
        self._listener = listener
        self._slots = slots

    def on_arrival(self, queue: str, max_offset: int) -> None:
        merged = self._slots.merged
        if merged is not None and spread_queue(queue):
            max_offset = merged.max_offset(queue)
        self._listener.on_arrival(queue, max_offset)

    def on_arrivals(self, ends: dict[str, int]) -> None:
        """The queues of one tail answer (Mirrors' batch notice): passed on in one call when
        the listener takes batches, spread queues at their merged ends."""
        batch = getattr(self._listener, "on_arrivals", None)
        merged = self._slots.merged
        if batch is None:
            for queue, end in ends.items():
                self.on_arrival(queue, end)
            return
        if merged is not None:
            ends = {q: merged.max_offset(q) if spread_queue(q) else e for q, e in ends.items()}
        batch(ends)


class Slot:
    """One broker of a spread deployment other than the home broker: its sends, mirrors,
    parent-topic history and committed offsets (gateway/storage/rocketmq/spread.py)."""

    def __init__(self, broker: Broker, *, sync: bool, routing: Routing, notify: bool) -> None:
        self.broker = broker
        self.history_queue = broker.topic + SEP + broker.name
        self.history = ParentHistory(broker)
        self.sender = Sender(broker, self.history, sync=sync, failover=routing)
        self.mirrors = Mirrors(broker, self.sender.saw_phys, notify=notify)
        self.offsets = BrokerOffsets(broker)


class Slots:
    """The home broker's parts (slot 0) and the added brokers' (`others`, slots 1..)."""

    def __init__(
        self,
        home: Broker,
        sender: Sender,
        mirrors: Mirrors,
        history: ParentHistory,
        offsets: BrokerOffsets,
        *,
        sync: bool,
        notify: bool = False,
    ) -> None:
        self._topic = home.topic
        self._sender = sender
        self._mirrors = mirrors
        self._history = history
        self._home_offsets = offsets
        self._sync = sync
        self._notify = notify  # rocketmq_notify_pulls: the tail feeds each broker's mirrors
        self.others: list[Slot] = []
        self.names: list[str] = [home.name]  # broker names by slot
        self.routing = Routing(self.names, self._sender_named, self._sends_in_flight)
        #: The merged reads of the spread queues; None with one broker.
        self.merged: MergedReads | None = None
        self.offsets: BrokerOffsets | SpreadOffsets = offsets
        self._by_history: dict[str, Slot] = {}
        self._listeners: list[ArrivalListener] = []
        self._tickets: dict[int, list[tuple[Sender, int]]] = {}
        self._ticket = 0

    def add(self, broker: Broker) -> None:
        """Spread messages to `broker` too from now on (its copies read from offset 0)."""
        slot = Slot(broker, sync=self._sync, routing=self.routing, notify=self._notify)
        self._sender.failover = self.routing
        self.others.append(slot)
        self.names.append(broker.name)
        self._by_history[slot.history_queue] = slot
        if self.merged is None:
            self.merged = MergedReads([self._mirrors])
            self.offsets = SpreadOffsets([self._home_offsets])
        self.merged.mirrors.append(slot.mirrors)
        assert isinstance(self.offsets, SpreadOffsets)
        self.offsets.add(slot.offsets)
        for listener in self._listeners:
            slot.mirrors.add_listener(MergedEnds(listener, self))
            slot.history.add_listener(Renamed(listener, broker.topic, slot.history_queue))
        for queue in self._mirrors.queues():
            if spread_queue(queue):
                slot.mirrors.mirror(queue)  # held pulls on the new broker's copies too

    def add_listener(self, listener: ArrivalListener) -> None:
        """Told of arrivals on every broker's mirrors and history (added ones too, later)."""
        self._listeners.append(listener)
        self._mirrors.add_listener(MergedEnds(listener, self))
        self._history.add_listener(listener)
        for slot in self.others:
            slot.mirrors.add_listener(MergedEnds(listener, self))
            slot.history.add_listener(Renamed(listener, self._topic, slot.history_queue))

    # -- where a message goes ---------------------------------------------------------------------

    def _sender_named(self, name: str) -> Sender:
        if name == self.names[0]:
            return self._sender
        return next(s.sender for s in self.others if s.broker.name == name)

    def _sends_in_flight(self) -> list[asyncio.Future[None]]:
        out = self._sender.in_flight_sends()
        for slot in self.others:
            out += slot.sender.in_flight_sends()
        return out

    def sender_for(self, topic: str, queues: Sequence[str]) -> Sender:
        """The broker a message goes to: by MQTT topic; the home broker for a message of a
        home-only queue (%RETAIN%, %CLUSTER%: one total order each)."""
        if not self.others or any(not spread_queue(q) for q in queues):
            return self._sender
        return self.routing.sender(topic)

    def gate(self) -> asyncio.Future[Any] | None:
        """What a send waits for after a change of the live brokers (Routing.gate)."""
        return self.routing.gate() if self.others else None

    def send_batch(self, messages: Sequence[EncodedMessage]) -> int:
        """Send `messages`: one batch per broker (each pipelined on its connection); one
        ticket for all (`wait_durable`)."""
        if not self.others:
            return self._sender.send_batch(messages)
        parts: dict[int, tuple[Sender, list[EncodedMessage]]] = {}
        for message in messages:
            sender = self.sender_for(mqtt_topic(message[3], message[0]), message[1])
            parts.setdefault(id(sender), (sender, []))[1].append(message)
        self._ticket += 1
        gate = self.routing.gate()
        self._tickets[self._ticket] = [
            (s, s.send_batch(batch, gate)) for s, batch in parts.values()
        ]
        trim_oldest(self._tickets, 100_000)
        return self._ticket

    async def wait_durable(self, ticket: int) -> None:
        if not self.others:
            await self._sender.wait_durable(ticket)
            return
        for sender, part in self._tickets.pop(ticket, ()):
            await sender.wait_durable(part)

    def in_flight(self) -> list[asyncio.Future[Any]]:
        """Every broker's sends not answered yet."""
        return [*self._sender.in_flight(), *(f for s in self.others for f in s.sender.in_flight())]

    async def settle(self) -> None:
        await self._sender.settle()
        for slot in self.others:
            await slot.sender.settle()

    # -- which broker holds what ------------------------------------------------------------------

    def copies(self, queue: str) -> list[Mirrors]:
        """The mirrors holding `queue`: every broker's for a spread queue, else the home's."""
        if self.others and spread_queue(queue):
            return [self._mirrors, *(s.mirrors for s in self.others)]
        return [self._mirrors]

    def live_copies(self, queue: str) -> list[Mirrors]:
        """`copies` without a lost broker's (read once it is back: its mirror keeps asking)."""
        copies = self.copies(queue)
        if self.routing.lost and len(copies) > 1:
            copies = [m for k, m in enumerate(copies) if self.names[k] not in self.routing.lost]
        return copies

    def history_queues(self) -> list[str]:
        """One history queue per broker: the parent topic, named by broker after the home's."""
        return [self._topic, *(s.history_queue for s in self.others)]

    def histories(self, queues: Iterable[str]) -> list[tuple[str, ParentHistory]]:
        """(broker name, its history) of each history queue in `queues`."""
        wanted = set(queues)
        todo = [(self.names[0], self._history)] if self._topic in wanted else []
        return todo + [(s.broker.name, s.history) for s in self.others if s.history_queue in wanted]

    def history_of(self, queue: str) -> History | None:
        if queue == self._topic:
            return 0, self._history, queue
        slot = self._by_history.get(queue)
        if slot is None:
            return None
        return self.others.index(slot) + 1, slot.history, queue

    @staticmethod
    def history_get(hist: History, offset: int, max_messages: int) -> GetResult:
        """A broker's history with time-major physical offsets: replays merge the brokers'
        histories by them, in store-time order (gateway/storage/rocketmq/spread.py)."""
        k, history, queue = hist
        got = history.get(offset, max_messages)
        if not got.messages:
            return got
        # Named like the queue read (gateway/session/replay.py hands over a parent's own messages).
        msgs = [m._replace(topic=queue, physical_offset=spread_phys(k, m)) for m in got.messages]
        return GetResult(got.status, msgs, got.next_offset, got.min_offset, got.max_offset)

    def close(self) -> None:
        """Stop the added brokers' pulls (the home broker's parts are the storage's to close)."""
        for slot in self.others:
            slot.mirrors.close()
            slot.history.close()
