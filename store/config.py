"""Store configuration: one frozen model, resolved once at open."""

from __future__ import annotations

import enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from store.format import CQ_UNITS_PER_FILE


class FlushMode(enum.StrEnum):
    """When a put is durable.

    ASYNC: a flusher thread fsyncs every ``flush_interval_ms``; put returns after the append.
    SYNC: group commit; put returns (or its awaitable completes) after the fsync covering it,
    concurrent puts share one fsync.
    """

    ASYNC = "async"
    SYNC = "sync"


class StoreConfig(BaseModel):
    """Everything that shapes a MessageStore. Sizes are bytes, times as their names say."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: Path
    flush: FlushMode = FlushMode.ASYNC
    flush_interval_ms: int = Field(default=200, ge=1)
    #: A sync put waits at most this long for its fsync (RocketMQ: 5 s), then FlushTimeoutError.
    sync_flush_timeout_ms: int = Field(default=5000, ge=1)
    segment_size: int = Field(default=1 << 30, ge=4096, le=(1 << 31) - 1)
    max_body_size: int = Field(default=4 * 1024 * 1024, ge=0)
    #: Segments older than this (by file modification time) are deleted; None keeps them.
    retention_hours: float | None = Field(default=None, gt=0)
    #: Oldest segments are deleted while the CommitLog is larger than this; None: no budget.
    retention_bytes: int | None = Field(default=None, gt=0)
    retention_check_interval_s: float = Field(default=10.0, gt=0)
    #: Open an existing store for reading only: no lock, no abort marker, no recovery
    #: writes, no flusher thread. Safe while another process writes.
    read_only: bool = False
    cq_units_per_file: int = Field(default=CQ_UNITS_PER_FILE, ge=1)
    #: Bound on open consume-queue file descriptors (LRU).
    max_open_files: int = Field(default=256, ge=4)
    #: Bound on consume-queue states kept in memory (LRU); evicted ones are reloaded from disk.
    max_cached_queues: int = Field(default=100_000, ge=16)
