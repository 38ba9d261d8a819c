"""Sends to the RocketMQ broker: one SEND_MESSAGE_V2 per message, tickets, durability.

    append   SEND_MESSAGE_V2 to the parent topic (`rocketmq_topic`, one queue), with
             the light queues of the matching filters as its dispatch property (names mapped by
             gateway/storage/rocketmq/names.py), all pipelined on one connection; the batch's
             ticket (PutResult.end_offset) resolves when every send is SEND_OK, and raises
             StoreError when one was not (refused, FLUSH_DISK_TIMEOUT, connection lost: maybe
             stored, not acknowledged; the client sends it again).
    frames   a batch on an open connection (the usual case) is written at once: its frames
             (one per message, consecutive opaques) built in one call from the sender's
             template (rocketmq_remoting/send_frames.py: binary header, in C), their answers
             taken by one callback (_Batch), one timer per batch: no task, coroutine or
             callback object per message. An answer other than SEND_OK (busy, refused, timeout,
             connection lost) hands that message to the coroutine path below, as if its first
             attempt had been made there. The first batch (no connection yet), one after a
             drop, and one behind a `gate` take the coroutine path whole, and while one of
             those is in flight later batches do too (they must not overtake it).
             SEND_MESSAGE_V2 and not SEND_BATCH_MESSAGE: a 5.3.3 broker indexes the light
             queues of single messages only (CommitLog's batch append assigns no
             INNER_MULTI_QUEUE_OFFSET, so the consume-queue dispatch skips them).
    busy     SYSTEM_BUSY (nothing stored) is retried with backoff, SEND_ATTEMPTS times.
    away     a send the broker did not take because it was away (connection refused,
             SERVICE_NOT_AVAILABLE: a broker restarting) is sent again on a new connection,
             pausing RESEND_FIRST_S doubling to RESEND_MAX_S, until `Broker.resend_s` has
             passed since the first such failure; then it fails (async mode: logged, the
             message lost). So is one that may have been stored (connection lost, no answer
             in time) if the message may be stored `twice`: a batch's QoS 0/1 publish; a
             single `send` (QoS 2, retained, wills, state) then fails at once, as before
             (stored twice, a QoS 2 message would be delivered twice). Resends go one at a
             time in the order their failures were seen (`_resend`, a FIFO lock), and a send
             made while any is pending waits for them (a gate, so the coroutine path): order
             is kept across a lost connection or a broker restart (not behind a send timed
             out alone: the sends already in flight after it on a live connection may be
             stored first). At most HELD_MAX sends wait so; past it a new send fails at once.
    sync     `--flush sync` sends WAIT=true: on a SYNC_FLUSH broker SEND_OK follows the flush.
    counted  every send is told to a SendCounter when it is made and when it is answered (its
             offset in the parent queue, or None): the parent topic's history
             (gateway/storage/rocketmq/history.py) bounds a replay's pin by the sends in flight.
    failover spread only (`failover` set): a send the broker did not answer (refused
             connection, connection lost, no answer in time) goes at once to the broker the
             Failover names instead (gateway/storage/rocketmq/spread.py, "A broker lost").
    gate     spread only: a send made while the brokers' set changes waits for `gate` (the
             sends in flight then answered) before it goes, so a topic moving between brokers
             keeps its order.

Physical offsets are the broker's CommitLog offsets (unique on one broker), so the delivery
loop's cross-queue ordering (`start_phys`, `read_phys`) works unchanged; `log_max` is the
highest one seen (sends and pulls: `saw_phys`) + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from gateway.bounded import trim_oldest
from gateway.storage.port import EncodedMessage, StoreError
from gateway.storage.rocketmq.broker import Broker
from rocketmq_remoting import (
    BrokerBusyError,
    BrokerError,
    ProtocolError,
    RemotingClosedError,
    RemotingCommand,
    RemotingConnectError,
    RemotingError,
    RemotingTimeoutError,
    RequestCode,
    ResponseCode,
    SendResult,
)
from rocketmq_remoting.client import send_result
from rocketmq_remoting.connection import Connection
from rocketmq_remoting.message import (
    PROPERTY_INNER_MULTI_DISPATCH,
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_WAIT_STORE_MSG_OK,
    decode_message_id,
    dispatch_property,
    encode_properties,
    message_id_offset,
)
from rocketmq_remoting.send_frames import SendFrames
from topicmap.record import TOPIC
from topicmap.rocketmq import EMPTY_BODY_PROPERTY, TOPIC_PROPERTY

log = logging.getLogger("lmqtt.rocketmq")

SEND_ATTEMPTS = 5  # broker busy (nothing stored): retried with backoff
#: The pauses between the attempts to resend a message while its broker is away ("away" above).
RESEND_FIRST_S = 0.1
RESEND_MAX_S = 1.0
#: Sends a sender holds behind its resends (memory while its broker is away); past it a new
#: send fails at once, as it would with no resends.
HELD_MAX = 50_000
FAILED_TICKETS_KEPT = 10_000
#: Light-queue sets whose encoded dispatch property a sender keeps (a route's queues repeat).
DISPATCH_MEMO = 4096
#: A broker cannot store an empty body (5.3.3: NullPointerException in buildMsgContext, answered
#: SYSTEM_ERROR; Java clients refuse empty bodies before sending). An empty MQTT payload (a
#: retained message's deletion) is sent as one byte with EMPTY_BODY_PROPERTY, and read back
#: empty (rocketmq_broker.to_stored).
_EMPTY_BODY_MARK = EMPTY_BODY_PROPERTY.encode() + b"\x011\x02"
_TOPIC_PAIR = TOPIC.encode() + b"\x01"
_TOPIC_PROPERTY_HEAD = TOPIC_PROPERTY.encode() + b"\x01"


def topic_in(block: bytes) -> bytes | None:
    """The MQTT topic in an encoded property block (`TOPIC \x01 name \x02`), None if none
    (a state record)."""
    i = block.find(_TOPIC_PAIR)
    if i < 0 or (i > 0 and block[i - 1] != 2):
        return None
    j = block.find(b"\x02", i)
    return block[i + len(_TOPIC_PAIR) : j if j >= 0 else len(block)]


#: What a frame-path send was answered: the broker's command, or the error that ended the wait.
Answer = RemotingCommand | RemotingError


def broker_away(exc: RemotingError, twice: bool) -> bool:
    """Whether a send failed because the broker was not there to take it, so it is sent
    again ("away" above): not stored (no connection, SERVICE_NOT_AVAILABLE) or, if the
    message may be stored `twice`, maybe stored (connection lost, no answer in time)."""
    if isinstance(exc, BrokerError):
        return exc.code == ResponseCode.SERVICE_NOT_AVAILABLE
    if isinstance(exc, RemotingConnectError):
        return True
    return twice and isinstance(exc, RemotingClosedError | RemotingTimeoutError)


class SendCounter(Protocol):
    """Told of every send: made (before its task runs) and answered."""

    def sending(self) -> None: ...

    def sent(self, queue_offset: int | None) -> None:
        """Answered with its offset in the parent queue, or failed (None)."""


class Failover(Protocol):
    """Where a message goes when its broker did not answer (spread over several brokers)."""

    def instead_of(self, broker: str, queues: Sequence[str], block: bytes) -> Sender | None:
        """The sender of the live broker that takes it (None: the message's queues stay on
        `broker`, or no broker is left); `broker` counts as lost from now on."""


class Sender:
    """Sends messages to `broker` and keeps the tickets of batches in flight."""

    def __init__(
        self,
        broker: Broker,
        counter: SendCounter,
        *,
        sync: bool,
        failover: Failover | None = None,
    ) -> None:
        self._broker = broker
        self.failover = failover
        self._counter = counter
        self._sync = sync
        self._loop = asyncio.get_running_loop()
        self._ticket = 0
        self._batches: dict[int, asyncio.Future[None]] = {}
        self._failed: dict[int, StoreError] = {}
        # One per send (coroutine path) or per batch (frames) not answered yet.
        self._sending: set[asyncio.Future[None]] = set()
        self._coroutine_batches = 0  # in flight: later batches must not overtake them
        # Sends to be sent again ("away"): counted from their failure on; later sends wait
        # for `_resent`, resolved when none is left; `_resend` takes them one at a time.
        # `_away_since`: when the first of them failed (loop time); they fail once
        # `Broker.resend_s` has passed since, or it is reset by a resend the broker took.
        self._resending = 0
        self._resent: asyncio.Future[None] | None = None
        self._resend = asyncio.Lock()
        self._away_since: float | None = None
        self._held = 0  # sends waiting for `_resent`
        self._frames = SendFrames(broker.client.producer_group, broker.topic)
        # Light queues -> the property head of their messages: dispatch, then WAIT.
        self._heads: dict[tuple[str, ...], bytes] = {}
        self._wait = encode_properties(
            {PROPERTY_WAIT_STORE_MSG_OK: "true" if sync else "false"}
        ).encode()
        self.log_max = 0
        self._topic_property = broker.topic_property
        if broker.topic_property:  # chosen once: nothing added per message when it is off
            self._send = self._send_with_topic  # type: ignore[method-assign]

    def send_batch(
        self, messages: Sequence[EncodedMessage], gate: asyncio.Future[Any] | None = None
    ) -> int:
        """Send `messages` (all in flight at once, after `gate`); returns the batch's ticket."""
        self._ticket += 1
        ticket = self._ticket
        fut: asyncio.Future[None] = self._loop.create_future()
        self._batches[ticket] = fut
        gate = self._behind_resends(gate, len(messages))
        conn = None
        if gate is None and not self._coroutine_batches and messages:
            conn = self._broker.client.open_broker_connection(self._broker.addr)
        if conn is not None:
            encoded = self._encode_all(messages)
            if encoded is not None:
                first = conn.reserve_opaques(len(encoded))
                try:
                    frames = self._frames.frames(first, int(time.time() * 1000), encoded)
                except ProtocolError:  # a message over the frame limit: refused below
                    frames = None
                if frames is not None:
                    _Batch(self, ticket, fut, messages, conn, first).send(frames)
                    return ticket
        self._coroutine_batches += 1
        sends = [
            self._start(queues, body, block, gate, True)
            for _parent, queues, body, block in messages
        ]
        batch = asyncio.ensure_future(asyncio.gather(*sends))
        batch.add_done_callback(lambda b: self._coroutine_batch_done(ticket, fut, b))
        return ticket

    def _encode_all(self, messages: Sequence[EncodedMessage]) -> list[tuple[bytes, bytes]] | None:
        """(properties, body) of each message as its frame carries them; None if a light
        queue's name is unusable (the coroutine path then fails the batch, as it would)."""
        heads = self._heads
        out = []
        try:
            for _parent, queues, body, block in messages:
                key = queues if type(queues) is tuple else tuple(queues)
                head = heads.get(key)
                if head is None:
                    head = self._head(key)
                if self._topic_property:
                    topic = topic_in(block)
                    if topic is not None:
                        block += _TOPIC_PROPERTY_HEAD + topic + b"\x02"
                if not body:
                    body, block = b"\x00", block + _EMPTY_BODY_MARK
                out.append((head + block, body))
        except ValueError:
            return None
        return out

    def _head(self, queues: tuple[str, ...]) -> bytes:
        """The property head of a message to `queues`: what client.send_message puts before
        the block (INNER_MULTI_DISPATCH if any queue, then WAIT)."""
        lmq = self._broker.names.lmq
        props = {}
        if queues:
            props[PROPERTY_INNER_MULTI_DISPATCH] = dispatch_property([lmq(q) for q in queues])
        head = encode_properties(props).encode() + self._wait
        if len(self._heads) >= DISPATCH_MEMO:
            self._heads.clear()
        self._heads[queues] = head
        return head

    def _coroutine_batch_done(
        self, ticket: int, fut: asyncio.Future[None], batch: asyncio.Future[list[SendResult]]
    ) -> None:
        self._coroutine_batches -= 1
        err: StoreError | None = None
        if batch.cancelled():
            err = StoreError("send cancelled (storage closing)")
        elif (exc := batch.exception()) is not None:
            err = exc if isinstance(exc, StoreError) else StoreError(str(exc))
        self._batch_done(ticket, fut, err)

    def _batch_done(self, ticket: int, fut: asyncio.Future[None], err: StoreError | None) -> None:
        del self._batches[ticket]
        if err is None:
            fut.set_result(None)
            return
        if not self._sync:  # nobody waits in async mode: the log is all there is
            log.error("RocketMQ send failed, messages not stored: %s", err)
        self._failed[ticket] = err
        trim_oldest(self._failed, FAILED_TICKETS_KEPT)
        fut.set_exception(err)
        fut.exception()  # retrieved: a batch nobody awaits (async mode) logs nothing more

    async def wait_durable(self, ticket: int) -> None:
        fut = self._batches.get(ticket)
        if fut is not None:
            await asyncio.shield(fut)
            return
        err = self._failed.get(ticket)
        if err is not None:
            raise err

    def in_flight(self) -> list[asyncio.Future[None]]:
        """The batches not answered yet (a graceful stop waits for them)."""
        return list(self._batches.values())

    async def settle(self) -> None:
        """Wait until every send started so far was answered (stored or refused): cluster
        mode acknowledges a new filter only once the messages routed without it are stored
        (gateway/cluster/filter_registry.py)."""
        if self._sending:
            await asyncio.wait(list(self._sending))

    def in_flight_sends(self) -> list[asyncio.Future[None]]:
        """One future per send not answered yet (a gate waits for them)."""
        return list(self._sending)

    def send(
        self,
        queues: Sequence[str],
        body: bytes,
        block: bytes,
        gate: asyncio.Future[Any] | None = None,
        *,
        twice: bool = False,
    ) -> Awaitable[SendResult]:
        """One SEND_MESSAGE_V2 (see _send_message), counted from this call on, before its task
        runs: a replay pinned meanwhile must cover it. `twice`: the message may be stored
        twice (a QoS 1 publish), so a send that may have been stored is sent again too
        (broker_away); else (QoS 2, state) only one that certainly was not."""
        return self._start(queues, body, block, self._behind_resends(gate, 1), twice)

    def _start(
        self,
        queues: Sequence[str],
        body: bytes,
        block: bytes,
        gate: asyncio.Future[Any] | None,
        twice: bool,
    ) -> Awaitable[SendResult]:
        self._counter.sending()
        return self._counted(queues, body, block, gate, twice)

    def _behind_resends(
        self, gate: asyncio.Future[Any] | None, sends: int
    ) -> asyncio.Future[Any] | None:
        """`gate`, joined by the resends pending now: `sends` made meanwhile go after them
        (or fail at once, past HELD_MAX)."""
        if not self._resending:
            return gate
        if self._held + sends > HELD_MAX:
            full: asyncio.Future[None] = self._loop.create_future()
            full.set_exception(
                StoreError(
                    f"broker {self._broker.name} away: {self._held} sends wait for it already"
                )
            )
            return full
        self._held += sends
        if self._resent is None:
            self._resent = self._loop.create_future()
        return self._resent if gate is None else asyncio.gather(gate, self._resent)

    async def send_delayed(
        self, queues: Sequence[str], body: bytes, block: bytes, deliver_ms: int
    ) -> SendResult:
        """A timer message due at `deliver_ms`: the broker keeps it in its timer topic and puts
        it to the parent topic and its light queues when due. Not counted as a send: the
        parent queue gets it only then."""
        timer = encode_properties({PROPERTY_TIMER_DELIVER_MS: str(deliver_ms)}).encode()
        return await self._send_message(queues, body, block + timer)

    async def _counted(
        self,
        queues: Sequence[str],
        body: bytes,
        block: bytes,
        gate: asyncio.Future[Any] | None,
        twice: bool,
    ) -> SendResult:
        offset: int | None = None
        try:
            res = await self._send_message(queues, body, block, gate, twice)
            offset = res.queue_offset
            return res
        finally:
            self._counter.sent(offset)

    async def _send_message(
        self,
        queues: Sequence[str],
        body: bytes,
        block: bytes,
        gate: asyncio.Future[Any] | None = None,
        twice: bool = False,
    ) -> SendResult:
        """One SEND_MESSAGE_V2, after `gate` (in flight while it waits: `settle` and a later
        gate wait for it too); StoreError unless the broker answered SEND_OK."""
        answered: asyncio.Future[None] = self._loop.create_future()
        self._sending.add(answered)
        try:
            if gate is not None:
                await asyncio.shield(gate)
            return await self._send(queues, body, block, twice=twice)
        finally:
            self._sending.discard(answered)
            answered.set_result(None)

    async def resend(
        self, queues: Sequence[str], body: bytes, block: bytes, first: Answer, counted: bool
    ) -> SendResult:
        """A frame-path send (_Batch) not answered SEND_OK: its first attempt's `first`
        answer handled, and what follows done, as on the coroutine path (a publish of a
        batch: stored `twice` allowed); counted. `counted`: a broker away, already counted in
        `_resending` by the caller."""
        offset: int | None = None
        try:
            res = await self._send(queues, body, block, first, counted, True)
            offset = res.queue_offset
            return res
        finally:
            self._counter.sent(offset)

    async def _send_with_topic(
        self,
        queues: Sequence[str],
        body: bytes,
        block: bytes,
        first: Answer | None = None,
        counted: bool = False,
        twice: bool = False,
    ) -> SendResult:
        """_send, the MQTT topic also as TOPIC_PROPERTY (settings.rocketmq_topic_property)."""
        topic = topic_in(block)
        if topic is not None:
            block += _TOPIC_PROPERTY_HEAD + topic + b"\x02"
        return await Sender._send(self, queues, body, block, first, counted, twice)

    async def _send(
        self,
        queues: Sequence[str],
        body: bytes,
        block: bytes,
        first: Answer | None = None,
        counted: bool = False,
        twice: bool = False,
    ) -> SendResult:
        """One message, SEND_ATTEMPTS times while the broker is busy, again and again for
        `Broker.resend_s` while it is away (broker_away, `twice`: see `send`); `first`: the
        answer to a first attempt already made (_Batch), `counted`: its resend already
        counted in `_resending` (_Batch)."""
        broker = self._broker
        lmqs = [broker.names.lmq(q) for q in queues]
        if not body:
            body, block = b"\x00", block + _EMPTY_BODY_MARK
        delay = 0.05
        attempt = 0
        pause = RESEND_FIRST_S
        own = False  # counted in `_resending` here
        turn = False  # `_resend` taken: this send's turn to be sent again
        try:
            while True:
                try:
                    res = await self._attempt(lmqs, body, block, first)
                    first = None
                    if turn:
                        self._away_since = None  # back: the resends behind go at once
                except BrokerBusyError as exc:
                    first = None
                    attempt += 1
                    if attempt == SEND_ATTEMPTS:
                        raise StoreError(f"broker {broker.name} busy: {exc}") from exc
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                except RemotingError as exc:
                    first = None
                    refused = isinstance(exc, BrokerError)
                    if refused and not broker_away(exc, twice):
                        raise StoreError(
                            f"broker {broker.name} refused the message: {exc}"
                        ) from exc
                    # Maybe stored, maybe not: sent to another broker (spread), else sent
                    # here again while the broker may be coming back.
                    other = None
                    if self.failover is not None and not refused:
                        other = self.failover.instead_of(broker.name, queues, block)
                    if other is not None:
                        log.debug("broker %s: %s; message sent to broker %s", broker.name,
                                  exc, other._broker.name)  # fmt: skip
                        return await other.send(queues, body, block, twice=twice)
                    if not broker.resend_s or not broker_away(exc, twice):
                        raise StoreError(f"broker {broker.name}: {exc}") from exc
                    if not counted and not own:
                        self._resending += 1
                        own = True
                    since = self._away_since
                    if since is None:
                        since = self._away_since = self._loop.time()
                    if not turn:
                        await self._resend.acquire()  # after the resends that failed before
                        turn = True
                        since = self._away_since  # read again: cleared while we waited?
                        if since is None:
                            continue  # the broker took the resend before this one
                    if self._loop.time() + pause > since + broker.resend_s:
                        raise StoreError(
                            f"broker {broker.name} away for over {broker.resend_s:g} s: {exc}"
                        ) from exc
                    log.debug("broker %s: %s; sending again in %.1f s", broker.name, exc, pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, RESEND_MAX_S)
                    continue
                if not res.ok:
                    raise StoreError(
                        f"broker {broker.name} stored the message but could not make it"
                        f" durable in time (response code {res.code})"
                    )
                with contextlib.suppress(ValueError):
                    self.saw_phys(decode_message_id(res.msg_id)[1])
                return res
        finally:
            if turn:
                self._resend.release()
            if own:
                self._resend_done()

    def _resend_done(self) -> None:
        """One resend less pending; with none left, the sends held behind them go."""
        self._resending -= 1
        if self._resending:
            return
        self._away_since = None
        self._held = 0
        if self._resent is not None:
            self._resent.set_result(None)
            self._resent = None

    async def _attempt(
        self, lmqs: list[str], body: bytes, block: bytes, first: Answer | None
    ) -> SendResult:
        """One attempt to send: the broker's answer as a SendResult (`first`: the answer of
        one already made), or its error raised."""
        broker = self._broker
        if first is not None:
            if isinstance(first, RemotingError):
                raise first
            return send_result(first, broker.addr)
        return await broker.client.send_message(
            broker.addr,
            broker.topic,
            body,
            light_queues=lmqs,
            raw_properties=block.decode("utf-8"),
            wait_store=self._sync,
        )

    def saw_phys(self, phys: int) -> None:
        if phys >= self.log_max:
            self.log_max = phys + 1


