"""Store benchmark: lmqtt's CommitLog store against SQLite (WAL, batched transactions).

    python bench/store_bench.py [--messages N] [--batch 64] [--dir PATH]

Every message has a 100-byte body and is dispatched to its parent queue plus three light
queues (``%LMQ%all``, one of 1,000 device queues, one of 10 group queues). Phases:

1. append N messages with ``append_encoded`` in batches (what the gateway does per event-loop
   turn), in a child process that is then killed with SIGKILL (an unclean stop);
2. append N/5 messages with single ``put`` calls (reported separately);
3. recover the killed store (abort marker present, checkpoint as the flusher left it);
4. worst case: recover again with the checkpoint and every consume queue deleted, so the
   whole log is validated (magic, lengths, CRC) and 4 N units are re-dispatched;
5. read ``%LMQ%all`` back from offset 0 in batches of 32;
6. the same messages and index rows (parent + three light queues) into SQLite, then read the
   same light queue back.

Numbers depend on the machine and its load; run it on a quiet host. Next to every rate the
bench prints the same rate per CPU-second of this process (``time.process_time``, all threads,
kernel time included), which a shared machine's load distorts far less than wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from store import GetStatus, MessageStore, StoreConfig  # noqa: E402

BODY = bytes(range(100))


def queues_of(i: int) -> tuple[str, ...]:
    return ("%LMQ%all", f"%LMQ%dev{i % 1000}", f"%LMQ%grp{i % 10}")


def append_child(data_dir: str, n: int, batch: int) -> None:
    """Child process: append, report, then wait to be killed."""
    s = MessageStore.open(StoreConfig(data_dir=Path(data_dir)))
    reqs = [(f"site{i % 4}", queues_of(i), BODY, b"") for i in range(n)]
    t = time.perf_counter()
    c = time.process_time()
    if batch > 1:
        for k in range(0, n, batch):
            s.append_encoded(reqs[k : k + batch])
    else:
        for topic, queues, body, _props in reqs:
            s.put(topic, body, queues)
    dt = time.perf_counter() - t
    cpu = time.process_time() - c
    print(json.dumps({"seconds": dt, "cpu": cpu, "bytes": s.log_max_offset}), flush=True)
    time.sleep(3600)  # killed by the parent: no close(), no final checkpoint


def run_child(data_dir: Path, n: int, batch: int) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(data_dir), "--messages", str(n),
         "--batch", str(batch)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        # Give the flusher one interval so the kill lands on a typical state, not mid-write.
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if not line:
        raise SystemExit("append child failed")
    result: dict[str, float] = json.loads(line)
    return result


def timed_open(data_dir: Path) -> tuple[MessageStore, float, float]:
    """Open (and so recover) the store: ``(store, wall seconds, CPU seconds)``."""
    logging.getLogger("lmqtt.store").setLevel(logging.ERROR)
    t = time.perf_counter()
    c = time.process_time()
    s = MessageStore.open(StoreConfig(data_dir=data_dir))
    return s, time.perf_counter() - t, time.process_time() - c


def read_queue(s: MessageStore, queue: str) -> tuple[int, float, float]:
    """Read ``queue`` from 0 in batches of 32: ``(messages, wall seconds, CPU seconds)``."""
    t = time.perf_counter()
    c = time.process_time()
    off = 0
    n = 0
    while True:
        g = s.get(queue, off, 32)
        if g.status is not GetStatus.FOUND:
            break
        n += len(g.messages)
        off = g.next_offset
    return n, time.perf_counter() - t, time.process_time() - c


def sqlite_bench(path: Path, n: int, batch: int) -> tuple[float, float, int, float, float]:
    """``(write seconds, read seconds, messages read, write CPU seconds, read CPU seconds)``."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(
        "CREATE TABLE messages (id INTEGER PRIMARY KEY, topic TEXT, body BLOB, props TEXT,"
        " born INTEGER, stored INTEGER)"
    )
    db.execute(
        "CREATE TABLE queue_index (queue TEXT, qoffset INTEGER, msg_id INTEGER,"
        " PRIMARY KEY (queue, qoffset)) WITHOUT ROWID"
    )
    next_off: dict[str, int] = {}
    t = time.perf_counter()
    c = time.process_time()
    for k in range(0, n, batch):
        msgs = []
        rows = []
        now = int(time.time() * 1000)
        for i in range(k, min(n, k + batch)):
            topic = f"site{i % 4}"
            qs = queues_of(i)
            msgs.append((i, topic, BODY, ",".join(qs), now, now))
            for q in (topic, *qs):
                o = next_off.get(q, 0)
                next_off[q] = o + 1
                rows.append((q, o, i))
        db.execute("BEGIN")
        db.executemany("INSERT INTO messages VALUES (?,?,?,?,?,?)", msgs)
        db.executemany("INSERT INTO queue_index VALUES (?,?,?)", rows)
        db.execute("COMMIT")
    write_s = time.perf_counter() - t
    write_cpu = time.process_time() - c
    t = time.perf_counter()
    c = time.process_time()
    got = 0
    off = 0
    while True:
        page = db.execute(
            "SELECT m.topic, m.body, m.props, q.qoffset FROM queue_index q JOIN messages m"
            " ON m.id = q.msg_id WHERE q.queue = ? AND q.qoffset >= ? ORDER BY q.qoffset"
            " LIMIT 32",
            ("%LMQ%all", off),
        ).fetchall()
        if not page:
            break
        got += len(page)
        off = page[-1][3] + 1
    read_s = time.perf_counter() - t
    read_cpu = time.process_time() - c
    db.close()
    return write_s, read_s, got, write_cpu, read_cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=64, help="append_encoded batch (1: single puts)")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    ap.add_argument("--skip-sqlite", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        append_child(args.child, args.messages, args.batch)
        return 0
    n = args.messages
    work = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.dir))
    try:
        return run(work, n, args.batch, args.skip_sqlite)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, n: int, batch: int, skip_sqlite: bool) -> int:
    out: dict[str, float] = {}
    size_mb = 0.0

    def line(label: str, value: str) -> None:
        print(f"{label:<46} {value}", flush=True)

    print(f"lmqtt store bench: {n:,} messages x 100 B, parent + 3 light queues each")
    data = work / "lmqtt"
    res = run_child(data, n, batch)
    size_mb = res["bytes"] / 1e6
    out["append"] = n / res["seconds"]
    line(f"append, append_encoded({batch})", f"{out['append']:>12,.0f} msg/s  "
         f"{size_mb / res['seconds']:>8.1f} MB/s  ({n / res['cpu']:,.0f} msg/CPU-s)")  # fmt: skip
    single_n = max(1, n // 5)
    res1 = run_child(work / "single", single_n, 1)
    out["append_single"] = single_n / res1["seconds"]
    line("append, single put()", f"{out['append_single']:>12,.0f} msg/s  "
         f"{res1['bytes'] / 1e6 / res1['seconds']:>8.1f} MB/s  "
         f"({single_n / res1['cpu']:,.0f} msg/CPU-s)")  # fmt: skip
    shutil.rmtree(work / "single", ignore_errors=True)

    s, dt, cpu = timed_open(data)
    rep = s.recovery
    line("recovery after kill -9 (checkpoint)", f"{dt:>12.2f} s     "
         f"({rep.records_scanned:,} records re-validated, {cpu:.2f} CPU-s)")  # fmt: skip
    count = s.max_offset("%LMQ%all")
    s.close()
    if count != n:
        print(f"ERROR: %LMQ%all holds {count} messages after recovery, expected {n}")
        return 1
    (data / "checkpoint").unlink()
    shutil.rmtree(data / "consumequeue")
    (data / "abort").touch()
    s, dt, cpu = timed_open(data)
    out["recovery_full"] = dt
    line("recovery, full rescan + rebuild of all CQs", f"{dt:>12.2f} s     "
         f"({s.recovery.records_scanned:,} records, {n / dt:,.0f} msg/s, "
         f"{cpu:.2f} CPU-s)")  # fmt: skip
    got, rs, rcpu = read_queue(s, "%LMQ%all")
    s.close()
    if got != n:
        print(f"ERROR: read {got} messages from %LMQ%all, expected {n}")
        return 1
    out["read"] = got / rs
    line("read %LMQ%all, get(32)", f"{out['read']:>12,.0f} msg/s  "
         f"{got * 100 / 1e6 / rs:>8.1f} MB/s body ({got / rcpu:,.0f} msg/CPU-s)")  # fmt: skip
    if skip_sqlite:
        return 0
    sq_w, sq_r, sq_got, sq_cpu, sq_rcpu = sqlite_bench(work / "bench.sqlite", n, 1000)
    sq_mb = os.path.getsize(work / "bench.sqlite") / 1e6
    line("SQLite WAL append (1000/txn)", f"{n / sq_w:>12,.0f} msg/s  {sq_mb / sq_w:>8.1f} MB/s  "
         f"({n / sq_cpu:,.0f} msg/CPU-s)")  # fmt: skip
    line("SQLite read %LMQ%all (LIMIT 32)", f"{sq_got / sq_r:>12,.0f} msg/s  "
         f"{'':>13}({sq_got / sq_rcpu:,.0f} msg/CPU-s)")  # fmt: skip
    line("ratio append lmqtt/SQLite", f"{out['append'] / (n / sq_w):>12.1f} x  "
         f"(per CPU-s {(n / res['cpu']) / (n / sq_cpu):.1f} x)")  # fmt: skip
    line("ratio single-put lmqtt/SQLite", f"{out['append_single'] / (n / sq_w):>12.1f} x  "
         f"(per CPU-s {(single_n / res1['cpu']) / (n / sq_cpu):.1f} x)")  # fmt: skip
    line("ratio read lmqtt/SQLite", f"{out['read'] / (sq_got / sq_r):>12.1f} x  "
         f"(per CPU-s {(got / rcpu) / (sq_got / sq_rcpu):.1f} x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
