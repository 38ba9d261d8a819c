"""The gateway's durable state on RocketMQ: the %STATE% light queue, its replay and compaction.

Sessions with their subscriptions, positions and wills, the retained snapshot and config
documents are state records (gateway/storage.py StateRecord). Each append() batch is one
message to the state light queue (gateway name STATE_QUEUE), its body the batch's records:

    record := u16 key length, key (UTF-8), i32 value length (-1: the key is deleted), value

Batches are sent one after the other (each waits for the previous SEND_OK), so the queue
holds them in the order they were made even on a broker with several send threads.
At start the queue is replayed from the offset committed for the consumer group of
STATE_START (or its minimum) and folded into `records` (key -> newest value); compaction
re-sends every live record and then commits the offset it started at, so a replay reads
the last complete snapshot and what followed it. A crash before that commit only means
a longer replay from the previous start.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable, Sequence

from gateway.rocketmq_broker import Broker
from gateway.storage import StateRecord, StoreError
from rocketmq_remoting import RemotingError

log = logging.getLogger("lmqtt.rocketmq")

STATE_QUEUE = "%STATE%"
#: Property of every state batch: the process that wrote it (a random id per start), so a
#: node catching up with the state log (`catch_up`) skips its own batches, which it applied
#: when it made them (gateway/cluster_sessions.py).
NODE_PROPERTY = "lmqtt.node"
#: The consumer group whose committed offset in STATE_QUEUE is where a replay starts (the
#: last compaction's snapshot).
STATE_START = "%STATE-START%"
STATE_SNAPSHOT_BATCH = 1000  # records per message of a compaction's snapshot
STATE_COMPACT_SLACK = 10_000  # history records tolerated beyond twice the live ones
FAILED_TICKETS_KEPT = 10_000
#: Batches queued behind a send in flight are merged into one message up to this size (the
#: broker's default maxMessageSize is 4 MiB).
MERGED_BATCH_BYTES = 1 << 20

_STATE_KEY = struct.Struct(">H")
_STATE_VALUE = struct.Struct(">i")

#: Sends one message (light queues, body, property block) and returns once it is SEND_OK.
Send = Callable[[Sequence[str], bytes, bytes], Awaitable[object]]


def encode_state(records: Sequence[StateRecord]) -> bytes:
    out = bytearray()
    for key, value in records:
        raw = key.encode("utf-8")
        out += _STATE_KEY.pack(len(raw))
        out += raw
        if value is None:
            out += _STATE_VALUE.pack(-1)
        else:
            out += _STATE_VALUE.pack(len(value))
            out += value
    return bytes(out)


def decode_state(body: bytes) -> list[StateRecord]:
    out: list[StateRecord] = []
    pos = 0
    try:
        while pos < len(body):
            (klen,) = _STATE_KEY.unpack_from(body, pos)
            pos += 2
            key = body[pos : pos + klen].decode("utf-8")
            pos += klen
            (vlen,) = _STATE_VALUE.unpack_from(body, pos)
            pos += 4
            if vlen < 0:
                out.append((key, None))
            else:
                out.append((key, body[pos : pos + vlen]))
                pos += vlen
    except (struct.error, UnicodeDecodeError):
        log.error("state queue: a damaged batch skipped after %d record(s)", len(out))
    return out


class StateLog:
    """The live state records (key -> newest value) and their log on the broker."""

    def __init__(self, broker: Broker, send: Send, node_block: bytes = b"") -> None:
        """`node_block`: the property block every batch carries (NODE_PROPERTY)."""
        self._broker = broker
        self._send = send
        self._node_block = node_block
        self.next = 0  # the queue's offset read up to (load, catch_up)
        self._catch_up_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self.records: dict[str, bytes] = {}
        self.history = 0  # records in the log from the replay's start (live or not)
        self._ticket = 0
        self._chain: asyncio.Task[None] | None = None
        self._sends: dict[int, asyncio.Task[None]] = {}
        self._failed: dict[int, StoreError] = {}
        self._compacting = False
        self._open: list[bytes] | None = None  # the queued batch later ones may join
        self._open_size = 0

    async def load(self) -> None:
        """Replay the state queue (before the gateway reads state)."""
        broker = self._broker
        client, addr = broker.client, broker.addr
        lmq = broker.names.lmq(STATE_QUEUE)
        start = await client.query_consumer_offset(addr, broker.names.lmq(STATE_START), lmq)
        lo = await client.get_min_offset(addr, lmq)
        hi = await client.get_max_offset(addr, lmq)
        state: dict[str, bytes] = {}
        history = 0
        async for batch in broker.read(lmq, max(lo, start or 0), hi):
            for rec in batch:
                for key, value in decode_state(rec.body):
                    history += 1
                    if value is None:
                        state.pop(key, None)
                    else:
                        state[key] = value
        self.records = state
        self.history = history
        self.next = hi
        log.info(
            "state: %d record(s) replayed from %s offsets %d..%d, %d live",
            history, STATE_QUEUE, max(lo, start or 0), hi, len(state),
        )  # fmt: skip

    async def catch_up(self, node: str) -> list[StateRecord]:
        """Read the queue from where this process last read it to the broker's end now, and
        return the records other processes wrote there (oldest first), folded into `records`
        as well. Batches stamped with `node` (ours) are skipped: we applied them when we made
        them, and re-applying an older one could undo a newer one still in flight.

        "The end now" is GET_MAX_OFFSET asked after the call: a batch another node had
        SEND_OK for before is read (modulo the broker's dispatch, milliseconds: quirk 3)."""
        async with self._catch_up_lock:
            broker = self._broker
            lmq = broker.names.lmq(STATE_QUEUE)
            hi = await broker.client.get_max_offset(broker.addr, lmq)
            out: list[StateRecord] = []
            state = self.records
            async for batch in broker.read(lmq, self.next, hi):
                for rec in batch:
                    off = rec.light_queue_offsets().get(lmq)
                    if off is not None and off >= self.next:
                        self.next = off + 1
                    if rec.properties.get(NODE_PROPERTY) == node:
                        continue
                    for key, value in decode_state(rec.body):
                        if value is None:
                            state.pop(key, None)
                        else:
                            state[key] = value
                        out.append((key, value))
            self.history += len(out)
            return out

    def append(self, batch: Sequence[StateRecord]) -> int:
        """Apply `batch` and send it; returns the ticket for wait_durable."""
        state = self.records
        for key, value in batch:
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        self.history += len(batch)
        return self._send_batch(encode_state(batch))

    @property
    def ticket(self) -> int:
        """The ticket of the last batch sent."""
        return self._ticket

    def _send_batch(self, body: bytes) -> int:
        # Group commit: batches made while the previous send is in flight join the one queued
        # behind it (records concatenate), so N sessions saved at once (a fleet connecting,
        # each CONNECT writing its session: gateway/cluster_sessions.py) cost a few round
        # trips, not N one after the other.
        joining = self._open
        if joining is not None and self._open_size + len(body) <= MERGED_BATCH_BYTES:
            joining.append(body)
            self._open_size += len(body)
            return self._ticket
        self._ticket += 1
        ticket = self._ticket
        prev = self._chain
        parts = [body]
        self._open, self._open_size = parts, len(body)

        async def send() -> None:
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            if self._open is parts:
                self._open = None  # sending: later batches queue behind this one
            await self._send((STATE_QUEUE,), b"".join(parts), self._node_block)

        task = self._loop.create_task(send())
        self._chain = task
        self._sends[ticket] = task

        def done(t: asyncio.Task[None]) -> None:
            self._sends.pop(ticket, None)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                log.error("state write to RocketMQ failed: %s", exc)
                self._failed[ticket] = exc if isinstance(exc, StoreError) else StoreError(str(exc))
                if len(self._failed) > FAILED_TICKETS_KEPT:
                    self._failed.pop(next(iter(self._failed)))

        task.add_done_callback(done)
        return ticket

    async def wait_durable(self, ticket: int) -> None:
        task = self._sends.get(ticket)
        if task is not None:
            await asyncio.shield(task)
            return
        err = self._failed.get(ticket)
        if err is not None:
            raise err

    def in_flight(self) -> list[asyncio.Task[None]]:
        """The batches not answered yet (a graceful stop waits for them)."""
        return list(self._sends.values())

    async def compact(self) -> None:
        if self._compacting:
            return
        if self.history <= 2 * len(self.records) + STATE_COMPACT_SLACK:
            return
        self._compacting = True
        broker = self._broker
        try:
            if self._chain is not None:
                await asyncio.gather(self._chain, return_exceptions=True)
            lmq = broker.names.lmq(STATE_QUEUE)
            # The queue's end before the snapshot (it may lag the sends just made: then the
            # replay reads a few older records first, which the snapshot overrides).
            start = await broker.client.get_max_offset(broker.addr, lmq)
            items = list(self.records.items())
            ticket = self._ticket
            for i in range(0, len(items), STATE_SNAPSHOT_BATCH):
                ticket = self._send_batch(encode_state(items[i : i + STATE_SNAPSHOT_BATCH]))
            await self.wait_durable(ticket)
            await broker.client.update_consumer_offset(
                broker.addr, broker.names.lmq(STATE_START), lmq, start
            )
            self.history = len(items)
            log.info("state: compacted to %d record(s), replay starts at %d", len(items), start)
        except (RemotingError, StoreError) as exc:
            log.warning("state compaction failed (the queue keeps its history): %s", exc)
        finally:
            self._compacting = False
