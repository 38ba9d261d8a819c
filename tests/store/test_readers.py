"""The record layout drawn in store/format.py, and the store's readers of its files.

The drawing is the documentation of the format and HEADER_LAYOUT the table every header
struct derives from: they must say the same. The readers (walk_records, segment_files,
first_store_timestamp, queue_extents, read_unit) are what tools without a store (analytics)
read the files with, so they are checked against what a real store wrote.
"""

from __future__ import annotations

import inspect
import re
import struct
from pathlib import Path

import pytest

from store import format as fmt
from store.commitlog import first_store_timestamp, segment_files
from store.consumequeue import queue_extents, read_unit
from store.statelog import StateLog, has_state_log, read_state
from tests.store.conftest import OpenStore, encoded


def test_the_drawn_layout_is_the_one_every_struct_derives_from() -> None:
    source = inspect.getsource(fmt)
    rows = re.findall(r"^#\s+(\d+)\s+(\d+)\s+([A-Z]+)\b", source, re.MULTILINE)
    drawn = [(int(off), int(size), name) for off, size, name in rows]
    derived = []
    for name, code in fmt.HEADER_LAYOUT:
        at = struct.calcsize(fmt.header_struct(name).format) - struct.calcsize(">" + code)
        derived.append((at, struct.calcsize(">" + code), name))
    # The drawing shows each host as one 8-byte field (address + port).
    merged: list[tuple[int, int, str]] = []
    for at, size, name in derived:
        if name in ("BORNPORT", "STOREPORT"):
            merged[-1] = (merged[-1][0], merged[-1][1] + size, merged[-1][2])
        else:
            merged.append((at, size, name))
    assert drawn == merged
    assert fmt.HEADER_SIZE == 88 and fmt.FIXED_OVERHEAD == 91 and fmt.MIN_RECORD_SIZE == 112


def test_header_structs_read_the_fields_they_name() -> None:
    rec = fmt.encode_record(
        topic="t", body=b"abc", queues=["%LMQ%a"], queue_offsets=[5], queue_offset=7,
        physical_offset=4096, born_timestamp=11, store_timestamp=22,
    )  # fmt: skip
    assert fmt.READ_FIELDS.unpack_from(rec) == (7, 11, 22, 3)
    assert fmt.DISPATCH_FIELDS.unpack_from(rec) == (len(rec), fmt.MAGIC, 7, 3)
    assert fmt.SCAN_FIELDS.unpack_from(rec) == (len(rec), fmt.MAGIC, 3)
    assert fmt.STORE_TIMESTAMP.unpack_from(rec) == (22,)
    assert fmt.HEADER.unpack_from(rec)[5:7] == (7, 4096)
    with pytest.raises(ValueError):
        fmt.header_struct("NOSUCHFIELD")


def test_walk_records_says_why_it_stopped() -> None:
    recs = [fmt.encode_record(topic="t", body=bytes(i)) for i in range(3)]
    data = b"".join(recs)
    ends = [sum(map(len, recs[: i + 1])) for i in range(3)]
    assert fmt.walk_records(data + bytes(64), 0, len(data) + 64, 10) == (
        [0, ends[0], ends[1]], ends[2], fmt.WALK_END,
    )  # fmt: skip
    assert fmt.walk_records(data, 0, len(data), 2) == ([0, ends[0]], ends[1], None)
    # A filler ends the data; a record cut by the limit runs beyond it; garbage is damage.
    filler = struct.pack(">iI", 64, fmt.BLANK_MAGIC) + bytes(56)
    assert fmt.walk_records(recs[0] + filler, 0, ends[0] + 64, 10)[2] == fmt.WALK_END
    assert fmt.walk_records(data, 0, len(data) - 1, 10) == ([0, ends[0]], ends[1], fmt.WALK_BEYOND)
    assert fmt.walk_records(recs[0] + b"GIF89a" + bytes(10), 0, ends[0] + 16, 10)[2] == (
        fmt.WALK_BAD
    )


def test_file_readers_agree_with_the_store(open_store: OpenStore, tmp_path: Path) -> None:
    s = open_store(segment_size=4096, cq_units_per_file=8)
    results = s.append_encoded(
        [
            encoded(s, "t", b"m%03d" % i + bytes(200), ["%LMQ%all", f"%LMQ%g{i % 2}"])
            for i in range(40)
        ]
    )
    s.flush()
    data = tmp_path / "data"
    files = segment_files(data / fmt.COMMITLOG_DIR)
    assert [start for start, _ in files] == [seg.start for seg in s.commitlog.segments]
    assert len(files) > 2
    first = s.message_at(results[0].physical_offset)
    assert first_store_timestamp(files[0][1]) == first.store_timestamp
    assert first_store_timestamp(data / "missing") is None
    root = data / fmt.CONSUMEQUEUE_DIR
    assert sorted(queue_extents(root)) == sorted(
        (q, s.min_offset(q), s.max_offset(q)) for q in s.queues()
    )
    for i in (0, 7, 8, 39):  # first unit, last of a file, first of the next, last
        r = results[i]
        assert read_unit(root, "%LMQ%all", i) == (
            r.physical_offset,
            r.end_offset - r.physical_offset,
        )
    assert read_unit(root, "%LMQ%all", 40) is None
    assert read_unit(root, "%LMQ%none", 0) is None


def test_has_state_log_sees_an_empty_log_too(tmp_path: Path) -> None:
    d = tmp_path / "state"
    assert not has_state_log(d)
    d.mkdir()
    (d / "notes.txt").write_text("not a state file")
    assert not has_state_log(d)
    log = StateLog.open(d)
    try:
        assert has_state_log(d)  # opened, nothing appended yet
        log.sync(log.append([("k", b"v")]))
        assert has_state_log(d) and read_state(d) == {"k": b"v"}
    finally:
        log.close()
