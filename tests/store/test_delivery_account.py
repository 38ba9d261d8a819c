"""The delivery account files: round trip, reopen, torn tails, damage, rolling, retention."""

from __future__ import annotations

import os
from pathlib import Path

from store.commitlog import first_store_timestamp
from store.delivery_account import (
    ACCOUNT_DIR,
    FLAG_CLEAN,
    FLAG_CLOSED,
    NAMES_FILE,
    RANGES_FILE,
    RECORD_SIZE,
    AccountRecord,
    AccountWriter,
    ranges_files,
    read_account,
)
from tests.store.conftest import OpenStore


def _rec(sub: str, queue: str, acked: int, flags: int = 0, t: int = 1000) -> AccountRecord:
    return AccountRecord(sub, queue, flags, 1, 10, acked, acked + 1, acked + 5, t)


def test_round_trip_and_reopen(tmp_path: Path) -> None:
    assert read_account(tmp_path) == []
    w = AccountWriter(tmp_path)
    first = [_rec("dev-é", "%LMQ%a", 11), _rec("$share/g", "%LMQ%a", 12, FLAG_CLEAN)]
    assert w.append(first) == 2
    w.close()
    w = AccountWriter(tmp_path)  # names are read back: no id is reused
    second = [_rec("dev-é", "%LMQ%b", 13, FLAG_CLEAN | FLAG_CLOSED), _rec("new", "%LMQ%c", 14)]
    w.append(second)
    w.close()
    assert read_account(tmp_path) == first + second
    assert (tmp_path / ACCOUNT_DIR / RANGES_FILE).stat().st_size == 4 * RECORD_SIZE


def test_torn_tails_are_skipped_then_cut(tmp_path: Path) -> None:
    w = AccountWriter(tmp_path)
    w.append([_rec("a", "%LMQ%q", 1), _rec("b", "%LMQ%q", 2)])
    w.close()
    ranges = tmp_path / ACCOUNT_DIR / RANGES_FILE
    names = tmp_path / ACCOUNT_DIR / NAMES_FILE
    with open(ranges, "ab") as f:
        f.write(b"\x4c\x44\x41\x31" + bytes(20))  # half a record: a crash mid-write
    with open(names, "ab") as f:
        f.write(b"\x00\x00\x00\x09\x00\x10abc")  # half a name entry
    assert [r.subscriber for r in read_account(tmp_path)] == ["a", "b"]
    w = AccountWriter(tmp_path)  # cuts both tails, appends after them
    w.append([_rec("c", "%LMQ%q", 3)])
    w.close()
    assert [r.subscriber for r in read_account(tmp_path)] == ["a", "b", "c"]
    assert ranges.stat().st_size == 3 * RECORD_SIZE


def test_a_damaged_record_is_skipped(tmp_path: Path) -> None:
    w = AccountWriter(tmp_path)
    w.append([_rec("a", "%LMQ%q", 1), _rec("b", "%LMQ%q", 2), _rec("c", "%LMQ%q", 3)])
    w.close()
    ranges = tmp_path / ACCOUNT_DIR / RANGES_FILE
    fd = os.open(ranges, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff", RECORD_SIZE + 30)  # inside b's ACKED field
    finally:
        os.close(fd)
    assert [r.subscriber for r in read_account(tmp_path)] == ["a", "c"]


def test_ranges_roll_into_numbered_files_read_in_order(tmp_path: Path) -> None:
    w = AccountWriter(tmp_path, roll_bytes=2 * RECORD_SIZE)
    for i in range(3):
        w.append([_rec(f"s{i}", "%LMQ%q", 2 * i), _rec(f"s{i}", "%LMQ%q", 2 * i + 1)])
    w.close()
    files = ranges_files(tmp_path / ACCOUNT_DIR)
    assert [(seq, p.name) for seq, p in files] == [
        (0, RANGES_FILE), (1, "ranges.0000000001"), (2, "ranges.0000000002"),
    ]  # fmt: skip
    assert all(p.stat().st_size == 2 * RECORD_SIZE for _, p in files)
    w = AccountWriter(tmp_path, roll_bytes=2 * RECORD_SIZE)  # the last file is full: a new one
    w.append([_rec("s3", "%LMQ%q", 6)])
    w.close()
    assert [r.acked for r in read_account(tmp_path)] == list(range(7))
    assert len(ranges_files(tmp_path / ACCOUNT_DIR)) == 4


def test_retention_deletes_the_account_files_older_than_the_log(open_store: OpenStore) -> None:
    """Ranges files whose every record was written before the oldest message the store keeps
    go with the segments; a file with one younger record stays, and so does the writer's."""
    s = open_store(segment_size=4096, retention_hours=1)
    for i in range(60):
        s.put("t", b"%03d" % i + b"." * 200, ["%LMQ%a"])
    # What retention will keep: the last segment, whose first message is stored at `cut`.
    cut = first_store_timestamp(s.commitlog.segments[-1].path)
    assert cut is not None
    w = AccountWriter(s.data_dir, roll_bytes=2 * RECORD_SIZE)
    w.append([_rec("old", "%LMQ%a", 1, t=cut - 10), _rec("old", "%LMQ%a", 2, t=cut - 1)])
    w.append([_rec("mixed", "%LMQ%a", 3, t=cut - 1), _rec("mixed", "%LMQ%a", 4, t=cut)])
    w.append([_rec("old2", "%LMQ%a", 5, t=cut - 5), _rec("old2", "%LMQ%a", 6, t=cut - 1)])
    w.append([_rec("last", "%LMQ%a", 7, t=cut - 1)])  # the writer's file: never deleted
    root = s.data_dir / ACCOUNT_DIR
    assert len(ranges_files(root)) == 4
    assert s.delete_expired() == 0  # nothing expired: every file stays
    assert len(ranges_files(root)) == 4
    nsegs = len(s.commitlog.segments)
    now = os.path.getmtime(s.commitlog.segments[0].path) + 7200
    assert s.delete_expired(now=now) == nsegs - 1
    assert first_store_timestamp(s.commitlog.segments[0].path) == cut
    assert [seq for seq, _ in ranges_files(root)] == [1, 3]
    assert [r.subscriber for r in read_account(s.data_dir)] == ["mixed", "mixed", "last"]
    # The gateway's writer carries on in its file after retention.
    w.append([_rec("after", "%LMQ%a", 8, t=cut + 1)])
    w.close()
    assert [r.subscriber for r in read_account(s.data_dir)][-1] == "after"
