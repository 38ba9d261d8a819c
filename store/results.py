"""Values crossing the store's public API: put/get results, stored messages, listeners."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from store.kernel import load as load_kernel


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
    Must be quick and must not raise (exceptions are logged and dropped). A listener with a
    method ``on_arrivals(ends: dict[str, int])`` is called that instead, once per appended
    batch, with every queue the batch touched and where it now ends (the dict is the store's:
    read it during the call, copy it to keep it).
    """

    def on_arrival(self, queue: str, max_offset: int) -> None: ...


#: (parent topic, light queues, body, property block): one message of an appended batch
#: (MessageStore.append_encoded).
_Encoded = tuple[str, tuple[str, ...], bytes, bytes]
_tuple_new = tuple.__new__


def stored_runs_py(
    messages: Sequence[_Encoded],
    props: Sequence[dict[str, str]],
    results: Sequence[PutResult],
    stored_message: type[StoredMessage] = StoredMessage,
) -> dict[str, tuple[list[StoredMessage], int]]:
    """The StoredMessages an appended batch adds to each light queue, in batch order, with
    the sum of their body lengths, built from what the append had and returned (no read
    back): `props[k]` is message k's properties, `results[k]` its PutResult. A message's
    `queues` is its own tuple when that names each light queue once, else the queues in
    dispatch order. The reference of store/_speedups.c `stored_runs`
    (tests/store/test_stored_runs.py)."""
    runs: dict[str, list[StoredMessage]] = {}
    for (parent, routed, body, _), p, r in zip(messages, props, results, strict=True):
        lights = r.light_offsets
        if not lights:
            continue
        queues = routed if len(routed) == len(lights) else tuple(lights)
        ts = r.store_timestamp
        phys = r.physical_offset
        qoff = r.queue_offset
        for q, off in lights.items():
            m = _tuple_new(stored_message, (parent, body, p, off, phys, ts, ts, qoff, queues))
            run = runs.get(q)
            if run is None:
                runs[q] = [m]
            else:
                run.append(m)
    return {q: (run, sum([len(m[1]) for m in run])) for q, run in runs.items()}


StoredRuns = Callable[..., dict[str, tuple[list[StoredMessage], int]]]


#: store/_speedups.c's stored_runs, or its reference; LMQTT_PURE_PYTHON (every accelerator)
#: or LMQTT_PURE_PYTHON_APPEND keep the reference.
_STORED_RUNS: StoredRuns = getattr(
    load_kernel("LMQTT_PURE_PYTHON_APPEND"), "stored_runs", stored_runs_py
)


def stored_runs(
    messages: Sequence[_Encoded],
    props: Sequence[dict[str, str]],
    results: Sequence[PutResult],
) -> dict[str, tuple[list[StoredMessage], int]]:
    """stored_runs_py, in C when built (lists only; other sequences take the reference)."""
    if type(messages) is list and type(props) is list and type(results) is list:
        return _STORED_RUNS(messages, props, results, StoredMessage)
    return stored_runs_py(messages, props, results)
