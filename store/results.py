"""Values crossing the store's public API: put/get results, stored messages, listeners."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class GetStatus(enum.Enum):
    """Outcome of a read, as RocketMQ's GetMessageStatus."""

    FOUND = "FOUND"
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"  # the queue exists but was never written
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"  # below min_offset (retention deleted it)
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"  # offset == max_offset: nothing new yet
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"  # offset > max_offset
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"  # no such queue


class PutResult(NamedTuple):
    """Where a message went. ``end_offset`` = physical_offset + record size.

    A NamedTuple rather than a dataclass: one is built per put, on the hot path.
    """

    physical_offset: int
    queue_offset: int
    light_offsets: dict[str, int]
    end_offset: int
    store_timestamp: int = 0


class StoredMessage(NamedTuple):
    """A message read back.

    ``queue_offset`` is the offset in the queue that was read (a light queue's own offset when
    reading a light queue; the parent offset for ``message_at``). ``properties`` are the
    caller's own; the store's INNER_* and __CRC32# properties are removed and the light queues
    are in ``queues``. A NamedTuple: one is built per message read, on the hot path.
    """

    topic: str
    body: bytes
    properties: dict[str, str]
    queue_offset: int
    physical_offset: int
    store_timestamp: int
    born_timestamp: int
    parent_offset: int = 0
    queues: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GetResult:
    """A batch read from one queue; read again from ``next_offset``."""

    status: GetStatus
    messages: list[StoredMessage] = field(default_factory=list)
    next_offset: int = 0
    min_offset: int = 0
    max_offset: int = 0


class ArrivalListener(Protocol):
    """Told after dispatch that ``queue`` now ends at ``max_offset`` (its next free offset).

    Called in the thread that called put, outside the store's lock, once per queue touched.
    Must be quick and must not raise (exceptions are logged and dropped).
    """

    def on_arrival(self, queue: str, max_offset: int) -> None: ...
