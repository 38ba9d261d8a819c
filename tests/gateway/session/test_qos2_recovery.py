"""Inbound QoS 2 ids read back from the log at a restart (gateway/session/qos2.py), on a real
embedded store."""

from __future__ import annotations

from pathlib import Path

from gateway.messages.records import message_properties
from gateway.protocol import Publish
from gateway.session.model import Session
from gateway.session.qos2 import InboundQos2
from gateway.storage.embedded import EmbeddedStorage
from store import StoreConfig


def _put(store: EmbeddedStorage, client_id: str, packet_id: int, qos: int = 2) -> None:
    pub = Publish("t/a", b"m%d" % packet_id, qos=qos, packet_id=packet_id)
    store.put("t", pub.payload, [], message_properties(pub, client_id))


def test_the_ids_past_each_crashed_sessions_log_pos_are_added(tmp_path: Path) -> None:
    store = EmbeddedStorage.open(StoreConfig(data_dir=tmp_path, segment_size=4096))
    assert isinstance(store, EmbeddedStorage)
    try:
        _put(store, "a", 1)  # below a's log_pos: its id was saved (or released) already
        a_pos = store.log_max_offset
        for i in range(40):  # other clients' traffic, across segments
            _put(store, "x", i % 7 + 1)
        _put(store, "a", 2)
        _put(store, "a", 3, qos=1)  # QoS 1: no exchange to complete
        _put(store, "b", 4)  # b was offline at the crash: never read for
        marks = InboundQos2(store)
        marks.saved = {"a": a_pos, "gone": 0}  # "gone": a session that did not come back
        a, b = Session("a", 4, 60), Session("b", 4, 60)
        assert marks.recover({"a": a, "b": b}) == 1
        assert a.qos2_inbound == {2} and b.qos2_inbound == set()
        assert marks.saved == {}  # once, at the start
    finally:
        store.close()


def test_a_publish_between_its_append_and_its_id_lowers_the_saved_position(
    tmp_path: Path,
) -> None:
    store = EmbeddedStorage.open(StoreConfig(data_dir=tmp_path))
    assert isinstance(store, EmbeddedStorage)
    try:
        marks = InboundQos2(store)
        _put(store, "a", 1)
        before = store.log_max_offset
        marks.storing("a", 2)
        _put(store, "a", 2)
        end = store.log_max_offset
        # A record of "a" saved now must let a restart find message 2 (its id not in it yet).
        assert marks.position("a", end) == before < end
        assert marks.position("b", end) == end
        marks.stored("a", 2)
        assert marks.position("a", end) == end
    finally:
        store.close()


def test_no_position_is_kept_where_the_log_does_not_read_back() -> None:
    marks = InboundQos2(object())  # e.g. RocketMQ: not a LogScan
    marks.storing("a", 1)
    assert marks.end() is None
    marks.saved = {"a": 0}
    assert marks.recover({"a": Session("a", 4, 60)}) == 0


def test_the_floor_bounds_the_read_for_an_idle_sessions_old_log_pos(tmp_path: Path) -> None:
    """An idle connected session's record is not rewritten, so its `log_pos` may be old; the
    floor recorded by a progress pass is where a restart starts reading instead."""
    store = EmbeddedStorage.open(StoreConfig(data_dir=tmp_path))
    assert isinstance(store, EmbeddedStorage)
    try:
        marks = InboundQos2(store)
        a_pos = store.log_max_offset  # "a" saved long ago, idle since
        _put(store, "a", 1)  # below the floor: its id reached a saved record (the floor says so)
        marks.storing("b", 9)  # "b" is between its append and its id joining
        b_mark = store.log_max_offset
        _put(store, "b", 9)
        floor = marks.floor_now()
        assert floor == b_mark  # lowered to the oldest PUBLISH still being stored
        marks.stored("b", 9)
        assert marks.floor_now() == store.log_max_offset
        _put(store, "a", 2)  # after the floor: the crash leaves its id nowhere else
        assert floor is not None
        marks.floor = floor
        marks.saved = {"a": a_pos}
        a = Session("a", 4, 60)
        assert marks.recover({"a": a}) == 1
        assert a.qos2_inbound == {2}  # 1, below the floor, is not read for
    finally:
        store.close()
