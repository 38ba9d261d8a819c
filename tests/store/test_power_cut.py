"""Power-cut states the store must open: short segments, names whose directory was not synced.

These are the defects the crash simulator (tests/crash/) found or guards; each test here fails
on the store as it was before the fix (see the commit that added them).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import CorruptStoreError, GetStatus, MessageStore, StoreConfig
from store import format as fmt

SEG = 64 * 1024


def _copy_unsynced(s: MessageStore, dest: Path) -> Path:
    """A crash before the first segment was ever synced: no checkpoint can be on disk yet
    (one is written only after an fsync of the whole log up to it)."""
    shutil.copytree(s.data_dir, dest, ignore=shutil.ignore_patterns(".lock", "lock"))
    (dest / fmt.CHECKPOINT_FILE).unlink(missing_ok=True)
    return dest


def _copy_live(s: MessageStore, dest: Path) -> Path:
    """The data directory as a crash would leave it: abort marker present, store still open."""
    s.flush()
    shutil.copytree(s.data_dir, dest)
    (dest / ".lock").unlink(missing_ok=True)
    return dest


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[MessageStore]]:
    opened: list[MessageStore] = []
    yield opened
    for s in opened:
        s.close()


def _open(stores: list[MessageStore], data: Path, seg: int = SEG) -> MessageStore:
    s = MessageStore.open(StoreConfig(data_dir=data, segment_size=seg, flush="sync"))
    stores.append(s)
    return s


def test_a_lone_zero_byte_segment_opens_at_the_configured_size(
    tmp_path: Path, stores: list[MessageStore]
) -> None:
    # A cut within milliseconds of the first segment's creation: its growth to full size was
    # not synced. Before the fix: "segments are 0 bytes" then ZeroDivisionError, every time.
    data = tmp_path / "data"
    (data / "commitlog").mkdir(parents=True)
    (data / "commitlog" / fmt.offset_file_name(0)).touch()
    (data / "abort").touch()
    s = _open(stores, data)
    assert s.commitlog.segment_size == SEG
    assert os.path.getsize(data / "commitlog" / fmt.offset_file_name(0)) == SEG
    r = s.put("t", b"after the cut", [])
    assert r.physical_offset == 0
    assert [m.body for m in s.get("t", 0).messages] == [b"after the cut"]


def test_a_zero_byte_segment_after_retention_opens(
    tmp_path: Path, stores: list[MessageStore]
) -> None:
    # The only segment left is not the first one (retention deleted the older ones).
    data = tmp_path / "data"
    (data / "commitlog").mkdir(parents=True)
    (data / "commitlog" / fmt.offset_file_name(3 * SEG)).touch()
    (data / "abort").touch()
    s = _open(stores, data)
    assert s.commitlog.segment_size == SEG
    assert s.put("t", b"x", []).physical_offset == 3 * SEG


def test_a_short_last_segment_keeps_its_records_and_the_configured_size(
    tmp_path: Path, stores: list[MessageStore]
) -> None:
    # Only the first 4 KiB (the records written) reached the disk, not the file's growth.
    # Before the fix the store silently took 4096 as its segment size: a 10 KiB message was
    # then "too large" and every later segment 4 KiB.
    live = _open(stores, tmp_path / "live")
    bodies = [b"m%03d" % i * 10 for i in range(12)]
    for b in bodies:
        live.put("t", b, ["%LMQ%q"])
    assert live.commitlog.write_pos < 4096
    crash = _copy_live(live, tmp_path / "crash")
    os.truncate(crash / "commitlog" / fmt.offset_file_name(0), 4096)
    s = _open(stores, crash)
    assert s.commitlog.segment_size == SEG
    assert [m.body for m in s.get("%LMQ%q", 0, 64).messages] == bodies
    big = bytes(10 * 1024)
    r = s.put("t", big, ["%LMQ%q"])
    assert s.get("%LMQ%q", r.light_offsets["%LMQ%q"]).messages[0].body == big


def test_a_short_segment_before_the_last_is_grown_and_the_log_ends_in_it(
    tmp_path: Path, stores: list[MessageStore]
) -> None:
    # The next segment's name reached the disk before this one's tail (async mode, or one
    # group commit spanning both): the log ends where this segment's synced bytes end, and
    # the later segment goes (nothing in it was acknowledged before this one's fsync).
    # Before the fix: "start offset is not a multiple of the size" (or ZeroDivisionError when
    # the first segment was 0 bytes), on every restart.
    live = _open(stores, tmp_path / "live")
    results = []
    while len(live.commitlog.segments) < 3:
        results.append(live.put("t", bytes(3000), []))
    crash = _copy_unsynced(live, tmp_path / "crash")
    os.truncate(crash / "commitlog" / fmt.offset_file_name(0), 16384)
    s = _open(stores, crash)
    assert s.commitlog.segment_size == SEG
    kept = [r for r in results if r.end_offset <= 16384]
    assert s.max_offset("t") == len(kept)
    assert s.recovery.truncated_at == kept[-1].end_offset
    assert [p.name for p in sorted((crash / "commitlog").iterdir())] == [fmt.offset_file_name(0)]
    assert s.put("t", b"next", []).queue_offset == len(kept)


def test_a_zero_byte_first_segment_before_others_opens(
    tmp_path: Path, stores: list[MessageStore]
) -> None:
    live = _open(stores, tmp_path / "live")
    while len(live.commitlog.segments) < 2:
        live.put("t", bytes(3000), [])
    crash = _copy_unsynced(live, tmp_path / "crash")
    os.truncate(crash / "commitlog" / fmt.offset_file_name(0), 0)
    s = _open(stores, crash)
    assert s.commitlog.segment_size == SEG and s.max_offset("t") == 0
    assert s.put("t", b"x", []).physical_offset == 0


def test_a_segment_larger_than_the_spacing_is_a_clear_error(
    tmp_path: Path, stores: list[MessageStore]
) -> None:
    live = _open(stores, tmp_path / "live")
    while len(live.commitlog.segments) < 2:
        live.put("t", bytes(3000), [])
    crash = _copy_live(live, tmp_path / "crash")
    os.truncate(crash / "commitlog" / fmt.offset_file_name(0), SEG + 4096)
    with pytest.raises(CorruptStoreError):
        _open(stores, crash)


class _FsyncSpy:
    """Records what each os.fsync call synced (by /proc/self/fd), then does it for real."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


