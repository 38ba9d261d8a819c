"""What this gateway appended lately, kept for the subscribers that read it right away.

`RecentMessages`: the last messages appended, per light queue, in offset order, with each
record decoded once. A fan-out to N subscribers of one filter would otherwise decode the same
record N times, and a subscriber keeping up would read back from the store what was just
written (rocketmq-mqtt keeps a similar per-queue cache). Filled by the publish path
(gateway/messages/publishing.py), read through the one queue cursor (gateway/storage/cursor.py).

`PreparedCache`: the encoded PUBLISH packets of a fan-out, so each variant (QoS, flags,
identifiers) is encoded once for all the subscribers that receive it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from gateway.messages.records import RecordedPublish, read_record
from gateway.protocol import PreparedPublish
from gateway.storage.port import EncodedMessage, PutResult, StoredMessage, stored_runs

# RecentMessages bounds: entries and body bytes. A message counts once per queue it is in (a
# flood whose messages each go to an exact and two wildcard subscriptions fills three entries
# per message), and the entries must cover the delivery lag the overload guard lets through at
# such a flood's rate: a subscriber behind the window reads back from the store, which costs
# several times more per message and puts it further behind. An entry is a StoredMessage tuple
# and a list slot (about 120 bytes; bodies are bounded by RECENT_BYTES).
RECENT_MESSAGES = 65_536
RECENT_BYTES = 32 << 20
RECORDS_CACHED = 4096  # decoded records of fan-outs
# A window's list drops its evicted head once it is this long. Not later (say once the head is
# half the list, which moves fewer pointers): dropping an entry frees its tuple and, from the
# last window holding them, the message's body and properties, about 0.2 us each, so a
# wildcard window of tens of thousands of entries compacted at half freed ten thousand and
# more at once and held the event loop for milliseconds. Compacted at every bucket's eviction
# it frees about a bucket's entries, and moves the rest of its list's pointers (a memmove).
COMPACT_AT = 1024
# Eviction goes by buckets of appends, each at most 1/BUCKETS of either bound (see RecentMessages).
BUCKETS = 16
_MISSING = object()
_tuple_new = tuple.__new__  # builds a StoredMessage without NamedTuple's Python __new__
PREPARED_CACHE_SIZE = 4096


class PreparedCache:
    """Recently encoded PUBLISH packets, so a fan-out encodes each variant once.

    A plain dict with its keys in a deque, oldest first: past `size` entries, the oldest goes.
    A put costs less than with an OrderedDict's popitem(last=False), and far less than
    rebuilding the dict from its newest entries (every key tuple would be hashed again)."""

    def __init__(self, size: int = PREPARED_CACHE_SIZE) -> None:
        self._size = size
        self._items: dict[tuple[object, ...], PreparedPublish] = {}
        self._order: deque[tuple[object, ...]] = deque()
        # The dict's own get, bound once: a fan-out looks a packet up per delivery, and a
        # method wrapping it cost a Python call each time.
        self.lookup: Callable[[tuple[object, ...]], PreparedPublish | None] = self._items.get

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple[object, ...], make: Callable[[], PreparedPublish]) -> PreparedPublish:
        p = self._items.get(key)
        if p is None:
            p = make()
            self.put(key, p)
        return p

    def put(self, key: tuple[object, ...], p: PreparedPublish) -> None:
        items = self._items
        if key not in items:
            order = self._order
            order.append(key)
            if len(order) > self._size:
                del items[order.popleft()]
        items[key] = p


class _Window:
    """The cached messages of one queue: `msgs[head:]` hold offsets `first`, `first + 1`..."""

    __slots__ = ("first", "head", "msgs", "queue")

    def __init__(self, queue: str, first: int) -> None:
        self.queue = queue
        self.first = first
        self.head = 0
        self.msgs: list[StoredMessage] = []


class _Bucket:
    """Appends made one after another: how many messages each window got, and their bytes."""

    __slots__ = ("count", "nbytes", "trims")

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self.trims: dict[_Window, int] = {}


class RecentMessages:
    """The last messages this gateway appended, per queue, in offset order.

    A fan-out to N subscribers of one filter would otherwise decode the same record N times,
    and a subscriber running behind would read back from the store what was just written;
    subscribers that keep up read it from here (rocketmq-mqtt keeps a similar per-queue cache).
    Anything not here (older, or appended before a restart) is read from the store.

    Each queue has a window of consecutive offsets. Appends go into the open bucket, which
    counts per window how many messages they added (a window appended to many times, as a
    wildcard subscription's queue is, is one entry); the bucket is closed once it holds
    1/BUCKETS of `size` messages or of `max_bytes` of bodies (a body in several queues counts
    once per queue). While the cache holds more than either bound, whole buckets are dropped,
    oldest first: each of their windows' head moves by its count (a window's list is compacted
    now and then). So eviction happens once per bucket and costs a step per window in it, not
    per message or per append. Once an append is done the cache holds at most `size` messages
    and `max_bytes`; that append stays unless it alone holds more than `size - size // BUCKETS`
    (or of the bytes). Nothing is done per message beyond building its StoredMessage and
    appending it.
    """

    def __init__(self, size: int = RECENT_MESSAGES, max_bytes: int = RECENT_BYTES) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._count = 0
        self._bytes = 0
        self._windows: dict[str, _Window] = {}
        self._bucket_size = max(1, size // BUCKETS)
        self._bucket_bytes = max(1, max_bytes // BUCKETS)
        self._open = _Bucket()
        self._closed: deque[_Bucket] = deque()  # oldest first
        # Decoded records by physical offset (unique within a run of the log), shared by
        # every subscriber of a fan-out; oldest first.
        self._records: dict[int, RecordedPublish | None] = {}
        self._record_order: deque[int] = deque()

    def record(self, msg: StoredMessage) -> RecordedPublish | None:
        """read_record() of `msg`, decoded once for all the subscribers reading it."""
        records = self._records
        phys = msg.physical_offset
        rec = records.get(phys, _MISSING)
        if rec is not _MISSING:
            return rec  # type: ignore[return-value]
        rec = read_record(msg.topic, msg.body, msg.properties, msg.store_timestamp)
        records[phys] = rec
        # Oldest first from a deque: next(iter(dict)) would walk past every deleted slot at
        # the front of the dict on each call (quadratic until the dict is resized).
        order = self._record_order
        order.append(phys)
        if len(order) > RECORDS_CACHED:
            records.pop(order.popleft(), None)
        return rec

    def add(self, parent: str, body: bytes, props: dict[str, str], r: PutResult) -> None:
        queues = tuple(r.light_offsets)
        ts = r.store_timestamp
        for q, off in r.light_offsets.items():
            m = _tuple_new(
                StoredMessage,
                (parent, body, props, off, r.physical_offset, ts, ts, r.queue_offset, queues),
            )
            self._extend(q, [m], len(body))
        self._appended()

    def add_many(
        self,
        messages: Sequence[EncodedMessage],
        props: Sequence[dict[str, str]],
        results: Sequence[PutResult],
    ) -> None:
        """add() for a batch appended with MessageStore.append_encoded: `_extend` of every
        queue's run, in one loop in this frame (a batch of a thousand-topic flood touches
        about one queue per message), with the totals added once."""
        windows = self._windows
        trims = self._open.trims
        count = total = 0
        for q, (run, nbytes) in stored_runs(messages, props, results).items():
            first = run[0][3]
            n = len(run)
            if run[-1][3] - first != n - 1:
                continue  # not consecutive (cannot happen with one writer): left to the store
            w = windows.get(q)
            if w is None or w.first + len(w.msgs) - w.head != first:
                w = windows[q] = _Window(q, first)  # new queue, or a gap: start over
            w.msgs += run
            trims[w] = trims.get(w, 0) + n
            count += n
            total += nbytes
        b = self._open
        b.count += count
        b.nbytes += total
        self._count += count
        self._bytes += total
        # _appended(), inlined: this runs once per event-loop turn that stores publishes.
        if b.count >= self._bucket_size or b.nbytes >= self._bucket_bytes:
            self._closed.append(b)
            self._open = _Bucket()
        if self._count > self._size or self._bytes > self._max_bytes:
            self._evict()

    def _extend(self, queue: str, run: list[StoredMessage], nbytes: int) -> None:
        """Append `run` (consecutive offsets of `queue`, the store assigned them in one go)."""
        first = run[0][3]
        if run[-1][3] - first != len(run) - 1:
            return  # not consecutive (cannot happen with one writer): leave it to the store
        w = self._windows.get(queue)
        if w is None or w.first + len(w.msgs) - w.head != first:
            # New queue, or a gap (what was there is stale): start over at `first`.
            w = self._windows[queue] = _Window(queue, first)
        w.msgs += run
        n = len(run)
        b = self._open
        trims = b.trims
        trims[w] = trims.get(w, 0) + n
        b.count += n
        b.nbytes += nbytes
        self._count += n
        self._bytes += nbytes

    def _appended(self) -> None:
        """After an append: close the open bucket once it is full, evict if over a bound."""
        b = self._open
        if b.count >= self._bucket_size or b.nbytes >= self._bucket_bytes:
            self._closed.append(b)
            self._open = _Bucket()
        if self._count > self._size or self._bytes > self._max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Drop whole buckets, oldest first, until both bounds hold (the open one last)."""
        closed = self._closed
        windows = self._windows
        while self._count > self._size or self._bytes > self._max_bytes:
            if not closed:
                closed.append(self._open)
                self._open = _Bucket()
            b = closed.popleft()
            self._count -= b.count
            self._bytes -= b.nbytes
            for w, n in b.trims.items():
                if windows.get(w.queue) is not w:
                    continue  # replaced after a gap: nothing to trim
                w.head += n
                w.first += n
                if w.head >= len(w.msgs):
                    del windows[w.queue]
                elif w.head >= COMPACT_AT:
                    del w.msgs[: w.head]
                    w.head = 0

    def run(self, queue: str, offset: int, limit: int) -> list[StoredMessage]:
        """Consecutive cached messages of `queue` from `offset` (empty if the first is not)."""
        w = self._windows.get(queue)
        if w is None:
            return []
        i = offset - w.first
        if i < 0:
            return []
        i += w.head
        return w.msgs[i : i + limit]
