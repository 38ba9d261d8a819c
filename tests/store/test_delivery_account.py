"""The delivery account files: round trip, reopen, torn tails and damage."""

from __future__ import annotations

import os
from pathlib import Path

from store.delivery_account import (
    ACCOUNT_DIR,
    FLAG_CLEAN,
    FLAG_CLOSED,
    NAMES_FILE,
    RANGES_FILE,
    RECORD_SIZE,
    AccountRecord,
    AccountWriter,
    read_account,
)


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
