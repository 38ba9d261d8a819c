"""Subscribers, committed offsets and queue ends read from a real store's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analytics.errors import SnapshotError
from analytics.snapshots import (
    queue_ends,
    read_committed,
    read_subscriptions,
    subscribers,
)
from store import MessageStore, StoreConfig
from tests.analytics.groundtruth import World


def test_subscribers_fold_sessions_and_shared_groups(world: World) -> None:
    subs = subscribers(read_subscriptions(world.data_dir), read_committed(world.data_dir))
    got = {(s.subscriber, s.queue): (s.start_offset, s.committed) for s in subs}
    assert got == world.ranges
    shared = [s for s in subs if s.shared]
    assert [(s.subscriber, s.sessions, s.online) for s in shared] == [("$share/g", 2, True)]
    offline = {s.subscriber for s in subs if not s.online}
    assert offline == {"s-slow", "s-none"}
    assert {s.filter for s in shared} == {"site/1/#"}


def test_queue_ends_match_the_store(world: World) -> None:
    ends = {q.queue: q for q in queue_ends(world.data_dir)}
    store = MessageStore.open(StoreConfig(data_dir=world.data_dir, read_only=True))
    try:
        for queue, end in world.ends.items():
            assert ends[queue].end_offset == end == store.max_offset(queue)
            assert ends[queue].min_offset == store.min_offset(queue)
    finally:
        store.close()


def test_missing_snapshots_are_empty(tmp_path: Path) -> None:
    assert read_subscriptions(tmp_path) == []
    assert read_committed(tmp_path) == {}
    assert queue_ends(tmp_path) == []


def test_committed_falls_back_to_read_position_then_start(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    sub = {"filter": "a/#", "queue": "%LMQ%a", "share_group": None, "qos": 1}
    doc = {
        "version": 1,
        "sessions": {
            "c1": {"disconnected_at_ms": None, "subscriptions": [{**sub, "start_offset": 5,
                                                                   "next_offset": 9}]},
            "c2": {"disconnected_at_ms": 1, "subscriptions": [{**sub, "start_offset": 7}]},
            "c3": {"disconnected_at_ms": 1, "subscriptions": [sub]},  # no start_offset
        },
    }  # fmt: skip
    (tmp_path / "config" / "sessions.json").write_text(json.dumps(doc))
    subs = {s.subscriber: s for s in subscribers(read_subscriptions(tmp_path), {})}
    assert (subs["c1"].start_offset, subs["c1"].committed) == (5, 9)
    assert (subs["c2"].start_offset, subs["c2"].committed) == (7, 7)
    assert (subs["c3"].start_offset, subs["c3"].committed) == (0, 0)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("sessions.json", "{not json"),
        ("sessions.json", '{"sessions": {"c": {"subscriptions": [{"queue": "q"}]}}}'),
        ("consumer_offsets.json", '{"offsets": {"g": {"q": "x"}}}'),
        ("consumer_offsets.json", "[]"),
    ],
)
def test_damaged_snapshots_are_clear_errors(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / name).write_text(text)
    with pytest.raises(SnapshotError, match=name):
        read_subscriptions(tmp_path)
        read_committed(tmp_path)


def test_pieces_from_the_account_alone(tmp_path: Path) -> None:
    """Clean sessions leave only account records: closed, ended by a crash, or resumed."""
    from analytics.snapshots import OPEN_END, pieces
    from store import FLAG_CLEAN, FLAG_CLOSED, FLAG_SHARED, AccountRecord

    def rec(sub: str, flags: int, start: int, acked: int, qend: int, t: int) -> AccountRecord:
        return AccountRecord(sub, "%LMQ%q", flags, 1, start, acked, acked, qend, t)

    account = [
        rec("c", FLAG_CLEAN, 0, 3, 5, 1),  # session 1: open record, then closed at end 8
        rec("c", FLAG_CLEAN | FLAG_CLOSED, 0, 7, 8, 2),
        rec("c", FLAG_CLEAN, 10, 12, 15, 3),  # session 2: never closed, not listed: a crash
        rec("$share/g", FLAG_SHARED, 0, 20, 30, 4),  # a group, resumed at 18 after a restart
        rec("$share/g", FLAG_SHARED, 18, 19, 31, 5),
    ]
    got = {(p.subscriber, p.start): p for p in pieces(tmp_path, [], {}, account)}
    assert [(p.start, p.end, p.acked, p.kind) for k, p in sorted(got.items()) if k[0] == "c"] == [
        (0, 8, 7, "clean"),
        (10, 15, 12, "clean"),
    ]
    first, resumed = got[("$share/g", 0)], got[("$share/g", 18)]
    assert (first.end, first.acked) == (18, 18)  # cut where the next key starts
    assert (resumed.end, resumed.acked, resumed.kind) == (OPEN_END, 20, "shared")  # carried
