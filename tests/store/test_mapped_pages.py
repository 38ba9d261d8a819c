"""The CommitLog's mapped pages do not pile up in RSS: appends do not map pages at all, and
flushes unmap the pages readers mapped, except near the end of the log.

RSS of a segment mapping is read from /proc/self/smaps (Linux), so these tests measure what
an operator's `ps` would show. Unmapping (MADV_DONTNEED on a shared file mapping) must never
change data: everything is read back after it, in this process and after a restart.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from store import GetStatus, MessageStore
from store.flush import MAPPED_TAIL_BYTES
from tests.store.conftest import OpenStore

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/smaps; madvise is Linux"
)

BODY = bytes(range(256)) * 4  # 1 KiB, not all zeros: a lost page would read as zeros
SEGMENT = 64 << 20
COUNT = 40_000  # ~43 MB of records: well past MAPPED_TAIL_BYTES


def mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path`."""
    total = 0
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                current = line.rstrip("\n").endswith(str(path))
            elif current and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def segment_path(store: MessageStore) -> Path:
    [seg] = store.commitlog.segments
    return Path(seg.path)


def fill(store: MessageStore) -> None:
    for i in range(COUNT):
        store.put("dev", BODY + i.to_bytes(4, "big"), queues=[f"%LMQ%q{i % 4}"])


def read_all(store: MessageStore) -> int:
    seen = 0
    for q in range(4):
        offset = 0
        while True:
            got = store.get(f"%LMQ%q{q}", offset, 512)
            if got.status is not GetStatus.FOUND:
                break
            for msg in got.messages:
                i = int.from_bytes(msg.body[-4:], "big")
                assert i % 4 == q
                assert msg.body[:-4] == BODY
                seen += 1
            offset = got.next_offset
    return seen


def quiet_store(open_store: OpenStore) -> MessageStore:
    """A store whose flusher thread stays idle for the test (flushes run when called)."""
    return open_store(segment_size=SEGMENT, flush_interval_ms=600_000)


def test_appends_do_not_map_and_full_flush_unmaps_read_pages(open_store: OpenStore) -> None:
    store = quiet_store(open_store)
    fill(store)
    path = segment_path(store)
    written = store.log_max_offset
    assert written > 4 * MAPPED_TAIL_BYTES
    # Appends go through write(2) (Segment.write): the pages are in the page cache, not in RSS.
    assert mapped_rss(path) <= MAPPED_TAIL_BYTES
    # Readers read through the mapping, which maps every page they touch...
    assert read_all(store) == COUNT
    assert mapped_rss(path) > written // 2
    store.flush()  # ...until the next full flush lets them go
    assert mapped_rss(path) <= MAPPED_TAIL_BYTES + (1 << 20)
    # Data is unchanged: every record reads back again (faulting the pages in once more).
    assert read_all(store) == COUNT


def test_log_flush_unmaps_after_a_fast_writer(open_store: OpenStore) -> None:
    """The periodic CommitLog fsync (the flusher's step between full flushes) lets go of
    mapped pages too once MAPPED_TAIL_BYTES more were written: RSS does not wait a second."""
    store = quiet_store(open_store)
    fill(store)
    path = segment_path(store)
    assert read_all(store) == COUNT
    assert mapped_rss(path) > store.log_max_offset // 2
    files = store._files
    assert files is not None  # an open store
    files.flush_log()  # what the flusher thread runs every flush_interval_ms
    assert mapped_rss(path) <= MAPPED_TAIL_BYTES + (1 << 20)
    assert read_all(store) == COUNT


def test_unmapped_pages_survive_restart_and_keep_appending(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = quiet_store(open_store)
    fill(store)
    store.flush()  # release while nothing is waiting
    store.put("dev", b"after-release", queues=["%LMQ%tail"])
    store.close()
    reopened = quiet_store(open_store)
    assert read_all(reopened) == COUNT
    got = reopened.get("%LMQ%tail", 0, 1)
    assert [m.body for m in got.messages] == [b"after-release"]
    assert os.path.getsize(segment_path(reopened)) == SEGMENT
