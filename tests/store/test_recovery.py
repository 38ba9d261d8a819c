"""Crash recovery: damaged copies of a live store recover to exactly the intact prefix.

A "crash" is a copy of the data directory taken while the store is open (abort marker
present, consume-queue units still in memory are missing, the checkpoint is whatever was last
written), then damaged the way a crash or a disk would damage it.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from store import GetStatus, MessageStore, PutResult, StoreConfig
from store import format as fmt
from tests.store.conftest import OpenStore

SEG = 8192
Sent = list[tuple[str, bytes, list[str]]]


def fill(s: MessageStore, n: int, start: int = 0, seed: int = 1) -> tuple[Sent, list[PutResult]]:
    rnd = random.Random(seed + start)
    sent: Sent = []
    results = []
    for i in range(start, start + n):
        topic = f"t{i % 2}"
        queues = rnd.sample([f"%LMQ%q{k}" for k in range(5)], rnd.randint(0, 3))
        body = b"m%05d-" % i + bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 300)))
        results.append(s.put(topic, body, queues, {"i": str(i)}))
        sent.append((topic, body, queues))
    return sent, results


def read_all(s: MessageStore, queue: str) -> list[bytes]:
    out: list[bytes] = []
    off = s.min_offset(queue)
    while True:
        g = s.get(queue, off, 64)
        if g.status is not GetStatus.FOUND:
            return out
        out += [m.body for m in g.messages]
        off = g.next_offset


def assert_exact_prefix(s: MessageStore, sent: Sent, k: int) -> None:
    """The store holds exactly messages [0, k) in every queue, in order."""
    expected: dict[str, list[bytes]] = {f"t{j}": [] for j in range(2)}
    expected.update({f"%LMQ%q{j}": [] for j in range(5)})
    for topic, body, queues in sent[:k]:
        expected[topic].append(body)
        for q in queues:
            expected[q].append(body)
    for queue, bodies in expected.items():
        assert read_all(s, queue) == bodies, queue
        assert s.max_offset(queue) == len(bodies), queue


def crash_copy(src: Path, dst: Path) -> Path:
    # The store is live: the flusher may write checkpoint.tmp and rename it away while we
    # copy. A temp file is never read by recovery, so the copy leaves them out.
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.tmp"))
    assert (dst / "abort").exists()
    return dst


def zero_from(data: Path, pos: int) -> None:
    seg = data / fmt.commitlog_path(pos // SEG * SEG)
    with open(seg, "r+b") as f:
        f.seek(pos % SEG)
        f.write(bytes(SEG - pos % SEG))
    for p in (data / "commitlog").iterdir():
        if int(p.name) > pos:
            p.unlink()


def cfg(path: Path) -> StoreConfig:
    return StoreConfig(data_dir=path, segment_size=SEG, cq_units_per_file=16,
                       flush_interval_ms=60_000)  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_torn_tail_at_random_points(open_store: OpenStore, tmp_path: Path, seed: int) -> None:
    s = open_store(segment_size=SEG, cq_units_per_file=16, flush_interval_ms=60_000)
    sent, res = fill(s, 30)
    s.flush()  # checkpoint covers the first 30
    more, res2 = fill(s, 40, start=30)
    sent += more
    res += res2
    crash = crash_copy(tmp_path / "data", tmp_path / f"crash{seed}")
    rnd = random.Random(seed)
    cut = rnd.randrange(res[30].physical_offset, res[-1].end_offset)
    if seed % 2:
        zero_from(crash, cut)
    else:  # the file itself is cut short (a crash while it grew)
        seg = crash / fmt.commitlog_path(cut // SEG * SEG)
        os.truncate(seg, cut % SEG)
        for p in (crash / "commitlog").iterdir():
            if int(p.name) > cut:
                p.unlink()
    k = sum(1 for r in res if r.end_offset <= cut)
    r = MessageStore.open(cfg(crash))
    try:
        assert r.recovery.abnormal
        assert_exact_prefix(r, sent, k)
        # Writing continues right after the prefix, with consistent offsets.
        nxt = r.put("t0", b"after", ["%LMQ%q0"])
        assert nxt.physical_offset <= max(cut, res[k - 1].end_offset if k else 0) + SEG
        assert read_all(r, "%LMQ%q0")[-1] == b"after"
    finally:
        r.close()
    r = MessageStore.open(cfg(crash))  # and a clean restart after the repair
    try:
        assert not r.recovery.abnormal
        assert read_all(r, "%LMQ%q0")[-1] == b"after"
    finally:
        r.close()


@pytest.mark.parametrize("seed", range(4))
def test_flipped_byte_cuts_at_that_record(
    open_store: OpenStore, tmp_path: Path, seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    s = open_store(segment_size=SEG, cq_units_per_file=16, flush_interval_ms=60_000)
    sent, res = fill(s, 20)
    s.flush()
    more, res2 = fill(s, 40, start=20)
    sent += more
    res += res2
    crash = crash_copy(tmp_path / "data", tmp_path / "crash")
    rnd = random.Random(seed)
    k = rnd.randrange(20, 60)
    pos = rnd.randrange(res[k].physical_offset, res[k].end_offset)
    seg = crash / fmt.commitlog_path(pos // SEG * SEG)
    with open(seg, "r+b") as f:
        f.seek(pos % SEG)
        b = f.read(1)[0]
        f.seek(pos % SEG)
        f.write(bytes([b ^ (1 << rnd.randrange(8))]))
    with caplog.at_level(logging.WARNING, logger="lmqtt.store"):
        r = MessageStore.open(cfg(crash))
    try:
        assert r.recovery.truncated_at == res[k].physical_offset
        assert "truncated at offset" in caplog.text
        assert_exact_prefix(r, sent, k)
    finally:
        r.close()


def test_deleted_consume_queue_files_are_rebuilt(open_store: OpenStore, tmp_path: Path) -> None:
    s = open_store(segment_size=SEG, cq_units_per_file=16, flush_interval_ms=60_000)
    sent, _ = fill(s, 80)
    s.flush()
    crash = crash_copy(tmp_path / "data", tmp_path / "crash")
    cq = crash / "consumequeue"
    files = sorted((cq / "t0" / "0").iterdir())
    assert len(files) >= 3
    files[1].unlink()  # a middle file of a parent queue
    shutil.rmtree(cq / "%LMQ%q3")  # a whole light queue
    (sorted((cq / "%LMQ%q1" / "0").iterdir()))[-1].unlink()  # the newest file of another
    r = MessageStore.open(cfg(crash))
    try:
        assert r.recovery.queues_rebuilt
        assert_exact_prefix(r, sent, 80)
    finally:
        r.close()
    # Without any checkpoint the whole log is re-dispatched.
    crash2 = crash_copy(tmp_path / "data", tmp_path / "crash2")
    shutil.rmtree(crash2 / "consumequeue")
    (crash2 / "checkpoint").unlink()
    r = MessageStore.open(cfg(crash2))
    try:
        assert r.recovery.records_scanned == 80
        assert_exact_prefix(r, sent, 80)
    finally:
        r.close()


def test_stale_checkpoint_and_queue_units_past_the_log_end(
    open_store: OpenStore, tmp_path: Path
) -> None:
    s = open_store(segment_size=SEG, cq_units_per_file=16, flush_interval_ms=60_000)
    sent, res = fill(s, 10)
    s.flush()
    old_checkpoint = (tmp_path / "data" / "checkpoint").read_bytes()
    more, res2 = fill(s, 50, start=10)
    sent += more
    res += res2
    s.flush()  # consume queues now hold units for all 60 records
    crash = crash_copy(tmp_path / "data", tmp_path / "crash")
    (crash / "checkpoint").write_bytes(old_checkpoint)
    cut = res[40].physical_offset + 7
    zero_from(crash, cut)
    r = MessageStore.open(cfg(crash))
    try:
        assert r.recovery.scan_start == res[10].physical_offset
        assert r.recovery.units_dropped > 0
        assert_exact_prefix(r, sent, 40)
    finally:
        r.close()


def test_garbage_checkpoint_and_crash_without_damage(open_store: OpenStore, tmp_path: Path) -> None:
    s = open_store(segment_size=SEG, cq_units_per_file=16, flush_interval_ms=60_000)
    sent, _ = fill(s, 25)
    crash = crash_copy(tmp_path / "data", tmp_path / "crash")
    (crash / "checkpoint").write_bytes(b"not a checkpoint at all, really" * 3)
    r = MessageStore.open(cfg(crash))
    try:
        assert r.recovery.abnormal and r.recovery.truncated_at is None
        assert_exact_prefix(r, sent, 25)
    finally:
        r.close()


CHILD = textwrap.dedent(
    """
    import sys
    from store import MessageStore, StoreConfig
    s = MessageStore.open(StoreConfig(data_dir=sys.argv[1], flush="sync", segment_size=65536))
    i = 0
    while True:
        s.put("t", b"msg-%06d" % i, ["%LMQ%a"] if i % 2 else ["%LMQ%b"])
        print(i, flush=True)
        i += 1
    """
)


def test_kill_9_loses_nothing_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
        text=True,
    )
    acked = -1
    deadline = time.monotonic() + 60
    try:
        assert proc.stdout is not None
        while acked < 300 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked = int(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert acked >= 300
    s = MessageStore.open(StoreConfig(data_dir=data, segment_size=65536))
    try:
        assert s.recovery.abnormal
        n = s.max_offset("t")
        assert n >= acked + 1
        assert read_all(s, "t") == [b"msg-%06d" % i for i in range(n)]
        assert read_all(s, "%LMQ%a") == [b"msg-%06d" % i for i in range(1, n, 2)]
        assert read_all(s, "%LMQ%b") == [b"msg-%06d" % i for i in range(0, n, 2)]
    finally:
        s.close()
