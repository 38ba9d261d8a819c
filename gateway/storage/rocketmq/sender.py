"""Sends to the RocketMQ broker: one SEND_MESSAGE_V2 per message, tickets, durability.

    append   SEND_MESSAGE_V2 to the parent topic (`rocketmq_topic`, one queue), with
             the light queues of the matching filters as its dispatch property (names mapped by
             gateway/storage/rocketmq/names.py). One task per message, all pipelined on one
             connection; the batch's ticket (PutResult.end_offset) resolves when every send
             is SEND_OK, and raises StoreError when one was not (refused, FLUSH_DISK_TIMEOUT,
             connection lost: maybe stored, not acknowledged; the client sends it again).
    busy     SYSTEM_BUSY (nothing stored) is retried with backoff, SEND_ATTEMPTS times.
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
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from gateway.storage.port import EncodedMessage, StoreError
from gateway.storage.rocketmq.broker import Broker
from rocketmq_remoting import BrokerBusyError, BrokerError, RemotingError, SendResult
from rocketmq_remoting.message import (
    PROPERTY_TIMER_DELIVER_MS,
    decode_message_id,
    encode_properties,
)
from topicmap.record import TOPIC
from topicmap.rocketmq import EMPTY_BODY_PROPERTY, TOPIC_PROPERTY

log = logging.getLogger("lmqtt.rocketmq")

SEND_ATTEMPTS = 5  # broker busy (nothing stored): retried with backoff
FAILED_TICKETS_KEPT = 10_000
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
        self._sending: set[asyncio.Future[None]] = set()  # one per send not answered yet
        self.log_max = 0
        if broker.topic_property:  # chosen once: nothing added per message when it is off
            self._send = self._send_with_topic  # type: ignore[method-assign]

    def send_batch(
        self, messages: Sequence[EncodedMessage], gate: asyncio.Future[Any] | None = None
    ) -> int:
        """Send `messages` (all in flight at once, after `gate`); returns the batch's ticket."""
        self._ticket += 1
        ticket = self._ticket
        sends = [self.send(queues, body, block, gate) for _parent, queues, body, block in messages]
        batch = asyncio.ensure_future(asyncio.gather(*sends))
        fut: asyncio.Future[None] = self._loop.create_future()
        self._batches[ticket] = fut
        batch.add_done_callback(lambda b: self._batch_done(ticket, fut, b))
        return ticket

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
    ) -> Awaitable[SendResult]:
        """One SEND_MESSAGE_V2 (see _send_message), counted from this call on, before its task
        runs: a replay pinned meanwhile must cover it."""
        self._counter.sending()
        return self._counted(queues, body, block, gate)

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
    ) -> SendResult:
        offset: int | None = None
        try:
            if gate is not None:
                await asyncio.shield(gate)
            res = await self._send_message(queues, body, block)
            offset = res.queue_offset
            return res
        finally:
            self._counter.sent(offset)

    async def _send_message(self, queues: Sequence[str], body: bytes, block: bytes) -> SendResult:
        """One SEND_MESSAGE_V2; StoreError unless the broker answered SEND_OK."""
        answered: asyncio.Future[None] = self._loop.create_future()
        self._sending.add(answered)
        try:
            return await self._send(queues, body, block)
        finally:
            self._sending.discard(answered)
            answered.set_result(None)

    async def _send_with_topic(
        self, queues: Sequence[str], body: bytes, block: bytes
    ) -> SendResult:
        """_send, the MQTT topic also as TOPIC_PROPERTY (settings.rocketmq_topic_property)."""
        topic = topic_in(block)
        if topic is not None:
            block += _TOPIC_PROPERTY_HEAD + topic + b"\x02"
        return await Sender._send(self, queues, body, block)

    async def _send(self, queues: Sequence[str], body: bytes, block: bytes) -> SendResult:
        broker = self._broker
        lmqs = [broker.names.lmq(q) for q in queues]
        if not body:
            body, block = b"\x00", block + _EMPTY_BODY_MARK
        delay = 0.05
        for attempt in range(SEND_ATTEMPTS):
            try:
                res = await broker.client.send_message(
                    broker.addr,
                    broker.topic,
                    body,
                    light_queues=lmqs,
                    raw_properties=block.decode("utf-8"),
                    wait_store=self._sync,
                )
            except BrokerBusyError as exc:
                if attempt == SEND_ATTEMPTS - 1:
                    raise StoreError(f"broker {broker.name} busy: {exc}") from exc
                await asyncio.sleep(delay)
                delay *= 2
                continue
            except BrokerError as exc:
                raise StoreError(f"broker {broker.name} refused the message: {exc}") from exc
            except RemotingError as exc:
                # Maybe stored, maybe not: not acknowledged (the client sends it again), or
                # sent to another broker (spread).
                other = None
                if self.failover is not None:
                    other = self.failover.instead_of(broker.name, queues, block)
                if other is None:
                    raise StoreError(f"broker {broker.name}: {exc}") from exc
                log.debug("broker %s: %s; message sent to broker %s", broker.name, exc,
                          other._broker.name)  # fmt: skip
                return await other.send(queues, body, block)
            if not res.ok:
                raise StoreError(
                    f"broker {broker.name} stored the message but could not make it"
                    f" durable in time (response code {res.code})"
                )
            with contextlib.suppress(ValueError):
                self.saw_phys(decode_message_id(res.msg_id)[1])
            return res
        raise AssertionError("unreachable")

    def saw_phys(self, phys: int) -> None:
        if phys >= self.log_max:
            self.log_max = phys + 1
