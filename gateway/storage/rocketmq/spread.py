"""A deployment's messages spread over several RocketMQ brokers (`rocketmq_spread = true`).

Light queues are per broker (docs/rocketmq.md): a message sent to broker B is indexed only in
B's copies of its light queues. With spread on, each message goes to the broker
`rocketmq_remoting.route.broker_for(mqtt topic, brokers)` picks (rendezvous hashing: one MQTT
topic's messages are on one broker, in one order), and every gateway light queue `Q` is read
from every broker and merged here, so the gateway's core still sees ONE queue `Q` with one
offset per message. `%STATE%`, `%RETAIN%` and `%CLUSTER%` (queues not named `%LMQ%...`) stay
on the home broker: each needs one total order.

Slots and offsets. The brokers are numbered in the `meta/brokers` state record (slot 0 = home),
and the core sees a merged queue's positions as one int packing the per-broker offsets: the
format is drawn in topicmap/spread.py (the fan-out report decodes it too), imported here.

Order in a read: the messages each broker's mirror holds from the position, merged by store
timestamp (the brokers' clocks); a broker whose mirror is still pulling does not hold the
others back (its messages come in a later read, their offsets above what was read).

A broker lost (`Routing`). A message goes to `broker_for(mqtt topic, live brokers)`, so while a
broker is lost its topics' new messages go to the next broker of their rendezvous order and
every other topic stays where it was. A broker counts as lost from the moment a send to it
gets no answer (refused connection, connection lost, no answer in time: that message itself
goes at once to the stand-in, gateway/storage/rocketmq/sender.py), or when the route poll
(every `rocketmq_route_poll` s) finds it no longer registered; it is back when the next poll
finds it registered again. So publishes go on within one poll, at once after a failed send.
Order, the rule: each change of the live brokers closes a gate; the sends made after it go only
once every send in flight at the change is answered. A topic's messages before a change are
thus stored before its messages after it, on whichever broker each went to, and merged reads
deliver them in that order (store time). The messages a lost broker held stay there: they are
delivered when it is back, after the newer ones of the same topic stored on the stand-in
meanwhile, which is the one break of a topic's order; from its return on, order holds again.
A message whose send got no answer may have been stored on the lost broker all the same: it is
then stored twice (at least once, as after any unanswered send). Home-only queues (%STATE%,
%RETAIN%, %CLUSTER%) never move: they wait for the home broker.

Physical offsets. A merged message's `physical_offset` is time-major:
`(store_timestamp - EPOCH_MS) << 24 | slot << 20 | commitlog offset & 0xFFFFF`, below 2**62
(gateway/session/replay.py's REPLAYING) until 2033: unique as long as no broker writes 1 MiB within
one millisecond (the decoded-record and encoded-PUBLISH caches key on it), and ordered by
store time across brokers, so `log_max_offset` (now, in that form) as a subscription's
`start_phys`, the ownership between overlapping subscriptions and a replay's merge of the
per-broker history queues (gateway/session/replay.py merges by physical offset) all compare
brokers' records by when they were stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from gateway.storage.port import GetResult, GetStatus, StoredMessage
from rocketmq_remoting.route import broker_for
from topicmap.record import TOPIC

# The merged-offset format's home is topicmap/spread.py; its names stay importable from here.
from topicmap.spread import BASE as BASE
from topicmap.spread import SLOTS_KEY as SLOTS_KEY
from topicmap.spread import decode, encode, message_at, spread_queue
from topicmap.spread import slots_from_state as slots_from_state

if TYPE_CHECKING:
    from gateway.storage.rocketmq.sender import Sender


class Mirrors(Protocol):
    """What the merge reads of one broker's mirrors (gateway/storage/rocketmq/mirrors.py)."""

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult: ...

    def min_offset(self, queue: str) -> int: ...

    def max_offset(self, queue: str) -> int: ...


class BrokerOffsets(Protocol):
    """One broker's committed offsets (gateway/storage/rocketmq/offsets.py)."""

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None: ...

    def get(self, group: str, queue: str) -> int | None: ...

    def remove(self, group: str, queue: str) -> None: ...

    def all(self) -> dict[tuple[str, str], int]: ...

    async def load(self, keys: Iterable[tuple[str, str]]) -> None: ...

    async def flush(self, *, oneway: bool = False) -> None: ...

    def close(self) -> None: ...


log = logging.getLogger("lmqtt.rocketmq")

EPOCH_MS = 1_735_689_600_000  # 2025-01-01: physical offsets stay below 2**62 until 2033
#: How long a merged read waits for a broker's copy being pulled before it reads on without it.
WAIT_S = 2.0
#: The separator of a per-broker name (history queue `topic\x00broker`): never in an MQTT
#: topic, filter or RocketMQ name.
SEP = "\x00"


