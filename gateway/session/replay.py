"""Replay: a subscription that starts in the past, then continues live with no gap.

Theory of operation. Every stored message is in its parent topic's queue; a filter's light
queue only has what was published after someone subscribed with that filter. So history comes
from the parent queues, the live stream from the light queue, and the two meet at a seam pinned
at SUBSCRIBE time:

    parent P:  ... [offset_by_time(P, since) ........ end[P]) | later appends
    light  L:                          (nothing older)  next  | later appends
                                                            ^ both pinned in one synchronous
                                                              step of the event loop

Appends run on the event loop thread, and `start_replay` reads `max_offset` of every parent and
of the light queue without yielding in between (the caller registered the filter just before,
in the same step). A message appended before the pin is in its parent below `end[P]` and not in
L at or after `next`; a message appended after it is at or after `next` in L (the router already
knew the filter). So replaying `[offset_by_time(P, since), end[P])` of every parent, then reading
L from `next`, delivers every matching message exactly once: no gap, no duplicate.

Which queues hold a filter's history is the storage's answer (`history_queues`): the embedded
store's parent topics (one per first topic level; a filter with a literal first level reads
one), RocketMQ's one parent topic of the deployment (gateway/storage/rocketmq/history.py). Messages
of other topics in them are read and passed over, as are messages stored before `since` (a
backend whose offset_by_time is a lower bound costs reading, not correctness).

A backend whose reads complete later (RocketMQ: a pull) answers a read of history "nothing
yet": the replay then `waits` (peek returns None with `waiting` set) and the delivery loop
asks again shortly.

A backend that learns the pin's ends after the appends they cover (RocketMQ: sends in flight,
see gateway/storage/rocketmq/history.py) may pin a parent's end past a message stored after the pin,
or a light queue's `next` below a message stored before it: such a message is replayed and
also in the light queue's live part. The replay reads in store order, so every light-queue
message stored at or before the last one it handed over (`last_phys`) was handed over by it:
when the replay ends, the subscription keeps that position (`replayed_phys`) and the delivery
loop passes over those messages whenever it reads them, not only those the store's reads hold
at that moment (on RocketMQ the mirror may not have pulled them yet, or may have dropped them
during a long replay: they were delivered twice). (On the embedded store there are none:
everything in L from `next` was stored after the pin.)

Several parents (`#`, `+/...`) are merged in store order (CommitLog physical offset; a
multi-broker backend would merge by store timestamp). Only a few messages per parent are held
(`_head_size`), never the history; the position (`todo`: parent -> [next, end]) moves as each
message is handed to the delivery loop (sent, or passed over as not matching) and is saved with
the subscription, so a persistent session resumes there after a reconnect or a restart. Sent
QoS 1/2 replayed messages are in flight as copies (Inflight.message), like retained copies.

Re-subscribing to a filter the session already has, with a replay, moves its light-queue
position to the current end in that same step (the replay covers what lay before it).

Replays must not slow live traffic down: a delivery pass replays for a short slice only, and
ReplayPacer keeps all replays together to a share of the event loop's time. While a replay runs,
the subscription's `start_phys` is REPLAYING: a live message it shares with another of the
session's subscriptions is delivered by that one at once (not held until the replay ends), and
skipped when the light queue is read after the replay (gateway/delivery/overlap.py covering).

The only storage calls are `history_queues`, `max_offset`, `min_offset`, `offset_by_time` and
`get` (read a queue from an offset, through QueueCursor), after SUBSCRIBE awaited
`open_history`: on RocketMQ GET_MAX_OFFSET, GET_MIN_OFFSET, SEARCH_OFFSET_BY_TIMESTAMP and
PULL_MESSAGE. The seam above
relies on appends and the pin not interleaving (on RocketMQ: on this gateway's sends being
stored in the order they were made); a backend whose appends come from other gateway nodes
needs the seam pinned by store position instead (each parent's and the light queue's offset
for one CommitLog position), which such a backend does not offer yet.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.messages.records import RecordedPublish, read_record
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage, StoredMessage
from topicmap import TopicFilter, matches_levels

log = logging.getLogger("lmqtt.gateway")

# Messages read ahead per parent topic, and in all (a `#` replay over many parents reads fewer
# per parent so the read-ahead stays bounded).
HEAD_SIZE = 32
HEADS_TOTAL = 2048
# Share of the event loop's wall-clock time all replays together may use (ReplayPacer).
REPLAY_SHARE = 0.25
# SubscriptionState.start_phys while the replay runs: the subscription covers no live message
# yet, so the session's other subscriptions deliver the ones they share with it instead of
# waiting for the replay to end; when it ends, start_phys becomes the log's end then.
REPLAYING = 1 << 62


def iso_ms(ms: int) -> str:
    """RFC 3339 text of an epoch-milliseconds time (for log lines and SUBACK notes)."""
    return (
        datetime.fromtimestamp(ms / 1000, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


class ReplayPacer:
    """Keeps replays to a share of the gateway's event loop, so live traffic is not delayed.

    A replay always has more to send while its subscriber keeps acknowledging: left alone it
    would keep the loop busy all the time, and on a host short of CPU every live message would
    wait behind replay passes. After replay work that took `d` seconds of wall-clock time, no
    replay runs for `d * (1 - share) / share` seconds (shared by every session), so the loop is
    idle, or serving live messages, at least `1 - share` of the time. Wall-clock time, not CPU
    time: when the host starves the gateway, passes take longer and replays back off further.
    """

    __slots__ = ("_factor", "_resume_at")

    def __init__(self, share: float = REPLAY_SHARE) -> None:
        self._factor = (1.0 - share) / share
        self._resume_at = 0.0

    def wait(self) -> float:
        """Seconds until replays may run again (0: now)."""
        return max(0.0, self._resume_at - time.monotonic())

    def spent(self, started: float) -> None:
        """Replay work ran from `started` (time.monotonic()) until now."""
        now = time.monotonic()
        self._resume_at = max(self._resume_at, now) + (now - started) * self._factor


@dataclass(slots=True)
class CutOff:
    """Retention deleted part of what a replay asked for: it starts at `oldest_ms`."""

    requested: str
    oldest_ms: int

    def text(self, topic_filter: str) -> str:
        return (
            f"replay of {topic_filter!r} from {self.requested} starts at "
            f"{iso_ms(self.oldest_ms)}, the oldest message kept"
        )


@dataclass(slots=True)
class Replay:
    """The replay part of one subscription: what is left to read of each parent topic.

    Persisted in the subscription's JSON (`to_json`); the read-ahead (`_heads`, `_heap`) is
    rebuilt from the store on first use.
    """

    topic_filter: str  # the plain filter replayed
    since_ms: int
    start: str  # `{from}` as requested
    todo: dict[str, list[int]]  # parent -> [next offset, end offset (exclusive)]
    last_phys: int = -1  # physical offset of the last message handed over
    waiting: bool = False  # peek found nothing yet in a queue with more to read: ask again
    _levels: tuple[str, ...] = field(default=(), repr=False)
    _heads: dict[str, deque[StoredMessage]] = field(default_factory=dict, repr=False)
    _heap: list[tuple[int, str]] | None = field(default=None, repr=False)
    _record: RecordedPublish | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._levels = TopicFilter(self.topic_filter).levels

    # -- persistence ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "filter": self.topic_filter,
            "since_ms": self.since_ms,
            "start": self.start,
            "todo": {p: list(pos) for p, pos in self.todo.items()},
            "last_phys": self.last_phys,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Replay:
        todo = {str(p): [int(pos[0]), int(pos[1])] for p, pos in d.get("todo", {}).items()}
        return cls(
            str(d["filter"]),
            int(d["since_ms"]),
            str(d.get("start", "")),
            todo,
            int(d.get("last_phys", -1)),
        )

    # -- reading -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return not self.todo

    def _head_size(self) -> int:
        return max(1, min(HEAD_SIZE, HEADS_TOTAL // max(1, len(self.todo))))

    def _fill(self, cursor: QueueCursor, parent: str) -> bool:
        """Read ahead in `parent`; False when it has nothing left (removed from `todo`) or
        nothing yet (`waiting`: a read the backend completes later)."""
        pos = self.todo[parent]
        while pos[0] < pos[1]:
            messages, start, next_offset = cursor.read(
                parent, pos[0], min(self._head_size(), pos[1] - pos[0])
            )
            if start < pos[0]:
                break  # the queue ends before `end` (truncated): nothing more
            if start > pos[0]:
                log.warning(
                    "replay of %r: %s offsets %d..%d deleted by retention while replaying",
                    self.topic_filter, parent, pos[0], start,
                )  # fmt: skip
            msgs = [m for m in messages if m.queue_offset < pos[1]]
            if msgs:
                self._heads[parent] = deque(msgs)
                return True
            if next_offset <= start:
                if cursor.end(parent) > pos[0]:
                    self.waiting = True  # not read yet (RocketMQ: the pull is on its way)
                    return False
                break  # the queue is gone: nothing more
            pos[0] = next_offset  # unreadable units: skipped by the store
        del self.todo[parent]
        self._heads.pop(parent, None)
        return False

    def peek(self, cursor: QueueCursor) -> StoredMessage | None:
        """The next message in store order, or None when the replay is done, or when the
        next is not read yet (`waiting`: ask again later)."""
        self.waiting = False
        heap = self._heap
        if heap is None:
            heads: list[tuple[int, str]] = []
            for parent in list(self.todo):
                if parent in self._heads or self._fill(cursor, parent):
                    heads.append((self._heads[parent][0].physical_offset, parent))
                if self.waiting:  # every parent's head is needed to know the store order
                    return None
            heapq.heapify(heads)
            heap = self._heap = heads
        while heap:
            parent = heap[0][1]
            head = self._heads.get(parent)
            if head:
                return head[0]
            if self._fill(cursor, parent):
                heapq.heapreplace(heap, (self._heads[parent][0].physical_offset, parent))
            elif self.waiting:
                return None
            else:
                heapq.heappop(heap)
        return None

    def record(self, msg: StoredMessage) -> RecordedPublish | None:
        """The MQTT message `msg` holds when this replay delivers it, else None: not an MQTT
        record, not in its own parent (read through another queue), or not matching."""
        heap = self._heap
        if not heap or msg.topic != heap[0][1]:
            return None
        if msg.store_timestamp < self.since_ms:
            return None  # before the start (offset_by_time was a lower bound)
        rec = read_record(msg.topic, msg.body, msg.properties, msg.store_timestamp)
        if rec is None:
            return None
        if not matches_levels(self._levels, rec.topic.split("/")):
            return None
        return rec

    def advance(self) -> None:
        """The message `peek` returned is handed over: move past it."""
        heap = self._heap
        assert heap
        parent = heap[0][1]
        msg = self._heads[parent].popleft()
        self.todo[parent][0] = msg.queue_offset + 1
        self.last_phys = max(self.last_phys, msg.physical_offset)
        if self._heads[parent]:
            heapq.heapreplace(heap, (self._heads[parent][0].physical_offset, parent))
        # else: peek() refills (or drops) this parent, keeping its place in the heap meanwhile.

    def messages(self, cursor: QueueCursor) -> Iterator[tuple[StoredMessage, RecordedPublish]]:
        """Every matching message left, in store order (the offline export, of a backend
        whose reads complete at once: the embedded store)."""
        while (msg := self.peek(cursor)) is not None:
            rec = self.record(msg)
            self.advance()
            if rec is not None:
                yield msg, rec


def start_replay(
    store: Storage,
    tf: TopicFilter,
    since_ms: int,
    start: str,
    until_ms: int | None = None,
) -> tuple[Replay, CutOff | None]:
    """Pin a replay of `tf` from `since_ms` (see the module docstring: call it in the same
    event-loop step that pinned the light queue's position). `until_ms`: stop before that
    store time instead of at the current end (offline export)."""
    todo: dict[str, list[int]] = {}
    oldest: int | None = None
    cut = False
    cursor = QueueCursor(store)
    for parent in store.history_queues(tf):
        end = store.max_offset(parent)
        if until_ms is not None:
            end = min(end, store.offset_by_time(parent, until_ms))
        first = store.offset_by_time(parent, since_ms)
        lo = store.min_offset(parent)
        if first >= end:
            continue
        todo[parent] = [first, end]
        if first == lo and lo > 0:
            # Everything before the oldest kept message is gone: was any of it asked for?
            first_kept = cursor.one(parent, lo)
            if first_kept is not None and first_kept.store_timestamp > since_ms:
                ts = first_kept.store_timestamp
                oldest = ts if oldest is None else min(oldest, ts)
                cut = True
    replay = Replay(tf.filter, since_ms, start, todo)
    cutoff = CutOff(start, oldest) if cut and oldest is not None else None
    return replay, cutoff
