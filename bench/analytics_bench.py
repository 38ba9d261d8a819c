"""Analytics benchmark: records/s through the lmqtt-commitlog source, full fan-out report time
with a warm JVM, and the speed-up of compacted (Parquet) segments.

    python bench/analytics_bench.py [--messages N] [--data-dir D] [--segment-size BYTES]
                                    [--window FROM,TO]

The store is generated once per size (reused when it exists) with the store's own record
writer (store.format.append_record, the bytes MessageStore appends), 1,000 devices publishing
`site/<k>/dev/<d>/temp` with 100-byte bodies to light queues of wildcard filters, and the
gateway's sessions.json / consumer_offsets.json for 60 subscribers (some lagging, one shared
group), a delivery account of 50 clean-session clients that came and went, plus the consume
queues (built once from the segments if missing, as the store's dispatch would). Targets
(10,000,000 messages, 2 cores): >= 300,000 records/s raw, full report <= 90 s, compacted
re-scan >= 5x faster. The pruned line times a --since/--until report over a slice of the store
time (--window, fractions of the span, default 0.2,0.3); it reads the window's segments plus the
backlog's tail (from the oldest uncommitted message).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

# Run from the project root's view: bench/ holds modules (e.g. profile) that shadow the stdlib.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from store import format as fmt  # noqa: E402 (after the sys.path fix above)
from topicmap import queue_name, record  # noqa: E402

DEVICES = 1000
ACCOUNT_VERSION = 1  # the generated delivery account's shape (bumped: regenerate)
CLEAN_SESSIONS = 4
SAMPLES = 5
T0_MS = 1_700_000_000_000
SITES = 50


def _filters() -> list[str]:
    return ["site/+/dev/+/temp", *(f"site/{k}/#" for k in range(SITES))]


def generate(data_dir: Path, n: int, segment_size: int) -> None:
    """Write n records into segment files exactly as the store lays them out."""
    marker = data_dir / "bench-complete.json"
    if marker.exists() and json.loads(marker.read_text()) == {
        "n": n,
        "seg": segment_size,
        "account": ACCOUNT_VERSION,
    }:
        print(f"reusing {n:,} messages in {data_dir}")
        return
    shutil.rmtree(data_dir, ignore_errors=True)
    (data_dir / "commitlog").mkdir(parents=True)
    (data_dir / "config").mkdir()
    all_q = queue_name("site/+/dev/+/temp")
    site_q = [queue_name(f"site/{k}/#") for k in range(SITES)]
    dev_q = {d: queue_name(f"site/{d % SITES}/dev/{d}/temp") for d in range(0, DEVICES, 100)}
    offsets: dict[str, int] = {}
    body = bytes(100)
    started = time.monotonic()
    seg_start = 0
    buf = bytearray(segment_size)
    pos = 0
    t0 = T0_MS

    def flush_segment(last: bool) -> None:
        nonlocal buf, pos, seg_start
        if not last:
            # Blank filler: [remaining][BLANK_MAGIC], as CommitLog writes at a roll.
            fmt.SIZE_MAGIC.pack_into(buf, pos, segment_size - pos, fmt.BLANK_MAGIC)
        (data_dir / "commitlog" / fmt.offset_file_name(seg_start)).write_bytes(buf)
        seg_start += segment_size
        buf = bytearray(segment_size)
        pos = 0

    for i in range(n):
        d = i % DEVICES
        k = d % SITES
        topic = f"site/{k}/dev/{d}/temp"
        queues = [all_q, site_q[k]]
        if d in dev_q:
            queues.append(dev_q[d])
        offs = []
        for q in queues:
            o = offsets.get(q, 0)
            offs.append(o)
            offsets[q] = o + 1
        props = fmt.encode_properties(
            {record.TOPIC: topic, record.QOS: "1", record.RETAIN: "0", record.CLIENT: f"dev-{d}"}
        )
        ts = t0 + i // 100  # 100 messages per ms of store time
        rec = bytearray()
        for _ in range(2):  # a second try in a fresh segment
            room = segment_size - fmt.END_FILE_MIN_BLANK_LENGTH - pos
            size = fmt.append_record(
                rec, room, i, seg_start + pos, ts, ts, body, b"\x04site", props,
                fmt.inner_head(queues), tuple(offs),
            )  # fmt: skip
            if size >= 0:
                break
            flush_segment(last=False)
        buf[pos : pos + size] = rec
        pos += size
        if i and i % 1_000_000 == 0:
            print(f"  generated {i:,} ({i / (time.monotonic() - started):,.0f}/s)")
    flush_segment(last=True)
    # 60 subscribers: one per site filter (every 5th lagging by half), the all-queue filter
    # held by a shared group of two, and per-device subscribers.
    sessions: dict[str, dict[str, object]] = {}
    committed: dict[str, dict[str, int]] = {}
    for k in range(SITES):
        q = site_q[k]
        end = offsets.get(q, 0)
        client = f"sub-site-{k}"
        sessions[client] = _session([(f"site/{k}/#", q, None)], online=k % 5 != 0)
        committed[client] = {q: end // 2 if k % 5 == 0 else end}
    for m in ("m1", "m2"):
        sessions[m] = _session([("$share/all/site/+/dev/+/temp", all_q, "all")], online=True)
    committed["$share/all"] = {all_q: offsets[all_q] - 1000}
    for d, q in dev_q.items():
        client = f"watch-{d}"
        sessions[client] = _session([(f"site/{d % SITES}/dev/{d}/temp", q, None)], online=True)
        committed[client] = {q: offsets.get(q, 0)}
    (data_dir / "config" / "sessions.json").write_text(
        json.dumps({"version": 1, "sessions": sessions})
    )
    (data_dir / "config" / "consumer_offsets.json").write_text(
        json.dumps({"version": 1, "offsets": committed})
    )
    _clean_sessions(data_dir, site_q, offsets, n)
    marker.write_text(json.dumps({"n": n, "seg": segment_size, "account": ACCOUNT_VERSION}))
    print(f"generated {n:,} messages in {time.monotonic() - started:.1f}s")


def _clean_sessions(data_dir: Path, site_q: list[str], offsets: dict[str, int], n: int) -> None:
    """The delivery account of clean sessions: per site filter, one client that connected
    CLEAN_SESSIONS times over the span (each session its own range, the last one still open),
    sampled SAMPLES times per session, as the gateway writes it (store.delivery_account)."""
    from store import FLAG_CLEAN, FLAG_CLOSED, AccountRecord, AccountWriter

    span_ms = n // 100
    writer = AccountWriter(data_dir)
    for k, q in enumerate(site_q):
        end = offsets.get(q, 0)
        cut = [end * i // CLEAN_SESSIONS for i in range(CLEAN_SESSIONS + 1)]
        records = []
        for i in range(CLEAN_SESSIONS):
            lo, hi = cut[i], cut[i + 1]
            last = i == CLEAN_SESSIONS - 1
            for j in range(1, SAMPLES + 1):
                seen = lo + (hi - lo) * j // SAMPLES
                closing = j == SAMPLES and not last
                records.append(
                    AccountRecord(
                        f"clean-site-{k}", q, FLAG_CLEAN | (FLAG_CLOSED if closing else 0), 1,
                        lo, max(lo, seen - 10), seen, seen,
                        T0_MS + span_ms * seen // max(1, end),
                    )
                )  # fmt: skip
        writer.append(records)
    writer.close()


def _cq_of_segment(path: str, start: int, sealed: bool) -> dict[str, tuple[bytes, int]]:
    """The consume-queue units of one segment's records: queue -> (units, first offset)."""
    import numpy as np
    import pyarrow.compute as pc

    from analytics.segments import SegmentFile, SegmentParser

    seg = SegmentFile(path, start, os.path.getsize(path), sealed)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    unit = np.dtype([("phys", ">i8"), ("size", ">i4"), ("tag", ">i8")])
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for batch in SegmentParser(seg).batches():
        phys = batch.column("physical_offset").to_numpy()
        rel = phys - start
        head = raw[rel[:, None] + np.arange(4)].astype(np.int64)  # TOTALSIZE, big-endian
        sizes = (head << np.array([24, 16, 8, 0])).sum(axis=1)
        queues = batch.column("queues")
        owner = pc.list_parent_indices(queues).to_numpy()
        names = queues.flatten().dictionary_encode()
        offs = batch.column("queue_offsets").flatten().to_numpy()
        codes = names.indices.to_numpy()
        for code, name in enumerate(names.dictionary.to_pylist()):
            hit = codes == code
            rows = np.zeros(int(hit.sum()), dtype=unit)
            rows["phys"] = phys[owner[hit]]
            rows["size"] = sizes[owner[hit]]
            parts.setdefault(name, []).append((offs[hit], rows))
    out = {}
    for name, chunks in parts.items():
        offs = np.concatenate([o for o, _ in chunks])
        rows = np.concatenate([r for _, r in chunks])  # (native byte order now)
        assert (np.diff(offs) == 1).all(), f"{name}: queue offsets not contiguous"
        out[name] = (rows.astype(unit).tobytes(), int(offs[0]))  # concatenate made it native
    return out


