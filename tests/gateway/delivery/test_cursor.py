"""QueueCursor (gateway/storage/cursor.py) on a real store: the recent cache first, the store else,
retention and a position past the queue's end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.messages.recent import RecentMessages
from gateway.storage.cursor import GONE, QueueCursor
from gateway.storage.embedded import EmbeddedStorage
from store import StoreConfig

QUEUE = "%LMQ%cursor"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStorage]:
    s = EmbeddedStorage.open(StoreConfig(data_dir=tmp_path / "data", segment_size=1 << 20))
    assert isinstance(s, EmbeddedStorage)
    yield s
    s.close()


def _fill(store: EmbeddedStorage, n: int, recent: RecentMessages | None = None) -> None:
    for i in range(n):
        r = store.put("t", b"%d" % i, queues=[QUEUE], properties={})
        if recent is not None:
            recent.add("t", b"%d" % i, {}, r)


def test_reads_the_recent_cache_first_then_the_store(store: EmbeddedStorage) -> None:
    _fill(store, 5)  # before this run's cache: only in the store
    recent = RecentMessages()
    _fill(store, 5, recent)  # offsets 5..9 are cached too
    cursor = QueueCursor(store, recent.run)

    cached, start, nxt = cursor.read(QUEUE, 5, 32)
    assert (start, nxt) == (5, 10)
    assert [m.body for m in cached] == [b"%d" % i for i in range(5)]
    assert cached[0] is recent.run(QUEUE, 5, 1)[0]  # the cache's own objects, not a re-read

    stored, start, nxt = cursor.read(QUEUE, 0, 3)
    assert [m.queue_offset for m in stored] == [0, 1, 2] and (start, nxt) == (0, 3)

    one = cursor.one(QUEUE, 7)
    assert one is not None and one.queue_offset == 7
    assert cursor.one(QUEUE, 10) is None  # not there (yet)
    assert cursor.read(QUEUE, 10, 32) == ([], 10, 10)  # nothing new
    assert cursor.end(QUEUE) == 10


def test_offsets_deleted_by_retention_are_read_on_from_the_first_kept(tmp_path: Path) -> None:
    s = EmbeddedStorage.open(
        StoreConfig(data_dir=tmp_path / "data", segment_size=4096, retention_bytes=2 * 4096)
    )
    assert isinstance(s, EmbeddedStorage)
    try:
        _fill(s, 200)
        assert s.delete_expired() > 0
        lo = s.min_offset(QUEUE)
        assert lo > 0
        cursor = QueueCursor(s)
        messages, start, nxt = cursor.read(QUEUE, 0, 4)
        assert start == lo and [m.queue_offset for m in messages] == list(range(lo, lo + 4))
        assert nxt == lo + 4
        assert cursor.one(QUEUE, 0) is None
        assert cursor.lookup(QUEUE, 0) is GONE  # deleted, not "not there yet"
        kept = cursor.lookup(QUEUE, lo)
        assert kept is not None and not isinstance(kept, str)  # not GONE
        assert kept.queue_offset == lo
        assert cursor.lookup(QUEUE, 200) is None  # not there yet
    finally:
        s.close()


def test_a_position_past_the_queue_end_is_reported_below_it(store: EmbeddedStorage) -> None:
    """After an async-flush crash the log may end before a saved position (a lost tail):
    the cursor says where the queue ends, so the reader resumes there."""
    _fill(store, 3)
    assert QueueCursor(store).read(QUEUE, 50, 32) == ([], 3, 3)
