"""The embedded store as the gateway's Storage (gateway/storage/port.py): the one adapter module.

`EmbeddedStorage` is a `store.MessageStore` (so the hot path calls the store's own methods,
with no wrapper in between) plus the asynchronous half of the port: waiting for the state
log's fsync and compacting it, in worker threads so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gateway.config import GatewaySettings
from gateway.storage.group_commit import GroupCommit
from gateway.storage.port import Storage
from store import AccountWriter, FlushMode, MessageStore, StoreConfig, TimerQueue
from topicmap import TopicFilter, replay_parents


class EmbeddedStorage(MessageStore):
    """MessageStore + the port's async state operations."""

    _compacting: asyncio.Future[None] | None = None
    _state_commit: GroupCommit | None = None  # the state log's fsyncs (sync mode)
    _timers: TimerQueue | None = None

    def read_max_offset(self, queue: str) -> int:
        """The store reads every queue itself: `max_offset` (see the port)."""
        return self.max_offset(queue)

    @property
    def timers(self) -> TimerQueue:
        """The store's timer queue, its pending entries recovered on first use."""
        if self._timers is None:
            self._timers = TimerQueue(self)
            self._timers.recover()
        return self._timers

    async def put_delayed(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str],
        properties: dict[str, str],
        deliver_ms: int,
    ) -> None:
        """Into the timer queue (store/timer.py); the gateway routes it when it fires."""
        await self.timers.schedule(body, properties, deliver_ms)

    @property
    def tail_may_be_lost(self) -> bool:
        return self.recovery.abnormal

    async def drain(self) -> None:
        """Nothing to wait for: appends are written in the caller's thread; close() fsyncs."""

    @property
    def waits(self) -> bool:
        """Never: queues open at once, the state log's fsyncs (sync flush) are futures
        (`state_durable`)."""
        return False

    async def open_queue(self, queue: str) -> None:
        """Nothing to do: every queue's end is in memory."""

    async def catch_up_queue(self, queue: str) -> None:
        """Nothing to do: reads see every append at once."""

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None:
        """Nothing to do: reads never block."""

    def history_queues(self, tf: TopicFilter) -> list[str]:
        """The parent topics (first topic levels) whose messages `tf` may match."""
        return replay_parents(tf, self.queues())

    async def open_history(self, queues: Sequence[str], since_ms: int) -> None:
        """Nothing to do: offsets by time are read from the consume queues at once."""

    def close_queue(self, queue: str) -> None:
        """Nothing to do: a queue costs its index file, not a reader."""

    async def load_offsets(self, keys: Iterable[tuple[str, str]]) -> None:
        """Nothing to do: the committed offsets table was read at open."""

    async def wait_state_durable(self, position: int) -> None:
        """Sync flush mode: wait until the state log is fsynced up to `position`, one fsync
        for every caller waiting at once (group commit: gateway/storage/group_commit.py).
        Async mode: the write already survives a process crash; the store's periodic full
        flush (each second) makes it survive a power loss, as for messages."""
        fut = self.state_durable(position)
        if fut is not None:
            await fut

    def state_durable(self, position: int) -> asyncio.Future[None] | None:
        """`wait_state_durable`'s future (None in async mode, or when already durable)."""
        commit = self._state_commit
        if commit is None:
            state = self.state
            if self.config.flush != FlushMode.SYNC or state is None:
                return None
            commit = self._state_commit = GroupCommit(state)
        return commit.durable(position)

    def close(self) -> None:
        """Close the store (its state log fsynced), then end the state fsync worker."""
        super().close()
        if self._state_commit is not None:
            self._state_commit.stop()
            self._state_commit = None

    async def compact_state(self) -> None:
        if self.read_only or not self.state_needs_compaction():
            return
        if self._compacting is not None and not self._compacting.done():
            return
        # The snapshot is written by a child process: a thread of this one would take turns
        # with the event loop for the GIL at every callback (store/statelog.py).
        fut = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.rewrite_state, child=True)
        )
        self._compacting = fut
        await fut


def store_config(settings: GatewaySettings, **extra: Any) -> StoreConfig:
    """The StoreConfig the settings imply (`extra` adds/overrides store-only fields)."""
    fields: dict[str, Any] = {
        "data_dir": settings.data_dir,
        "flush": settings.flush,
        "flush_interval_ms": settings.flush_interval_ms,
        "segment_size": settings.segment_size,
        # A message body can never be larger than the packet that carried it.
        "max_body_size": settings.max_packet_size,
        "retention_hours": settings.retention_hours,
        "retention_bytes": settings.retention_bytes,
    }
    fields.update(extra)
    return StoreConfig(**fields)


def open_storage(settings: GatewaySettings) -> EmbeddedStorage:
    """Open (create or recover) the embedded store of `settings.data_dir`."""
    store = EmbeddedStorage.open(store_config(settings))
    assert isinstance(store, EmbeddedStorage)
    return store


def open_read_only(data_dir: Path) -> Storage:
    """The store of `data_dir` for reading, safe while a gateway writes it (lmqtt inspect)."""
    store = EmbeddedStorage.open(StoreConfig(data_dir=data_dir, read_only=True))
    assert isinstance(store, EmbeddedStorage)
    return store


def open_account(settings: GatewaySettings) -> AccountWriter:
    """The delivery account of `settings.data_dir` (store/delivery_account.py), for appending."""
    return AccountWriter(settings.data_dir)
