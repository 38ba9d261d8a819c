"""Retention: delete whole CommitLog segments by age and by total size.

The segment being written is never deleted. After segments go, every consume queue deletes
files whose units all point below the new log start, and its ``min_offset`` moves up; queues
not in memory are corrected when next loaded; and the delivery account's ranges files that
speak only of deleted messages go too (store/delivery_account.py: written before the oldest
message left). Runs under the store lock. Every deletion is made durable (an fsync of its
directory, store/atomicfile.py) before retention returns: a file that came back after a power
cut would speak of what the others no longer hold.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from store.atomicfile import unlink_durably
from store.commitlog import CommitLog, first_store_timestamp
from store.consumequeue import ConsumeQueueTable
from store.delivery_account import expired_ranges

log = logging.getLogger("lmqtt.store.retention")


def expired_segments(
    commitlog: CommitLog,
    *,
    retention_hours: float | None,
    retention_bytes: int | None,
    now: float | None = None,
) -> int:
    """How many of the oldest segments retention removes (never the last one)."""
    segs = commitlog.segments
    if len(segs) <= 1:
        return 0
    now = time.time() if now is None else now
    n = 0
    if retention_hours is not None:
        limit = now - retention_hours * 3600
        while n < len(segs) - 1 and os.path.getmtime(segs[n].path) < limit:
            n += 1
    if retention_bytes is not None:
        total = len(segs) * commitlog.segment_size
        while n < len(segs) - 1 and total - n * commitlog.segment_size > retention_bytes:
            n += 1
    return n


def apply_retention(
    commitlog: CommitLog,
    table: ConsumeQueueTable,
    *,
    retention_hours: float | None,
    retention_bytes: int | None,
    now: float | None = None,
    data_dir: Path | None = None,
) -> int:
    """Delete expired segments and the queue files they make useless, and (given the data
    directory) the delivery account files that speak only of deleted messages; returns the
    segments deleted."""
    n = expired_segments(
        commitlog, retention_hours=retention_hours, retention_bytes=retention_bytes, now=now
    )
    if not n:
        return 0
    for _ in range(n):
        seg = commitlog.delete_oldest()
        log.info("retention: deleted segment %s", seg.path.name)
    log_min = commitlog.min_offset
    table.log_min_offset = log_min
    table.write_pending()
    for name in list(table.disk_names()):
        cq = table.lookup(name)
        if cq is None:
            continue
        table.delete_files_below(cq, log_min)
        table.correct_min_offset(cq)
        table.evict_overflow()
    if data_dir is not None:
        delete_expired_account(data_dir, commitlog)
    return n


def delete_expired_account(data_dir: Path, commitlog: CommitLog) -> int:
    """Delete the account's ranges files written wholly before the oldest message the log
    still holds; returns how many. Runs when segments were deleted (only then does that
    message get younger); the writer's current file is never one of them."""
    if not commitlog.segments:
        return 0
    oldest = first_store_timestamp(commitlog.segments[0].path)
    if oldest is None:
        return 0
    paths = list(expired_ranges(data_dir, oldest))
    deleted = unlink_durably(paths)
    if deleted:
        log.info("retention: deleted %d delivery account file(s) up to %s", deleted, paths[-1].name)
    return deleted
