"""The deployment's parent topic on RocketMQ as the one queue replays read history from.

On the embedded store a message's history lives in its parent topic's queue (the first topic
level); on RocketMQ every message of the deployment is sent to ONE parent topic
(`rocketmq_topic`, queue 0; gateway/storage/rocketmq/adapter.py), so that queue, named like the
topic, holds the whole history in store order. `RocketMqStorage.history_queues` answers it for every
filter, and a replay (gateway/session/replay.py) reads it from the offset SEARCH_OFFSET_BY_TIMESTAMP
gives for its start, skipping what does not match the filter:

    open(since)        GET_MIN_OFFSET, GET_MAX_OFFSET, SEARCH_OFFSET_BY_TIMESTAMP(since), awaited
                       by SUBSCRIBE before the replay is pinned (Storage.open_history), so that
                       min_offset, max_offset and offset_by_time answer without blocking
    get(offset)        a try-read of the messages pulled so far; a miss starts one pull of
                       PULL_MESSAGES from there and answers "nothing yet", and the pull's
                       arrival notice wakes the reader (as for the light queues' mirrors)

The seam (gateway/session/replay.py). A replay is pinned in one event-loop step with the filter's
registration; it must cover every message routed before that step, whose sends may still be in
flight. Sends go in order over one connection to a broker that stores them in order
(sendMessageThreadPoolNums=1, checked at start), and the answer to each carries its offset in
the parent queue. So the queue's end as the pin sees it (`max_offset`) is

    max(broker's end at open, highest answered offset + 1 + sends still unanswered)

which is exact when no send fails: the unanswered sends take the next offsets, in order. A send
that fails (no offset taken) makes the bound one too high: the replay then reads one message
stored after the pin, which the light queue also delivers; the delivery loop passes over such
a message when it reads it after the replay (`Replay.last_phys`, kept as the subscription's
`replayed_phys`: the message need not be in the mirror when the replay ends). A broker-busy
retry stores a message after later ones: the replay may end before it (it is delivered live
only if its route had the filter). One gateway per `rocketmq_topic` (docs/rocketmq.md): another
writer's sends would take offsets this count does not know of.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from gateway.bounded import trim_oldest
from gateway.storage.port import ArrivalListener, GetResult, GetStatus, StoredMessage
from gateway.storage.rocketmq.broker import (
    EMPTY_RETRIES,
    EMPTY_RETRY_S,
    Broker,
    after_empty,
    to_stored,
    trim_window,
)
from gateway.storage.rocketmq.spread import SEP
from gateway.storage.rocketmq.spread import phys as spread_phys
from rocketmq_remoting import OffsetMovedError, RemotingClient, RemotingError
from rocketmq_remoting.message import MessageRecord

log = logging.getLogger("lmqtt.rocketmq")
T = TypeVar("T")

#: Messages one history pull asks for (the broker sends fewer past its transfer limits).
PULL_MESSAGES = 256
#: Messages of history kept in memory (the oldest dropped; a replay reads on from its head).
KEEP = 8192
#: The history pulls' consumer group (nothing is committed; `%LMQ%` groups need no creation).
PULL_GROUP = "%LMQ%lmqtt-history"


class ParentHistory:
    """The parent topic's queue 0, read for replays (see the module docstring)."""

    def __init__(self, broker: Broker) -> None:
        # The topic is also its gateway queue name (StoredMessage.topic of its messages).
        self.topic = broker.topic
        self._client = broker.client
        self._addr = broker.addr
        self._queue_of = broker.names.queue  # light queue -> gateway queue name
        self._listeners: list[ArrivalListener] = []
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._min = 0
        self._broker_max = 0
        self._answered = 0  # highest parent offset a SEND_OK answered + 1
        self._in_flight = 0  # sends issued and not answered yet
        self._by_time: dict[int, int] = {}
        self._msgs: dict[int, StoredMessage] = {}
        self._fetching: set[int] = set()

    def add_listener(self, listener: ArrivalListener) -> None:
        self._listeners.append(listener)

    def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()

    # -- the sends (rocketmq_sender.Sender's SendCounter: told of each SEND_MESSAGE_V2) --------

    def sending(self) -> None:
        self._in_flight += 1

    def sent(self, queue_offset: int | None) -> None:
        """A send answered (its parent offset), or failed (None)."""
        self._in_flight -= 1
        if queue_offset is not None and queue_offset >= self._answered:
            self._answered = queue_offset + 1

    def position(self) -> int:
        """The parent queue's end as this node knows it: every send made from now on takes an
        offset at or past it (the broker stores in order)."""
        return max(self._broker_max, self._answered)

    # -- opening ---------------------------------------------------------------------------------

    async def open(self, since_ms: int) -> None:
        """Learn the bounds and the first offset stored at or after `since_ms`."""
        self._min = await self._client.get_min_offset(self._addr, self.topic)
        self._broker_max = max(
            self._broker_max, await self._client.get_max_offset(self._addr, self.topic)
        )
        if since_ms <= 0:
            self._by_time[since_ms] = self._min
            return
        found = await self._client.search_offset(self._addr, self.topic, since_ms)
        self._by_time[since_ms] = max(self._min, found)
        trim_oldest(self._by_time, 1024)

    # -- the port's reads for this queue ---------------------------------------------------------

    def min_offset(self) -> int:
        return self._min

    def max_offset(self) -> int:
        return max(self._broker_max, self._answered + self._in_flight)

    def offset_by_time(self, timestamp_ms: int) -> int:
        # Exact once open(timestamp_ms) ran; else the oldest kept offset (a replay also skips
        # messages stored before its start, so an earlier offset only costs reading).
        return self._by_time.get(timestamp_ms, self._min)

    def get(self, offset: int, max_messages: int) -> GetResult:
        msgs = self._msgs
        first = msgs.get(offset)
        hi = self.max_offset()
        if first is not None:
            out = [first]
            nxt = offset + 1
            while len(out) < max_messages and (msg := msgs.get(nxt)) is not None:
                out.append(msg)
                nxt += 1
            if nxt not in msgs and nxt < hi:
                self._fetch(nxt)  # read ahead while the reader sends these
            return GetResult(GetStatus.FOUND, out, nxt, self._min, hi)
        if offset < self._min:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, [], self._min, self._min, hi)
        if offset >= hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, self._min, hi)
        self._fetch(offset)
        return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, self._min, hi)

    def _fetch(self, offset: int) -> None:
        if offset not in self._fetching and not self._closed:
            self._fetching.add(offset)
            task = self._loop.create_task(self._pull(offset))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pull(self, offset: int) -> None:
        try:
            res = await self._client.pull(
                self._addr,
                self.topic,
                offset,
                consumer_group=PULL_GROUP,
                max_messages=PULL_MESSAGES,
            )
            self._min = res.min_offset
            self._broker_max = max(self._broker_max, res.max_offset)
            self._keep(res.messages)
            nxt = res.messages[0].queue_offset if res.messages else after_empty(offset, res)
            if nxt is not None:
                if nxt > offset:
                    # Units whose CommitLog file is deleted by age (the oldest: all below
                    # them are gone too): the reader sees OFFSET_TOO_SMALL and reads on.
                    log.warning(
                        "history of %s: offsets %d..%d hold no readable message (pull code "
                        "%d; deleted by age?): reading on from %d",
                        self.topic, offset, nxt, res.code, nxt,
                    )  # fmt: skip
                    self._min = max(self._min, nxt)
                elif not res.messages:
                    log.warning(
                        "history of %s: the broker answers nothing at offset %d below its "
                        "end %d (pull code %d); again in 1s",
                        self.topic, offset, res.max_offset, res.code,
                    )  # fmt: skip
                    await asyncio.sleep(1.0)  # the reader asks again when notified
        except OffsetMovedError as exc:
            self._min = exc.min_offset
            self._broker_max = max(self._broker_max, exc.max_offset)
        except RemotingError as exc:
            log.warning("history of %s: reading offset %d failed: %s", self.topic, offset, exc)
            await asyncio.sleep(1.0)  # the reader asks again when notified
        finally:
            self._fetching.discard(offset)
        self._notify()

    def _keep(self, records: list[MessageRecord]) -> None:
        msgs = self._msgs
        for rec in records:
            msgs[rec.queue_offset] = to_stored(rec, rec.queue_offset, self._queue_of)
        trim_window(msgs, KEEP)

    def _notify(self) -> None:
        hi = self.max_offset()
        for listener in self._listeners:
            try:
                listener.on_arrival(self.topic, hi)
            except Exception:
                log.exception("arrival listener failed")


