"""`$SYS/broker/...`: the gateway's counters as retained messages, Mosquitto's topic names.

    $SYS/broker/version                   "lmqtt version 0.1.0"
    $SYS/broker/uptime                    "<n> seconds"
    $SYS/broker/clients/connected         clients connected now
    $SYS/broker/clients/total             connected + persistent sessions held offline
    $SYS/broker/messages/received         PUBLISH packets received
    $SYS/broker/messages/sent             PUBLISH packets sent
    $SYS/broker/bytes/received            bytes read from clients
    $SYS/broker/bytes/sent                bytes written to clients
    $SYS/broker/subscriptions/count       subscriptions held (live and persistent sessions)
    $SYS/broker/retained messages/count   live retained messages
    $SYS/broker/store/bytes               CommitLog bytes on disk

Every `sys_interval` seconds (0 = off) the publisher sends, through
`PublishPath.publish_internal(retain=True)` (gateway/messages/publishing.py), the values that
changed since its last round (all of them on the first round; uptime always), so an idle gateway
does not grow its store with identical $SYS records. Values are plain decimal text like
Mosquitto's, so `mosquitto_sub -t '$SYS/#' -v` reads well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sized
from importlib import metadata
from pathlib import Path

from gateway.stats import GatewayStats

__all__ = ["SYS_PREFIX", "SysPublisher"]

log = logging.getLogger("lmqtt.sys")

SYS_PREFIX = "$SYS/broker/"

# Publishes (topic, payload, retain=, qos=) as the gateway itself.
PublishInternal = Callable[..., Awaitable[None]]


@functools.cache
def _version() -> str:
    """The installed package's version (read once: it scans the installed distributions)."""
    try:
        return metadata.version("lmqtt")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _dir_bytes(path: Path) -> int:
    """Bytes held by the files directly in `path` (the CommitLog segments)."""
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    # Allocated size: segments may be sparse or preallocated.
                    st = entry.stat(follow_symlinks=False)
                    total += min(st.st_size, getattr(st, "st_blocks", 0) * 512 or st.st_size)
    except OSError:
        return 0
    return total


class SysPublisher:
    """Started and stopped by the Gateway: `SysPublisher(...).start()` / `await .stop()`."""

    def __init__(
        self,
        stats: GatewayStats,
        publish: PublishInternal,
        *,
        data_dir: Path | None = None,
        retained: Sized | None = None,
        interval: float = 10.0,
    ) -> None:
        self._stats = stats
        self._publish = publish
        self._data_dir = data_dir  # the CommitLog's size is measured there until stats has it
        self._retained = retained
        self.interval = float(interval)
        self._started = time.monotonic()
        self._last: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0  # completed publishing rounds (tests wait on it)

    def values(self) -> dict[str, str]:
        """The current value of every $SYS topic, keyed by full topic name."""
        stats = self._stats
        retained = self._retained
        retained_count = len(retained) if retained is not None else stats.retained_count
        store_bytes = stats.store_bytes
        if not store_bytes and self._data_dir is not None:
            store_bytes = _dir_bytes(self._data_dir / "commitlog")
        raw: dict[str, object] = {
            "version": f"lmqtt version {_version()}",
            "uptime": f"{int(time.monotonic() - self._started)} seconds",
            "clients/connected": stats.clients_connected,
            "clients/total": stats.clients_total,
            "messages/received": stats.messages_received,
            "messages/sent": stats.messages_sent,
            "bytes/received": stats.bytes_received,
            "bytes/sent": stats.bytes_sent,
            "subscriptions/count": stats.subscriptions,
            "retained messages/count": retained_count,
            "store/bytes": store_bytes,
        }
        return {SYS_PREFIX + key: str(value) for key, value in raw.items()}

    async def publish_once(self) -> int:
        """Publish the values that changed (uptime always); returns how many were sent."""
        sent = 0
        for topic, value in self.values().items():
            if self._last.get(topic) == value:
                continue
            await self._publish(topic, value.encode(), retain=True, qos=0)
            self._last[topic] = value
            sent += 1
        self.rounds += 1
        return sent

    def start(self) -> None:
        if self.interval <= 0 or self._task is not None:
            return
        self._started = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lmqtt-sys")

    def stop(self) -> asyncio.Future[None]:
        """Cancel the publishing task now; the result may be awaited to wait for its end
        (`await publisher.stop()`), or ignored (`publisher.stop()`)."""
        task, self._task = self._task, None
        if task is None:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        task.cancel()
        return asyncio.ensure_future(self._finished(task))

    @staticmethod
    async def _finished(task: asyncio.Task[None]) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        while True:
            try:
                await self.publish_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A full disk or a closing store must not kill the gateway's $SYS forever.
                log.warning("$SYS publish failed", exc_info=True)
            await asyncio.sleep(self.interval)
