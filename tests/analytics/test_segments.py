"""The segment parser against the store's own writer and decoder, on real files."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analytics.errors import CorruptSegmentError, DataDirError
from analytics.segments import SegmentFile, SegmentParser, list_segments, read_segment_table
from store import MessageStore, StoreConfig, TimerQueue
from store import format as fmt
from tests.analytics.groundtruth import World


def _decoded(world: World) -> list[fmt.DecodedRecord]:
    """Every record as the store's own decoder sees it (the reference for the fast parser)."""
    out: list[fmt.DecodedRecord] = []
    for seg in list_segments(world.data_dir):
        data = Path(seg.path).read_bytes()
        out.extend(fmt.iter_records(data))
    return out


def test_every_column_matches_the_store_decoder(world: World) -> None:
    segments = list_segments(world.data_dir)
    assert len(segments) > 2, "small segments must have rolled"
    rows = [r for seg in segments for r in read_segment_table(seg).to_pylist()]
    ref = _decoded(world)
    assert len(rows) == len(ref) == len(world.messages)
    for row, rec, msg in zip(rows, ref, world.messages, strict=True):
        assert row["physical_offset"] == rec.physical_offset
        assert int(row["store_timestamp"].timestamp() * 1000) == rec.store_timestamp
        assert int(row["born_timestamp"].timestamp() * 1000) == rec.born_timestamp == msg.store_ms
        assert row["parent_topic"] == rec.topic == msg.topic.split("/")[0]
        assert row["topic"] == rec.properties["mqtt.topic"] == msg.topic
        assert row["client_id"] == msg.client_id
        assert row["qos"] == int(rec.properties["mqtt.qos"])
        assert row["retain"] is False
        assert row["body_size"] == len(rec.body) == msg.body_size
        assert row["queues"] == rec.queues == msg.queues
        assert row["queue_offsets"] == rec.queue_offsets == msg.offsets
        assert row["segment"] == rec.physical_offset - rec.physical_offset % 8192


def _store(tmp_path: Path, n: int, segment_size: int = 1 << 20, **props: str) -> Path:
    data = tmp_path / "data"
    s = MessageStore.open(StoreConfig(data_dir=data, segment_size=segment_size))
    try:
        for i in range(n):
            s.put(topic="t", body=bytes([i % 256]) * (i % 50), queues=[f"%LMQ%q{i % 3}"],
                  properties=dict(props))  # fmt: skip
    finally:
        s.close()
    return data


def test_messages_without_mqtt_properties_give_nulls(tmp_path: Path) -> None:
    data = _store(tmp_path, 5)
    rows = read_segment_table(list_segments(data)[0]).to_pylist()
    assert [r["topic"] for r in rows] == [None] * 5
    assert [r["client_id"] for r in rows] == [None] * 5
    assert [r["qos"] for r in rows] == [None] * 5
    assert [r["queues"] for r in rows] == [[f"%LMQ%q{i % 3}"] for i in range(5)]


def test_many_batches_and_a_body_that_looks_like_a_record(tmp_path: Path) -> None:
    data = tmp_path / "data"
    fake = fmt.encode_record(topic="x", body=b"inner", physical_offset=0)
    s = MessageStore.open(StoreConfig(data_dir=data))
    try:
        for i in range(300):
            s.put(topic="t", body=fake * (i % 3), properties={"mqtt.client": f"c{i}"})
    finally:
        s.close()
    parser = SegmentParser(list_segments(data)[0], batch_rows=64)
    rows = [r for b in parser.batches() for r in b.to_pylist()]
    assert [r["client_id"] for r in rows] == [f"c{i}" for i in range(300)]
    assert [r["body_size"] for r in rows] == [len(fake) * (i % 3) for i in range(300)]
    assert parser.records == 300


def test_live_store_is_read_up_to_what_was_written(tmp_path: Path) -> None:
    data = tmp_path / "data"
    s = MessageStore.open(StoreConfig(data_dir=data))
    try:
        for _i in range(10):
            s.put(topic="t", body=b"x", properties={"mqtt.client": "live"})
        first = sum(len(read_segment_table(seg)) for seg in list_segments(data))
        for _i in range(5):
            s.put(topic="t", body=b"y", properties={"mqtt.client": "live"})
        second = sum(len(read_segment_table(seg)) for seg in list_segments(data))
    finally:
        s.close()
    assert (first, second) == (10, 15)


def _active(data: Path) -> SegmentFile:
    return list_segments(data)[-1]