def test_a_new_segment_name_is_synced_before_its_records_are_acknowledged(
    tmp_path: Path, stores: list[MessageStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _open(stores, tmp_path / "data")
    s.put("t", b"first", [])
    spy = _FsyncSpy(monkeypatch)
    while len(s.commitlog.segments) < 2:
        s.put("t", bytes(3000), [])  # sync mode: returns after the fsync covering it
    cl = str((tmp_path / "data" / "commitlog").resolve())
    second = f"{cl}/{fmt.offset_file_name(SEG)}"
    assert cl in spy.paths, f"commitlog/ never fsynced; fsynced: {sorted(set(spy.paths))}"
    assert second in spy.paths
    assert spy.paths.index(cl) < spy.paths.index(second)
    # The new segment was also really created on disk, not merely remembered.
    assert s.get("t", 0, 1).status is GetStatus.FOUND


def test_new_consume_queue_files_and_directories_are_synced_by_the_flush(
    tmp_path: Path, stores: list[MessageStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = (tmp_path / "data").resolve()
    s = MessageStore.open(StoreConfig(data_dir=data, cq_units_per_file=4))
    stores.append(s)
    spy = _FsyncSpy(monkeypatch)
    for i in range(6):  # two files in the light queue: the second created at unit 4
        s.put("parent", b"%d" % i, ["%LMQ%a/b"])
    s.flush()
    qdir = Path(s.queues_table.dir_of("%LMQ%a/b"))
    synced = set(spy.paths)
    for d in (data / "consumequeue", qdir.parent, qdir):
        assert str(d) in synced, f"{d} not fsynced; fsynced: {sorted(synced)}"
    for unit in (0, 4):
        assert f"{qdir}/{fmt.offset_file_name(unit * fmt.CQ_UNIT_SIZE)}" in synced
    # Names that were there already are not synced again by the next flush.
    spy.paths.clear()
    s.put("parent", b"6", ["%LMQ%a/b"])
    s.flush()
    assert str(qdir.parent) not in spy.paths