class _Batch:
    """One send_batch on the frame path: its frames (consecutive opaques, built in one call)
    written now, answers taken by one callback (`_answer`), one timer for all; resolves the
    ticket when every message is answered (the first error, if any, fails it whole)."""

    __slots__ = (
        "_answered",
        "_conn",
        "_error",
        "_first",
        "_fut",
        "_left",
        "_messages",
        "_sender",
        "_ticket",
        "_timer",
    )  # fmt: skip

    def __init__(
        self,
        sender: Sender,
        ticket: int,
        fut: asyncio.Future[None],
        messages: Sequence[EncodedMessage],
        conn: Connection,
        first: int,
    ) -> None:
        self._sender = sender
        self._ticket = ticket
        self._fut = fut
        self._messages = messages
        self._conn = conn
        self._first = first  # the opaque of messages[0]; messages[i]'s is first + i
        self._left = len(messages)
        self._error: StoreError | None = None
        self._answered: asyncio.Future[None] = sender._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None

    def send(self, frames: bytes) -> None:
        """Write `frames` (every message's, SendFrames.frames) and take their answers."""
        sender = self._sender
        sender._sending.add(self._answered)
        sending = sender._counter.sending
        for _ in range(self._left):
            sending()
        self._conn.expect_all(self._first, self._left, self._answer)
        self._conn.write(frames)
        self._timer = sender._loop.call_later(sender._broker.client.request_timeout, self._expire)

    def _expire(self) -> None:
        timeout = self._sender._broker.client.request_timeout
        opaques = range(self._first, self._first + len(self._messages))
        self._conn.expire(opaques, RequestCode.SEND_MESSAGE_V2, timeout)

    def _answer(self, opaque: int, answer: Answer) -> None:
        sender = self._sender
        if type(answer) is RemotingCommand and answer.code == ResponseCode.SUCCESS:
            fields = answer.ext_fields
            offset = fields.get("queueOffset")
            try:
                phys = message_id_offset(fields["msgId"])
            except (KeyError, ValueError):
                pass
            else:
                if phys >= sender.log_max:  # saw_phys, inlined: once per answer
                    sender.log_max = phys + 1
            sender._counter.sent(int(offset) if offset and offset != "null" else 0)
            self._left -= 1
            if not self._left:
                self._finish()
            return
        _parent, queues, body, block = self._messages[opaque - self._first]
        # A broker away: counted as a resend pending from now on (before the task runs), so
        # no send made meanwhile overtakes it.
        away = isinstance(answer, RemotingError) and broker_away(answer, True)
        if away:
            sender._resending += 1
        task = sender._loop.create_task(sender.resend(queues, body, block, answer, away))
        task.add_done_callback(self._resent_away if away else self._resent)

    def _resent_away(self, task: asyncio.Task[SendResult]) -> None:
        self._sender._resend_done()
        self._resent(task)

    def _resent(self, task: asyncio.Task[SendResult]) -> None:
        if task.cancelled():
            self._one_done(StoreError("send cancelled (storage closing)"))
        elif (exc := task.exception()) is not None:
            self._one_done(exc if isinstance(exc, StoreError) else StoreError(str(exc)))
        else:
            self._one_done(None)

    def _one_done(self, err: StoreError | None) -> None:
        if err is not None and self._error is None:
            self._error = err
        self._left -= 1
        if not self._left:
            self._finish()

    def _finish(self) -> None:
        sender = self._sender
        if self._timer is not None:
            self._timer.cancel()
        sender._sending.discard(self._answered)
        self._answered.set_result(None)
        sender._batch_done(self._ticket, self._fut, self._error)
