"""The cluster bus: the records gateway nodes of one deployment send each other, through storage.

Several `lmqtt serve --store rocketmq` processes on one namespace (`rocketmq_topic`) talk only
through the broker: each appends small records to one light queue, %CLUSTER%, and every node
tails that queue with the storage's held pull (the same long poll that delivers messages), so
a record reaches every node in milliseconds and every node reads all records in the one order
the broker stored them. Nothing else connects the nodes: no node addresses, no extra port.

    message body (UTF-8 JSON)  [record, ...]  (the records a node queued during its last send)
    record                     {"k": kind, "n": sending node id, "i": its sequence number at
                                that node, ...the kind's fields}

Kinds (each handled by the module named): "join", "hb", "hello", "bye"
(gateway/cluster/membership.py), "flt", "ack" (gateway/cluster/filter_registry.py), "conn"
(gateway/cluster/takeover.py), "hand" (gateway/cluster/handover.py).

A node's messages are sent one after the other (each waits for the previous SEND_OK), so the
queue holds its records in the order the node made them, whatever the broker's send threads do; the
records of different nodes interleave in the broker's order, which every reader sees alike.
`sent(seq)` resolves when the node has read its own record `seq` back from the queue: from
then on every record stored before it has been handled here too (the point the registry's
acknowledgements and the takeover race are decided at).

Why a queue of its own, not the %STATE% log: these are events (heartbeats every second,
acknowledgements), not key/value state; in the state log they would lengthen every replay and
every compaction. The state log is tailed as well (gateway/storage/rocketmq/adapter.py), for the
records of sessions other nodes write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from pydantic_core import from_json, to_json

from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage, StoreError

log = logging.getLogger("lmqtt.cluster")

CLUSTER_QUEUE = "%CLUSTER%"
#: The parent topic of the records on the embedded store (RocketMQ sends every message to the
#: deployment's one parent topic whatever this says).
CLUSTER_TOPIC = "$cluster"
READ_BATCH = 64
RECORDS_PER_MESSAGE = 500
#: ... and at most about this many bytes (a hand-over carries a session's in-flight window,
#: gateway/cluster/handover.py; the broker's default maxMessageSize is 4 MiB).
MESSAGE_BYTES = 1 << 20
#: A reader with no arrival notice looks again after this long (a notice lost to a broker
#: reconnect costs this much delay, never a record).
IDLE_POLL_S = 0.5

Record = dict[str, Any]
Handler = Callable[[Record], None]


class ClusterBus:
    """Send records to every node; hand each record read to the handler of its kind."""

    def __init__(self, store: Storage, node_id: str) -> None:
        self.node_id = node_id
        self._store = store
        self._cursor = QueueCursor(store)
        self._handlers: dict[str, list[Handler]] = {}
        self._seq = 0
        self._queued: list[Record] = []  # not sent yet
        self._writer: asyncio.Task[None] | None = None
        self._readback: dict[int, asyncio.Future[None]] = {}
        self._offset = 0
        #: Where this node began reading (records stored before are history: `history`).
        self.origin = 0
        #: The queue offset of the message whose records are being handled; between reads,
        #: the next offset to read. A record sent now is stored at or after it.
        self.position = 0
        self._wake = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    def on(self, kind: str, handler: Handler) -> None:
        """Call `handler(record)` for every record of `kind` read, the node's own included."""
        self._handlers.setdefault(kind, []).append(handler)

    async def start(self) -> None:
        """Tail the queue from its end: records sent before now are history, not news."""
        store = self._store
        await store.open_queue(CLUSTER_QUEUE)
        self._offset = self.origin = self.position = store.max_offset(CLUSTER_QUEUE)
        store.add_listener(self)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def on_arrival(self, queue: str, max_offset: int) -> None:
        if queue == CLUSTER_QUEUE:
            self._wake.set()

    # -- sending -----------------------------------------------------------------------------

    def send(self, kind: str, **fields: Any) -> int:
        """Append a record (after this node's earlier ones); returns its sequence number, for
        `sent`. A failed send is logged; its read-back waiter fails."""
        self._seq += 1
        seq = self._seq
        self._queued.append({"k": kind, "n": self.node_id, "i": seq, **fields})
        loop = asyncio.get_running_loop()
        self._readback[seq] = loop.create_future()
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write())
        return seq

    async def _write(self) -> None:
        """One send at a time; the records queued meanwhile go out together in the next (a
        burst of CONNECTs costs a few sends, not one broker round trip each)."""
        while self._queued and not self._closed:
            queued = self._queued
            parts = [to_json(queued[0])]
            size = len(parts[0])
            while len(parts) < min(RECORDS_PER_MESSAGE, len(queued)):
                part = to_json(queued[len(parts)])
                if size + len(part) > MESSAGE_BYTES:
                    break
                parts.append(part)
                size += len(part) + 1
            batch = queued[: len(parts)]
            del queued[: len(parts)]
            body = b"[" + b",".join(parts) + b"]"
            try:
                await self._store.put_async(CLUSTER_TOPIC, body, (CLUSTER_QUEUE,))
            except StoreError as exc:
                log.error("%d cluster record(s) not sent: %s", len(batch), exc)
                for rec in batch:
                    waiter = self._readback.pop(rec["i"], None)
                    if waiter is not None and not waiter.done():
                        waiter.set_exception(exc)
                        waiter.exception()  # retrieved: a caller may not wait for it

    async def sent(self, seq: int, timeout: float) -> None:
        """Wait until record `seq` of this node was read back from the queue (StoreError if
        its send failed, TimeoutError after `timeout`)."""
        waiter = self._readback.get(seq)
        if waiter is None:
            return  # read back already
        await asyncio.wait_for(asyncio.shield(waiter), timeout)

    # -- reading -----------------------------------------------------------------------------

    async def _read(self) -> None:
        read = self._cursor.read
        wake = self._wake
        while not self._closed:
            wake.clear()
            offset = self._offset
            messages, start, next_offset = read(CLUSTER_QUEUE, offset, READ_BATCH)
            if start > offset:
                log.warning(
                    "cluster queue: records %d..%d deleted before they were read", offset, start
                )
            for msg in messages:
                self.position = msg.queue_offset
                self._handle(msg.body)
            if start >= offset and next_offset > offset:
                self._offset = self.position = next_offset
                continue
            self.position = offset
            # Nothing new, or the queue ends below the position (a lost tail): wait for more.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), IDLE_POLL_S)

    def _handle(self, body: bytes) -> None:
        for rec in self._records(body):
            self._handle_record(rec)

    @staticmethod
    def _records(body: bytes) -> list[Record]:
        try:
            records = from_json(body)
        except ValueError:
            log.error("cluster queue: an unreadable message skipped")
            return []
        return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []

    async def history(self, start: int) -> list[tuple[int, Record]]:
        """The records stored from queue offset `start` up to what this node has read (its
        `position` when this returns), with the offset of each; handlers are not called.
        Raises StoreError when part of that range cannot be read (deleted by retention)."""
        store = self._store
        read_range = getattr(store, "read_range", None)  # RocketMQ: from the broker
        fetched = await read_range(CLUSTER_QUEUE, start, self.position) if read_range else []
        end = self.position  # from here on synchronous: nothing is handled meanwhile
        got = {m.queue_offset: m for m in fetched if m.queue_offset < end}
        offset = max(got, default=start - 1) + 1
        while offset < end:  # read since the fetch (or the embedded store: everything)
            messages, first, after = self._cursor.read(CLUSTER_QUEUE, offset, READ_BATCH)
            if first != offset or not messages:
                break
            got.update((m.queue_offset, m) for m in messages if m.queue_offset < end)
            offset = after
        missing = [o for o in range(start, end) if o not in got]
        if missing:
            raise StoreError(
                f"cluster queue: {len(missing)} record message(s) from {missing[0]} unreadable"
            )
        return [(o, rec) for o in range(start, end) for rec in self._records(got[o].body)]

    def _handle_record(self, rec: Record) -> None:
        try:
            kind = rec["k"]
            node = rec["n"]
        except (KeyError, TypeError):
            log.error("cluster queue: an unreadable record skipped")
            return
        if node == self.node_id:
            waiter = self._readback.pop(rec.get("i", 0), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        for handler in self._handlers.get(kind, ()):
            try:
                handler(rec)
            except Exception:
                log.exception("cluster record %s from %s: handler failed", kind, node)

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the records sent so far (a graceful stop's last words)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._writer), timeout)

    def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        for waiter in self._readback.values():
            waiter.cancel()
        self._readback.clear()