def phys(slot: int, msg: StoredMessage) -> int:
    return (msg.store_timestamp - EPOCH_MS) << 24 | slot << 20 | (msg.physical_offset & 0xFFFFF)


def log_max_now() -> int:
    """`log_max_offset` in the time-major form: records stored from now on are at or above."""
    return (int(time.time() * 1000) - EPOCH_MS) << 24


class MergedReads:
    """Reads of the merged light queues over every slot's mirrors (see the module docstring)."""

    def __init__(self, mirrors: list[Mirrors]) -> None:
        self.mirrors = mirrors  # by slot
        # (queue, slot) -> when a read first waited for that broker's copy (see `get`)
        self._waiting: dict[tuple[str, int], float] = {}

    def get(self, queue: str, offset: int, max_messages: int) -> GetResult:
        mirrors = self.mirrors
        n = len(mirrors)
        vec, first = decode(offset, n)
        runs: list[list[StoredMessage]] = []
        wait = False
        for k, m in enumerate(mirrors):
            got = m.get(queue, vec[k], max_messages)
            if got.status is GetStatus.OFFSET_TOO_SMALL:
                log.warning(
                    "queue %s on broker slot %d: offsets %d..%d deleted by retention",
                    queue, k, vec[k], got.min_offset,
                )  # fmt: skip
                vec[k] = got.min_offset
                got = m.get(queue, vec[k], max_messages)
            if got.status is GetStatus.NO_MESSAGE_IN_QUEUE:
                # That broker's next message is being pulled (a backlog): the others wait for
                # it, so the merge stays in store order (a topic's retained message is on the
                # home broker, its others on the topic's), for at most WAIT_S (a broker down).
                since = self._waiting.setdefault((queue, k), time.monotonic())
                wait = wait or time.monotonic() - since < WAIT_S
            elif self._waiting:
                self._waiting.pop((queue, k), None)
            runs.append(got.messages if got.status is GetStatus.FOUND else [])
        if wait and first < 0:
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, self.min_offset(queue),
                             self.max_offset(queue))  # fmt: skip
        if first >= 0 and not (runs[first] and runs[first][0].queue_offset == vec[first]):
            # A message's own offset: that message first, or nothing (it is being pulled).
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, self.min_offset(queue),
                             self.max_offset(queue))  # fmt: skip
        out: list[StoredMessage] = []
        heads = [0] * n
        while len(out) < max_messages:
            best = -1
            if first >= 0:
                best, first = first, -1
            else:
                ts = 0
                for k in range(n):
                    run = runs[k]
                    i = heads[k]
                    if i < len(run) and (best < 0 or run[i].store_timestamp < ts):
                        best, ts = k, run[i].store_timestamp
            if best < 0:
                break
            msg = runs[best][heads[best]]
            heads[best] += 1
            out.append(
                msg._replace(
                    queue_offset=encode(vec, 2 * best + 1), physical_offset=phys(best, msg)
                )
            )
            vec[best] += 1
        if not out:
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, self.min_offset(queue),
                             self.max_offset(queue))  # fmt: skip
        return GetResult(GetStatus.FOUND, out, encode(vec), self.min_offset(queue),
                         self.max_offset(queue))  # fmt: skip

    def max_offset(self, queue: str) -> int:
        return encode([m.max_offset(queue) for m in self.mirrors])

    def min_offset(self, queue: str) -> int:
        return encode([m.min_offset(queue) for m in self.mirrors])

    def count(self, queue: str, offset: int) -> int:
        """`offset` of `queue` as the number of messages before it over every broker (the sum
        of its per-broker offsets): differences of these count messages."""
        if not spread_queue(queue):
            return offset
        return sum(decode(offset, len(self.mirrors))[0])

    def split(self, queue: str, offsets: Sequence[int]) -> dict[int, list[int]]:
        """Merged message offsets -> {slot: that broker's offsets} (prefetch)."""
        n = len(self.mirrors)
        out: dict[int, list[int]] = {}
        for value in offsets:
            at = message_at(value, n)
            if at is not None:
                out.setdefault(at[0], []).append(at[1])
        return out


