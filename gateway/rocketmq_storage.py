"""Apache RocketMQ 5 as the gateway's Storage (gateway/storage.py): the second adapter.

Messages live on a RocketMQ broker with `enableLmq=true` and `enableMultiDispatch=true`, spoken
to with rocketmq_remoting (docs/rocketmq.md has the verified protocol facts this relies on):

    append   SEND_MESSAGE_V2 to the parent topic (`rocketmq_topic`, one queue), with
             INNER_MULTI_DISPATCH = the light queues of the matching filters (names mapped by
             `lmq_name`). One task per message, all pipelined on one connection; the batch's
             ticket (PutResult.end_offset) resolves when every send is SEND_OK.
    read     a `_Mirror` per opened queue: a held long poll (PULL_MESSAGE with the suspend
             flag) from the queue's end brings each new message in and fires the arrival
             notice; `get` is a try-read of the mirror, and a miss below the end starts a
             one-shot pull of that range (backlog after a reconnect), whose arrival wakes the
             reader again. So the delivery loop is the same as on the embedded store.
    offsets  the gateway's committed offsets are mirrored to the broker's consumer offsets,
             group `%LMQ%` + the encoded consumer (client id or $share group), every second.

Light queues are per broker (docs/rocketmq.md): the gateway writes and reads ONE broker (named
by `rocketmq_broker`, else the first in the cluster by name), so each light queue has one
home, one offset sequence and a total order. Spreading over brokers needs per-broker offsets.

State: the gateway's state log (sessions with their subscriptions, positions and wills, the
retained snapshot) is the %STATE% light queue, replayed at start (`load_state`); retained
messages are the %RETAIN% light queue. What stays in `data_dir` (a local embedded store): the
committed-offsets table (its broker copy is the mirror above; session records carry their own
positions, shared groups' positions are only local) and the delivery account.

Physical offsets are the broker's CommitLog offsets (unique on one broker), so the delivery
loop's cross-queue ordering (`start_phys`, `read_phys`) works unchanged; `log_max_offset` is the
highest one seen (sends and pulls) + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.storage import (
    ArrivalListener,
    CommittedOffsets,
    EncodedMessage,
    GetResult,
    GetStatus,
    PutResult,
    StateRecord,
    Storage,
    StorageUnavailable,
    StoredMessage,
    StoreError,
)
from rocketmq_remoting import (
    BrokerBusyError,
    BrokerError,
    OffsetMovedError,
    RemotingClient,
    RemotingError,
    SendResult,
)
from rocketmq_remoting.message import MessageRecord, decode_message_id

if TYPE_CHECKING:
    from gateway.config import GatewaySettings

log = logging.getLogger("lmqtt.rocketmq")

LMQ_PREFIX = "%LMQ%"
#: Consumer group of the gateway's own pulls. `%LMQ%` groups need no creation on the broker
#: (LmqSubscriptionGroupManager synthesizes them); pulls carry their subscription, so no
#: consumer registration either.
PULL_GROUP = "%LMQ%lmqtt-gateway"
#: A light queue no gateway queue maps to (`_9` follows no namespace in an encoded name): the
#: start-up probe that the broker really indexes light queues.
PROBE_QUEUE = "%LMQ%lmqtt_9probe"
#: How long a held pull waits for an arrival. Well under the broker's 120 s idle close; the
#: broker answers NOT_FOUND after it (rounded up to its hold checker's 5 s pass).
SUSPEND_S = 15.0
PULL_BATCH = 32
#: Messages a mirror keeps per queue (oldest dropped; a reader behind them pulls them again).
MIRROR_SIZE = 4096
#: %RETAIN% messages read at start for the retained index's catch-up (gateway/retained.py).
RETAIN_PRELOAD = 20_000
RETAIN_QUEUE = "%RETAIN%"
#: The gateway's state records (sessions, subscriptions, wills, retained snapshot): see
#: RocketMqStorage.load_state. STATE_START names the consumer group whose committed offset in
#: it is where a replay starts (the last compaction's snapshot).
STATE_QUEUE = "%STATE%"
STATE_START = "%STATE-START%"
STATE_SNAPSHOT_BATCH = 1000  # records per message of a compaction's snapshot
STATE_COMPACT_SLACK = 10_000  # history records tolerated beyond twice the live ones
CONFIG_KEY_PREFIX = "config/"
#: Property of every state batch: the process that wrote it (a random id per start), so a
#: node catching up with the state log (catch_up_state) skips its own batches, which it
#: applied when it made them (gateway/cluster_sessions.py).
NODE_PROPERTY = "lmqtt.node"
SEND_ATTEMPTS = 5  # broker busy (nothing stored): retried with backoff
OFFSET_FLUSH_S = 1.0
DRAIN_S = 10.0  # a graceful stop waits this long at most for the sends in flight
#: A broker cannot store an empty body (5.3.3: NullPointerException in buildMsgContext, answered
#: SYSTEM_ERROR; Java clients refuse empty bodies before sending). An empty MQTT payload (a
#: retained message's deletion) is sent as one byte with this property, and read back empty.
EMPTY_BODY_PROPERTY = "lmqtt.empty"
_EMPTY_BODY_MARK = EMPTY_BODY_PROPERTY.encode() + b"\x011\x02"
FAILED_TICKETS_KEPT = 10_000
#: Properties the broker adds to a stored message; the gateway's readers never see them.
_BROKER_PROPERTIES = frozenset(
    {
        "INNER_MULTI_DISPATCH",
        "INNER_MULTI_QUEUE_OFFSET",
        "UNIQ_KEY",
        "WAIT",
        "CLUSTER",
        "MSG_REGION",
        "TRACE_ON",
        "__CRC32#",
        "CONSUME_START_TIME",
        "MIN_OFFSET",
        "MAX_OFFSET",
    }
)


# -- names ------------------------------------------------------------------------------------
#
# A gateway queue name (the router's `%LMQ%site.%2b`, or `%RETAIN%`) as a RocketMQ light queue,
# within the namespace of the deployment's parent topic (`rocketmq_topic`, default `lmqtt`), so
# several gateways' deployments share a cluster without seeing each other's queues:
#
#     %LMQ% <encoded topic> _0 [_2 if the name does not start with %LMQ%] <encoded rest>
#     encoded: A-Z a-z 0-9 - %  as is;  .  -> _1;  _  -> _3;  | -> _4;  other bytes -> _x + 2 hex
#     longer than MAX_LMQ_NAME:  %LMQ% <encoded topic> _5 <sha256 hex, 40 digits>
#                                (reverse: the name table of the process that named it)
#
# e.g. `%LMQ%site.%2b` -> `%LMQ%lmqtt_0site_1%2b`, `%RETAIN%` -> `%LMQ%lmqtt_0_2%RETAIN%`.
# RocketMQ topic names allow only [%|a-zA-Z0-9_-] (TopicValidator), and a `/` would make the
# broker skip the dispatch silently (docs/rocketmq.md quirk 4). Each `_` starts an escape of a
# known length, so the mapping is injective; `_9` is left for the probe queue.

MAX_LMQ_NAME = 200
_KEEP = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-%")


def _escape(text: str) -> str:
    out: list[str] = []
    for ch in text:
        if ch in _KEEP:
            out.append(ch)
        elif ch == ".":
            out.append("_1")
        elif ch == "_":
            out.append("_3")
        elif ch == "|":
            out.append("_4")
        else:
            out.extend(f"_x{b:02x}" for b in ch.encode("utf-8", "surrogatepass"))
    return "".join(out)


def encode_lmq(queue: str, namespace: str = "lmqtt") -> str:
    """The light queue of gateway queue `queue` in `namespace` (see the table above)."""
    head = LMQ_PREFIX + _escape(namespace)
    if queue.startswith(LMQ_PREFIX):
        name = head + "_0" + _escape(queue[len(LMQ_PREFIX) :])
    else:
        name = head + "_0_2" + _escape(queue)
    if len(name) > MAX_LMQ_NAME:
        name = head + "_5" + hashlib.sha256(queue.encode("utf-8")).hexdigest()[:40]
    return name


def decode_lmq(name: str, namespace: str = "lmqtt") -> str | None:
    """Inverse of encode_lmq for names not hashed; None for any other name."""
    head = LMQ_PREFIX + _escape(namespace) + "_0"
    if not name.startswith(head):
        return None
    rest = name[len(head) :]
    prefix = LMQ_PREFIX
    if rest.startswith("_2"):
        rest, prefix = rest[2:], ""
    out = bytearray()
    i = 0
    escapes = {"1": b".", "3": b"_", "4": b"|"}
    while i < len(rest):
        ch = rest[i]
        if ch != "_":
            out += ch.encode()
            i += 1
            continue
        code = rest[i + 1 : i + 2]
        if code in escapes:
            out += escapes[code]
            i += 2
        elif code == "x":
            try:
                out.append(int(rest[i + 2 : i + 4], 16))
            except ValueError:
                return None
            i += 4
        else:
            return None
    try:
        return prefix + out.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


class _Names:
    """Gateway queue <-> light queue, both ways, for every name this process used."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._to_lmq: dict[str, str] = {}
        self._to_queue: dict[str, str] = {}

    def lmq(self, queue: str) -> str:
        name = self._to_lmq.get(queue)
        if name is None:
            name = self._to_lmq[queue] = encode_lmq(queue, self.namespace)
            self._to_queue[name] = queue
        return name

    def queue(self, lmq: str) -> str:
        queue = self._to_queue.get(lmq)
        if queue is None:
            queue = decode_lmq(lmq, self.namespace) or lmq
            self._to_queue[lmq] = queue
        return queue


