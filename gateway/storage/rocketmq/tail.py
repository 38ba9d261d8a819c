"""One held pull at the end of a broker's parent topic: the arrival notices of every mirror.

Every message of the deployment is sent to the parent topic (`rocketmq_topic`, queue 0) with the
light queues it goes to and its offset in each (INNER_MULTI_DISPATCH / INNER_MULTI_QUEUE_OFFSET,
read by MessageRecord.light_queue_offsets). So one long poll at the parent queue's end tells a
node which of its mirrored light queues got data, at which offsets, and brings the message
itself: the mirrors (gateway/storage/rocketmq/mirrors.py, `notify` mode) take it from the tail
and keep no held pull of their own. Held pulls per node: one per broker, not one per
subscribed light queue.

    start      GET_MAX_OFFSET of the parent queue: the tail's first offset (`ready` set after it)
    follow     PULL_MESSAGE (suspend SUSPEND_S) from the tail's offset; the offset moves to
               each answer's nextBeginOffset and the next pull is written at once, before the
               answer's records go to `deliver` (in the loop's next step): the broker holds
               the next pull while this one's messages are handed out, so a message stored
               meanwhile is not left waiting for that work. After the first answer the pulls
               follow one another by callback on the open connection (`held_pull`: no task
               step or coroutine per answer, the frame made once, one deadline timer); the
               first pull, and the one after an error or a dropped connection, is the
               coroutine's (`run`), which reconnects and backs off
    pass over  only the records dispatched to a light queue this node mirrors (`wanted`) are
               decoded; the others are passed over from their INNER_MULTI_DISPATCH property
               (rocketmq_remoting.message.scan_records), their body never copied. A mirror
               opened after the answer was read finds such a record below its end (bounds
               read after registering), as with one handed out before it registered
    errors     a refused or lost connection (a broker restart): the same offset again, with
               backoff, so nothing stored meanwhile is skipped; an offset out of the queue's
               range (the broker lost or deleted data): on from where the broker says

No gap (a mirror opened while the tail runs): a mirror reads its queue's bounds only after the
tail's `ready`, and registers itself before. A message the tail handed out before the mirror
was registered was dispatched before the mirror's bounds were read, so it is below the mirror's
end (read by the mirror's one-shot pulls when a reader wants it); one handed out after is
delivered to the mirror by the tail.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container

from gateway.storage.rocketmq.broker import PULL_GROUP, Broker
from rocketmq_remoting import OffsetMovedError, PullResult, RemotingError
from rocketmq_remoting.message import MessageRecord

log = logging.getLogger("lmqtt.rocketmq")

#: How long the tail's held pull waits for an arrival (see mirrors.SUSPEND_S).
SUSPEND_S = 15.0
#: Messages one answer of the tail may bring (the broker sends fewer past its transfer limits).
TAIL_BATCH = 256


class ParentTail:
    """The parent queue of one broker, followed from its end (see the module docstring)."""

    def __init__(
        self,
        broker: Broker,
        deliver: Callable[[list[MessageRecord], int], None],
        wanted: Container[str],
    ) -> None:
        self._broker = broker
        self._deliver = deliver
        #: The light queues this node mirrors (read live: mirrors come and go). A message
        #: dispatched to none of them is passed over from its properties, never decoded.
        self._wanted = wanted
        self.ready = asyncio.Event()  # the start offset is known
        self.offset = 0  # the next parent offset the tail reads
        self._loop = asyncio.get_running_loop()
        #: While the pulls follow by callback: what `run` awaits, resolved (None) when no
        #: connection is open for the next pull, or failed with the error that ended one.
        self._back: asyncio.Future[None] | None = None
        #: The pulls after the first, one after another by callback (held_pull.py: the frame
        #: made once, one deadline timer for all of them).
        self._held = broker.client.held_pull(
            broker.addr,
            broker.topic,
            self._answered,
            consumer_group=PULL_GROUP,
            max_messages=TAIL_BATCH,
            suspend_timeout=SUSPEND_S,
            wanted=wanted,
        )

    async def run(self) -> None:
        """Follow the parent queue until cancelled."""
        try:
            await self._follow()
        finally:
            self._held.close()

    async def _follow(self) -> None:
        broker = self._broker
        client = broker.client
        backoff = 0.1
        while True:
            try:
                if not self.ready.is_set():
                    self.offset = await client.get_max_offset(broker.addr, broker.topic)
                    self.ready.set()
                res = await client.pull(
                    broker.addr,
                    broker.topic,
                    self.offset,
                    consumer_group=PULL_GROUP,
                    max_messages=TAIL_BATCH,
                    suspend_timeout=SUSPEND_S,
                    wanted=self._wanted,
                )
                backoff = 0.1
                # The next pulls by callback (`_answered`) until one fails or finds no open
                # connection; the loop's next turn then pulls again from the same offset.
                self._back = back = self._loop.create_future()
                self._took(res)
                await back
            except OffsetMovedError as exc:
                log.warning(
                    "parent topic %s: offset %d moved (broker range %d..%d): following from %d",
                    broker.topic, self.offset, exc.min_offset, exc.max_offset,
                    exc.next_begin_offset,
                )  # fmt: skip
                self.offset = exc.next_begin_offset
                continue
            except RemotingError as exc:
                log.warning(
                    "parent topic %s: tail pull failed (%s); again in %.1fs",
                    broker.topic, exc, backoff,
                )  # fmt: skip
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            finally:
                self._back = None

    def _took(self, res: PullResult) -> None:
        """An answer: the next pull written (by callback), then its records handed out in
        the loop's next step, after the next pull's frame left (its write was queued first)."""
        if res.found:
            self.offset = max(self.offset, res.next_begin_offset)
        else:
            log.debug(
                "parent topic %s: held pull ended empty (code %d)", self._broker.topic, res.code
            )
        if not self._held.send(self.offset):
            back = self._back
            if back is not None and not back.done():
                back.set_result(None)  # no open connection: `run` pulls (and reconnects)
        if res.found:
            self._loop.call_soon(self._hand_out, res.messages, res.last_commitlog_offset)

    def _answered(self, res: PullResult | RemotingError) -> None:
        back = self._back
        if back is None or back.done():
            return  # `run` was cancelled (the storage closed) or took over: nothing follows
        if isinstance(res, RemotingError):
            back.set_exception(res)  # `run` handles it as a failed pull of its own
            return
        self._took(res)

    def _hand_out(self, records: list[MessageRecord], last_phys: int) -> None:
        try:
            self._deliver(records, last_phys)
        except Exception:  # one bad answer must not stop every mirror's arrivals
            log.exception("parent topic %s: delivering a tail answer failed", self._broker.topic)
