"""Reads of a light queue go on past an answer without messages below the queue's end
(gateway/storage/rocketmq/broker.py RangeRead, after_empty; mirrors.py `_fetch`).

A RocketMQ 5.3.3 master answers a pull below a queue's end with no message when the units
there point into a CommitLog file it has just deleted (by age or disk space) and the queue's
min has not moved yet: GetMessageStatus MESSAGE_WAS_REMOVING, PULL_RETRY_IMMEDIATELY, with a
nextBeginOffset past up to 800 units it passed over (DefaultMessageStore.getMessage,
maxFilterMessageSize / 20). The min moves at the broker's next consume-queue clean, up to
cleanResourceInterval later. In that window a read that took the empty answer for the end lost
every message still stored after the deleted units.

Provoked on a broker of its own in the session's cluster: 1 MiB CommitLog files, all of them
expired at once (fileReservedTime=0), deleted when asked (DELETE_EXPIRED_COMMITLOG) at the
broker's first clean, 60 s after its start (DefaultMessageStore.addScheduleTask: a fixed
delay, hence this test's length; nothing asks it sooner), one file every 2 s. One queue has
1,000 messages in the second file, 20 more in the current one; the test waits for the window
(a pull at the queue's min answering nothing below its end), then reads the queue three ways.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.storage.port import GetStatus
from gateway.storage.rocketmq.broker import PULL_GROUP, Broker, after_empty
from gateway.storage.rocketmq.mirrors import Mirrors
from rocketmq_remoting import OffsetMovedError, PullResult, RemotingClient
from rocketmq_remoting.admin import create_topic
from rocketmq_remoting.codes import ResponseCode
from tests.rocketmq.cluster import RocketMQCluster, dispatched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GAP_BROKER = "broker-gap"
FILE = 1 << 20
SETTINGS = [
    f"mappedFileSizeCommitLog={FILE}",
    "fileReservedTime=0",  # every CommitLog file but the current one is expired
    # The CommitLog and the consume queues are cleaned by two tasks at the same fixed rate;
    # the first deletes one file, waits, deletes the next: the second file goes half-way
    # between two consume-queue cleans, which leaves a window of 2 s to see it in.
    "cleanResourceInterval=4000",
    "deleteCommitLogFilesInterval=2000",
]
#: DELETE_EXPIRED_COMMITLOG (RequestCode 329): delete the expired files at the next cleans.
DELETE_EXPIRED_COMMITLOG = 329
OLD = 1000  # messages of the queue in the first CommitLog file (> 800: one answer is empty)
NEW = 20  # messages of the queue in the current file


@pytest.fixture(scope="module")
def gap_broker(rocketmq: RocketMQCluster) -> Iterator[tuple[str, float]]:
    """The broker's address and when it started (time.monotonic)."""
    started = time.monotonic()
    addr = rocketmq.start_extra_broker(GAP_BROKER, extra=SETTINGS)
    yield addr, started
    rocketmq.stop_broker(GAP_BROKER, signal.SIGKILL)  # done with: no graceful stop


@pytest.fixture
async def client(rocketmq: RocketMQCluster) -> AsyncIterator[RemotingClient]:
    async with rocketmq.client(request_timeout=10.0) as c:
        yield c


async def _window(client: RemotingClient, addr: str, lmq: str, deadline: float) -> PullResult:
    """Wait until a pull at the queue's min answers nothing below its end; that answer."""
    while True:
        assert time.monotonic() < deadline, "the broker deleted no CommitLog file in time"
        lo = await client.get_min_offset(addr, lmq)
        assert lo == 0, f"the queue's min moved to {lo} before an empty answer was seen"
        try:
            res = await client.pull(addr, lmq, lo, consumer_group=PULL_GROUP, max_messages=32)
        except OffsetMovedError:
            res = None
        if res is not None and not res.messages and res.max_offset > lo:
            return res
        await asyncio.sleep(0.02)