# -- state batches ---------------------------------------------------------------------------

_STATE_KEY = struct.Struct(">H")
_STATE_VALUE = struct.Struct(">i")


def _encode_state(records: Sequence[StateRecord]) -> bytes:
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


def _decode_state(body: bytes) -> list[StateRecord]:
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


# -- mirrors of light queues -------------------------------------------------------------------


class _Mirror:
    """What this process knows of one light queue: its bounds and recently read messages."""

    __slots__ = ("fetching", "limit", "lmq", "max", "min", "msgs", "queue", "ready", "tail", "task")

    def __init__(self, queue: str, lmq: str) -> None:
        self.queue = queue
        self.lmq = lmq
        self.ready = False  # bounds known (GET_MIN/MAX_OFFSET answered)
        self.min = 0
        self.max = 0  # the next offset to be written, as far as we know
        self.tail = 0  # where the held pull reads from
        self.msgs: dict[int, StoredMessage] = {}
        self.limit = MIRROR_SIZE  # messages kept (the oldest dropped beyond it)
        self.fetching: set[int] = set()  # offsets of one-shot pulls in flight
        self.task: asyncio.Task[None] | None = None


class _MirroredOffsets:
    """The local committed offsets (primary: restart reads them), copied to the broker."""

    def __init__(self, local: CommittedOffsets, storage: RocketMqStorage) -> None:
        self._local = local
        self._storage = storage

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None:
        self._local.commit(group, queue, offset, durable=durable)
        if durable:
            self._storage.offset_changed(group, queue, offset)

    def get(self, group: str, queue: str) -> int | None:
        return self._local.get(group, queue)

    def remove(self, group: str, queue: str) -> None:
        self._local.remove(group, queue)

    def all(self) -> dict[tuple[str, str], int]:
        return self._local.all()