def ensure_consume_queues(data_dir: Path) -> None:
    """Write consume-queue files for every light queue (once; two processes)."""
    from multiprocessing import get_context

    marker = data_dir / "bench-consumequeue.json"
    if marker.exists():
        return
    started = time.monotonic()
    shutil.rmtree(data_dir / fmt.CONSUMEQUEUE_DIR, ignore_errors=True)
    files = sorted((data_dir / fmt.COMMITLOG_DIR).iterdir())
    jobs = [(str(f), int(f.name), i < len(files) - 1) for i, f in enumerate(files)]
    queues: dict[str, list[tuple[int, bytes]]] = {}
    with get_context("fork").Pool(2) as pool:
        for part in pool.starmap(_cq_of_segment, jobs):
            for name, (units, first) in part.items():
                queues.setdefault(name, []).append((first, units))
    per_file = fmt.CQ_UNITS_PER_FILE * fmt.CQ_UNIT_SIZE
    for name, chunks in queues.items():
        chunks.sort()
        data = b"".join(u for _, u in chunks)
        assert chunks[0][0] == 0 and len(data) % fmt.CQ_UNIT_SIZE == 0
        for at in range(0, len(data), per_file):
            path = data_dir / fmt.consumequeue_path(name, at // fmt.CQ_UNIT_SIZE)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[at : at + per_file])
    marker.write_text(json.dumps({"queues": len(queues)}))
    print(f"built consume queues of {len(queues)} queues in {time.monotonic() - started:.1f}s")


def _session(subs: list[tuple[str, str, str | None]], online: bool) -> dict[str, object]:
    return {
        "protocol_level": 5,
        "expiry_interval": 3600,
        "disconnected_at_ms": None if online else 1,
        "subscriptions": [
            {"filter": f, "queue": q, "share_group": g, "qos": 1, "start_offset": 0}
            for f, q, g in subs
        ],
        "qos2_inbound": [],
        "inflight": [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000_000)
    parser.add_argument("--data-dir", default="/tmp/lmqtt-analytics-bench")
    parser.add_argument("--segment-size", type=int, default=64 << 20)
    parser.add_argument("--out", default=None, help="report dir (default: <data-dir>-reports)")
    parser.add_argument("--window", default="0.2,0.3", help="pruned report's slice of the span")
    args = parser.parse_args()
    data = Path(args.data_dir) / f"n{args.messages}"
    out = Path(args.out or f"{args.data_dir}-reports") / f"n{args.messages}"
    generate(data, args.messages, args.segment_size)
    ensure_consume_queues(data)

    from analytics.compaction import COMPACTED_DIR, compact
    from analytics.fanout import load_messages, run_fanout
    from analytics.segments import SegmentParser, list_segments
    from analytics.spark import get_spark, stop_spark

    segments = list_segments(data)
    results: dict[str, float] = {"messages": args.messages, "segments": len(segments)}

    t = time.monotonic()
    rows = 0
    for seg in segments[:2]:
        for batch in SegmentParser(seg).batches():
            rows += batch.num_rows
    dt = time.monotonic() - t
    results["parser_records_per_s_1core"] = rows / dt
    print(f"parser, one process:        {rows / dt:12,.0f} records/s ({rows:,} records)")

    t = time.monotonic()
    spark = get_spark()
    results["spark_start_s"] = time.monotonic() - t
    print(f"Spark start:                {results['spark_start_s']:12.1f} s")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    def scan(df) -> tuple[int, float]:  # type: ignore[no-untyped-def]
        t = time.monotonic()
        row = df.selectExpr("count(*) n", "sum(body_size) b", "sum(size(queues)) q").collect()[0]
        return int(row.n), time.monotonic() - t

    # A DataFrameReader's options stick to it: a fresh reader per read.
    first = str(segments[0].start_offset)
    scan(spark.read.format("lmqtt-commitlog").option("segments", first).load(str(data)))  # warm
    n, dt = scan(spark.read.format("lmqtt-commitlog").load(str(data)))
    assert n == args.messages, (n, args.messages)
    results["source_records_per_s"] = n / dt
    results["raw_scan_s"] = dt
    print(f"data source, raw segments:  {n / dt:12,.0f} records/s ({dt:.1f} s)")

    t = time.monotonic()
    meta = run_fanout(spark, data, out)
    results["report_raw_s"] = time.monotonic() - t
    print(f"full fan-out report (raw):  {results['report_raw_s']:12.1f} s "
          f"({meta.devices:,} devices, {meta.deliveries:,} deliveries)")  # fmt: skip

    # A --since/--until report: the generator's store time runs 100 messages per ms from T0.
    lo_f, hi_f = (float(x) for x in args.window.split(","))
    span_ms = args.messages // 100
    since, until = T0_MS + int(lo_f * span_ms), T0_MS + int(hi_f * span_ms)
    t = time.monotonic()
    pruned = run_fanout(spark, data, out / "pruned", since_ms=since, until_ms=until)
    results["report_pruned_s"] = time.monotonic() - t
    results["report_pruned_segments_read"] = pruned.segments_read
    print(f"pruned report ({lo_f:.0%}-{hi_f:.0%} of time): {results['report_pruned_s']:7.1f} s "
          f"({pruned.messages:,} messages; read {pruned.segments_read}/{pruned.segments} "
          f"segments, {pruned.window_segments} in the window + backlog tail)")  # fmt: skip

    t = time.monotonic()
    res = compact(spark, data, out / COMPACTED_DIR)
    results["compact_s"] = time.monotonic() - t
    print(f"compaction:                 {results['compact_s']:12.1f} s "
          f"({len(res.compacted)} segments)")  # fmt: skip

    # Compaction's gain on the segments it covers: the sealed ones, raw vs Parquet.
    sealed = ",".join(str(s.start_offset) for s in segments if s.sealed)
    n_raw, dt_raw = scan(
        spark.read.format("lmqtt-commitlog").option("segments", sealed).load(str(data))
    )
    files = [str(out / COMPACTED_DIR / f"{s.name}.parquet") for s in segments if s.sealed]
    n_pq, dt_pq = scan(spark.read.parquet(*files))
    assert n_raw == n_pq
    results["sealed_raw_scan_s"] = dt_raw
    results["sealed_compacted_scan_s"] = dt_pq
    results["compaction_speedup"] = dt_raw / dt_pq
    print(f"sealed segments, raw:       {n_raw / dt_raw:12,.0f} records/s ({dt_raw:.1f} s)")
    print(f"sealed segments, compacted: {n_pq / dt_pq:12,.0f} records/s ({dt_pq:.1f} s), "
          f"speed-up {dt_raw / dt_pq:.1f}x")  # fmt: skip
    # What a report reads after compaction: Parquet for sealed, the source for the active one.
    n2, dt2 = scan(load_messages(spark, data, out / COMPACTED_DIR))
    assert n2 == n
    results["mixed_scan_s"] = dt2
    print(f"all segments, after compaction: {n2 / dt2:8,.0f} records/s ({dt2:.1f} s)")

    t = time.monotonic()
    run_fanout(spark, data, out)
    results["report_compacted_s"] = time.monotonic() - t
    print(f"full fan-out report (compacted): {results['report_compacted_s']:7.1f} s")
    stop_spark()
    results_dir = Path(__file__).resolve().parent / "results"
    results_dir.mkdir(exist_ok=True)
    (results_dir / "analytics.json").write_text(json.dumps(results, indent=1))
    print(f"load average during the run: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
