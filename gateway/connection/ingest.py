"""IngestBatch: the plain PUBLISHes every connection read in one turn of the event loop,
stored with one append at the end of the turn.

A device fleet sends one small PUBLISH per TCP write from thousands of connections. Stored one
by one, each costs a store append, an arrival round over its light queues and a delivery pass
per subscriber. Here the transports' `data_received` callbacks of one loop turn only collect
(no task, no await: `ClientConnection._read_inline`), and the batch is stored once, from a
`call_soon` callback that runs after the turn's I/O callbacks:

    data_received (conn 1) --add--+
    data_received (conn 2) --add--+--> flush: one append_encoded, one arrival notice per queue
    data_received (conn n) --add--+           (each subscriber: one delivery pass, one write),
                                              then per connection one write of its PUBACKs

The batch may also linger (`Linger`, settings.ingest_linger_ms): stored that long after its
first publish instead of at the end of the turn, with what the turns in between read. A fleet
whose devices each send one message per read fills a turn's batch with a few publishes only,
and what a batch costs beyond its messages (the store call, the recent cache's runs, one
arrival notice per queue and so the subscribers' delivery passes and writes) is paid per batch.
It lingers only while the measured arrival rate says that pays: not when idle (nothing more
would come). A lingering batch is stored at the end of the turn in which it holds
GATHERS_AT_MOST, so a fast stream's batch waits a fraction of the linger, and a read that
brings that many (a flood's connection) does not linger at all.

Ordering: a connection hands everything after its first non-plain packet to its reader task,
which runs after the flush (at the end of the turn the batch's callback comes first; a
lingering batch is stored before the task starts, and before a closed connection's will:
`settle`): the store sees a connection's packets in the order it sent them, and its PUBACKs
leave before any later reply. Anything that must see the batch stored sooner (a protocol
error answered now) calls `flush()` itself, and so does a delivery pass queued ahead of the
flush callback (gateway/delivery/loop.py `_step`): the messages of the turn's reads go with
it.

Only the async flush mode batches here: in sync mode every acknowledgement waits for its
fsync, and the reader tasks' group commit already shares one fsync among many publishes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from gateway.messages.records import PublishProperties
from gateway.protocol import Publish
from gateway.storage.port import PutResult, StoreError

__all__ = ["IngestBatch", "Linger", "Lingering", "Publisher"]

# (publishes, the property blocks of each publisher) -> one result per publish, or StoreError
# with nothing stored.
Append = Callable[[list[Publish], list[PublishProperties]], list[PutResult]]


class Publisher(Protocol):
    """What the batch needs of a connection whose publishes it stores."""

    closed: bool

    def publish_blocks(self) -> PublishProperties: ...

    def acknowledge_stored(self, packet_ids: list[int]) -> None: ...

    def store_failed(self, pub: Publish, err: StoreError) -> None: ...


class Lingering(Protocol):
    """When a batch lingers (`Linger`; a test forces one)."""

    def linger(self, n: int, now: float) -> float: ...

    def stored(self, n: int, now: float) -> None: ...


# Linger: a batch lingers only while the arrival rate says its linger gathers at least
# GATHERS_AT_LEAST publishes (fewer: the gateway is idle or nearly, and a lone message would
# only wait); a batch that holds GATHERS_AT_MOST is stored at the end of that turn, lingering
# or not: past it a batch's fixed cost (the append call, the recent cache's runs, an arrival
# notice per queue, the subscribers' passes and writes) is small beside its messages, and a
# fast stream's batch waits that many arrivals rather than the whole linger (12 arrivals are
# 0.6 ms of a 20,000-a-second stream; at 10,000 a second the 1 ms linger ends first). The
# turns of a busy loop alone gather few: a fleet's devices send one publish per read.
GATHERS_AT_LEAST = 1.0
GATHERS_AT_MOST = 12.0
# Linger: the arrival rate is averaged over about this many seconds; a store after a longer
# quiet measures it afresh (an idle gateway's lone publish: close to nothing, so no linger).
RATE_HORIZON = 0.05


class Linger:
    """When a batch lingers, and how long (settings.ingest_linger_ms, `most` seconds).

    The rate is publishes stored per second, measured at each store and averaged over
    RATE_HORIZON; a batch whose first publish comes when `most` seconds of that rate make
    GATHERS_AT_LEAST publishes or more lingers `most` (IngestBatch stores it sooner once it
    holds GATHERS_AT_MOST), any other is stored at the end of its turn."""

    __slots__ = ("_last", "most", "rate")

    def __init__(self, most: float) -> None:
        self.most = most
        self.rate = 0.0
        self._last = float("-inf")

    def _estimate(self, n: int, now: float) -> float:
        """The rate with `n` publishes more since the last store, at `now`."""
        elapsed = now - self._last
        if elapsed >= RATE_HORIZON:
            return n / elapsed
        weight = elapsed / RATE_HORIZON
        return self.rate * (1.0 - weight) + n / max(elapsed, 1e-6) * weight

    def linger(self, n: int, now: float) -> float:
        """Seconds a batch of `n` publishes, begun at `now`, lingers (0: the end of the turn)."""
        gathers = self._estimate(n, now) * self.most
        if gathers >= GATHERS_AT_LEAST:
            return self.most
        return 0.0

    def stored(self, n: int, now: float) -> None:
        """A batch of `n` publishes was stored at `now`."""
        self.rate = self._estimate(n, now)
        self._last = now


class IngestBatch:
    """Collects plain (QoS 0/1, not retained, validated) PUBLISHes until the end of the turn.

    `pubs`, `owners` and `blocks` are parallel: a publish, the connection it came from, that
    connection's property blocks. `add` fills them one publish at a time; a device's read of
    plain publishes fills them in one C call (Connection.take_plain, from
    ClientConnection.feed), which then calls `schedule`."""

    __slots__ = (
        "_append",
        "_loop",
        "_timer",
        "blocks",
        "linger",
        "owners",
        "pubs",
        "scheduled",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, append: Append, linger: Lingering | None = None
    ) -> None:
        """`linger`: when a batch waits for more after its first publish (None: never, stored
        at the end of the turn)."""
        self._loop = loop
        self._append = append
        self.linger = linger
        # The lingering batch's timer: set while the batch waits for it, not the turn's end.
        self._timer: asyncio.TimerHandle | None = None
        self.pubs: list[Publish] = []
        self.owners: list[Publisher] = []
        self.blocks: list[PublishProperties] = []
        self.scheduled = False

    def __len__(self) -> int:
        return len(self.pubs)

    def last_qos(self) -> int:
        """QoS of the last publish added (the overload guard's question, once per read)."""
        return self.pubs[-1].qos

    def add(self, owner: Publisher, pub: Publish) -> None:
        self.pubs.append(pub)
        self.owners.append(owner)
        self.blocks.append(owner.publish_blocks())
        self.added()

    def added(self) -> None:
        """Publishes were added (`add`, or a connection's C read straight into the lists):
        the first schedules the batch's store; a lingering batch that now holds
        GATHERS_AT_MOST is stored at the end of this turn, not the linger's (see
        GATHERS_AT_MOST)."""
        if not self.scheduled:
            self.schedule()
        elif self._timer is not None and len(self.pubs) >= GATHERS_AT_MOST:
            self._end_linger()
            self._loop.call_soon(self.flush)

    def _end_linger(self) -> None:
        """The batch no longer waits for its linger's timer (stored now, or at the turn's end)."""
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None

    def schedule(self) -> None:
        """Store what was added at the end of this turn, or once the linger is over."""
        self.scheduled = True
        linger = self.linger
        n = len(self.pubs)
        if linger is not None and n < GATHERS_AT_MOST:
            delay = linger.linger(n, time.monotonic())
            if delay:
                self._timer = self._loop.call_later(delay, self.flush)
                return
        self._loop.call_soon(self.flush)

    def settle(self) -> None:
        """Store a lingering batch now: what a connection does next (a packet for its reader
        task, its will once it is gone) must come after the publishes it has in the batch. At
        the end of the turn (not lingering) the batch's callback already comes first."""
        if self._timer is not None:
            self.flush()

    def flush(self) -> None:
        """Store what was collected, then acknowledge it (one write per connection). The end
        of the turn's (or the linger's) callback (`schedule`); called before it (a protocol
        error answered now, a reader task about to start), the end of the turn's callback
        still runs and stores what was added since, if anything, while a linger's timer is
        cancelled (the next publish schedules anew)."""
        self.scheduled = False
        self._end_linger()  # stored before its linger was over, if it lingered
        pubs = self.pubs
        if not pubs:
            return
        owners = self.owners
        blocks = self.blocks
        self.pubs = []
        self.owners = []
        self.blocks = []
        if self.linger is not None:
            self.linger.stored(len(pubs), time.monotonic())
        try:
            self._append(pubs, blocks)
        except StoreError:
            # Nothing was stored: one by one, so only a bad message fails, and each answer
            # leaves in order, exactly as without batching.
            for pub, owner in zip(pubs, owners, strict=True):
                if not owner.closed:  # a failure closes a 3.1.1 client: the rest is dropped
                    self._store_one(pub, owner)
            return
        if len(set(owners)) == len(owners):
            # Each connection handed in one publish (a fleet's devices): its PUBACK alone.
            for pub, owner in zip(pubs, owners, strict=True):
                packet_id = pub.packet_id
                if packet_id is not None and pub.qos and not owner.closed:
                    owner.acknowledge_stored([packet_id])
            return
        # Packet ids per connection, in order; a connection's publishes of one read are
        # consecutive, so the dict is looked up once per run of them.
        acks: dict[Publisher, list[int]] = {}
        last: Publisher | None = None
        ids: list[int] = []
        for pub, owner in zip(pubs, owners, strict=True):
            packet_id = pub.packet_id
            if packet_id is not None and pub.qos:
                if owner is not last:
                    last = owner
                    found = acks.get(owner)
                    if found is None:
                        found = acks[owner] = []
                    ids = found
                ids.append(packet_id)
        for owner, ids in acks.items():
            if not owner.closed:
                owner.acknowledge_stored(ids)

    def _store_one(self, pub: Publish, owner: Publisher) -> None:
        try:
            self._append([pub], [owner.publish_blocks()])
        except StoreError as err:
            owner.store_failed(pub, err)
            return
        if pub.qos and pub.packet_id is not None:
            owner.acknowledge_stored([pub.packet_id])
