"""Store recovery A/B: the same store directory recovered by two source trees, alternating.

    python bench/recovery_ab.py --old /tmp/old-tree [--new .] [--messages N] [--pairs 5]

``bench/store_bench.py`` recovers a store it has just killed, so how much of the log its
"recovery after kill -9" phase re-validates depends on where the flusher's last checkpoint
fell before the kill (from nothing to about a second of appends): two runs differ in work,
not only in speed. Here one directory is built once (appended in batches of 64 by a child
process, as the bench does, then killed with SIGKILL) and every timed run recovers a fresh
copy of it, so both trees do exactly the same work. Two cases:

- ``kill -9``: the killed directory as it is (abort marker, the flusher's checkpoint);
- ``full rescan``: the same with the checkpoint and every consume queue deleted, so the whole
  log is validated and every unit re-dispatched.

Each run is a fresh process of the tree's own ``.venv/bin/python`` that imports that tree's
``store`` and reports ``time.process_time`` (all threads) around ``MessageStore.open`` and
around ``open`` + ``close`` (close waits for the flusher's first full flush, which writes the
rebuilt queue files). Runs alternate old/new, so host load falls on both alike. The on-disk
format must be the same in both trees (it is checked: the directories after recovery must
hold byte-identical consume-queue files).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run by a tree's venv: build a store and wait to be killed, or recover one and report CPU.
_BUILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from store import MessageStore, StoreConfig
n = int(sys.argv[3])
s = MessageStore.open(StoreConfig(data_dir=Path(sys.argv[2])))
body = bytes(range(100))
reqs = [(f"site{i % 4}", ("%LMQ%all", f"%LMQ%dev{i % 1000}", f"%LMQ%grp{i % 10}"), body, b"")
        for i in range(n)]
for k in range(0, n, 64):
    s.append_encoded(reqs[k : k + 64])
print("ok", flush=True)
time.sleep(3600)
"""

_RECOVER = """
import json, logging, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from store import MessageStore, StoreConfig
logging.disable(logging.WARNING)
c = time.process_time()
s = MessageStore.open(StoreConfig(data_dir=Path(sys.argv[2])))
c_open = time.process_time() - c
rep = s.recovery
s.close()
c_all = time.process_time() - c
print(json.dumps({"open": c_open, "open_close": c_all, "records": rep.records_scanned,
                  "units": rep.units_total}))
"""


def python_of(tree: Path) -> str:
    return str(tree / ".venv" / "bin" / "python")


def build(tree: Path, data: Path, n: int, settle_s: float) -> None:
    """Append ``n`` messages in a child of ``tree`` and SIGKILL it after ``settle_s``."""
    proc = subprocess.Popen(
        [python_of(tree), "-c", _BUILD, str(tree), str(data), str(n)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        time.sleep(settle_s)
    finally:
        proc.kill()
        proc.wait()
    if line.strip() != "ok":
        raise SystemExit("build child failed")


def recover(tree: Path, src: Path, work: Path) -> tuple[dict[str, float], str]:
    """Recover a fresh copy of ``src`` with ``tree``: CPU figures and a digest of the CQs."""
    copy = work / "run"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(src, copy)
    out = subprocess.run(
        [python_of(tree), "-c", _RECOVER, str(tree), str(copy)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    digest = hashlib.sha256()
    for f in sorted((copy / "consumequeue").rglob("*")):
        if f.is_file():
            digest.update(str(f.relative_to(copy)).encode() + b"\0" + f.read_bytes())
    result: dict[str, float] = json.loads(out.stdout)
    return result, digest.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="root of the old tree (with .venv)")
    ap.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds before the kill")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    work = Path(tempfile.mkdtemp(prefix="recovery-ab-", dir=args.dir))
    try:
        killed = work / "killed"
        build(trees["new"], killed, args.messages, args.settle)
        rescan = work / "rescan"
        shutil.copytree(killed, rescan)
        (rescan / "checkpoint").unlink(missing_ok=True)
        shutil.rmtree(rescan / "consumequeue")
        (rescan / "abort").touch()
        print(f"recovery A/B: {args.messages:,} messages x (parent + 3 light queues), "
              f"{args.pairs} pairs, CPU seconds (process_time) per run")  # fmt: skip
        for case, src in (("kill -9", killed), ("full rescan", rescan)):
            runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
            digests: set[str] = set()
            for i in range(args.pairs):
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for side in order:
                    res, digest = recover(trees[side], src, work)
                    runs[side].append(res)
                    digests.add(digest)
                    print(f"  {case:<12} {side}: open {res['open']:.3f}  open+close "
                          f"{res['open_close']:.3f}  ({res['records']:,} records)")  # fmt: skip
            if len(digests) != 1:
                print(f"ERROR: {case}: the trees wrote different consume-queue files")
                return 1
            for key in ("open", "open_close"):
                old = statistics.median(r[key] for r in runs["old"])
                new = statistics.median(r[key] for r in runs["new"])
                print(f"{case:<12} {key:<10} median old {old:.3f}  new {new:.3f}  "
                      f"new/old {new / old:.2f}")  # fmt: skip
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
