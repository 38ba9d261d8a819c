"""TimerQueue: messages due later, kept durably in the CommitLog (the store's timer).

A delayed message is appended like any other record, to the timer topic TIMER_TOPIC, with its
due time (epoch ms) in PROP_DELIVER_MS; TIMER_TOPIC's consume queue indexes them in arrival
order (RocketMQ's SCHEDULE_TOPIC_XXXX / timer log play the same part). Its owner (the gateway,
which alone knows where a message goes) asks for the due ones and `fire`s each: the real
message is appended to its topic and light queues, and the same record is also dispatched to
the light queue FIRED_QUEUE with PROP_FIRED_OF = the timer entry's offset in TIMER_TOPIC.

The exactly-once rule:

    a timer entry has fired  <=>  a record in FIRED_QUEUE names its offset

The fired mark and the real message are one record, appended in one critical section, so a
crash leaves both or neither: never a message without its mark (fired twice after a restart)
nor a mark without its message (lost). A fired record lost with the unflushed tail of the log
(power loss, async flush) takes its mark with it, and the entry (older, so flushed first)
fires again.

Recovery reads only what may still be pending, from a checkpoint (CHECKPOINT_NAME, in the
store's config directory, replaced atomically):

    offset 0            8
           +------------+------------+
           | C  int64   | F  int64   |   big-endian
           +------------+------------+

    C  every TIMER_TOPIC entry below C has fired, and its fired record is flushed
    F  every fired record naming an entry >= C sits at FIRED_QUEUE offset >= F

At open: pending = TIMER_TOPIC entries from C on, minus those named by FIRED_QUEUE records
from F on. A checkpoint behind the truth only makes that read longer; one ahead would lose
timers, so it is written from flushed facts only (`save_checkpoint`). The read spans what
arrived since the oldest pending entry, never the whole log. Pending entries are kept in
memory as (due, offset, physical offset): about 100 bytes each, in a heap by due time (a
firing costs O(log n)). The limit of one watermark: a long delay among many short ones holds
C back, so the marks of those fired since stay in memory (about 50 bytes each) and the next
start reads them again, until it fires.

Retention deletes whole CommitLog segments by age: an entry older than the retention is lost
with its segment (the open logs how many). The operator keeps retention above the longest delay.

Not thread-safe: one owner (the event loop) calls it.
"""

from __future__ import annotations

import heapq
import logging
import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from store.append import EncodedMessage
from store.results import GetResult, GetStatus, PutResult, StoredMessage

log = logging.getLogger("lmqtt.store")

#: The parent topic of delayed records (not a valid MQTT parent name: replay never reads it).
TIMER_TOPIC = "%TIMER%"
#: The light queue of fired records (their marks).
FIRED_QUEUE = "%TIMER_FIRED%"
#: Due time, epoch milliseconds (RocketMQ's MessageConst.PROPERTY_TIMER_DELIVER_MS).
PROP_DELIVER_MS = "TIMER_DELIVER_MS"
#: On a fired record: the TIMER_TOPIC offset of the entry it fires.
PROP_FIRED_OF = "TIMER_FIRED_OF"
CHECKPOINT_NAME = "timer-checkpoint"
_CHECKPOINT = struct.Struct(">qq")
_READ_BATCH = 256


class TimerStore(Protocol):
    """What TimerQueue uses of the store (store.MessageStore)."""

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult: ...

    def min_offset(self, queue: str) -> int: ...

    def max_offset(self, queue: str) -> int: ...

    def encode_properties(self, properties: dict[str, str]) -> bytes: ...

    def append_encoded(self, messages: Sequence[EncodedMessage]) -> list[PutResult]: ...

    async def wait_durable(self, end_offset: int) -> None: ...

    def message_at(self, physical_offset: int) -> StoredMessage: ...

    def read_config(self, name: str) -> bytes | None: ...

    def write_config(self, name: str, data: bytes) -> None: ...

    @property
    def flushed_offset(self) -> int: ...


class TimerEntry(NamedTuple):
    """A pending delayed message: due time, its TIMER_TOPIC offset, its record's position."""

    due_ms: int
    offset: int
    physical_offset: int


def read_checkpoint(data: bytes | None) -> tuple[int, int]:
    if data is None or len(data) != _CHECKPOINT.size:
        return 0, 0
    c, f = _CHECKPOINT.unpack(data)
    return int(c), int(f)


def _read_queue(store: TimerStore, queue: str, start: int) -> Iterator[StoredMessage]:
    """Every message of `queue` from `start` (or its minimum, when retention removed it)."""
    offset = max(start, store.min_offset(queue))
    while True:
        res = store.get(queue, offset, _READ_BATCH)
        if res.status == GetStatus.OFFSET_TOO_SMALL:
            offset = res.next_offset
            continue
        if res.status != GetStatus.FOUND or not res.messages:
            return
        yield from res.messages
        offset = res.next_offset


