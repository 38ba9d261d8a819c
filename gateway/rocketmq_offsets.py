"""Committed consumer offsets on RocketMQ: the gateway's positions as the broker's offsets.

The local committed-offsets table (primary: a restart reads it) is copied to the broker's
consumer offsets, group `%LMQ%` + the encoded consumer (client id or $share group), topic the
light queue: UPDATE_CONSUMER_OFFSET one-way every OFFSET_FLUSH_S for what changed, and once
more at a graceful stop.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.rocketmq_broker import Broker
from gateway.storage import CommittedOffsets
from rocketmq_remoting import RemotingError

log = logging.getLogger("lmqtt.rocketmq")

OFFSET_FLUSH_S = 1.0


class BrokerOffsets:
    """CommittedOffsets: the local table, with the changes copied to the broker."""

    def __init__(self, local: CommittedOffsets, broker: Broker) -> None:
        self._local = local
        self._broker = broker
        self._dirty: dict[tuple[str, str], int] = {}
        self._task = asyncio.get_running_loop().create_task(self._flush_periodically())

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None:
        self._local.commit(group, queue, offset, durable=durable)
        if durable:
            self._dirty[(group, queue)] = offset

    def get(self, group: str, queue: str) -> int | None:
        return self._local.get(group, queue)

    def remove(self, group: str, queue: str) -> None:
        self._local.remove(group, queue)

    def all(self) -> dict[tuple[str, str], int]:
        return self._local.all()

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(OFFSET_FLUSH_S)
            await self.flush()

    async def flush(self) -> None:
        dirty, self._dirty = self._dirty, {}
        broker = self._broker
        names = broker.names
        try:
            for (group, queue), offset in dirty.items():
                # One-way, as Java consumers do: the local copy is the primary one.
                await broker.client.update_consumer_offset(
                    broker.addr, names.lmq(group), names.lmq(queue), offset, oneway=True
                )
        except RemotingError as exc:
            log.warning("committing offsets to broker %s failed: %s", broker.name, exc)

    def close(self) -> None:
        self._task.cancel()
