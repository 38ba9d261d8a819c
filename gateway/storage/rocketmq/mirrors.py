"""Mirrors of light queues: what the gateway reads of RocketMQ, and its arrival notices.

A `Mirror` per opened queue: GET_MIN/MAX_OFFSET, then a held long poll (PULL_MESSAGE with the
suspend flag, SUSPEND_S) at the queue's end brings each new message in and fires the arrival
notice. `get` is a try-read of the mirror (the Storage port's reads never block), and a miss
below the end starts a one-shot pull of that range (backlog after a reconnect or a restart),
whose arrival wakes the reader again. So the delivery loop is the same as on the embedded
store. A mirror keeps MIRROR_SIZE messages (the oldest dropped; a reader behind them pulls
them again).

With `notify` (settings.rocketmq_notify_pulls) no mirror holds a pull: one tail of
the parent topic per broker (gateway/storage/rocketmq/tail.py) hands each message to the mirrors
of the light queues it was dispatched to, with its offset in each, and fires their arrival
notices. A mirror then only reads its bounds (after the tail's start: no gap) and pulls its
backlog.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from gateway.storage.port import ArrivalListener, GetResult, GetStatus, StoredMessage, StoreError
from gateway.storage.rocketmq.broker import (
    PULL_BATCH,
    PULL_GROUP,
    Broker,
    after_empty,
    at_offset,
    to_stored,
    trim_window,
)
from gateway.storage.rocketmq.tail import ParentTail
from rocketmq_remoting import OffsetMovedError, PullResult, RemotingError
from rocketmq_remoting.message import MessageRecord

log = logging.getLogger("lmqtt.rocketmq")

#: How long a held pull waits for an arrival. Well under the broker's 120 s idle close; the
#: broker answers NOT_FOUND after it, at its hold checker's next pass (up to 5 s later), and the
#: client waits for that whole hold (rocketmq_remoting.client HOLD_CHECK_S): an idle queue's
#: pull ends with PULL_NOT_FOUND, never with a client timeout.
SUSPEND_S = 15.0
#: Messages a mirror keeps per queue (oldest dropped; a reader behind them pulls them again).
MIRROR_SIZE = 4096
#: How long opening a queue waits for its bounds before it fails (StoreError).
READY_S = 10.0


class Mirror:
    """What this process knows of one light queue: its bounds and recently read messages."""

    __slots__ = (
        "fetching",
        "limit",
        "lmq",
        "max",
        "min",
        "msgs",
        "queue",
        "ready",
        "tail",
        "task",
        "waiters",
    )

    def __init__(self, queue: str, lmq: str) -> None:
        self.queue = queue
        self.lmq = lmq
        self.ready = False  # bounds known (GET_MIN/MAX_OFFSET answered)
        self.min = 0
        self.max = 0  # the next offset to be written, as far as we know
        self.tail = 0  # where the held pull reads from
        self.msgs: dict[int, StoredMessage] = {}
        self.limit = MIRROR_SIZE  # messages kept (the oldest dropped beyond it)
        #: Offsets of one-shot pulls in flight; None while there are none (most mirrors, a
        #: device's command queue: an empty set is 216 bytes a subscribed queue).
        self.fetching: set[int] | None = None
        self.task: asyncio.Task[None] | None = None
        #: Who waits for the bounds (`Mirrors._ready`); None while nobody does (most mirrors).
        self.waiters: list[asyncio.Future[None]] | None = None


class Mirrors:
    """Every mirror of this process, their pulls and the arrival listeners."""

    def __init__(
        self, broker: Broker, saw_phys: Callable[[int], None], *, notify: bool = False
    ) -> None:
        self._broker = broker
        self._saw_phys = saw_phys  # the log's end: the highest CommitLog offset seen
        self._mirrors: dict[str, Mirror] = {}
        self._listeners: list[ArrivalListener] = []
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._phys_waiters: dict[tuple[str, int], asyncio.Future[int]] = {}
        self._pinned: set[str] = set()  # queues the gateway itself reads (never released)
        # notify: the parent topic's tail feeds the mirrors, found by light queue name.
        self._tail: ParentTail | None = None
        self._by_lmq: dict[str, Mirror] = {}
        if notify:
            self._tail = ParentTail(broker, self._arrived, self._by_lmq)
            self._spawn(self._tail.run())

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for m in self._mirrors.values():
            self._wake(m)  # a closed store answers nothing more: readers go on (and fail)
        for fut in self._phys_waiters.values():
            fut.cancel()

    # -- reads (the Storage port's) --------------------------------------------------------------

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        m = self._mirrors.get(queue) or self.mirror(queue)
        msgs = m.msgs
        first = msgs.get(offset)
        if first is not None:
            out = [first]
            nxt = offset + 1
            while len(out) < max_messages:
                msg = msgs.get(nxt)
                if msg is None:
                    break
                out.append(msg)
                nxt += 1
            return GetResult(GetStatus.FOUND, out, nxt, m.min, m.max)
        if not m.ready:
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, 0, 0)
        if offset < m.min:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, [], m.min, m.min, m.max)
        if offset >= m.max:
            # Never OVERFLOW_BADLY: our max lags the broker's, a reader past it is not wrong.
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, m.min, m.max)
        if (m.fetching is None or offset not in m.fetching) and not self._closed:
            if m.fetching is None:
                m.fetching = set()
            m.fetching.add(offset)
            self._spawn(self._fetch(m, offset))
        return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, m.min, m.max)

    def min_offset(self, queue: str) -> int:
        return (self._mirrors.get(queue) or self.mirror(queue)).min

    def max_offset(self, queue: str) -> int:
        m = self._mirrors.get(queue)
        return m.max if m is not None else self.mirror(queue).max

    def queues(self) -> list[str]:
        return list(self._mirrors)

    def mirrored(self, queue: str) -> bool:
        """Whether this process follows `queue` now (a mirror is open: something reads it)."""
        return queue in self._mirrors

    def add_listener(self, listener: ArrivalListener) -> None:
        self._listeners.append(listener)

    async def open_queue(self, queue: str) -> None:
        m = self._mirrors.get(queue) or self.mirror(queue)
        if not m.ready:
            await self._ready(m)

    def release(self, queue: str) -> None:
        """Nothing reads `queue` now: drop its mirror, stop its held pull (the broker answers
        it into the void) and forget its name; a later read makes a new mirror. So memory
        and held pulls follow the subscriptions, not every queue ever subscribed."""
        if queue in self._pinned:
            return
        m = self._mirrors.pop(queue, None)
        if m is None:
            return
        self._by_lmq.pop(m.lmq, None)
        if m.task is not None:
            m.task.cancel()
        self._broker.names.forget(queue)

    def mirror(self, queue: str) -> Mirror:
        """The mirror of `queue`, created (and its long poll started) on first use."""
        m = self._mirrors.get(queue)
        if m is None:
            m = self._mirrors[queue] = Mirror(queue, self._broker.names.lmq(queue))
            self._by_lmq[m.lmq] = m
            if not self._closed:
                m.task = self._spawn(self._follow(m))
        return m

    async def light_offset(self, queue: str, phys: int, timeout: float) -> int | None:
        """The offset in `queue` of the message stored at CommitLog offset `phys` (the send
        answer has none: the held pull brings the message in milliseconds); None if it was
        not seen within `timeout`."""
        m = self.mirror(queue)
        found = next((o for o, s in m.msgs.items() if s.physical_offset == phys), None)
        if found is not None:
            return found
        waiter: asyncio.Future[int] = self._loop.create_future()
        self._phys_waiters[(queue, phys)] = waiter
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            return None
        finally:
            self._phys_waiters.pop((queue, phys), None)

    async def preload(self, queue: str, count: int) -> None:
        """Read the last `count` messages of `queue` into its mirror now (the retained index's
        start-up catch-up reads %RETAIN% without waiting)."""
        self._pinned.add(queue)
        m = self.mirror(queue)
        m.limit = max(m.limit, count + MIRROR_SIZE)  # all of them stay for the catch-up
        await self._ready(m)
        async for records in self._broker.read(m.lmq, max(m.min, m.max - count), m.max):
            self._keep(m, records)

    async def catch_up(self, queue: str) -> int:
        """Bring `queue`'s mirror up to the broker's end now (reads of it then see every
        message stored before the call) and return where the read got to: that end, unless
        the broker kept answering nothing below it (RangeRead; logged). The retained index
        before it answers a SUBSCRIBE, so a retained message set through another gateway
        process is never missed; the state log before a CONNACK (a session another node
        wrote)."""
        m = self.mirror(queue)
        await self._ready(m)
        broker = self._broker
        hi = await broker.client.get_max_offset(broker.addr, m.lmq)
        reader = broker.read(m.lmq, m.max, hi)
        async for records in reader:
            self._keep(m, records)
        return min(reader.reached, hi)

    async def read_range(self, queue: str, start: int, end: int) -> list[StoredMessage]:
        """The messages at `start` up to `end` of `queue`, read from the broker now and not
        kept in the mirror (a one-off reader of an old range, e.g. the cluster bus read back,
        needs it whole, which a full mirror's trim would not leave). Offsets deleted by age
        are skipped."""
        m = self.mirror(queue)
        await self._ready(m)
        out: list[StoredMessage] = []
        async for records in self._broker.read(m.lmq, start, end):
            for rec in records:
                offsets = rec.light_queue_offsets()
                off = offsets.get(m.lmq)
                if off is not None and start <= off < end:
                    out.append(to_stored(rec, off, self._broker.names.queue, offsets))
        return out

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None:
        """Read the messages at `offsets` of `queue` into its mirror now: the in-flight
        messages of a session resumed here are re-sent (with DUP) by synchronous reads
        (`get`), which find nothing in a mirror that never saw them (another node delivered
        them, or this process is new), and the resend would be skipped. Offsets deleted by
        age are skipped."""
        m = self.mirror(queue)
        await self._ready(m)
        todo = sorted(o for o in set(offsets) if o not in m.msgs and o < m.max)
        while todo:
            reader = self._broker.read(m.lmq, todo[0], todo[-1] + 1)
            async for records in reader:
                self._keep(m, records)
            # Below `reached` the broker has no more (deleted by age, or trimmed off the
            # mirror again by a full one: not asked twice); a read that stopped short ends it.
            if reader.reached <= todo[0]:
                break
            todo = [o for o in todo if o not in m.msgs and o >= reader.reached]

    # -- following the broker --------------------------------------------------------------------

    async def _ready(self, m: Mirror) -> None:
        """Wait until `m` knows its bounds: woken by `_bounds` (no polling: thousands of
        subscriptions may wait at once while the broker answers)."""
        if m.ready or self._closed:
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        if m.waiters is None:
            m.waiters = []
        m.waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, READY_S)
        except TimeoutError:
            raise StoreError(f"broker {self._broker.name}: no answer for queue {m.queue}") from None

    @staticmethod
    def _wake(m: Mirror) -> None:
        waiters, m.waiters = m.waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def _notify(self, m: Mirror) -> None:
        for listener in self._listeners:
            try:
                listener.on_arrival(m.queue, m.max)
            except Exception:
                log.exception("arrival listener failed")

    def _notify_all(self, ends: dict[str, int]) -> None:
        """Where the queues of one tail answer end now: one call per listener with an
        `on_arrivals` (the store's batch notice, store/results.py ArrivalListener), else one
        per queue."""
        for listener in self._listeners:
            try:
                batch = getattr(listener, "on_arrivals", None)
                if batch is not None:
                    batch(ends)
                else:
                    for queue, end in ends.items():
                        listener.on_arrival(queue, end)
            except Exception:
                log.exception("arrival listener failed")

    async def _bounds(self, m: Mirror) -> None:
        broker = self._broker
        lo = await broker.client.get_min_offset(broker.addr, m.lmq)
        hi = await broker.client.get_max_offset(broker.addr, m.lmq)
        m.min, m.max = lo, max(m.max, hi)
        if not m.ready:
            m.tail = m.max
            m.ready = True
            self._wake(m)

    async def _follow(self, m: Mirror) -> None:
        """Learn the queue's bounds, then hold a pull at its end for as long as we run (with
        the parent topic's tail: the bounds only, read once the tail has its start)."""
        broker = self._broker
        backoff = 0.1
        if self._tail is not None:
            await self._tail.ready.wait()
        while not self._closed:
            try:
                if not m.ready:
                    await self._bounds(m)
                    self._notify(m)
                if self._tail is not None:
                    return
                res = await broker.client.pull(
                    broker.addr,
                    m.lmq,
                    m.tail,
                    consumer_group=PULL_GROUP,
                    max_messages=PULL_BATCH,
                    suspend_timeout=SUSPEND_S,
                )
            except OffsetMovedError as exc:
                log.warning(
                    "queue %s: offset %d moved (broker range %d..%d): following from %d",
                    m.queue, m.tail, exc.min_offset, exc.max_offset, exc.next_begin_offset,
                )  # fmt: skip
                m.min = exc.min_offset
                m.tail = exc.next_begin_offset
                continue
            except asyncio.CancelledError:
                raise
            except RemotingError as exc:
                if not self._closed:
                    log.warning("queue %s: pull failed (%s); again in %.1fs", m.queue, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            m.min = res.min_offset
            before = m.max
            if res.messages:
                self._keep(m, res.messages)
                m.tail = max(m.tail, res.next_begin_offset)
            m.max = max(m.max, m.tail)
            if m.max > before or res.messages:
                self._notify(m)
            elif not res.found:
                log.debug("queue %s: held pull ended empty (code %d)", m.queue, res.code)

    async def _fetch(self, m: Mirror, offset: int) -> None:
        """One-shot pull of a range below the held pull (a reader behind: backlog)."""
        broker = self._broker
        try:
            res = await broker.client.pull(
                broker.addr, m.lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
            )
            if res.messages:
                self._keep(m, res.messages)
                first = res.messages[0].light_queue_offsets().get(m.lmq, offset)
                if first > offset:
                    self._passed_over(m, offset, first, res.code)
                self._notify(m)
            else:
                self._fetched_nothing(m, offset, res)
        except OffsetMovedError as exc:
            m.min = exc.min_offset
            self._notify(m)  # the reader sees OFFSET_TOO_SMALL and moves on
        except RemotingError as exc:
            log.warning("queue %s: reading offset %d failed: %s", m.queue, offset, exc)
            self._loop.call_later(1.0, self._notify, m)  # the reader will ask again
        finally:
            if m.fetching is not None:
                m.fetching.discard(offset)
                if not m.fetching:
                    m.fetching = None

    def _fetched_nothing(self, m: Mirror, offset: int, res: PullResult) -> None:
        """A one-shot pull from `offset`, below the mirror's end, answered no message
        (after_empty): past units with no readable message the queue's min moves
        (`_passed_over`) and the reader is woken; with no way on it is woken again in a
        second and asks again (a bound on the pulls, never a spin)."""
        nxt = after_empty(offset, res)
        if nxt is None:
            return  # the broker's end: the held pull or the tail brings what comes
        if nxt > offset:
            self._passed_over(m, offset, nxt, res.code)
            self._notify(m)
            return
        log.warning(
            "queue %s: the broker answers nothing at offset %d below its end %d (pull code %d); "
            "again in 1s",
            m.queue, offset, res.max_offset, res.code,
        )  # fmt: skip
        self._loop.call_later(1.0, self._notify, m)

    @staticmethod
    def _passed_over(m: Mirror, offset: int, nxt: int, code: int) -> None:
        """A pull from `offset` passed over units up to `nxt` with no readable message: their
        CommitLog file is deleted (by age or disk space), the oldest of the queue, so all
        below them are gone too: the queue's min is `nxt` (the broker moves its own a moment
        later), and a reader below it sees OFFSET_TOO_SMALL and reads on from there."""
        log.warning(
            "queue %s: offsets %d..%d hold no readable message (pull code %d; deleted by age?): "
            "reading on from %d",
            m.queue, offset, nxt, code, nxt,
        )  # fmt: skip
        m.min = max(m.min, nxt)

    def _arrived(self, records: list[MessageRecord], last_phys: int) -> None:
        """The parent topic's tail read `records` (those dispatched to a mirrored queue; the
        answer went up to CommitLog offset `last_phys`): each goes to the mirrors of the light
        queues it was dispatched to (the others' are skipped), whose readers are woken.
        An answer handed out after `close` (the tail hands out in the loop's next step) is
        dropped."""
        if self._closed:
            return
        if last_phys >= 0:
            self._saw_phys(last_phys)
        by_lmq = self._by_lmq
        queue_of = self._broker.names.queue
        touched: dict[str, Mirror] = {}
        put = self._put if self._phys_waiters else None  # someone waits for a message's offset
        for rec in records:
            offsets = rec.light_queue_offsets()
            stored: StoredMessage | None = None  # decoded once for all its mirrors here
            for lmq, off in offsets.items():
                m = by_lmq.get(lmq)
                if m is not None:
                    if stored is None:
                        stored = to_stored(rec, off, queue_of, offsets)
                    else:
                        stored = at_offset(stored, off)
                    if put is not None:
                        put(m, stored, off)
                    else:  # _put without a waiter to tell, inlined: once per message and mirror
                        m.msgs[off] = stored
                        if off >= m.max:
                            m.max = off + 1
                    touched[lmq] = m
        ends: dict[str, int] = {}
        for m in touched.values():
            trim_window(m.msgs, m.limit)
            if m.ready:
                ends[m.queue] = m.max
        if ends:
            self._notify_all(ends)  # one notice per answer, as the embedded store's per batch

    def _keep(self, m: Mirror, records: list[MessageRecord]) -> None:
        for rec in records:
            offsets = rec.light_queue_offsets()
            off = offsets.get(m.lmq)
            if off is not None:
                self._keep_one(m, rec, off, offsets)
        trim_window(m.msgs, m.limit)

    def _keep_one(self, m: Mirror, rec: MessageRecord, off: int, offsets: dict[str, int]) -> None:
        self._put(m, to_stored(rec, off, self._broker.names.queue, offsets), off)
        self._saw_phys(rec.commitlog_offset)

    def _put(self, m: Mirror, stored: StoredMessage, off: int) -> None:
        """`stored` at `off` in `m`: kept, its phys waiter told, the mirror's end moved (the
        caller tells the log's end: the tail once per answer)."""
        m.msgs[off] = stored
        if self._phys_waiters:
            phys = stored.physical_offset
            waiter = self._phys_waiters.get((m.queue, phys))
            if waiter is not None and not waiter.done():
                waiter.set_result(off)
        if off >= m.max:
            m.max = off + 1
