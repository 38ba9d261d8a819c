"""SIGKILL of a process while its state log compacts in a child (store/statelog.py
``compact(child=True)``), or a close meanwhile: the child ends, and the state reopens whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from store import StateLog, StoreError, read_state
from store.statelog import STATE_MAGIC, encode_record

ROOT = Path(__file__).resolve().parents[2]
KEYS = 20_000  # x ROUNDS records: a child reads 400,000 in its two passes
ROUNDS = 10

_PROGRAM = f"""
import sys
from pathlib import Path
from store import StateLog
log = StateLog.open(Path(sys.argv[1]))
for r in range({ROUNDS}):
    log.append([(f"k{{n}}", b"%d:%d" % (r, n)) for n in range({KEYS})])
log.sync()
print("synced", flush=True)
log.compact(child=True)
print("compacted", flush=True)
"""


def _snapshot_children(directory: Path) -> list[int]:
    """The snapshot children (statelog.snapshot_main) compacting `directory`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"snapshot_main" in cmdline and str(directory).encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def test_sigkill_while_a_child_compacts_loses_nothing_and_leaves_no_child(
    tmp_path: Path,
) -> None:
    d = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROGRAM, str(d)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "synced"
    deadline = time.monotonic() + 60
    children: list[int] = []
    while not children and time.monotonic() < deadline and proc.poll() is None:
        children = _snapshot_children(d)
    assert children, "no snapshot child seen"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    # Its step notices the parent is gone and exits, before it could finish the snapshot
    # (killed as it starts, it has ~400,000 records to read yet).
    while _snapshot_children(d) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _snapshot_children(d), "the snapshot child outlived its parent"
    full = len(STATE_MAGIC) + sum(
        len(encode_record(f"k{n}", b"%d:%d" % (ROUNDS - 1, n))) for n in range(KEYS)
    )
    assert all(p.stat().st_size < full for p in d.glob("*.snapshot.tmp"))
    log = StateLog.open(d)
    log.close()
    assert not list(d.glob("*.tmp"))
    assert read_state(d) == {f"k{n}": b"%d:%d" % (ROUNDS - 1, n) for n in range(KEYS)}


def test_close_during_a_child_compaction_ends_the_child_and_loses_nothing(
    tmp_path: Path,
) -> None:
    # A stop does not wait for a background compaction: close() kills the child, the
    # compaction fails (StoreError), the files it would have replaced stay authoritative.
    d = tmp_path / "state"
    log = StateLog.open(d)
    for r in range(ROUNDS):
        log.append([(f"k{n}", b"%d:%d" % (r, n)) for n in range(KEYS)])
    errors: list[BaseException] = []

    def compact() -> None:
        try:
            log.compact(child=True)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=compact)
    t.start()
    deadline = time.monotonic() + 60
    while not _snapshot_children(d) and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.001)
    assert _snapshot_children(d), "no snapshot child seen"
    log.close()
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], StoreError), errors
    assert not _snapshot_children(d)
    assert not list(d.glob("*.tmp")) and not list(d.glob("*.snapshot"))
    StateLog.open(d).close()
    assert read_state(d) == {f"k{n}": b"%d:%d" % (ROUNDS - 1, n) for n in range(KEYS)}