async def test_reads_go_on_past_units_whose_commitlog_file_was_deleted(
    client: RemotingClient, gap_broker: tuple[str, float]
) -> None:
    addr, started = gap_broker
    topic = f"gap-{int(time.time() * 1000)}"
    await create_topic(client, addr, topic)
    broker = Broker(client, GAP_BROKER, addr, topic)
    queue = "gap/q"
    lmq = broker.names.lmq(queue)
    # CommitLog files: 0 other messages, 1 the queue's first OLD and others, 2 others,
    # 3 (the current one, never deleted) the queue's last NEW. Nothing of the queue in the
    # first file: its min stays 0 until the second is deleted (and once that first file is
    # gone the broker reads CommitLog offset 0 from whichever file is first then:
    # CommitLog.getMessage, findMappedFileByOffset(offset, offset == 0)).
    filler = b"f" * 100_000
    for _ in range(11):
        await client.send_message(addr, topic, filler)
    for i in range(OLD):
        await client.send_message(addr, topic, b"old %04d " % i + b"x" * 100, light_queues=[lmq])
    for _ in range(19):
        await client.send_message(addr, topic, filler)
    for i in range(NEW):
        await client.send_message(addr, topic, b"new %02d" % i, light_queues=[lmq])
    end = OLD + NEW
    await dispatched(client, addr, lmq, end)  # the broker indexes a send after answering it
    first = await client.pull(addr, lmq, 0, consumer_group=PULL_GROUP, max_messages=1)
    assert FILE <= first.messages[0].commitlog_offset < 2 * FILE
    last = await client.pull(addr, lmq, end - 1, consumer_group=PULL_GROUP, max_messages=1)
    assert last.max_offset == end and last.messages[0].commitlog_offset >= 3 * FILE
    new = {b"new %02d" % i for i in range(NEW)}

    mirrors = Mirrors(broker, lambda phys: None)
    woken = asyncio.Event()

    class Wake:
        def on_arrival(self, q: str, max_offset: int) -> None:
            woken.set()

    mirrors.add_listener(Wake())
    await mirrors.open_queue(queue)  # before the deletion: a mirror of the queue's bounds
    try:
        answer = await client.invoke_broker(addr, DELETE_EXPIRED_COMMITLOG, {})
        assert answer.code == ResponseCode.SUCCESS
        empty = await _window(client, addr, lmq, started + 120)
        # What the broker answered (MESSAGE_WAS_REMOVING): retry, past 800 units, the end.
        assert (empty.code, empty.next_begin_offset, empty.max_offset) == (
            ResponseCode.PULL_RETRY_IMMEDIATELY,
            800,
            end,
        )
        t0 = time.monotonic()
        missed: dict[str, set[bytes]] = {}

        # 1. The plain range read (catch_up, preload, the state replay, prefetch).
        reader = broker.read(lmq, 0, end)
        got = [rec.body async for batch in reader for rec in batch]
        missed["read"] = new - set(got)
        assert getattr(reader, "reached", end) == end

        # 2. read_range (the cluster bus read back).
        ranged = await mirrors.read_range(queue, 0, end)
        missed["read_range"] = new - {m.body for m in ranged}

        # 3. The mirror's try-reads, as the delivery loop makes them: a miss below the end
        # pulls that range and wakes the reader.
        seen: set[bytes] = set()
        offset, deadline = 0, time.monotonic() + 10
        while offset < end:
            woken.clear()
            res = mirrors.get(queue, offset)
            if res.status is GetStatus.FOUND:
                seen.update(m.body for m in res.messages)
            if res.status is not GetStatus.NO_MESSAGE_IN_QUEUE:
                offset = res.next_offset
                continue
            try:
                await asyncio.wait_for(woken.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break  # the reader was left there
        missed["get"] = new - seen
        print(f"reads in the window took {time.monotonic() - t0:.2f}s")
        assert missed == {"read": set(), "read_range": set(), "get": set()}
    finally:
        mirrors.close()


@pytest.mark.parametrize(
    ("offset", "answer", "expected"),
    [
        # Captured from the broker above (MESSAGE_WAS_REMOVING): go on past what it passed.
        (0, PullResult(ResponseCode.PULL_RETRY_IMMEDIATELY, 800, 0, 1020), 800),
        # At the end (OFFSET_OVERFLOW_ONE): next = offset = maxOffset.
        (1020, PullResult(ResponseCode.PULL_NOT_FOUND, 1020, 0, 1020), None),
        # An empty queue (NO_MESSAGE_IN_QUEUE at offset 0).
        (0, PullResult(ResponseCode.PULL_NOT_FOUND, 0, 0, 0), None),
        # A slave's answer below the end (RETRY, next = offset): no way on, ask again.
        (5, PullResult(ResponseCode.PULL_RETRY_IMMEDIATELY, 5, 0, 9), 5),
        # No consume-queue file at the offset (OFFSET_FOUND_NULL): the next file's start.
        (7, PullResult(ResponseCode.PULL_NOT_FOUND, 3000, 0, 4000), 3000),
    ],
)
def test_after_an_empty_answer(offset: int, answer: PullResult, expected: int | None) -> None:
    assert after_empty(offset, answer) == expected
