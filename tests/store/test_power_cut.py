"""Power-cut states the store must open: short segments, names whose directory was not synced.

These are the defects the crash simulator (tests/crash/) found or guards; each test here fails
on the store as it was before the fix (see the commit that added them).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store import CorruptStoreError, FlushMode, GetStatus, MessageStore, StoreConfig
from store import format as fmt
from store.statelog import fold_records

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
    s = MessageStore.open(StoreConfig(data_dir=data, segment_size=seg, flush=FlushMode.SYNC))
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


class _NameSpy:
    """Records, in order, every name change (create, rename, unlink) and every fsync the
    store makes, then does each for real: which name changes a directory fsync made durable."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        real_open, real_replace, real_unlink, real_fsync = os.open, os.replace, os.unlink, os.fsync

        def spy_open(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
            new = flags & os.O_CREAT and not os.path.exists(path)
            fd = real_open(path, flags, mode, **kw)
            if new:
                self.events.append(("create", os.path.abspath(path)))
            return fd

        def spy_replace(src: Any, dst: Any, **kw: Any) -> None:
            real_replace(src, dst, **kw)
            self.events.append(("rename", os.path.abspath(dst)))

        def spy_unlink(path: Any, **kw: Any) -> None:
            real_unlink(path, **kw)
            self.events.append(("unlink", os.path.abspath(path)))

        def spy_fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        monkeypatch.setattr(os, "open", spy_open)
        monkeypatch.setattr(os, "replace", spy_replace)
        monkeypatch.setattr(os, "unlink", spy_unlink)
        monkeypatch.setattr(os, "fsync", spy_fsync)

    def not_made_durable(self, kinds: tuple[str, ...] = ("rename", "unlink")) -> list[str]:
        """The name changes of these kinds that no later fsync of their directory covers."""
        out = []
        for i, (kind, path) in enumerate(self.events):
            parent = os.path.dirname(path)
            if kind in kinds and ("fsync", parent) not in self.events[i + 1 :]:
                out.append(f"{kind} {path}")
        return out


def test_retention_deletes_are_durable_before_it_returns(
    tmp_path: Path, stores: list[MessageStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before the fix no directory was fsynced after retention's unlinks: a cut could bring
    # back segments and queue files that the files kept no longer agree with.
    data = (tmp_path / "data").resolve()
    s = MessageStore.open(
        StoreConfig(data_dir=data, segment_size=4096, cq_units_per_file=4, retention_hours=1)
    )
    stores.append(s)
    for i in range(60):
        s.put("t", b"%03d" % i + b"." * 200, ["%LMQ%a"])
    s.flush()
    spy = _NameSpy(monkeypatch)
    assert s.delete_expired(now=os.path.getmtime(s.commitlog.segments[0].path) + 7200) > 1
    unlinked = {os.path.dirname(p) for k, p in spy.events if k == "unlink"}
    assert str(data / "commitlog") in unlinked
    assert any(d.startswith(str(data / "consumequeue")) for d in unlinked), unlinked
    assert not spy.not_made_durable(), spy.not_made_durable()


def test_a_zero_byte_state_log_left_by_a_cut_at_its_creation_opens(
    tmp_path: Path, stores: list[MessageStore]
) -> None:
    # A cut right after a generation's log was created in place: the create durable, the magic
    # not. Before the fix the next start created generation 1, then read generation 0 as a
    # sealed log: "not a state log file (bad magic)", at that start and every later one.
    data = tmp_path / "data"
    (data / "state").mkdir(parents=True)
    (data / "state" / "00000000000000000000.log").touch()
    (data / "offsets").mkdir()
    (data / "offsets" / "00000000000000000000.log").write_bytes(b"LMQ")  # magic cut short
    for restart in range(3):
        s = _open(stores, data)
        assert dict(fold_records(s.state_records())) == {f"k{i}": b"v" for i in range(restart)}
        assert s.offsets.all() == {("g", f"q{i}"): i for i in range(restart)}
        s.append_state([(f"k{restart}", b"v")])
        s.offsets.commit("g", f"q{restart}", restart)
        s.close()
        stores.remove(s)
    # A sealed log of the older format that is all zeros (the size reached the disk, the
    # magic did not) is empty too; damage inside a sealed log is still an error.
    (data / "state" / "00000000000000000000.log").write_bytes(bytes(5))
    s = _open(stores, data)
    assert len(dict(fold_records(s.state_records()))) == 3


def test_a_state_log_generation_appears_only_with_its_magic_synced(
    tmp_path: Path, stores: list[MessageStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every state-log file is created under a temporary name and renamed into place once its
    # header is fsynced; every rename and unlink there is made durable. Before the fix the log
    # was created in place (a cut could leave it empty under its real name).
    data = (tmp_path / "data").resolve()
    spy = _NameSpy(monkeypatch)
    s = _open(stores, data)
    s.append_state([("a", b"1")])
    s.rewrite_state()
    s.close()
    stores.remove(s)
    _open(stores, data)
    state_dirs = (str(data / "state"), str(data / "offsets"))
    created = [p for k, p in spy.events if k == "create" and p.startswith(state_dirs)]
    assert created and not [p for p in created if p.endswith((".log", ".snapshot"))], created
    renamed = [p for k, p in spy.events if k == "rename" and p.startswith(state_dirs)]
    for p in renamed:
        if p.endswith(".log"):
            tmp = p + ".tmp"
            i = spy.events.index(("rename", p))
            assert ("fsync", tmp) in spy.events[:i] or ("fsync", p) in spy.events[:i], p
    assert not spy.not_made_durable(), spy.not_made_durable()
