"""The gateway's durable state on RocketMQ: the %STATE% light queue, its replay and compaction.

Sessions with their subscriptions, positions and wills, the retained snapshot and config
documents are state records (gateway/storage/port.py StateRecord). Each append() batch is one
message to the state light queue (gateway name STATE_QUEUE), its body the batch's records
(the layout is drawn in topicmap/rocketmq.py, which the fan-out report reads it with too):

    record := u16 key length, key (UTF-8), i32 value length (-1: the key is deleted), value

Batches are sent one after the other (each waits for the previous SEND_OK), so the queue
holds them in the order they were made even on a broker with several send threads.
At start the queue is replayed from the offset committed for the consumer group of
STATE_START (or its minimum) and folded into `records` (key -> newest value); compaction
re-sends every live record and then commits the offset it started at, so a replay reads
the last complete snapshot and what followed it. A crash before that commit only means
a longer replay from the previous start.

Cluster mode: other nodes keep writing while the leader compacts, so a record of theirs can
land in the log between the compaction's start and the snapshot's copy of the same key, which
holds the value the leader knew before. Each snapshot batch says where its compaction started
(SNAPSHOT_PROPERTY): a replay skips a snapshot record whose key an ordinary batch at or after
that start wrote (that record is newer), and the tails skip snapshot batches altogether (a
node that tails the log has every record already). The leader applies the log up to the
start before it copies its records, so none stored before the start is missing.

A lost node's batches stored after the first fence marker naming it are dropped by every
reader, the tails, the replays and so compaction (gateway/storage/rocketmq/fences.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from gateway.bounded import trim_oldest
from gateway.storage.port import GetResult, GetStatus, StateRecord, StoreError
from gateway.storage.rocketmq.broker import Broker
from gateway.storage.rocketmq.fences import FENCE_PROPERTY, Fences, has_marker, marker
from rocketmq_remoting import RemotingError
from topicmap.rocketmq import STATE_QUEUE, STATE_START, decode_state, encode_state

log = logging.getLogger("lmqtt.rocketmq")

STATE_SNAPSHOT_BATCH = 1000  # records per message of a compaction's snapshot
SNAPSHOT_IN_FLIGHT = 8  # a compaction's snapshot batches sent and not yet answered, at most
STATE_COMPACT_SLACK = 10_000  # history records tolerated beyond twice the live ones
FAILED_TICKETS_KEPT = 10_000
#: Property of a state batch: the id of the node that wrote it (cluster mode,
#: gateway/cluster/node.py: every node tails the state log and applies the other nodes' records;
#: a lost node's sessions are found by it). A compaction's snapshot keeps each record's writer.
NODE_PROPERTY = "lmqtt.node"
#: Property of a compaction's snapshot batch: the state queue offset that compaction started
#: at (see the module docstring).
SNAPSHOT_PROPERTY = "lmqtt.snap"
#: Batches queued behind a send in flight are merged into one message up to this size (the
#: broker's default maxMessageSize is 4 MiB).
MERGED_BATCH_BYTES = 1 << 20
#: A compaction in cluster mode waits this long at most for the tail to reach its start.
COMPACT_CATCH_UP_S = 30.0

#: Sends one message (light queues, body, property block) and returns once it is SEND_OK.
Send = Callable[[Sequence[str], bytes, bytes], Awaitable[object]]


def _snapshot_start(properties: dict[str, str]) -> int | None:
    value = properties.get(SNAPSHOT_PROPERTY)
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _decode_state(body: bytes) -> list[StateRecord]:
    records, whole = decode_state(body)
    if not whole:
        log.error("state queue: a damaged batch skipped after %d record(s)", len(records))
    return records


class StateLog:
    """The live state records (key -> newest value) and their log on the broker."""

    def __init__(self, broker: Broker, send: Send, node_id: str = "") -> None:
        self._broker = broker
        self._send = send
        self.node_id = node_id
        # Cluster mode: who wrote each live record; where the replay ended (the tail of the
        # other nodes' records reads on from there); whether this node may compact.
        self.writers: dict[str, str] = {}
        self.end = 0
        self.observers: list[Callable[[str, list[StateRecord]], None]] = []
        self.may_compact: Callable[[], bool] = lambda: True
        self._wake = asyncio.Event()
        self._reached: list[tuple[int, asyncio.Future[None]]] = []  # (offset, tail got there)
        self._loop = asyncio.get_running_loop()
        self.records: dict[str, bytes] = {}
        self.history = 0  # records in the log from the replay's start (live or not)
        self._ticket = 0
        self._chain: asyncio.Task[None] | None = None
        self._sends: dict[int, asyncio.Task[None]] = {}
        self._failed: dict[int, StoreError] = {}
        self._compacting = False
        self._following = False  # follow() runs: reached() answers
        self._open: list[bytes] | None = None  # the queued batch later ones may join
        self._open_size = 0
        #: The fence markers read (gateway/storage/rocketmq/fences.py): the one rule of every
        #: reader of the log, this node's tail and replays.
        self.fences = Fences()
        self._fences_sent: dict[str, int] = {}  # node -> ticket of our marker fencing it

    async def load(self) -> None:
        """Replay the state queue (before the gateway reads state)."""
        broker = self._broker
        client, addr = broker.client, broker.addr
        lmq = broker.names.lmq(STATE_QUEUE)
        start = await client.query_consumer_offset(addr, broker.names.lmq(STATE_START), lmq)
        lo = await client.get_min_offset(addr, lmq)
        hi = await client.get_max_offset(addr, lmq)
        fences = Fences()
        await self._replay(lmq, max(lo, start or 0), hi, fences)
        if fences.late:
            # A lost node's batch came before the snapshot copy of its marker: again, with the
            # markers known from the start.
            log.info("state: replaying again with the fence markers of %s", sorted(fences.at))
            fences = Fences(fences.at)
            await self._replay(lmq, max(lo, start or 0), hi, fences)
        self.fences = fences
        log.info(
            "state: %d record(s) replayed from %s offsets %d..%d, %d live",
            self.history, STATE_QUEUE, max(lo, start or 0), hi, len(self.records),
        )  # fmt: skip

    async def _replay(self, lmq: str, offset: int, hi: int, fences: Fences) -> None:
        broker = self._broker
        state: dict[str, bytes] = {}
        writers: dict[str, str] = {}
        history = 0
        written_at: dict[str, int] = {}  # key -> offset of its newest ordinary batch
        async for batch in broker.read(lmq, offset, hi):
            for rec in batch:
                # The entries of a light queue are consecutive; the broker says so too.
                offset = rec.light_queue_offsets().get(lmq, offset)
                node = rec.properties.get(NODE_PROPERTY, "")
                snapshot = _snapshot_start(rec.properties)
                if not fences.admits(node, offset, snapshot=snapshot is not None):
                    offset += 1
                    continue  # a lost node's, stored after its takeover
                records = _decode_state(rec.body)
                if snapshot is None:
                    fences.applied(node, offset)
                if has_marker(records):
                    records = [*records, *fences.read(records, offset)]
                for key, value in records:
                    history += 1
                    if snapshot is None:
                        written_at[key] = offset
                    elif written_at.get(key, -1) >= snapshot:
                        continue  # written again after the compaction started: that is newer
                    if value is None:
                        state.pop(key, None)
                        writers.pop(key, None)
                    else:
                        state[key] = value
                        writers[key] = node
                offset += 1
        self.records = state
        self.writers = writers
        self.end = hi
        self.history = history

    def append(self, batch: Sequence[StateRecord]) -> int:
        """Apply `batch` and send it; returns the ticket for wait_durable."""
        self._apply(self.node_id, batch)
        return self._send_batch(encode_state(batch))

    def _apply(self, node: str, records: Sequence[StateRecord]) -> None:
        """Make `records`, written by `node`, the live ones."""
        state = self.records
        writers = self.writers
        for key, value in records:
            if value is None:
                state.pop(key, None)
                writers.pop(key, None)
            else:
                state[key] = value
                writers[key] = node
        self.history += len(records)

    @property
    def ticket(self) -> int:
        """The ticket of the last batch sent."""
        return self._ticket

    def fence(self, node: str) -> int:
        """Append the marker fencing `node` (a batch of its own); returns its ticket. It takes
        effect here as everywhere: when the tail reads it (gateway/storage/rocketmq/fences.py)."""
        ticket = self._fences_sent.get(node)
        if ticket is None or ticket in self._failed:  # not sent yet, or refused: (again)
            body = encode_state([marker(node)])
            ticket = self._fences_sent[node] = self._send_batch(body, self.node_id, fence=node)
        return ticket

    def _send_batch(
        self,
        body: bytes,
        writer: str | None = None,
        snapshot: int | None = None,
        *,
        fence: str | None = None,
    ) -> int:
        # Group commit: batches made while the previous send is in flight join the one queued
        # behind it (records concatenate), so N sessions saved at once (a fleet connecting,
        # each CONNECT writing its session before CONNACK in cluster mode) cost a few round
        # trips, not N one after the other. Only this node's own batches join: a compaction's
        # snapshot keeps each record's writer.
        joining = self._open
        if (
            writer is None
            and joining is not None
            and self._open_size + len(body) <= MERGED_BATCH_BYTES
        ):
            joining.append(body)
            self._open_size += len(body)
            return self._ticket
        node = self.node_id if writer is None else writer
        # The property block in RocketMQ's format (`name \x01 value \x02`); ids are [A-Za-z0-9._-].
        block = f"{NODE_PROPERTY}\x01{node}\x02".encode() if node else b""
        if snapshot is not None:
            block += f"{SNAPSHOT_PROPERTY}\x01{snapshot}\x02".encode()
        if fence is not None:
            block += f"{FENCE_PROPERTY}\x01{fence}\x02".encode()
        self._ticket += 1
        ticket = self._ticket
        prev = self._chain
        parts = [body]
        self._open = parts if writer is None else None
        self._open_size = len(body)

        async def send() -> None:
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            if self._open is parts:
                self._open = None  # sending: later batches queue behind this one
            await self._send((STATE_QUEUE,), b"".join(parts), block)

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
                trim_oldest(self._failed, FAILED_TICKETS_KEPT)

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
        if not self.may_compact():
            return  # cluster mode: the leader compacts (one node at a time)
        self._compacting = True
        broker = self._broker
        try:
            if self._chain is not None:
                await asyncio.gather(self._chain, return_exceptions=True)
            lmq = broker.names.lmq(STATE_QUEUE)
            # The queue's end before the snapshot (it may lag the sends just made: then the
            # replay reads a few older records first, which the snapshot overrides).
            start = await broker.client.get_max_offset(broker.addr, lmq)
            if self._following:
                # Every record stored before the start applied here (other nodes' included).
                await asyncio.wait_for(self.reached(start), COMPACT_CATCH_UP_S)
            copied = await self._send_snapshot(start)
            await broker.client.update_consumer_offset(
                broker.addr, broker.names.lmq(STATE_START), lmq, start
            )
            log.info("state: compacted to %d record(s), replay starts at %d", copied, start)
        except (RemotingError, StoreError, TimeoutError) as exc:
            log.warning("state compaction failed (the queue keeps its history): %s", exc)
        finally:
            self._compacting = False
        self._following = False  # follow() runs: reached() answers

    async def _send_snapshot(self, start: int) -> int:
        """Send every live record as snapshot batches of `start`; returns how many.

        In slices of STATE_SNAPSHOT_BATCH keys with a turn of the event loop between them, and
        at most SNAPSHOT_IN_FLIGHT batches unanswered: the copy of a million records neither
        holds the loop nor queues every batch at once ahead of the ordinary writes. Records
        change meanwhile: a slice sends the values of when it runs, skips the keys deleted
        since, and a key written since was written by an ordinary batch after `start`, which
        a replay prefers to the snapshot's copy anyway (see the module docstring)."""
        keys = list(self.records)  # the keys only: one pointer copy
        history = self.history
        records, writers = self.records, self.writers
        sent: list[int] = []
        copied = 0
        for i in range(0, len(keys), STATE_SNAPSHOT_BATCH):
            if i:
                await asyncio.sleep(0)
            # One batch per writer in the slice: each record keeps who wrote it.
            by_writer: dict[str, list[StateRecord]] = {}
            for key in keys[i : i + STATE_SNAPSHOT_BATCH]:
                value = records.get(key)
                if value is not None:
                    by_writer.setdefault(writers.get(key, self.node_id), []).append((key, value))
            for writer, batch in by_writer.items():
                sent.append(self._send_batch(encode_state(batch), writer, start))
                copied += len(batch)
            while len(sent) > SNAPSHOT_IN_FLIGHT:
                await self.wait_durable(sent.pop(0))
        for ticket in sent:
            await self.wait_durable(ticket)
        # The snapshot, plus what was appended while it was sent.
        self.history = copied + self.history - history
        return copied

    # -- cluster mode: the other nodes' records ------------------------------------------------

    def written_by(self, node: str) -> list[tuple[str, bytes]]:
        writers = self.writers
        return [(k, v) for k, v in self.records.items() if writers.get(k) == node]

    def wake(self) -> None:
        """The state queue's mirror has news (its arrival notice)."""
        self._wake.set()

    async def reached(self, offset: int) -> None:
        """Wait until the tail (`follow`) applied every batch below `offset`."""
        if self.end >= offset:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._reached.append((offset, fut))
        self._wake.set()
        await fut

    def _release_reached(self) -> None:
        end = self.end
        waiting = []
        for offset, fut in self._reached:
            if offset <= end:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():
                waiting.append((offset, fut))
        self._reached = waiting

    async def follow(self, get: Callable[[str, int, int], GetResult]) -> None:
        """Read the state queue on from where the replay ended (`get`: the mirrors' try-read)
        and apply what other nodes wrote; this node's records were applied when written."""
        wake = self._wake
        self._following = True
        while True:
            wake.clear()
            res = get(STATE_QUEUE, self.end, 32)
            if res.status is GetStatus.FOUND:
                fences = self.fences
                for msg in res.messages:
                    props = msg.properties
                    if SNAPSHOT_PROPERTY in props:
                        continue  # a compaction's copy of records applied here already
                    node = props.get(NODE_PROPERTY, "")
                    offset = msg.queue_offset
                    if not fences.admits(node, offset):
                        log.warning(
                            "state: a batch of fenced node %s stored after its takeover (offset"
                            " %d) ignored", node, offset,
                        )  # fmt: skip
                        continue
                    if node != self.node_id:
                        records = _decode_state(msg.body)
                        if FENCE_PROPERTY in props:
                            records = [*records, *fences.read(records, offset)]
                        self._apply_remote(node, records)
                    elif FENCE_PROPERTY in props:
                        # Our own marker, read back: it takes effect here now, in log order.
                        self._apply(node, fences.read(_decode_state(msg.body), offset))
                self.end = res.next_offset
                if self._reached:
                    self._release_reached()
                continue
            if res.status is GetStatus.OFFSET_TOO_SMALL:
                self.end = res.next_offset
                continue
            if self._reached:
                self._release_reached()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), 1.0)

    def _apply_remote(self, node: str, records: list[StateRecord]) -> None:
        self._apply(node, records)
        for observer in self.observers:
            try:
                observer(node, records)
            except Exception:
                log.exception("state observer failed")
