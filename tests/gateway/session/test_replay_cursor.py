"""The replay cursor (gateway/session/replay.py) on a real store: store order across parent topics,
bounded read-ahead, the persisted position, retention underneath."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.messages.records import message_properties
from gateway.protocol import Publish
from gateway.session.model import SubscriptionState
from gateway.session.replay import HEADS_TOTAL, Replay, ReplayPacer, start_replay
from gateway.storage.cursor import QueueCursor
from gateway.storage.embedded import EmbeddedStorage
from store import StoreConfig
from topicmap import TopicFilter, parent_topic


def _open(config: StoreConfig) -> EmbeddedStorage:
    """The embedded store as the gateway's Storage (replays ask it for their history)."""
    s = EmbeddedStorage.open(config)
    assert isinstance(s, EmbeddedStorage)
    return s


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStorage]:
    s = _open(StoreConfig(data_dir=tmp_path / "data", segment_size=1 << 20))
    yield s
    s.close()


def _put(store: EmbeddedStorage, topic: str, i: int) -> int:
    props = message_properties(Publish(topic=topic, payload=b"%d" % i, qos=1, packet_id=1), "c")
    return store.put(parent_topic(topic), b"%d" % i, properties=props).physical_offset


def test_store_order_across_parents_and_bounded_read_ahead(store: EmbeddedStorage) -> None:
    expected = []
    for i in range(3000):
        topic = f"p{i % 7}/x" if i % 5 else "other/y"
        phys = _put(store, topic, i)
        if topic != "other/y":
            expected.append(phys)
    replay, cutoff = start_replay(store, TopicFilter("+/x"), 0, "earliest")
    assert cutoff is None
    # A wildcard first level spans every parent; `other/y` is filtered out message by message.
    assert sorted(replay.todo) == sorted({"other", *(parent_topic(f"p{k}/x") for k in range(7))})
    got = []
    most = 0
    while (msg := replay.peek(QueueCursor(store))) is not None:
        most = max(most, sum(len(h) for h in replay._heads.values()))
        if replay.record(msg) is not None:
            got.append(msg.physical_offset)
        replay.advance()
    assert got == expected
    assert most <= HEADS_TOTAL
    assert replay.done


def test_position_survives_serialisation_and_the_seam_is_pinned(store: EmbeddedStorage) -> None:
    for i in range(100):
        _put(store, "s/a", i)
    replay, _ = start_replay(store, TopicFilter("s/#"), 0, "earliest")
    for _ in range(40):
        assert replay.peek(QueueCursor(store)) is not None
        replay.advance()
    for i in range(100, 120):
        _put(store, "s/a", i)  # after the pin: the light queue's, not the replay's
    sub = SubscriptionState("s/#", "%LMQ%s.%23", None, 1, replay=replay)
    again = SubscriptionState.from_json(sub.to_json())
    assert again.replay is not None
    bodies = [m.body for m, _ in again.replay.messages(QueueCursor(store))]
    assert bodies == [b"%d" % i for i in range(40, 100)]
    assert "replay" not in SubscriptionState("a", "q", None, 0).to_json()


def test_retention_under_a_running_replay_moves_it_forward(tmp_path: Path) -> None:
    s = _open(StoreConfig(data_dir=tmp_path / "data", segment_size=4096, retention_bytes=2 * 4096))
    try:
        for i in range(20):
            _put(s, "r/t", i)
        replay, _ = start_replay(s, TopicFilter("r/t"), 0, "earliest")
        first = replay.peek(QueueCursor(s))
        assert first is not None and first.body == b"0"
        replay.advance()
        replay._heads.clear()  # as after a restart: nothing read ahead
        for i in range(20, 200):
            _put(s, "r/t", i)
        assert s.delete_expired() > 0
        lo = s.min_offset(parent_topic("r/t"))
        bodies = [m.body for m, _ in replay.messages(QueueCursor(s))]
        assert bodies == [b"%d" % i for i in range(lo, 20)]  # resumes at the oldest kept
    finally:
        s.close()


def test_until_bounds_the_export(store: EmbeddedStorage) -> None:
    for i in range(10):
        _put(store, "u/t", i)
    assert Replay.from_json({"filter": "u/t", "since_ms": 0, "todo": {}}).done
    replay, _ = start_replay(store, TopicFilter("u/t"), 0, "earliest", until_ms=0)
    assert replay.done and list(replay.messages(QueueCursor(store))) == []


def test_pacer_leaves_the_loop_its_share() -> None:
    pacer = ReplayPacer(share=0.25)
    assert pacer.wait() == 0.0
    started = time.monotonic() - 0.010
    pacer.spent(started)  # 10 ms of replay work just ended
    wait = pacer.wait()
    assert 0.025 < wait <= 3 * (time.monotonic() - started)  # 3 times as long without replays
