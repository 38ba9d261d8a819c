"""Committed consumer offsets on RocketMQ: the broker's consumer offsets are the truth.

The gateway commits a position per (group, queue) (gateway/storage/port.py CommittedOffsets: the
client id for a subscriber's own queue, `$share/<group>` for a shared group). Here they live
in memory and on the broker, as the consumer offset of group `%LMQ%` + the encoded consumer,
topic the light queue (gateway/storage/rocketmq/names.py), queue id 0:

    commit   in memory at once; what changed is sent to the broker every OFFSET_FLUSH_S
             (UPDATE_CONSUMER_OFFSET one-way, as Java consumers do) and at a graceful stop
             (answered: `drain` waits for it)
    get      what this run committed, or what `load` read back from the broker
    load     QUERY_CONSUMER_OFFSET for the keys a restart resumes (shared groups), all
             pipelined: a gateway started with an empty data directory resumes them there

Nothing of it is on the gateway's disk. A crash loses at most the last OFFSET_FLUSH_S of
commits (redelivery of messages acknowledged in that second, never a loss: a committed offset
is below everything not acknowledged), and the broker flushes its consumer offsets every 5 s
(docs/rocketmq.md quirk 10), which bounds what a broker crash forgets the same way.

Sessions resume from their own records (positions and in-flight window together, in the
%STATE% queue on the broker: gateway/session/registry.py); their broker offsets are kept for lag
monitoring and RocketMQ's own tools, and not read back (docs/rocketmq.md says why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from gateway.storage.port import StorageUnavailable
from gateway.storage.rocketmq.broker import Broker
from rocketmq_remoting import RemotingError

log = logging.getLogger("lmqtt.rocketmq")

OFFSET_FLUSH_S = 1.0
LOAD_ATTEMPTS = 3  # QUERY_CONSUMER_OFFSET rounds at start before the gateway gives up

Key = tuple[str, str]  # (group, queue): gateway names


class BrokerOffsets:
    """CommittedOffsets kept by the broker (see the module docstring)."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._offsets: dict[Key, int] = {}
        self._durable: set[Key] = set()  # keys whose offset goes to the broker
        self._dirty: dict[Key, int] = {}
        self._failing = False  # the last flush failed (logged once per outage)
        self._task = asyncio.get_running_loop().create_task(self._flush_periodically())

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None:
        key = (group, queue)
        self._offsets[key] = offset
        # A clean session's position stays in memory (the embedded table's rule: unless the
        # key is already durable).
        if durable or key in self._durable:
            self._durable.add(key)
            self._dirty[key] = offset

    def get(self, group: str, queue: str) -> int | None:
        return self._offsets.get((group, queue))

    def remove(self, group: str, queue: str) -> None:
        # The broker keeps its copy (a light queue group's offset cannot be deleted alone);
        # nothing reads it back unless this key is committed again first.
        key = (group, queue)
        self._offsets.pop(key, None)
        self._durable.discard(key)
        self._dirty.pop(key, None)

    def all(self) -> dict[Key, int]:
        return dict(self._offsets)

    async def load(self, keys: Iterable[Key]) -> None:
        """Read the broker's committed offsets of `keys` (not committed in this run yet)."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._offsets]
        broker = self._broker
        names = broker.names
        for attempt in range(LOAD_ATTEMPTS):
            if not todo:
                return
            answers = await asyncio.gather(
                *(
                    broker.client.query_consumer_offset(broker.addr, names.lmq(g), names.lmq(q))
                    for g, q in todo
                ),
                return_exceptions=True,
            )
            failed: list[Key] = []
            for key, answer in zip(todo, answers, strict=True):
                if isinstance(answer, RemotingError):
                    failed.append(key)
                elif isinstance(answer, BaseException):
                    raise answer
                elif answer is not None and answer >= 0 and key not in self._offsets:
                    self._offsets[key] = answer
                    self._durable.add(key)
            todo = failed
            if failed and attempt < LOAD_ATTEMPTS - 1:
                await asyncio.sleep(0.5)
        if todo:
            raise StorageUnavailable(
                f"broker {broker.name} ({broker.addr}): committed offsets of {len(todo)}"
                " consumer(s) not readable (a restart would deliver their acknowledged messages"
                " again)"
            )

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(OFFSET_FLUSH_S)
            await self.flush(oneway=True)

    async def flush(self, *, oneway: bool = False) -> None:
        """Send the changed offsets; `oneway=False` waits for each answer (a graceful stop:
        then the next gateway reads them back)."""
        dirty, self._dirty = self._dirty, {}
        if not dirty:
            return
        broker = self._broker
        names = broker.names
        update = broker.client.update_consumer_offset
        try:
            if oneway:
                # One after the other, no task each: one-way calls only queue a frame.
                for (group, queue), offset in dirty.items():
                    await update(
                        broker.addr, names.lmq(group), names.lmq(queue), offset, oneway=True
                    )
            else:
                await asyncio.gather(
                    *(
                        update(broker.addr, names.lmq(group), names.lmq(queue), offset)
                        for (group, queue), offset in dirty.items()
                    )
                )
        except RemotingError as exc:
            for key, offset in dirty.items():  # sent again by the next flush
                self._dirty.setdefault(key, offset)
            # Once per outage (a broker away is tried every second), and when it is over.
            if not self._failing:
                log.warning("committing offsets to broker %s failed: %s", broker.name, exc)
            self._failing = True
            return
        if self._failing:
            self._failing = False
            log.warning("committing offsets to broker %s works again", broker.name)

    def close(self) -> None:
        self._task.cancel()