class TimerQueue:
    """Delayed messages of one store (see the module docstring)."""

    def __init__(self, store: TimerStore) -> None:
        self._store = store
        self._heap: list[TimerEntry] = []
        # Offsets not yet fired: on the heap, or taken off it by due() and not yet fired.
        self._pending: set[int] = set()
        # Fired entries at or above the checkpoint's C: offset -> (FIRED_QUEUE offset, end of
        # the fired record in the log), until a checkpoint covers them.
        self._fired: dict[int, tuple[int, int]] = {}
        self._checkpoint = (0, 0)
        self._moved = False  # something fired or was forgotten since the last full save

    # -- open ----------------------------------------------------------------------------------

    def recover(self) -> int:
        """Load the pending entries (from the checkpoint on); returns how many are pending."""
        store = self._store
        c, f = self._checkpoint = read_checkpoint(store.read_config(CHECKPOINT_NAME))
        lost = max(0, store.min_offset(TIMER_TOPIC) - c) if store.max_offset(TIMER_TOPIC) else 0
        fired: dict[int, tuple[int, int]] = {}
        for m in _read_queue(store, FIRED_QUEUE, f):
            of = m.properties.get(PROP_FIRED_OF)
            if of is not None and int(of) >= c:
                fired[int(of)] = (m.queue_offset, 0)
        for m in _read_queue(store, TIMER_TOPIC, c):
            if m.queue_offset in fired:
                continue
            due = int(m.properties.get(PROP_DELIVER_MS, "0"))
            self._push(TimerEntry(due, m.queue_offset, m.physical_offset))
        self._fired = fired
        self._moved = bool(fired)
        if lost:
            log.warning(
                "timer: retention removed %d delayed message(s) the checkpoint did not see fire"
                " (those still pending are lost)",
                lost,
            )
        return len(self._heap)

    # -- schedule and fire ---------------------------------------------------------------------

    async def schedule(
        self, body: bytes, properties: dict[str, str], due_ms: int
    ) -> tuple[TimerEntry, PutResult]:
        """Append a message due at `due_ms` (acknowledge it once this returns: durable in sync
        flush mode)."""
        store = self._store
        props = dict(properties)
        props[PROP_DELIVER_MS] = str(due_ms)
        block = store.encode_properties(props)
        r = store.append_encoded([(TIMER_TOPIC, (), body, block)])[0]
        # Pending before the await: a checkpoint written meanwhile must not pass it.
        entry = TimerEntry(due_ms, r.queue_offset, r.physical_offset)
        self._push(entry)
        await store.wait_durable(r.end_offset)
        return entry, r

    def _push(self, entry: TimerEntry) -> None:
        heapq.heappush(self._heap, entry)
        self._pending.add(entry.offset)

    def next_due(self) -> int | None:
        """The earliest due time pending (epoch ms), None when nothing is."""
        return self._heap[0].due_ms if self._heap else None

    def due(self, now_ms: int) -> list[TimerEntry]:
        """Take the entries due at `now_ms` off the wheel, earliest first: each is still
        pending (the checkpoint holds it) until `fire`d, `forget`-ten or put back (`defer`)."""
        heap, out = self._heap, []
        while heap and heap[0].due_ms <= now_ms:
            out.append(heapq.heappop(heap))
        return out

    def defer(self, entry: TimerEntry) -> None:
        """Put an entry `due` gave back (its firing failed: tried again next time)."""
        if entry.offset in self._pending:
            heapq.heappush(self._heap, entry)

    def message(self, entry: TimerEntry) -> StoredMessage:
        """The delayed record of `entry`, its PROP_DELIVER_MS removed from the properties."""
        m = self._store.message_at(entry.physical_offset)
        props = dict(m.properties)
        props.pop(PROP_DELIVER_MS, None)
        return m._replace(properties=props)

    def fire(
        self,
        entry: TimerEntry,
        topic: str,
        queues: Sequence[str],
        body: bytes,
        properties: dict[str, str],
    ) -> PutResult:
        """Append the real message of `entry` with its fired mark, as one record (the rule in
        the module docstring). Firing an entry no longer pending is an error."""
        if entry.offset not in self._pending:
            raise ValueError(f"timer entry {entry.offset} is not pending")
        store = self._store
        props = dict(properties)
        props[PROP_FIRED_OF] = str(entry.offset)
        block = store.encode_properties(props)
        r = store.append_encoded([(topic, (*queues, FIRED_QUEUE), body, block)])[0]
        # Mark and message are in the log: it is fired (save_checkpoint counts it only once
        # flushed). Not awaited here: a subscriber's acknowledgement follows its own rules.
        self._pending.discard(entry.offset)
        self._fired[entry.offset] = (r.light_offsets.get(FIRED_QUEUE, 0), r.end_offset)
        self._moved = True
        return r

    def forget(self, entry: TimerEntry) -> None:
        """Drop an entry `due` gave whose record retention deleted (it can never fire)."""
        self._pending.discard(entry.offset)
        self._moved = True

    def pending(self) -> list[TimerEntry]:
        """Every pending entry on the wheel, earliest due first."""
        return sorted(self._heap)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def unsaved(self) -> bool:
        """Something fired that no checkpoint covers yet (save_checkpoint again later)."""
        return self._moved

    # -- checkpoint ----------------------------------------------------------------------------

    def save_checkpoint(self) -> bool:
        """Write (C, F) as far as the flushed log proves (module docstring); True if moved."""
        if not self._moved:
            return False  # nothing fired or forgotten since the last save that covered all
        store = self._store
        flushed = store.flushed_offset
        unfired = [o for o, (_, end) in self._fired.items() if end > flushed]
        self._moved = bool(unfired)  # save again once those are flushed
        if self._pending:
            unfired.append(min(self._pending))
        c = min(unfired) if unfired else store.max_offset(TIMER_TOPIC)
        at_or_above = [pos for o, (pos, _) in self._fired.items() if o >= c]
        f = min(at_or_above) if at_or_above else store.max_offset(FIRED_QUEUE)
        c, f = max(c, self._checkpoint[0]), max(f, self._checkpoint[1])
        if (c, f) == self._checkpoint:
            return False
        store.write_config(CHECKPOINT_NAME, _CHECKPOINT.pack(c, f))
        self._checkpoint = (c, f)
        self._fired = {o: v for o, v in self._fired.items() if o >= c}
        return True


def pending_timers(store: TimerStore) -> list[tuple[TimerEntry, StoredMessage]]:
    """The pending delayed messages of a (read-only) store, earliest due first."""
    timers = TimerQueue(store)
    timers.recover()
    return [(e, timers.message(e)) for e in timers.pending()]