def _now_ms() -> int:
    return int(time.time() * 1000)


class RocketMqStorage:
    """The Storage port on one RocketMQ broker; create with :func:`open_rocketmq`."""

    def __init__(
        self,
        client: RemotingClient,
        broker_name: str,
        broker_addr: str,
        topic: str,
        local: Storage,
        *,
        sync: bool,
    ) -> None:
        self._client = client
        self.broker_name = broker_name
        self._addr = broker_addr
        self._topic = topic
        self._local = local
        self._sync = sync
        self._names = _Names(topic)
        self._mirrors: dict[str, _Mirror] = {}
        self._listeners: list[ArrivalListener] = []
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._ticket = 0
        self._batches: dict[int, asyncio.Future[None]] = {}
        self._failed: dict[int, StoreError] = {}
        self._log_max = 0
        self._phys_waiters: dict[tuple[str, int], asyncio.Future[int]] = {}
        self._offsets = _MirroredOffsets(local.offsets, self)
        self._dirty_offsets: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._state: dict[str, bytes] = {}
        self._state_history = 0
        self._state_ticket = 0
        self._state_chain: asyncio.Task[None] | None = None
        self._state_sends: dict[int, asyncio.Task[None]] = {}
        self._state_failed: dict[int, StoreError] = {}
        self._compacting = False
        self.node_id = uuid.uuid4().hex[:16]
        self._node_block = local.encode_properties({NODE_PROPERTY: self.node_id})
        self._state_next = 0  # the state queue's offset read up to (load_state, catch_up_state)
        self._catch_up_lock = asyncio.Lock()
        self._spawn(self._flush_offsets_periodically())

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the port: properties --------------------------------------------------------------------

    @property
    def offsets(self) -> CommittedOffsets:
        return self._offsets

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tail_may_be_lost(self) -> bool:
        # Acknowledged messages are the broker's to keep; our saved positions are never past
        # what it acknowledged.
        return False

    def encode_properties(self, properties: dict[str, str]) -> bytes:
        # The embedded store's block is RocketMQ's own property format (`k \x01 v \x02`).
        return self._local.encode_properties(properties)

    # -- the port: append ------------------------------------------------------------------------

    def append_encoded(self, messages: Sequence[EncodedMessage]) -> list[PutResult]:
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        self._ticket += 1
        ticket = self._ticket
        sends = [self._send(queues, body, block) for _parent, queues, body, block in messages]
        batch = asyncio.ensure_future(asyncio.gather(*sends))
        fut: asyncio.Future[None] = self._loop.create_future()
        self._batches[ticket] = fut
        batch.add_done_callback(lambda b: self._batch_done(ticket, fut, b))
        result = PutResult(ticket, -1, {}, ticket, _now_ms())
        return [result] * len(messages)

    def _batch_done(
        self, ticket: int, fut: asyncio.Future[None], batch: asyncio.Future[list[SendResult]]
    ) -> None:
        del self._batches[ticket]
        err: StoreError | None = None
        if batch.cancelled():
            err = StoreError("send cancelled (storage closing)")
        elif (exc := batch.exception()) is not None:
            err = exc if isinstance(exc, StoreError) else StoreError(str(exc))
        if err is None:
            fut.set_result(None)
            return
        if not self._sync:  # nobody waits in async mode: the log is all there is
            log.error("RocketMQ send failed, messages not stored: %s", err)
        self._failed[ticket] = err
        if len(self._failed) > FAILED_TICKETS_KEPT:
            self._failed.pop(next(iter(self._failed)))
        fut.set_exception(err)
        fut.exception()  # retrieved: a batch nobody awaits (async mode) logs nothing more

    async def wait_durable(self, end_offset: int) -> None:
        fut = self._batches.get(end_offset)
        if fut is not None:
            await asyncio.shield(fut)
            return
        err = self._failed.get(end_offset)
        if err is not None:
            raise err

    async def _send(self, queues: Sequence[str], body: bytes, block: bytes) -> SendResult:
        """One SEND_MESSAGE_V2; StoreError unless the broker answered SEND_OK."""
        lmqs = [self._names.lmq(q) for q in queues]
        if not body:
            body, block = b"\x00", block + _EMPTY_BODY_MARK
        delay = 0.05
        for attempt in range(SEND_ATTEMPTS):
            try:
                res = await self._client.send_message(
                    self._addr,
                    self._topic,
                    body,
                    light_queues=lmqs,
                    raw_properties=block.decode("utf-8"),
                    wait_store=self._sync,
                )
            except BrokerBusyError as exc:
                if attempt == SEND_ATTEMPTS - 1:
                    raise StoreError(f"broker {self.broker_name} busy: {exc}") from exc
                await asyncio.sleep(delay)
                delay *= 2
                continue
            except BrokerError as exc:
                raise StoreError(f"broker {self.broker_name} refused the message: {exc}") from exc
            except RemotingError as exc:
                # Maybe stored, maybe not: not acknowledged (the client sends it again).
                raise StoreError(f"broker {self.broker_name}: {exc}") from exc
            if not res.ok:
                raise StoreError(
                    f"broker {self.broker_name} stored the message but could not make it"
                    f" durable in time (response code {res.code})"
                )
            with contextlib.suppress(ValueError):
                self._saw_phys(decode_message_id(res.msg_id)[1])
            return res
        raise AssertionError("unreachable")

    def _saw_phys(self, phys: int) -> None:
        if phys >= self._log_max:
            self._log_max = phys + 1

    async def put_async(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str] = (),
        properties: dict[str, str] | None = None,
        born_timestamp: int | None = None,
    ) -> PutResult:
        block = self.encode_properties(properties or {})
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        waiter: asyncio.Future[int] | None = None
        res = await self._send(queues, body, block)
        phys = decode_message_id(res.msg_id)[1]
        lights: dict[str, int] = {}
        if RETAIN_QUEUE in queues:
            # The retained index orders changes by their %RETAIN% offset, which only the read
            # back tells (the send answer has none): the mirror's held pull brings it in ms.
            m = self._mirror(RETAIN_QUEUE)
            found = next((o for o, s in m.msgs.items() if s.physical_offset == phys), None)
            if found is None:
                waiter = self._loop.create_future()
                self._phys_waiters[(RETAIN_QUEUE, phys)] = waiter
                try:
                    found = await asyncio.wait_for(asyncio.shield(waiter), 5.0)
                except TimeoutError:
                    log.warning("%%RETAIN%% offset of a retained message not seen in 5 s")
                finally:
                    self._phys_waiters.pop((RETAIN_QUEUE, phys), None)
            if found is not None:
                lights[RETAIN_QUEUE] = found
        # end_offset 0: already durable (tickets of append_encoded start at 1).
        return PutResult(phys, res.queue_offset, lights, 0, _now_ms())

    # -- the port: read --------------------------------------------------------------------------

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        m = self._mirrors.get(queue) or self._mirror(queue)
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
        if offset not in m.fetching and not self._closed:
            m.fetching.add(offset)
            self._spawn(self._fetch(m, offset))
        return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], offset, m.min, m.max)

    def min_offset(self, queue: str) -> int:
        return (self._mirrors.get(queue) or self._mirror(queue)).min

    def max_offset(self, queue: str) -> int:
        m = self._mirrors.get(queue)
        return m.max if m is not None else self._mirror(queue).max

    def offset_by_time(self, queue: str, timestamp_ms: int) -> int:
        # Used by replays of parent topics, which this backend does not keep apart (one
        # parent topic): nothing to replay; see docs/rocketmq.md.
        return self.max_offset(queue)

    def queues(self) -> list[str]:
        return list(self._mirrors)

    @property
    def log_min_offset(self) -> int:
        return 0

    @property
    def log_max_offset(self) -> int:
        return self._log_max

    def add_listener(self, listener: ArrivalListener) -> None:
        self._listeners.append(listener)

    async def open_queue(self, queue: str) -> None:
        m = self._mirrors.get(queue) or self._mirror(queue)
        if not m.ready:
            await self._ready(m)

    def _mirror(self, queue: str) -> _Mirror:
        """The mirror of `queue`, created (and its long poll started) on first use."""
        m = self._mirrors.get(queue)
        if m is None:
            m = self._mirrors[queue] = _Mirror(queue, self._names.lmq(queue))
            if not self._closed:
                m.task = self._spawn(self._follow(m))
        return m

    async def _ready(self, m: _Mirror) -> None:
        deadline = time.monotonic() + 10.0
        while not m.ready and not self._closed:
            if time.monotonic() > deadline:
                raise StoreError(f"broker {self.broker_name}: no answer for queue {m.queue}")
            await asyncio.sleep(0.005)

    def _notify(self, m: _Mirror) -> None:
        for listener in self._listeners:
            try:
                listener.on_arrival(m.queue, m.max)
            except Exception:
                log.exception("arrival listener failed")

    async def _bounds(self, m: _Mirror) -> None:
        lo = await self._client.get_min_offset(self._addr, m.lmq)
        hi = await self._client.get_max_offset(self._addr, m.lmq)
        m.min, m.max = lo, max(m.max, hi)
        if not m.ready:
            m.tail = m.max
            m.ready = True

    async def _follow(self, m: _Mirror) -> None:
        """Learn the queue's bounds, then hold a pull at its end for as long as we run."""
        backoff = 0.1
        while not self._closed:
            try:
                if not m.ready:
                    await self._bounds(m)
                    self._notify(m)
                res = await self._client.pull(
                    self._addr,
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

    async def _fetch(self, m: _Mirror, offset: int) -> None:
        """One-shot pull of a range below the held pull (a reader behind: backlog)."""
        try:
            res = await self._client.pull(
                self._addr, m.lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
            )
            if res.messages:
                self._keep(m, res.messages)
                self._notify(m)
        except OffsetMovedError as exc:
            m.min = exc.min_offset
            self._notify(m)  # the reader sees OFFSET_TOO_SMALL and moves on
        except RemotingError as exc:
            log.warning("queue %s: reading offset %d failed: %s", m.queue, offset, exc)
            self._loop.call_later(1.0, self._notify, m)  # the reader will ask again
        finally:
            m.fetching.discard(offset)

    def _keep(self, m: _Mirror, records: list[MessageRecord]) -> None:
        msgs = m.msgs
        names = self._names
        for rec in records:
            offsets = rec.light_queue_offsets()
            off = offsets.get(m.lmq)
            if off is None:
                continue
            props = {k: v for k, v in rec.properties.items() if k not in _BROKER_PROPERTIES}
            body = b"" if props.pop(EMPTY_BODY_PROPERTY, None) is not None else rec.body
            queues = tuple(names.queue(n) for n in offsets)
            phys = rec.commitlog_offset
            msgs[off] = StoredMessage(
                rec.topic,
                body,
                props,
                off,
                phys,
                rec.store_timestamp,
                rec.born_timestamp,
                rec.queue_offset,
                queues,
            )
            self._saw_phys(phys)
            if self._phys_waiters:
                waiter = self._phys_waiters.get((m.queue, phys))
                if waiter is not None and not waiter.done():
                    waiter.set_result(off)
            if off >= m.max:
                m.max = off + 1
        if len(msgs) > m.limit:
            for off in sorted(msgs)[: len(msgs) - m.limit * 3 // 4]:
                del msgs[off]

    async def preload(self, queue: str, count: int) -> None:
        """Read the last `count` messages of `queue` into its mirror now (the retained index's
        start-up catch-up reads %RETAIN% without waiting)."""
        m = self._mirror(queue)
        m.limit = max(m.limit, count + MIRROR_SIZE)  # all of them stay for the catch-up
        await self._ready(m)
        offset = max(m.min, m.max - count)
        while offset < m.max:
            try:
                res = await self._client.pull(
                    self._addr, m.lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
                )
            except OffsetMovedError as exc:
                offset = exc.next_begin_offset
                continue
            if not res.messages:
                break
            self._keep(m, res.messages)
            offset = res.next_begin_offset

    # -- committed offsets on the broker -------------------------------------------------------

    def offset_changed(self, group: str, queue: str, offset: int) -> None:
        self._dirty_offsets[(group, queue)] = offset

    async def _flush_offsets_periodically(self) -> None:
        while True:
            await asyncio.sleep(OFFSET_FLUSH_S)
            await self._flush_offsets()

    async def _flush_offsets(self) -> None:
        dirty, self._dirty_offsets = self._dirty_offsets, {}
        names = self._names
        try:
            for (group, queue), offset in dirty.items():
                # One-way, as Java consumers do: the local copy is the primary one.
                await self._client.update_consumer_offset(
                    self._addr, names.lmq(group), names.lmq(queue), offset, oneway=True
                )
        except RemotingError as exc:
            log.warning("committing offsets to broker %s failed: %s", self.broker_name, exc)

    # -- durable gateway state: the %STATE% light queue ------------------------------------------
    #
    # Each append_state() batch is one message to the state light queue (gateway name
    # STATE_QUEUE), its body the batch's records:
    #
    #     record := u16 key length, key (UTF-8), i32 value length (-1: the key is deleted), value
    #
    # Batches are sent one after the other (each waits for the previous SEND_OK), so the queue
    # holds them in the order they were made even on a broker with several send threads.
    # At start the queue is replayed from the offset committed for the consumer group of
    # STATE_START (or its minimum) and folded into `_state` (key -> newest value); compaction
    # re-sends every live record and then commits the offset it started at, so a replay reads
    # the last complete snapshot and what followed it. A crash before that commit only means
    # a longer replay from the previous start.

    async def load_state(self) -> None:
        """Replay the state queue (open_rocketmq calls this before the gateway reads state)."""
        lmq = self._names.lmq(STATE_QUEUE)
        group = self._names.lmq(STATE_START)
        start = await self._client.query_consumer_offset(self._addr, group, lmq)
        lo = await self._client.get_min_offset(self._addr, lmq)
        hi = await self._client.get_max_offset(self._addr, lmq)
        offset = max(lo, start or 0)
        state: dict[str, bytes] = {}
        history = 0
        while offset < hi:
            try:
                res = await self._client.pull(
                    self._addr, lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
                )
            except OffsetMovedError as exc:
                log.warning(
                    "state queue: offset %d moved, replaying from %d", offset, exc.min_offset
                )
                offset = exc.next_begin_offset
                continue
            if not res.messages:
                break
            for rec in res.messages:
                for key, value in _decode_state(rec.body):
                    history += 1
                    if value is None:
                        state.pop(key, None)
                    else:
                        state[key] = value
            offset = res.next_begin_offset
        self._state = state
        self._state_history = history
        self._state_next = offset
        log.info(
            "state: %d record(s) replayed from %s offsets %d..%d, %d live",
            history, STATE_QUEUE, max(lo, start or 0), offset, len(state),
        )  # fmt: skip

    async def catch_up_state(self) -> list[StateRecord]:
        """Read the state queue from where this process last read it to the broker's end now,
        and return the records other gateway processes wrote there (oldest first), folded into
        our state as well. Our own batches are skipped (NODE_PROPERTY): we applied them when we
        made them, and re-applying an older one of ours could undo a newer one still in flight.

        "The end now" is GET_MAX_OFFSET, asked after the call: a batch another node had SEND_OK
        for before we asked is read (modulo the broker's dispatch, milliseconds: quirk 3)."""
        try:
            return await self._catch_up_state()
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading the state queue: {exc}") from exc

    async def _catch_up_state(self) -> list[StateRecord]:
        async with self._catch_up_lock:
            lmq = self._names.lmq(STATE_QUEUE)
            hi = await self._client.get_max_offset(self._addr, lmq)
            offset = self._state_next
            out: list[StateRecord] = []
            state = self._state
            while offset < hi:
                try:
                    res = await self._client.pull(
                        self._addr, lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
                    )
                except OffsetMovedError as exc:
                    log.warning("state queue: offset %d moved, reading on from %d",
                                offset, exc.next_begin_offset)  # fmt: skip
                    offset = exc.next_begin_offset
                    continue
                if not res.messages:
                    break
                for rec in res.messages:
                    if rec.properties.get(NODE_PROPERTY) == self.node_id:
                        continue
                    for key, value in _decode_state(rec.body):
                        if value is None:
                            state.pop(key, None)
                        else:
                            state[key] = value
                        out.append((key, value))
                offset = max(offset, res.next_begin_offset)
            self._state_next = offset
            self._state_history += len(out)
            return out

    async def catch_up_queue(self, queue: str) -> None:
        """Bring `queue`'s mirror up to the broker's end now (reads of it then see every
        message stored before the call): the retained index before it answers a SUBSCRIBE,
        so a retained message set through another gateway process is never missed."""
        try:
            await self._catch_up_queue(self._mirror(queue))
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading {queue}: {exc}") from exc

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None:
        """Read the messages at `offsets` of `queue` into its mirror now: the in-flight
        messages of a session resumed here are re-sent (with DUP) by synchronous reads
        (`get`), which would find nothing in a mirror that never saw them (another node
        delivered them, or this process is new). Offsets deleted by retention are skipped."""
        try:
            await self._prefetch(self._mirror(queue), sorted(set(offsets)))
        except RemotingError as exc:
            raise StoreError(f"broker {self.broker_name}: reading {queue}: {exc}") from exc

    async def _prefetch(self, m: _Mirror, offsets: list[int]) -> None:
        await self._ready(m)
        todo = [o for o in offsets if o not in m.msgs and o < m.max]
        while todo:
            try:
                res = await self._client.pull(
                    self._addr, m.lmq, todo[0], consumer_group=PULL_GROUP, max_messages=PULL_BATCH
                )
            except OffsetMovedError as exc:
                m.min = exc.min_offset
                todo = [o for o in todo if o >= exc.next_begin_offset]
                continue
            if not res.messages:
                break
            self._keep(m, res.messages)
            after = max(todo[0] + 1, res.next_begin_offset)
            todo = [o for o in todo if o not in m.msgs and o >= after]

    async def _catch_up_queue(self, m: _Mirror) -> None:
        await self._ready(m)
        hi = await self._client.get_max_offset(self._addr, m.lmq)
        offset = m.max
        while offset < hi:
            try:
                res = await self._client.pull(
                    self._addr, m.lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_BATCH
                )
            except OffsetMovedError as exc:
                m.min = exc.min_offset
                offset = exc.next_begin_offset
                continue
            if not res.messages:
                break
            self._keep(m, res.messages)
            offset = max(offset, res.next_begin_offset)
        if m.max < offset:
            m.max = offset

    def state_records(self) -> Iterable[StateRecord]:
        return list(self._state.items())

    def append_state(self, records: Iterable[StateRecord]) -> int:
        batch = list(records)
        if not batch:
            return self._state_ticket
        if self._closed:
            raise StoreError("the RocketMQ storage is closed")
        state = self._state
        for key, value in batch:
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        self._state_history += len(batch)
        return self._send_state(_encode_state(batch))

    def _send_state(self, body: bytes) -> int:
        self._state_ticket += 1
        ticket = self._state_ticket
        prev = self._state_chain

        async def send() -> None:
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            await self._send((STATE_QUEUE,), body, self._node_block)

        task = self._loop.create_task(send())
        self._state_chain = task
        self._state_sends[ticket] = task

        def done(t: asyncio.Task[None]) -> None:
            self._state_sends.pop(ticket, None)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                log.error("state write to RocketMQ failed: %s", exc)
                self._state_failed[ticket] = (
                    exc if isinstance(exc, StoreError) else StoreError(str(exc))
                )
                if len(self._state_failed) > FAILED_TICKETS_KEPT:
                    self._state_failed.pop(next(iter(self._state_failed)))

        task.add_done_callback(done)
        return ticket

    async def wait_state_durable(self, position: int) -> None:
        task = self._state_sends.get(position)
        if task is not None:
            await asyncio.shield(task)
            return
        err = self._state_failed.get(position)
        if err is not None:
            raise err

    async def compact_state(self) -> None:
        if self._closed or self._compacting:
            return
        if self._state_history <= 2 * len(self._state) + STATE_COMPACT_SLACK:
            return
        self._compacting = True
        try:
            if self._state_chain is not None:
                await asyncio.gather(self._state_chain, return_exceptions=True)
            lmq = self._names.lmq(STATE_QUEUE)
            # The queue's end before the snapshot (it may lag the sends just made: then the
            # replay reads a few older records first, which the snapshot overrides).
            start = await self._client.get_max_offset(self._addr, lmq)
            items = list(self._state.items())
            ticket = self._state_ticket
            for i in range(0, len(items), STATE_SNAPSHOT_BATCH):
                ticket = self._send_state(_encode_state(items[i : i + STATE_SNAPSHOT_BATCH]))
            await self.wait_state_durable(ticket)
            await self._client.update_consumer_offset(
                self._addr, self._names.lmq(STATE_START), lmq, start
            )
            self._state_history = len(items)
            log.info("state: compacted to %d record(s), replay starts at %d", len(items), start)
        except (RemotingError, StoreError) as exc:
            log.warning("state compaction failed (the queue keeps its history): %s", exc)
        finally:
            self._compacting = False

    def read_config(self, name: str) -> bytes | None:
        # Config documents are written by older embedded versions only (legacy imports); on
        # RocketMQ they are state records.
        return self._state.get(CONFIG_KEY_PREFIX + name)

    def write_config(self, name: str, data: bytes) -> None:
        self.append_state([(CONFIG_KEY_PREFIX + name, data)])

    async def drain(self) -> None:
        pending: list[asyncio.Future[Any]] = [*self._batches.values(), *self._state_sends.values()]
        if pending:
            _done, late = await asyncio.wait(pending, timeout=DRAIN_S)
            if late:
                log.error("%d write(s) to RocketMQ still unanswered at stop", len(late))
        await self._flush_offsets()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for fut in self._phys_waiters.values():
            fut.cancel()
        self._client.close_nowait()
        self._local.close()


async def open_rocketmq(settings: GatewaySettings, local: Storage) -> RocketMqStorage:
    """Connect to the cluster of `settings.namesrv`, check the broker, and return the storage.

    StorageUnavailable (with what to fix) when the name server does not answer, no broker is
    registered, or the broker does not index light queues (enableLmq / enableMultiDispatch).
    """
    namesrv = settings.namesrv
    if not namesrv:
        raise StorageUnavailable("store = rocketmq needs the name server address (--namesrv)")
    client = RemotingClient([namesrv], client_id=None, request_timeout=5.0, connect_timeout=3.0)
    try:
        storage = await _open(client, settings, local)
    except BaseException:
        client.close_nowait()
        raise
    return storage


async def _open(
    client: RemotingClient, settings: GatewaySettings, local: Storage
) -> RocketMqStorage:
    namesrv = settings.namesrv
    try:
        info = await client.get_cluster_info()
    except RemotingError as exc:
        raise StorageUnavailable(f"RocketMQ name server {namesrv} unreachable: {exc}") from exc
    masters = {name: b.master_addr for name, b in info.brokers.items() if b.master_addr}
    if not masters:
        raise StorageUnavailable(f"no RocketMQ broker is registered at name server {namesrv}")
    name = settings.rocketmq_broker or sorted(masters)[0]
    addr = masters.get(name)
    if addr is None:
        raise StorageUnavailable(
            f"broker {name!r} is not registered at name server {namesrv}"
            f" (registered: {', '.join(sorted(masters))})"
        )
    topic = settings.rocketmq_topic
    try:
        await client.create_topic(addr, topic, queues=1)
    except RemotingError as exc:
        raise StorageUnavailable(
            f"broker {name} ({addr}) refused to create topic {topic!r}: {exc}"
        ) from exc
    await _check_broker_config(client, name, addr, sync=settings.flush == "sync")
    storage = RocketMqStorage(client, name, addr, topic, local, sync=settings.flush == "sync")
    try:
        await _probe_light_queues(client, name, addr, topic)
        await storage.preload(RETAIN_QUEUE, RETAIN_PRELOAD)
        await storage.load_state()
    except BaseException:
        storage.close()
        raise
    log.info(
        "storage: RocketMQ broker %s (%s) via name server %s, topic %s, %s sends",
        name, addr, namesrv, topic, "sync" if settings.flush == "sync" else "async",
    )  # fmt: skip
    return storage


async def _check_broker_config(client: RemotingClient, name: str, addr: str, *, sync: bool) -> None:
    """Refuse a broker whose configuration says light queues are off; warn when sync mode
    runs on a broker that acknowledges before its disk does. (The probe after this is the
    proof; the configuration gives the clearer message.)"""
    try:
        config = await client.get_broker_config(addr)
    except RemotingError as exc:
        log.debug("broker %s: configuration not readable (%s)", name, exc)
        return
    off = [k for k in ("enableLmq", "enableMultiDispatch") if config.get(k, "").lower() != "true"]
    if off:
        raise StorageUnavailable(
            f"broker {name} ({addr}) does not index light queues ({', '.join(off)} not true):"
            " set enableLmq=true and enableMultiDispatch=true in its broker.conf and restart it"
        )
    threads = config.get("sendMessageThreadPoolNums", "1")
    if threads.isdigit() and int(threads) > 1:
        # Sends are pipelined: with several send threads the broker may append two messages
        # in flight in either order, and MQTT keeps one publisher's messages in order.
        log.warning(
            "broker %s has sendMessageThreadPoolNums=%s: messages a client publishes back to"
            " back may be stored (and delivered) out of order; set sendMessageThreadPoolNums=1",
            name, threads,
        )  # fmt: skip
    flush = config.get("flushDiskType", "")
    if sync and flush != "SYNC_FLUSH":
        log.warning(
            "--flush sync on broker %s with flushDiskType=%s: its SEND_OK does not wait for"
            " the disk, so an acknowledged message can be lost with the broker's machine;"
            " set flushDiskType=SYNC_FLUSH there",
            name, flush or "?",
        )  # fmt: skip


async def _probe_light_queues(client: RemotingClient, name: str, addr: str, topic: str) -> None:
    """Send one message to PROBE_QUEUE and wait until the broker indexed it there: a broker
    without enableLmq/enableMultiDispatch stores it and silently indexes nothing."""
    try:
        before: int | None = await client.get_max_offset(addr, PROBE_QUEUE)
    except BrokerError:  # a broker without LMQ has no such topic
        before = None
    try:
        await client.send_message(addr, topic, b"lmqtt probe", light_queues=[PROBE_QUEUE])
    except RemotingError as exc:
        raise StorageUnavailable(f"broker {name} ({addr}): light-queue probe: {exc}") from exc
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with contextlib.suppress(RemotingError):
            if await client.get_max_offset(addr, PROBE_QUEUE) > (before or 0):
                return
        await asyncio.sleep(0.05)
    raise StorageUnavailable(
        f"broker {name} ({addr}) does not index light queues: set enableLmq=true and"
        " enableMultiDispatch=true in its broker.conf and restart it"
    )