def test_torn_tail_of_the_active_segment_is_the_end_not_an_error(tmp_path: Path) -> None:
    data = _store(tmp_path, 20)
    seg = _active(data)
    full = SegmentParser(seg)
    rows = sum(b.num_rows for b in full.batches())
    end = full.end_offset - seg.start_offset
    last_start = read_segment_table(seg).column("physical_offset")[-1].as_py()
    # Tear the last record: keep its header but zero the rest, as a crash mid-write would.
    with open(seg.path, "r+b") as f:
        f.seek(last_start + 8)
        f.write(b"\0" * (end - last_start - 8))
    torn = SegmentParser(seg)
    assert sum(b.num_rows for b in torn.batches()) == rows - 1
    assert torn.end_offset == seg.start_offset + last_start


def test_corrupt_sealed_segment_raises_with_its_offset(tmp_path: Path) -> None:
    data = _store(tmp_path, 400, segment_size=4096)
    segments = list_segments(data)
    sealed = segments[1]
    assert sealed.sealed
    rows = read_segment_table(sealed)
    victim = rows.column("physical_offset")[3].as_py() - sealed.start_offset
    with open(sealed.path, "r+b") as f:
        f.seek(victim + fmt.OFF_BODY)  # one body byte: only the CRC can notice
        byte = f.read(1)
        f.seek(victim + fmt.OFF_BODY)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptSegmentError) as err:
        read_segment_table(sealed)
    assert err.value.offset == sealed.start_offset + victim
    assert "CRC" in str(err.value)
    # Not strict: the valid prefix.
    assert len(read_segment_table(sealed, strict=False)) == 3


def test_bad_magic_in_a_sealed_segment_is_corruption(tmp_path: Path) -> None:
    data = _store(tmp_path, 400, segment_size=4096)
    sealed = list_segments(data)[0]
    with open(sealed.path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack(">I", 0x12345678))
    with pytest.raises(CorruptSegmentError, match="bad magic 0x12345678"):
        read_segment_table(sealed)


def test_missing_or_foreign_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DataDirError, match="does not exist"):
        list_segments(tmp_path / "nope")
    with pytest.raises(DataDirError, match="not an lmqtt store"):
        list_segments(tmp_path)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cut=st.integers(min_value=0, max_value=4000),
    noise=st.binary(min_size=0, max_size=64),
    at=st.integers(min_value=0, max_value=4000),
)
def test_damaged_active_segment_yields_a_valid_prefix(
    tmp_path_factory: pytest.TempPathFactory, cut: int, noise: bytes, at: int
) -> None:
    base = tmp_path_factory.mktemp("h")
    seg_path = base / "commitlog" / fmt.offset_file_name(0)
    seg_path.parent.mkdir(parents=True)
    records = [
        fmt.encode_record(topic="t", body=bytes(i), properties={"mqtt.client": f"c{i}"},
                          queues=[f"%LMQ%{i}"], queue_offsets=[i], physical_offset=0)
        for i in range(40)
    ]  # fmt: skip
    blob = bytearray(b"".join(records))[: max(0, len(b"".join(records)) - cut)]
    blob[at : at + len(noise)] = noise
    seg_path.write_bytes(bytes(blob))
    seg = list_segments(base)[0]
    table = read_segment_table(seg)  # active segment: never raises
    # Every row returned is a record that was written, in order, from the start.
    clients = table.column("client_id").to_pylist()
    assert clients == [f"c{i}" for i in range(len(clients))]
    os.unlink(seg_path)


def test_a_delayed_message_is_a_row_once_when_it_fired(tmp_path: Path) -> None:
    """The store's timer records (store/timer.py) are no rows: a delayed message counts once,
    under its topic, at the time it fired; one still waiting not at all."""
    data = tmp_path / "data"
    s = MessageStore.open(StoreConfig(data_dir=data))
    try:
        timers = TimerQueue(s)
        timers.recover()
        props = {"mqtt.topic": "d/a", "mqtt.client": "pub"}
        asyncio.run(timers.schedule(b"fires", props, 1))
        asyncio.run(timers.schedule(b"waits", {**props, "mqtt.topic": "d/b"}, 1 << 50))
        s.put(topic="d", body=b"plain", properties={**props, "mqtt.topic": "d/c"})
        (due,) = timers.due(2)
        m = timers.message(due)
        fired = timers.fire(due, "d", ("%LMQ%d",), m.body, m.properties)
    finally:
        s.close()
    rows = read_segment_table(list_segments(data)[0]).to_pylist()
    assert [(r["parent_topic"], r["topic"]) for r in rows] == [("d", "d/c"), ("d", "d/a")]
    assert rows[1]["physical_offset"] == fired.physical_offset
    assert rows[1]["queues"] == ["%LMQ%d", "%TIMER_FIRED%"]
