"""The storage port: everything the gateway knows of storage, in one typed interface.

The gateway stores every PUBLISH once (one record, dispatched to the light queues of the
filters it matches), reads each subscription's light queue from the subscriber's offset, and
keeps its own durable state (sessions with their subscriptions and wills) as key/value
records in a compacted state log. `Storage` names exactly those operations. The embedded
store (`store.MessageStore`, through gateway/storage/embedded.py) implements it; an Apache RocketMQ
implementation maps it onto the remoting protocol (docs/storage.md). Only this module (the
store's value types and names, re-exported) and embedded.py import `store`; an import-linter
contract keeps it so.

Why synchronous reads: on the hot path a read must cost no more than a dict lookup and a
slice when the data is local. `get` is a *try-read*: it answers from what is at hand (the
embedded store: the page cache; a network client: the messages its pipelined pulls have
brought in) and never blocks; a reader that finds nothing waits for an arrival notice
(`add_listener`, long polling: RocketMQ's PullMessage with the suspend flag). Writes return
their positions at once (`append_encoded`: the embedded store appends in the caller's
thread; a network client sends asynchronously and pipelined), and durability is a separate
await (`wait_durable`, `wait_state_durable`), so acknowledgements can be batched behind one
fsync (group commit) or one broker round trip.

Appends that complete later (RocketMQ, gateway/storage/rocketmq/adapter.py): a broker assigns a
message's light-queue offsets when it stores it and does not return them (docs/rocketmq.md),
so such a backend's `append_encoded` answers before anything is stored: its PutResults have
empty `light_offsets`, and `end_offset` is a *ticket*: `wait_durable(ticket)` returns once the
batch was stored (SEND_OK) and raises StoreError if it was not. Callers therefore treat
`light_offsets` as a hint (an empty one: read the message back from the queue) and
acknowledge only after `wait_durable`, which the embedded store answers from its fsync
position as before (its hot path is unchanged). `put_async` waits for the broker and fills
`light_offsets` where the backend can learn them (RocketMQ: %RETAIN%, read back).

A queue a backend must look up before it can answer `max_offset` without blocking (RocketMQ:
GET_MAX_OFFSET, then a held long poll) is opened with `await open_queue(queue)` before a new
subscription takes the queue's end as its start; the embedded store answers at once.

The value types are the store's own (re-exported here as the port's vocabulary), so the
embedded store needs no conversion per message:

    GetStatus    FOUND | NO_MESSAGE_IN_QUEUE | OFFSET_TOO_SMALL | OFFSET_OVERFLOW_ONE |
                 OFFSET_OVERFLOW_BADLY | NO_MATCHED_LOGIC_QUEUE (RocketMQ's GetMessageStatus)
    GetResult    status, messages, next_offset (read on from here), min_offset, max_offset
    PutResult    physical_offset, queue_offset, light_offsets {queue: offset}, end_offset,
                 store_timestamp
    StoredMessage  topic, body, properties, queue_offset, physical_offset, timestamps, queues

The store's dispatch properties, which it adds to a record it dispatched to light queues,
are named by the store (DISPATCH_KEY: the light queues, DISPATCH_OFFSETS_KEY: the record's
offset in each, comma-separated, same order); a StoredMessage's `queues` is their reading.
    EncodedMessage (parent topic, light queues, body, property block from encode_properties)
    StateRecord  (key, value bytes) puts, (key, None) deletes: newest per key wins
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from store import (
    DISPATCH_KEY,
    DISPATCH_OFFSETS_KEY,
    FLAG_CLEAN,
    FLAG_CLOSED,
    FLAG_SHARED,
    AccountRecord,
    AccountWriter,
    ArrivalListener,
    EncodedMessage,
    GetResult,
    GetStatus,
    PutResult,
    StateRecord,
    StoredMessage,
    StoreError,
    StoreLockedError,
    TimerEntry,
    TimerQueue,
    stored_runs,
)
from topicmap import TopicFilter

__all__ = [
    "DISPATCH_KEY",
    "DISPATCH_OFFSETS_KEY",
    "FLAG_CLEAN",
    "FLAG_CLOSED",
    "FLAG_SHARED",
    "AccountRecord",
    "AccountWriter",
    "ArrivalListener",
    "CommittedOffsets",
    "EncodedMessage",
    "GetResult",
    "GetStatus",
    "LogScan",
    "PutResult",
    "StateRecord",
    "Storage",
    "StorageUnavailable",
    "StoreError",
    "StoreLockedError",
    "StoredMessage",
    "TimerEntry",
    "TimerQueue",
    "stored_runs",
]


class StorageUnavailable(Exception):
    """The storage backend cannot be used (name server unreachable, a broker without light
    queues, ...). The message says what to fix; `lmqtt serve` prints it and exits."""


class CommittedOffsets(Protocol):
    """Consumer offsets by (group, queue): the next offset a consumer group will read.

    RocketMQ: UpdateConsumerOffset / QueryConsumerOffset. The gateway uses the client id as
    the group of a subscriber's own queue and "$share/<group>" for a shared subscription.
    """

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None:
        """`durable=False`: a position that need not survive a restart (a clean session's),
        kept in memory only unless the key is already durable."""

    def get(self, group: str, queue: str) -> int | None: ...

    def remove(self, group: str, queue: str) -> None: ...

    def all(self) -> dict[tuple[str, str], int]: ...


@runtime_checkable
class LogScan(Protocol):
    """A backend whose log reads back in append order from a position (the embedded store;
    not RocketMQ): what a restart uses to find the QoS 2 publishes stored after a session's
    last saved record (gateway/session/qos2.py)."""

    @property
    def log_max_offset(self) -> int: ...

    def messages_since(self, physical_offset: int) -> Iterator[StoredMessage]:
        """The records from `physical_offset` (an earlier `log_max_offset`) to the end."""
        ...


@runtime_checkable
class PublishScan(Protocol):
    """A backend whose publishes read back in store order from a position, asynchronously
    (RocketMQ: the parent topic's queue): where a QoS 2 PUBLISH resent after an unknown outcome
    (its node lost, its send unanswered) is looked for before it is stored again
    (gateway/session/qos2.py)."""

    @property
    def publish_position(self) -> int | None:
        """A position at or below that of every publish appended from now on (None: not
        kept, e.g. publishes spread over several logs)."""
        ...

    def publishes_since(self, position: int) -> AsyncIterator[StoredMessage]:
        """The publishes from `position` (an earlier `publish_position`) to the end as of the
        call (StoreError: the log could not be read)."""
        ...


class Storage(Protocol):
    """What the gateway needs of storage (see the module docstring)."""

    @property
    def offsets(self) -> CommittedOffsets: ...

    async def load_offsets(self, keys: Iterable[tuple[str, str]]) -> None:
        """Make `offsets.get(group, queue)` answer for these keys what a previous run
        committed, where the backend keeps that elsewhere (RocketMQ: the broker's consumer
        offsets, read back; the embedded store has its table in memory already)."""
        ...

    @property
    def closed(self) -> bool: ...

    @property
    def waits(self) -> bool:
        """False when `open_queue` returns at once whatever it is given (the embedded store):
        a SUBSCRIBE is then handled without a task, its SUBACK sent once `state_durable`'s
        future is answered (gateway/connection/subscribe.py)."""
        ...

    @property
    def tail_may_be_lost(self) -> bool:
        """True when the last stop was unclean and the newest messages may be gone (async
        flush), so a saved read position may lie past its queue's end."""
        ...

    # -- messages: append ---------------------------------------------------------------------

    def encode_properties(self, properties: dict[str, str]) -> bytes:
        """The property block of `append_encoded` (validated; InvalidPropertyError)."""
        ...

    def append_encoded(self, messages: Sequence[EncodedMessage]) -> list[PutResult]:
        """Append a batch, each message with its light queues; the results carry the offsets.
        Does not wait for durability (await wait_durable(last end_offset) for that)."""
        ...

    async def put_async(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str] = (),
        properties: dict[str, str] | None = None,
        born_timestamp: int | None = None,
    ) -> PutResult:
        """Append one message and wait for its durability (sync flush mode)."""
        ...

    async def wait_durable(self, end_offset: int) -> None:
        """Return once everything up to `end_offset` is durable (sync flush: fsynced)."""
        ...

    # -- delayed messages ---------------------------------------------------------------------

    @property
    def timers(self) -> TimerQueue | None:
        """The store's durable timer queue, which the gateway fires when entries fall due
        (routing them then); None when the backend delivers delayed messages itself."""
        ...

    async def put_delayed(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str],
        properties: dict[str, str],
        deliver_ms: int,
    ) -> None:
        """Store a message to be delivered at `deliver_ms` (epoch ms); returns once it is
        stored (as durable as put_async). `topic` and `queues`: its parent topic and light
        queues now, which a backend without `timers` dispatches to when due (RocketMQ: the
        broker's timer re-puts the message); with `timers` the gateway routes it when it
        fires, and these are not kept."""
        ...

    # -- messages: read -----------------------------------------------------------------------

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        """Try-read up to `max_messages` of `queue` from `offset` (never blocks)."""
        ...

    def min_offset(self, queue: str) -> int: ...

    def max_offset(self, queue: str) -> int:
        """The queue's next free offset (0 for an unknown queue)."""
        ...

    def read_max_offset(self, queue: str) -> int:
        """`max_offset` of a queue this process reads; -1 for one it does not, without starting
        to read it. For an observer of queue ends that must not become a reader (the delivery
        account): on RocketMQ, max_offset opens a mirror of the queue."""
        ...

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int: ...

    def queues(self) -> list[str]: ...

    @property
    def log_min_offset(self) -> int: ...

    @property
    def log_max_offset(self) -> int:
        """The log's end position: ordering across queues (a subscription's start)."""
        ...

    async def open_queue(self, queue: str) -> None:
        """Make `max_offset(queue)` exact from now on (see the module docstring)."""
        ...

    async def catch_up_queue(self, queue: str) -> None:
        """Return once reads of `queue` see every message stored before the call (RocketMQ:
        its mirror read up to the broker's end)."""
        ...

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None:
        """Make `get` of `queue` at `offsets` answer without blocking (RocketMQ: read them
        into its mirror now)."""
        ...

    def history_queues(self, tf: TopicFilter) -> list[str]:
        """The queues that hold the history of filter `tf`, which a replay reads (matching
        each message against the filter): the embedded store's parent topics (one per first
        topic level), RocketMQ's one parent topic of the deployment."""
        ...

    async def open_history(self, queues: Sequence[str], since_ms: int) -> None:
        """Before a replay of `queues` from `since_ms` is pinned: make `min_offset`,
        `max_offset` and `offset_by_time(q, since_ms)` of those queues answer without blocking
        (RocketMQ asks the broker: GET_MIN/MAX_OFFSET, SEARCH_OFFSET_BY_TIMESTAMP)."""
        ...

    def close_queue(self, queue: str) -> None:
        """No subscription reads `queue` any more: drop what is kept to read it (RocketMQ: its
        mirror and held pull); a later read opens it again."""
        ...

    def add_listener(self, listener: ArrivalListener) -> None:
        """Arrival notices: `listener.on_arrival(queue, max_offset)` after each append."""
        ...

    # -- durable gateway state ----------------------------------------------------------------

    def state_records(self) -> Iterable[StateRecord]:
        """Every state record, oldest first (the newest of a key wins); for recovery."""
        ...

    def append_state(self, records: Iterable[StateRecord]) -> int:
        """Append state changes as one batch; returns the position for wait_state_durable."""
        ...

    async def wait_state_durable(self, position: int) -> None:
        """Return once the state log is durable up to `position` (group commit)."""
        ...

    def state_durable(self, position: int) -> asyncio.Future[None] | None:
        """`wait_state_durable` without a coroutine: None when there is nothing to wait for,
        else a future answered once the state log is durable up to `position`."""
        ...

    async def compact_state(self) -> None:
        """Rewrite the state log when its history outweighs its live state (bounds restart
        time); a no-op when not needed."""
        ...

    # -- small config documents (the retained snapshot) ---------------------------------------

    def read_config(self, name: str) -> bytes | None: ...

    def write_config(self, name: str, data: bytes) -> None: ...

    async def drain(self) -> None:
        """Wait (bounded) until what was appended so far is stored, before close() at a
        graceful stop (RocketMQ: the sends in flight answered; embedded: close() fsyncs)."""
        ...

    def close(self) -> None: ...