class SpreadOffsets:
    """CommittedOffsets over every slot's broker: a merged queue's committed position goes to
    each broker as its own component, under today's group and light queue names (the broker
    keeps `%LMQ%` offsets per broker anyway); other queues to the home broker only.

    Read back (`load`, a restart): a shared group's position is composed from its brokers'
    offsets (a group exists only as its committed offsets). A session's is not: its record
    holds its exact position, and a composed broker position compared with it as one int
    could drop in-flight entries the record still needs (`Session.skip_acknowledged`), so
    after a crash a spread session redelivers from its record (at least once, never lost).
    """

    def __init__(self, slots: list[BrokerOffsets]) -> None:
        self._slots = slots  # by slot; 0 = home
        self._merged: dict[tuple[str, str], int] = {}

    def add(self, slot: BrokerOffsets) -> None:
        self._slots.append(slot)

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None:
        if not spread_queue(queue):
            self._slots[0].commit(group, queue, offset, durable=durable)
            return
        self._merged[(group, queue)] = offset
        vec, _ = decode(offset, len(self._slots))
        for k, slot in enumerate(self._slots):
            if slot.get(group, queue) != vec[k]:
                slot.commit(group, queue, vec[k], durable=durable)

    def get(self, group: str, queue: str) -> int | None:
        if not spread_queue(queue):
            return self._slots[0].get(group, queue)
        found = self._merged.get((group, queue))
        if found is not None or not group.startswith("$share/"):
            return found
        parts = [slot.get(group, queue) for slot in self._slots]
        if any(p is None for p in parts):
            return None
        return encode([p for p in parts if p is not None])

    def remove(self, group: str, queue: str) -> None:
        self._merged.pop((group, queue), None)
        for slot in self._slots:
            slot.remove(group, queue)

    def all(self) -> dict[tuple[str, str], int]:
        out = self._slots[0].all()
        out.update(self._merged)
        return out

    async def load(self, keys: Iterable[tuple[str, str]]) -> None:
        wanted = list(keys)
        await self._slots[0].load(wanted)
        spread = [k for k in wanted if spread_queue(k[1])]
        for slot in self._slots[1:]:
            await slot.load(spread)

    async def flush(self) -> None:
        for slot in self._slots:
            await slot.flush()

    def close(self) -> None:
        for slot in self._slots:
            slot.close()


_TOPIC_PAIR = TOPIC.encode() + b"\x01"


def mqtt_topic(block: bytes, parent: str) -> str:
    """The MQTT topic in an encoded property block (`TOPIC \x01 name \x02`)."""
    i = block.find(_TOPIC_PAIR)
    if i < 0 or (i > 0 and block[i - 1] != 2):
        return parent
    j = block.find(b"\x02", i)
    return block[i + len(_TOPIC_PAIR) : j if j >= 0 else len(block)].decode("utf-8", "replace")


class Routing:
    """Which broker a spread message goes to: by MQTT topic over the live brokers, and the gate
    of a change of them (see "A broker lost" above). The sender's Failover."""

    def __init__(
        self,
        names: list[str],
        sender_of: Callable[[str], Sender],
        in_flight: Callable[[], list[asyncio.Future[None]]],
    ) -> None:
        self.names = names  # by slot, the home broker first (the adapter's list, shared)
        self.writable: list[str] = names  # where new messages go
        self._sender_of = sender_of
        self._in_flight = in_flight
        self._drained: set[str] = set()
        self.lost: set[str] = set()
        self._gate: asyncio.Future[Any] | None = None

    def gate(self) -> asyncio.Future[Any] | None:
        """What a send made now waits for (None: nothing)."""
        gate = self._gate
        if gate is not None and gate.done():
            self._gate = gate = None
        return gate

    def sender(self, topic: str) -> Sender:
        return self._sender_of(broker_for(topic.encode(), self.writable))

    def set_drained(self, names: Collection[str]) -> None:
        """Brokers new messages no longer go to: the route lists them without write permission
        (an operator drains a broker by taking it away; what it holds is still read)."""
        self._drained = set(names)
        self._update()

    def set_registered(self, names: Collection[str]) -> None:
        """The route poll's view: brokers not registered are lost, registered ones back."""
        lost = {n for n in self.names if n not in names}
        for name in sorted(lost - self.lost):
            log.warning("broker %s is not registered: its topics' messages go to the others", name)
        for name in sorted(self.lost - lost):
            log.warning("broker %s is back: its topics' new messages go to it again", name)
        self.lost = lost
        self._update()

    def instead_of(self, broker: str, queues: Sequence[str], block: bytes) -> Sender | None:
        if any(not spread_queue(q) for q in queues):
            return None  # a home-only queue's message waits for its broker
        if broker not in self.lost:
            log.warning("broker %s does not answer: its topics' messages go to the others", broker)
            self.lost.add(broker)
            self._update()
        live = [n for n in self.names if n not in self.lost and n not in self._drained]
        if not live:
            return None
        return self._sender_of(broker_for(mqtt_topic(block, "").encode(), live))

    def _update(self) -> None:
        writable = [n for n in self.names if n not in self._drained and n not in self.lost]
        if writable == self.writable:
            return
        self.writable = writable or [n for n in self.names if n not in self._drained] or self.names
        pending: list[asyncio.Future[Any]] = [*self._in_flight()]
        if self._gate is not None and not self._gate.done():
            pending.append(self._gate)
        if pending:
            self._gate = asyncio.ensure_future(asyncio.wait(pending))