class PulledHistory:
    """A deployment's parent topic read with blocking pulls: the reads a replay makes
    (gateway/session/replay.py), for `lmqtt replay --store rocketmq` (gateway/ops/replay_export.py).

    Read-only (nothing is sent, no offset committed), so it is safe beside running gateways.
    The export ends at the queues' ends when it starts (or at --until). A deployment spread
    over several brokers (gateway/storage/rocketmq/spread.py) has the topic on each: one history
    queue per broker (`topic`, then `topic SEP broker`), with time-major physical offsets so that
    the replay's merge gives store-time order; with `broker` named, that broker only.
    """

    def __init__(self, namesrv: str, topic: str, broker: str | None = None) -> None:
        self.topic = topic
        self._loop = asyncio.new_event_loop()
        self._client = RemotingClient([namesrv], request_timeout=10.0, connect_timeout=3.0)
        # queue name -> [slot, broker address, min, max]
        self._queues: dict[str, list[Any]] = {}
        try:
            brokers = self._run(deployment_brokers(self._client, topic, broker))
            for slot, (name, addr) in enumerate(brokers):
                queue = topic if slot == 0 else topic + SEP + name
                lo = self._run(self._client.get_min_offset(addr, topic))
                hi = self._run(self._client.get_max_offset(addr, topic))
                self._queues[queue] = [slot, addr, lo, hi]
        except BaseException:
            self.close()
            raise
        self._spread = len(self._queues) > 1

    def _run(self, coro: Awaitable[T]) -> T:
        return self._loop.run_until_complete(coro)

    def history_queues(self, tf: object) -> list[str]:
        return list(self._queues)

    def min_offset(self, queue: str) -> int:
        return int(self._queues[queue][2])

    def max_offset(self, queue: str) -> int:
        return int(self._queues[queue][3])

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int:
        _slot, addr, lo, hi = self._queues[queue]
        if timestamp_ms <= 0:
            return int(lo)
        found = self._run(self._client.search_offset(addr, self.topic, timestamp_ms))
        return int(max(lo, min(found, hi)))

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        entry = self._queues[queue]
        slot, addr, lo, hi = entry
        if offset >= hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, lo, hi)
        for attempt in range(EMPTY_RETRIES + 1):
            try:
                res = self._run(
                    self._client.pull(
                        addr,
                        self.topic,
                        offset,
                        consumer_group=PULL_GROUP,
                        max_messages=max_messages,
                    )
                )
            except OffsetMovedError as exc:
                entry[2] = lo = exc.min_offset
                if offset < exc.min_offset:
                    return GetResult(GetStatus.OFFSET_TOO_SMALL, [], lo, lo, hi)
                return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, lo, hi)
            # An empty answer below the end with no way on: ask again (a few times); one
            # that passed over units without a readable message goes on past them (the
            # replay skips to the answer's next offset).
            if res.messages or after_empty(offset, res) != offset:
                break
            if attempt < EMPTY_RETRIES:
                self._run(asyncio.sleep(EMPTY_RETRY_S * (attempt + 1)))
        else:
            log.warning(
                "history of %s: the broker answers nothing at offset %d below its end %d "
                "(pull code %d): the export ends there",
                queue, offset, res.max_offset, res.code,
            )  # fmt: skip
        if not res.messages and res.next_begin_offset > offset:
            log.warning(
                "history of %s: offsets %d..%d hold no readable message (pull code %d; "
                "deleted by age?): reading on from %d",
                queue, offset, res.next_begin_offset, res.code, res.next_begin_offset,
            )  # fmt: skip
        names = [to_stored(r, r.queue_offset, _same) for r in res.messages]
        msgs = [m for m in names if m.queue_offset < hi]
        if self._spread:
            msgs = [m._replace(topic=queue, physical_offset=spread_phys(slot, m)) for m in msgs]
        if not msgs:
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], res.next_begin_offset, lo, hi)
        return GetResult(GetStatus.FOUND, msgs, msgs[-1].queue_offset + 1, lo, hi)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(self._client.close())
        self._loop.close()


def _same(name: str) -> str:
    return name


async def deployment_brokers(
    client: RemotingClient, topic: str, broker: str | None
) -> list[tuple[str, str]]:
    """(name, address) of the brokers holding the deployment's messages: the home broker a
    gateway with these settings uses (RemotingClient.home_broker) first, then the other
    brokers the topic's route lists (a spread deployment's), unless `broker` is named."""
    home = await client.home_broker(topic, broker)
    out = [(home.name, home.addr)]
    if broker is None and len(home.serving) > 1:
        masters = (await client.get_cluster_info()).master_addrs()
        out += [(b, masters[b]) for b in home.serving if b != home.name and b in masters]
    return out
