"""Delayed publish: a PUBLISH to `$delayed/{seconds}/{topic}` reaches `{topic}`'s subscribers
`{seconds}` later (EMQX's syntax), 1 <= seconds <= max_delay.

    PUBLISH $delayed/30/valve/7/open
        parse_delayed                       -> (30, "valve/7/open"), or TopicError 0x90
        DelayedPublishes.schedule           -> storage.put_delayed(record of valve/7/open, due)
            embedded: the store's timer queue (store/timer.py); `run` fires each entry when
                      due: routed then (subscribers who came meanwhile get it too) and
                      appended with its fired mark as one record (exactly once)
            RocketMQ: a broker timer message with the light queues of now; the broker re-puts
                      it when due, whether or not any gateway runs

The stored record is the one a PUBLISH to `{topic}` makes (publisher, QoS, MQTT 5
properties), so delivery, replay and the fan-out report see the message once, under `{topic}`,
at the time it was delivered. A delayed message is not retained (its RETAIN flag is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.clock import now_ms
from gateway.messages.publishing import PublishPath
from gateway.messages.records import message_properties
from gateway.protocol import Publish, ReasonCode
from gateway.stats import GatewayStats
from gateway.storage.port import Storage, StoreError, TimerEntry, TimerQueue
from topicmap import TopicError
from topicmap.record import TOPIC

log = logging.getLogger("lmqtt.gateway")

DELAYED_PREFIX = "$delayed/"
#: Seconds between checkpoints of the timer queue while entries are pending or unsaved.
CHECKPOINT_INTERVAL_S = 1.0


def parse_delayed(name: str, max_delay: int) -> tuple[int, str]:
    """(seconds, target topic) of a `$delayed/{seconds}/{topic}` name; TopicError (reason
    0x90, Topic Name invalid) when the delay is not an integer in [1, max_delay] or the
    target is not a topic a client may publish to."""
    _, _, rest = name.partition(DELAYED_PREFIX)
    seconds, sep, target = rest.partition("/")
    bad = ReasonCode.TOPIC_NAME_INVALID
    if not sep or not seconds.isascii() or not seconds.isdigit():
        raise TopicError(f"{name!r}: the delay must be whole seconds", reason_code=bad)
    delay = int(seconds)
    if not 1 <= delay <= max_delay:
        raise TopicError(f"{name!r}: the delay must be 1 to {max_delay} s", reason_code=bad)
    if not target or target.startswith("$"):
        raise TopicError(f"{name!r}: no topic a client may publish to", reason_code=bad)
    return delay, target


class DelayedPublishes:
    """Schedules delayed PUBLISHes and, on a store with a timer queue, fires them."""

    def __init__(self, store: Storage, publisher: PublishPath, stats: GatewayStats) -> None:
        self._store = store
        self._publisher = publisher
        self._stats = stats
        self._timers: TimerQueue | None = store.timers
        self._wake = asyncio.Event()

    async def schedule(self, pub: Publish, client_id: str, delay_s: int, target: str) -> None:
        """Store `pub` (its topic already `target`-checked) for delivery to `target` in
        `delay_s` seconds; returns once stored (the acknowledgement may go). StoreError."""
        fenced = self._publisher.fenced
        if fenced is not None and fenced():
            raise StoreError("this gateway node is fenced (its cluster lease ran out)")
        parent, queues = self._publisher.publish_route(target)
        body = Publish(
            topic=target,
            payload=pub.payload,
            qos=pub.qos,
            packet_id=pub.packet_id,
            properties=pub.properties,
        )
        props = message_properties(body, client_id)
        await self._store.put_delayed(parent, pub.payload, queues, props, now_ms() + delay_s * 1000)
        self._wake.set()

    # -- firing (a store with a timer queue) ---------------------------------------------------

    async def run(self) -> None:
        """Fire due entries, checkpoint, sleep until the next is due or a new one comes."""
        timers = self._timers
        if timers is None:
            return
        while True:
            now = now_ms()
            failed = False
            for entry in timers.due(now):
                failed = not self._fire(timers, entry) or failed
            try:
                timers.save_checkpoint()
            except OSError as e:
                log.error("timer checkpoint not written: %s", e)
            nxt = timers.next_due()
            # Nothing pending and all checkpointed: sleep until a new one comes.
            timeout = CHECKPOINT_INTERVAL_S if failed or timers.unsaved else None
            if nxt is not None and not failed:
                timeout = min(max(0.0, (nxt - now_ms()) / 1000), CHECKPOINT_INTERVAL_S)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _fire(self, timers: TimerQueue, entry: TimerEntry) -> bool:
        """Fire one entry `due` gave; False when it could not be (put back, tried again)."""
        try:
            msg = timers.message(entry)
            parent, queues = self._publisher.publish_route(msg.properties[TOPIC])
            r = timers.fire(entry, parent, queues, msg.body, msg.properties)
        except (StoreError, KeyError, TopicError) as e:
            if isinstance(e, StoreError) and entry.physical_offset < self._store.log_min_offset:
                log.warning("delayed message %d was removed by retention unfired", entry.offset)
                timers.forget(entry)
                return True
            # Not stored, so not fired: it stays pending and is tried again next round.
            log.error("delayed message %d could not be delivered: %s", entry.offset, e)
            timers.defer(entry)
            return False
        self._publisher.recent.add(parent, msg.body, msg.properties, r)
        self._stats.messages_received += 1
        return True

    async def stop(self) -> None:
        """Checkpoint what fired (the store's close flushes the log first)."""
        if self._timers is not None:
            with contextlib.suppress(OSError):
                self._timers.save_checkpoint()
