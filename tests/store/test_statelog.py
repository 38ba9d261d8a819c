"""The state log (store/statelog.py): newest record per key, torn tails, atomic compaction."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from store import CorruptStoreError, StateLog, StoreError, read_state, read_state_records
from store.statelog import (
    COMPACT_MAX_LOGS,
    HEAD_SIZE,
    PREALLOCATE_BYTES,
    STATE_MAGIC,
    encode_record,
)
from tests.store.conftest import OpenStore


def _logs(d: Path) -> list[Path]:
    return sorted(d.glob("*.log"))


def test_newest_record_per_key_wins_and_deletes_remove(tmp_path: Path) -> None:
    log = StateLog.open(tmp_path / "s")
    log.append([("a", b"1"), ("b", b"2")])
    log.append([("a", b"3"), ("b", None), ("c", b"")])
    assert read_state(tmp_path / "s") == {"a": b"3", "c": b""}
    assert list(read_state_records(tmp_path / "s")) == [
        ("a", b"1"),
        ("b", b"2"),
        ("a", b"3"),
        ("b", None),
        ("c", b""),
    ]
    # Without preallocation (async flush mode) the log ends at its last record.
    (last,) = _logs(tmp_path / "s")
    assert last.stat().st_size == len(STATE_MAGIC) + log.written
    log.close()
    # Reopened after a clean close: the same state, the last log trusted without a scan,
    # and appends go on in a new generation.
    assert (tmp_path / "s" / "CLEAN").exists()
    log = StateLog.open(tmp_path / "s")
    assert log.recovered_records == 0 and log.truncated_bytes == 0
    assert not (tmp_path / "s" / "CLEAN").exists()
    log.append([("d", b"4")])
    log.close()
    assert read_state(tmp_path / "s") == {"a": b"3", "c": b"", "d": b"4"}
    assert read_state(tmp_path / "s", prefix="a") == {"": b"3"}


def test_a_torn_tail_record_is_truncated_at_recovery(tmp_path: Path) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d, preallocate=True)
    log.append([("keep", b"x" * 100)])
    log.sync()
    # A crash in the middle of the next write: only part of the record reached the file,
    # in front of the zero tail.
    (last,) = _logs(d)
    end = len(STATE_MAGIC) + len(encode_record("keep", b"x" * 100))
    whole = encode_record("lost", b"y" * 100)
    size_before = last.stat().st_size
    assert size_before > end + len(whole)  # the zero tail
    with open(last, "r+b") as f:
        f.seek(end)
        f.write(whole[: len(whole) // 2])
    # A reader (inspect, analytics) next to the writer stops at the partial record.
    assert read_state(d) == {"keep": b"x" * 100}
    log = StateLog.open(d)  # the previous writer "crashed": no close()
    assert log.truncated_bytes == len(whole) // 2
    assert log.zero_tail_bytes == size_before - end - len(whole) // 2
    assert last.stat().st_size == end
    log.append([("after", b"z")])
    log.close()
    assert read_state(d) == {"keep": b"x" * 100, "after": b"z"}


def test_a_tail_record_with_a_bad_crc_is_truncated(tmp_path: Path) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    log.append([("a", b"1")])
    log.append([("b", b"2")])
    log.sync()  # and then a crash: no close(), no CLEAN marker
    (last,) = _logs(d)
    data = bytearray(last.read_bytes())
    b_end = len(STATE_MAGIC) + len(encode_record("a", b"1")) + len(encode_record("b", b"2"))
    data[b_end - 1] ^= 0xFF  # the last byte of record "b"'s value: its write was cut short
    last.write_bytes(bytes(data))
    log = StateLog.open(d)
    assert log.truncated_bytes == HEAD_SIZE + 2
    log.close()
    assert read_state(d) == {"a": b"1"}


def test_a_zero_tail_left_by_a_crash_is_the_end_of_the_log(tmp_path: Path) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d, preallocate=True)
    records = [(f"k{i}", b"v" * i) for i in range(50)]
    for rec in records:
        log.append([rec])
    log.sync()
    # The log is allocated ahead of its appends: past the last record, zeros.
    (last,) = _logs(d)
    end = len(STATE_MAGIC) + sum(len(encode_record(k, v)) for k, v in records)
    assert last.stat().st_size >= len(STATE_MAGIC) + PREALLOCATE_BYTES > end
    assert not last.read_bytes()[end:].strip(b"\0")
    # A reader next to the writer, and a restart after a crash (no close), see every record.
    assert list(read_state_records(d)) == records
    log = StateLog.open(d, preallocate=True)
    assert log.recovered_records == len(records)
    assert log.truncated_bytes == 0 and log.zero_tail_bytes >= PREALLOCATE_BYTES - end
    assert last.stat().st_size == end  # cut, fsynced: the log is sealed at its last record
    log.append([("after", b"z")])
    log.close()
    assert list(read_state_records(d)) == [*records, ("after", b"z")]
    # Close cut the new log's zero tail before CLEAN recorded its size.
    assert last.stat().st_size == end
    newest = _logs(d)[-1]
    assert newest.stat().st_size == len(STATE_MAGIC) + len(encode_record("after", b"z"))
    assert (d / "CLEAN").read_text().split() == [newest.name, str(newest.stat().st_size)]


def test_a_roll_cuts_the_zero_tail_before_the_next_generation(tmp_path: Path) -> None:
    # A compaction cut short after its roll leaves the rolled log sealed, next to the new
    # one: it ends at its last record, not in zeros (zeros in a sealed log are damage).
    d = tmp_path / "s"
    log = StateLog.open(d, preallocate=True)
    log.append([("a", b"1"), ("b", b"2")])

    def crash() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        log.compact(step=crash)
    log.append([("c", b"3")])
    log.sync()  # and the process dies: no close()
    sealed, current = _logs(d)
    assert sealed.stat().st_size == len(STATE_MAGIC) + 2 * len(encode_record("a", b"1"))
    assert current.stat().st_size > len(STATE_MAGIC) + len(encode_record("c", b"3"))
    assert read_state(d) == {"a": b"1", "b": b"2", "c": b"3"}
    StateLog.open(d).close()
    assert read_state(d) == {"a": b"1", "b": b"2", "c": b"3"}


def test_zeros_in_a_sealed_log_are_damage(tmp_path: Path) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    log.append([("a", b"1")])
    log.close()
    StateLog.open(d).close()  # a second generation: the first is sealed
    first = _logs(d)[0]
    with open(first, "ab") as f:
        f.write(bytes(64))
    with pytest.raises(CorruptStoreError, match="bad record"):
        read_state(d)


def test_damage_in_a_sealed_log_is_an_error_not_a_silent_loss(tmp_path: Path) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    log.append([("a", b"1"), ("b", b"2")])
    log.close()
    StateLog.open(d).close()  # a second generation: the first is sealed
    first = _logs(d)[0]
    data = bytearray(first.read_bytes())
    data[len(STATE_MAGIC) + HEAD_SIZE] ^= 0xFF  # inside record "a"
    first.write_bytes(bytes(data))
    # Found by the reader (what a restart reads the state with), not cut off silently.
    with pytest.raises(CorruptStoreError, match="bad record"):
        read_state(d)


@pytest.mark.parametrize("child", [False, True])
def test_compaction_keeps_the_live_state_and_drops_history(tmp_path: Path, child: bool) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    for i in range(1000):
        log.append([(f"k{i % 10}", str(i).encode()), (f"gone{i}", b"x")])
        log.append([(f"gone{i}", None)])
    before = log.written
    log.compact(child=child)
    log.append([("k0", b"new")])
    files = sorted(p.name for p in d.iterdir())
    assert [f.split(".", 1)[1] for f in files] == ["log", "snapshot"]
    (snapshot,) = d.glob("*.snapshot")
    assert snapshot.stat().st_size < before / 10
    expected = {f"k{i}": str(990 + i).encode() for i in range(10)} | {"k0": b"new"}
    assert read_state(d) == expected
    log.close()
    log = StateLog.open(d)
    log.close()
    assert read_state(d) == expected


@pytest.mark.parametrize("child", [False, True])
def test_a_snapshot_holds_each_live_record_as_it_was_written(tmp_path: Path, child: bool) -> None:
    # Compaction copies the live records' bytes (no decoding, no encoding again): the snapshot
    # is what encode_record makes of them, in the order of their newest writes; keys compare
    # as bytes there, so a non-ASCII key is one key as it is for a reader.
    d = tmp_path / "s"
    log = StateLog.open(d)
    log.append([("ключ", b"1"), ("k", b"a"), ("x", b"gone"), ("", b"empty key")])
    log.append([("k", b"b"), ("x", None), ("ключ", b"2"), ("z", b"")])
    log.compact(child=child)
    log.close()
    (snapshot,) = d.glob("*.snapshot")
    live = [("", b"empty key"), ("k", b"b"), ("ключ", b"2"), ("z", b"")]
    assert snapshot.read_bytes() == STATE_MAGIC + b"".join(encode_record(k, v) for k, v in live)
    assert read_state(d) == dict(live)


def test_compaction_cut_short_before_its_rename_changes_nothing(tmp_path: Path) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    log.append([("a", b"1"), ("b", b"2")])
    log.close()
    # A crash while the snapshot was being written: a partial .tmp file is all it left.
    (d / f"{99:020d}.snapshot.tmp").write_bytes(STATE_MAGIC + b"\x00\x01")
    log = StateLog.open(d)
    assert not list(d.glob("*.tmp"))
    log.close()
    assert read_state(d) == {"a": b"1", "b": b"2"}


def test_compaction_crashed_after_its_rename_leaves_the_snapshot_authoritative(
    tmp_path: Path,
) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    log.append([("a", b"1"), ("b", b"2")])
    old = {p.name: p.read_bytes() for p in d.iterdir()}
    log.append([("b", None), ("c", b"3")])
    log.compact()
    log.close()
    # The crash came before the covered files were deleted: put an older one back.
    for name, data in old.items():
        (d / name).write_bytes(data)
    assert read_state(d) == {"a": b"1", "c": b"3"}  # readers skip it already
    StateLog.open(d).close()
    assert not (d / next(iter(old))).exists()
    assert read_state(d) == {"a": b"1", "c": b"3"}


@pytest.mark.parametrize("child", [False, True])
def test_appends_during_a_compaction_are_kept(tmp_path: Path, child: bool) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    for i in range(20_000):
        log.append([(f"k{i % 5000}", f"v{i}".encode())])
    errors: list[BaseException] = []

    def compact() -> None:
        try:
            log.compact(child=child)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=compact)
    t.start()
    for i in range(20_000, 30_000):
        log.append([(f"k{i % 5000}", f"v{i}".encode())])
        log.sync()  # sync and compaction switch files concurrently
    t.join(60)
    assert not errors
    log.close()
    assert read_state(d) == {f"k{i % 5000}": f"v{i}".encode() for i in range(25_000, 30_000)}


def test_a_compaction_in_a_child_reads_and_writes_there(tmp_path: Path) -> None:
    # The records' reading, decoding and encoding run in a child process (its CPU is a
    # waited-for child's), not in a thread that takes turns with an event loop for the GIL.
    d = tmp_path / "s"
    log = StateLog.open(d)
    for i in range(50_000):
        log.append([(f"k{i % 500}", b"%d" % i)])
    before = os.times()
    log.compact(child=True)
    after = os.times()
    assert after.children_user + after.children_system > (
        before.children_user + before.children_system
    )
    log.close()
    assert read_state(d) == {f"k{i % 500}": b"%d" % i for i in range(49_500, 50_000)}


def test_a_compaction_child_that_fails_leaves_the_old_files_authoritative(
    tmp_path: Path,
) -> None:
    d = tmp_path / "s"
    log = StateLog.open(d)
    log.append([("a", b"1"), ("b", b"2")])
    (sealed,) = _logs(d)
    log.sync()
    # Damage in a sealed log: the child's read of it fails (CorruptStoreError there).
    with open(sealed, "r+b") as f:
        f.seek(len(STATE_MAGIC) + 1)
        f.write(b"\xff")
    with pytest.raises(StoreError, match="snapshot child exited"):
        log.compact(child=True)
    assert not list(d.glob("*.tmp")) and not list(d.glob("*.snapshot"))
    assert sealed.exists() and log.needs_compaction() is False
    log.append([("c", b"3")])
    log.close()
    assert _logs(d)[0] == sealed


def test_a_compaction_child_ends_once_its_parent_is_gone() -> None:
    # Its step (every COMPACT_STEP records) checks the parent: the same one goes on, another
    # (the parent died and the child was re-parented) exits 1 at once.
    program = (
        "import os, sys; from store.statelog import _ParentWatch; "
        "_ParentWatch(os.getppid() + int(sys.argv[1]))(); print('on')"
    )
    kept = subprocess.run([sys.executable, "-c", program, "0"], capture_output=True, check=False)
    assert (kept.returncode, kept.stdout.strip()) == (0, b"on")
    gone = subprocess.run([sys.executable, "-c", program, "1"], capture_output=True, check=False)
    assert (gone.returncode, gone.stdout) == (1, b"")


def test_needs_compaction_after_many_reopenings(tmp_path: Path) -> None:
    d = tmp_path / "s"
    for _ in range(COMPACT_MAX_LOGS + 1):
        log = StateLog.open(d)
        log.append([("k", b"v")])
        log.close()
    log = StateLog.open(d)
    assert log.needs_compaction()
    log.compact()
    assert not log.needs_compaction()
    log.close()
    assert sorted(p.suffix for p in d.iterdir()) == ["", ".log", ".snapshot"]  # "": CLEAN


def test_sync_is_shared_by_concurrent_callers(tmp_path: Path) -> None:
    log = StateLog.open(tmp_path / "s")
    positions = [log.append([(f"k{i}", b"v")]) for i in range(10)]
    log.sync(positions[-1])
    assert log.synced == positions[-1]
    log.sync(positions[3])  # covered by the fsync above: returns at once
    assert log.synced == positions[-1]
    log.close()


def test_the_store_keeps_the_state_log_out_of_commitlog_retention(
    open_store: OpenStore, tmp_path: Path
) -> None:
    s = open_store(segment_size=4096, retention_bytes=8192)
    s.append_state([("session/a", b"{}")])
    for _i in range(200):
        s.put("t", b"x" * 200, queues=["q"])
    s.delete_expired()
    assert s.min_offset("q") > 0  # retention deleted messages
    s.close()
    s = open_store(read_only=True)
    assert dict((k, v) for k, v in s.state_records() if v is not None) == {"session/a": b"{}"}
    assert (tmp_path / "data" / "state").is_dir()


def test_a_read_only_store_cannot_append_state(open_store: OpenStore) -> None:
    open_store().close()
    s = open_store(read_only=True)
    with pytest.raises(Exception, match="read-only"):
        s.append_state([("k", b"v")])
