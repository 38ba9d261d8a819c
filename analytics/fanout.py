"""The fan-out report: per device, per topic, per light queue and over time.

Definitions (the tables' columns; all counts exact):

    fanout       light queues (%LMQ%...) a message was dispatched to (the store's dispatch
                 properties)
    eligible     per message, the subscribers that were subscribed (on one of its queues) when
                 it arrived and were due it: it falls in one of their pieces [start, end) (see
                 analytics.snapshots.Piece: the delivery account's ranges of every subscription,
                 persistent, clean or shared, plus the saved sessions; end is open while
                 subscribed)
    deliveries   per message, those eligible subscribers that got it: below the piece's
                 acknowledged end, i.e. acknowledged at QoS 1/2 (deliveries_acked) or sent at
                 QoS 0 (deliveries_qos0; delivered QoS = min(publish QoS, subscription QoS)).
                 A subscriber is a session or a shared group: a session matching a message
                 through several filters, and a shared group whatever member took it, count
                 once, as the gateway delivers once. A subscription still open when the report
                 runs counts up to its last account record (or its committed offset).
    messages_unreached  messages delivered to nobody
    delivery_ratio = deliveries / eligible
    backlog      per queue: messages in [max(slowest committed, queue min), end), their bytes
                 and the age of the oldest (relative to the report's generated_at)

Tables (Parquet, one directory each under <out>/report/): device_fanout, topic_fanout,
queue_backlog, timeline, fanout_histogram, filter_deliveries, subscribers, subscriber_lag (see
analytics.subscribers); plus meta.json. Messages of the gateway itself (client id "": $SYS)
are no device: device_fanout, topic_fanout and timeline leave them out and meta.json's
"gateway" holds their totals. --since/--until restrict the messages of every table except
queue_backlog and subscribers, which are the queues' and subscribers' current state.

Plan: one Spark task per segment parses it (or reads its compacted Parquet) and aggregates it
on the spot with Arrow kernels into small partials (analytics.scratch: per device, topic,
second and fan-out; per device, topic, second, subscriber and queue; per queue), written as
scratch Parquet: no message rows cross from Python into the JVM. Spark rolls those up into
every table.
With --since/--until only the segments that can hold the window's messages, plus the
backlog's tail, are read at all (analytics.pruning; a RocketMQ deployment's ranges, per broker:
analytics.rocketmq.plan_ranges); rows are then filtered exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from analytics.compaction import COMPACTED_DIR, CompactedSegment, compacted_segments
from analytics.copies import base_queue
from analytics.datasource import SOURCE_NAME, SPARK_SCHEMA
from analytics.errors import DataDirError
from analytics.pruning import backlog_segments, segment_spans, segments_in_window
from analytics.reportfiles import META_FILE, REPORT_DIR, TABLES
from analytics.rocketmq import PullRange, Snapshot, plan_ranges
from analytics.scratch import (
    BACKLOG_DDL,
    BACKLOG_DIR,
    CUBE_DDL,
    CUBE_DIR,
    REACHED_DDL,
    REACHED_DIR,
    ScratchInput,
    ScratchPart,
    ScratchPlan,
    build_scratch,
)
from analytics.segments import SegmentFile, list_segments
from analytics.snapshots import (
    LIGHT_QUEUE_PREFIX,
    QUEUE_ENDS_SCHEMA,
    SUBSCRIBERS_SCHEMA,
    QueueEnd,
    Subscriber,
    open_subscribers,
    pieces,
    queue_ends,
    queue_ends_table,
    read_committed,
    read_subscriptions,
    subscribers,
    subscribers_table,
)
from analytics.subscribers import lag_rows, subscriber_rows
from store.commitlog import first_store_timestamp
from store.delivery_account import read_account

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from analytics.progress import SparkProgress

NICE_WINDOWS = (1, 5, 10, 30, 60, 300, 900, 3600, 6 * 3600, 86400, 7 * 86400)


@dataclass
class ReportMeta:
    """meta.json: what the report covers, for `report show` and the HTML page."""

    generated_at_ms: int
    data_dir: str
    since_ms: int | None
    until_ms: int | None
    window_s: int
    segments: int
    compacted_segments: int
    messages: int
    devices: int
    topics: int
    bytes: int
    deliveries: int
    eligible: int
    light_queues: int
    subscribers: int
    deliveries_acked: int = 0  # of deliveries: acknowledged (QoS 1/2)
    deliveries_qos0: int = 0  # of deliveries: sent at QoS 0 (nothing to acknowledge)
    unreached_devices: int = 0  # devices none of whose messages reached a subscriber
    account_records: int = 0  # delivery account records read
    # The gateway's own messages ($SYS, client id ""): never counted as a device.
    gateway: dict[str, int] = field(default_factory=dict)
    segments_read: int = 0  # scanned: the window's segments and the backlog's tail
    window_segments: int = 0  # of which can hold messages in [since, until)
    duration_s: float = 0.0
    tables: list[str] = field(default_factory=lambda: list(TABLES))


def check_data_dir(data_dir: str | Path) -> list[SegmentFile]:
    """The store's segments, or DataDirError if there is nothing to report on."""
    segments = list_segments(data_dir)
    if not segments:
        raise DataDirError(f"{data_dir} has no CommitLog segments: the store is empty")
    for seg in segments:
        if first_store_timestamp(seg.path) is not None:
            return segments
    raise DataDirError(f"{data_dir} holds no messages yet: the store is empty")


def load_messages(
    spark: SparkSession, data_dir: str | Path, compacted_dir: str | Path
) -> DataFrame:
    """All messages: compacted segments natively from Parquet, the rest through the source."""
    from pyspark.sql import functions as F

    segments = list_segments(data_dir)
    done = compacted_segments(compacted_dir, segments)
    raw = (
        spark.read.format(SOURCE_NAME)
        .option("compacted", str(compacted_dir))
        .option("skip_compacted", "true")
        .load(str(data_dir))
    )
    if not done:
        return raw
    files = [c.parquet for c in done.values()]
    # Same columns in the same order; only nullability may differ (Parquet lists allow null
    # elements), which a union tolerates but a cast to the non-null element type does not.
    parquet = spark.read.parquet(*files).select([F.col(f.name) for f in SPARK_SCHEMA.fields])
    if len(done) == len(segments):
        return parquet
    return parquet.unionByName(raw)


def snapshot_frames(
    spark: SparkSession,
    subs: list[Subscriber] | None = None,
    ends: list[QueueEnd] | None = None,
    data_dir: str | Path | None = None,
) -> tuple[DataFrame, DataFrame]:
    """The subscribers and the queue ends as small DataFrames (read from data_dir if not given).

    subscribers: subscriber, queue, filter, start_offset, committed, sessions, shared, online
    queue ends:  queue, queue_filter, min_offset, end_offset
    """
    if subs is None or ends is None:
        assert data_dir is not None, "give the snapshots or the data directory"
        subs = subscribers(read_subscriptions(data_dir), read_committed(data_dir))
        ends = queue_ends(data_dir)
    return (
        spark.createDataFrame(subscribers_table(subs), schema=_spark_schema(SUBSCRIBERS_SCHEMA)),
        spark.createDataFrame(queue_ends_table(ends), schema=_spark_schema(QUEUE_ENDS_SCHEMA)),
    )


def choose_window(span_s: float) -> int:
    """A round window giving at most about 120 buckets over the span."""
    for w in NICE_WINDOWS:
        if span_s / w <= 120:
            return w
    return NICE_WINDOWS[-1]


def run_fanout(
    spark: SparkSession,
    data_dir: str | Path,
    out_dir: str | Path,
    since_ms: int | None = None,
    until_ms: int | None = None,
    window_s: int | None = None,
    progress: SparkProgress | None = None,
    rocketmq: Snapshot | None = None,
) -> ReportMeta:
    """Compute every table and swap them into <out_dir>/report atomically. With `rocketmq`
    (analytics.rocketmq.read_deployment) the messages and sessions are those of a RocketMQ
    deployment, pulled from its brokers, and `data_dir` is not read: its light queues are
    one per broker (analytics.copies), in every table that names a queue."""
    from pyspark.sql import functions as F

    started = time.monotonic()
    generated_at_ms = int(time.time() * 1000)
    data_dir = Path(data_dir)
    out_dir = Path(out_dir)
    segments: list[SegmentFile] | list[PullRange]
    if rocketmq is not None:
        # The deployment's messages are pulled from its brokers, one task per range of the
        # parent queue on each; its sessions, offsets and queue ends come from them too.
        snap = rocketmq
        segments = snap.ranges
        done: dict[int, CompactedSegment] = {}
        account = snap.account
        pcs = pieces("", snap.subscriptions, snap.committed, account)
        ends = snap.ends
        source_label = rocketmq.deployment.label
    else:
        segments = check_data_dir(data_dir)
        done = compacted_segments(out_dir / COMPACTED_DIR, segments)
        account = read_account(data_dir)
        pcs = pieces(data_dir, account=account)
        ends = queue_ends(data_dir)
        source_label = str(data_dir.resolve())
    n_compacted = len(done)
    subs = open_subscribers(pcs)

    def phase(name: str):  # type: ignore[no-untyped-def]
        from contextlib import nullcontext

        spark.sparkContext.setJobDescription(name)
        return progress.phase(name) if progress is not None else nullcontext()

    staging = out_dir / f".report-staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    scratch = staging / "_scratch"
    # Time pruning: only segments that can hold messages of the window, plus (the backlog is
    # the queues' current state) those from the oldest undelivered message on. A RocketMQ
    # deployment's brokers say both by SEARCH_OFFSET_BY_TIMESTAMP and pulls (plan_ranges).
    windowed = since_ms is not None or until_ms is not None
    window: list[SegmentFile] | list[PullRange]
    read: list[SegmentFile] | list[PullRange]
    if rocketmq is not None:
        plan_read = plan_ranges(rocketmq, since_ms, until_ms, _backlog_from(subs, ends))
        window, read = plan_read.window, plan_read.read
    else:
        files = cast(list[SegmentFile], segments)
        window = (
            segments_in_window(segment_spans(files, done), since_ms, until_ms)
            if windowed
            else files
        )
        tail = backlog_segments(data_dir, files, subs, ends) if windowed else []
        wanted = {s.start_offset for s in window} | {s.start_offset for s in tail}
        read = [s for s in files if s.start_offset in wanted]
    sources = [
        ScratchInput(s, done[s.start_offset].parquet if s.start_offset in done else None)
        for s in read
    ]
    n_read_compacted = sum(1 for src in sources if src.parquet is not None)
    # Only a subscriber holding several queues can be reached twice by one message (a
    # RocketMQ message is in one broker's copies: a queue's copies on several brokers cannot).
    queues_of: dict[str, set[str]] = {}
    for piece in pcs:
        queues_of.setdefault(piece.subscriber, set()).add(base_queue(piece.queue))
    plan = ScratchPlan(
        since_ms=since_ms,
        until_ms=until_ms,
        subscribers=tuple(
            (p.subscriber, p.queue, p.start, p.end, p.acked, p.qos) for p in pcs if p.end > p.start
        ),
        dedup=any(len(q) > 1 for q in queues_of.values()),
        backlog_from=_backlog_from(subs, ends),
    )
    # One parse of each segment, aggregated on the spot into small partials (analytics.scratch);
    # every table below is a roll-up of those.
    try:
        with phase(f"scan {len(read)}/{len(segments)} segments ({n_read_compacted} compacted)"):
            parts = build_scratch(spark, sources, scratch, plan)
        cube_parts = _scratch_frame(spark, scratch / CUBE_DIR, CUBE_DDL, parts)
        reached_parts = _scratch_frame(spark, scratch / REACHED_DIR, REACHED_DDL, parts)
        backlog_parts = _scratch_frame(spark, scratch / BACKLOG_DIR, BACKLOG_DDL, parts)
        if window_s is None:
            stamps_lo = [p.min_ts_ms for p in parts if p.min_ts_ms is not None]
            stamps_hi = [p.max_ts_ms for p in parts if p.max_ts_ms is not None]
            lo_ms = since_ms if since_ms is not None else min(stamps_lo, default=0)
            hi_ms = until_ms if until_ms is not None else max(stamps_hi, default=0)
            window_s = choose_window(max(0.0, (hi_ms - lo_ms) / 1000))

        subs_df = spark.createDataFrame(
            subscribers_table(subs), schema=_spark_schema(SUBSCRIBERS_SCHEMA)
        )
        ends_df = spark.createDataFrame(
            queue_ends_table(ends), schema=_spark_schema(QUEUE_ENDS_SCHEMA)
        )
        # Whole seconds floored to the window: the same bucket as flooring the timestamp.
        bucket = F.timestamp_seconds(F.floor(F.col("sec") / F.lit(window_s)) * F.lit(window_s))
        # Level 1: a small cube of (device, topic, window, fan-out) counts, and one of
        # (device, topic, window, subscriber) deliveries, rolled up from the tasks' partials.
        # Every table is then a cheap roll-up of those; no count-distinct runs on big data.
        cube = (
            cube_parts.withColumn("window_start", bucket)
            .groupBy("client_id", "topic", "window_start", "fanout")
            .agg(
                F.sum("n").alias("n"),
                F.sum("r").alias("r"),
                F.sum("b").alias("b"),
                F.min("first").alias("first"),
                F.max("last").alias("last"),
            )
            .cache()
        )
        rcube = (
            reached_parts.withColumn("window_start", bucket)
            .groupBy("client_id", "topic", "window_start", "subscriber", "queue")
            .agg(F.sum("d").alias("d"), F.sum("d0").alias("d0"), F.sum("e").alias("e"))
            .cache()
        )
        # The gateway's own messages (client id "") are reported on their own line.
        dev_cube = cube.where(F.col("client_id") != "")
        dev_rcube = rcube.where(F.col("client_id") != "")

        def rollup(keys: list[str], distinct: str, distinct_name: str) -> DataFrame:
            stats = dev_cube.groupBy(*keys).agg(
                F.sum("n").alias("messages"),
                (F.sum("n") - F.sum("r")).alias("messages_unreached"),
                F.sum("b").alias("bytes"),
                F.count_distinct(distinct).alias(distinct_name),
                (F.sum(F.col("n") * F.col("fanout")) / F.sum("n")).alias("fanout_mean"),
                F.percentile("fanout", 0.5, F.col("n")).alias("fanout_p50"),
                F.percentile("fanout", 0.99, F.col("n")).alias("fanout_p99"),
                F.max("fanout").alias("fanout_max"),
                F.min("first").alias("first_seen"),
                F.max("last").alias("last_seen"),
            )
            deliv = dev_rcube.groupBy(*keys).agg(
                F.sum("d").alias("deliveries"),
                (F.sum("d") - F.sum("d0")).alias("deliveries_acked"),
                F.sum("d0").alias("deliveries_qos0"),
                F.sum("e").alias("eligible"),
                F.count_distinct(F.when(F.col("d") > 0, F.col("subscriber"))).alias(
                    "subscribers_reached"
                ),
            )
            joined = stats.join(deliv, keys, "left").fillna(
                0,
                ["deliveries", "deliveries_acked", "deliveries_qos0", "eligible",
                 "subscribers_reached"],
            )  # fmt: skip
            return joined.withColumn(
                "delivery_ratio",
                F.when(F.col("eligible") > 0, F.col("deliveries") / F.col("eligible")),
            )

        device = rollup(["client_id"], "topic", "topics").select(
            "client_id", "messages", "bytes", "topics", "fanout_mean", "fanout_p50",
            "fanout_p99", "fanout_max", "deliveries", "eligible", "delivery_ratio",
            "subscribers_reached", "first_seen", "last_seen", "messages_unreached",
            "deliveries_acked", "deliveries_qos0",
        )  # fmt: skip
        with phase("device_fanout"):
            totals = _write(device, staging / "device_fanout")

        topic = rollup(["topic"], "client_id", "devices").select(
            "topic", "messages", "bytes", "devices", "fanout_mean", "fanout_p50", "fanout_p99",
            "fanout_max", "deliveries", "eligible", "delivery_ratio", "subscribers_reached",
            "first_seen", "last_seen", "messages_unreached", "deliveries_acked",
            "deliveries_qos0",
        )  # fmt: skip
        with phase("topic_fanout"):
            n_topics = _write(topic, staging / "topic_fanout")

        timeline = (
            dev_cube.groupBy("client_id", "window_start")
            .agg(F.sum("n").alias("messages"), F.sum("b").alias("bytes"))
            .join(
                dev_rcube.groupBy("client_id", "window_start").agg(F.sum("d").alias("deliveries")),
                ["client_id", "window_start"],
                "left",
            )
            .fillna(0, ["deliveries"])
            .withColumn("window_end", F.col("window_start") + F.make_interval(secs=F.lit(window_s)))
            .select("client_id", "window_start", "window_end", "messages", "bytes", "deliveries")
        )
        with phase("timeline"):
            _write(timeline, staging / "timeline")

        # Small answers collected to the driver in one job each: the histogram with the
        # gateway's totals, and the deliveries per (subscriber, queue) with the gateway's.
        is_gw = F.col("client_id") == ""
        with phase("fanout_histogram"):
            hist_rows = (
                cube.groupBy("fanout", is_gw.alias("gw"), F.when(is_gw, F.col("topic")).alias("t"))
                .agg(F.sum("n").alias("n"), F.sum("b").alias("b"))
                .collect()
            )
        hist: dict[int, int] = {}
        for h in hist_rows:
            hist[int(h.fanout)] = hist.get(int(h.fanout), 0) + int(h.n)
        _write_arrow(
            pa.table(
                {
                    "fanout": pa.array(list(hist), pa.int32()),
                    "messages": pa.array(list(hist.values()), pa.int64()),
                }
            ),
            staging / "fanout_histogram",
        )

        with phase("queue_backlog"):
            backlog = _backlog(backlog_parts, subs_df, ends_df, generated_at_ms)
            n_queues = _write(backlog, staging / "queue_backlog")

        with phase("filter_deliveries"):
            reach_rows = (
                rcube.groupBy("subscriber", "queue", is_gw.alias("gw"))
                .agg(F.sum("d").alias("d"), F.sum("d0").alias("d0"), F.sum("e").alias("e"))
                .collect()
            )
        cube.unpersist()
        rcube.unpersist()
        filters = {p.queue: p.filter for p in pcs}
        _write_arrow(_filter_table(reach_rows, filters, ends), staging / "filter_deliveries")
        subscribers_tab = subscriber_rows(pcs, ends, account)
        reached_by: dict[tuple[str, str], tuple[int, int]] = {}
        for r in reach_rows:
            d, e = reached_by.get((r.subscriber, r.queue), (0, 0))
            reached_by[(r.subscriber, r.queue)] = (d + int(r.d), e + int(r.e))
        subscribers_tab = subscribers_tab.append_column(
            "deliveries",
            pa.array([reached_by.get(k, (0, 0))[0] for k in _keys(subscribers_tab)], pa.int64()),
        ).append_column(
            "eligible",
            pa.array([reached_by.get(k, (0, 0))[1] for k in _keys(subscribers_tab)], pa.int64()),
        )
        subscribers_tab = _since_oldest(subscribers_tab, staging / "queue_backlog")
        _write_arrow(subscribers_tab, staging / "subscribers")
        _write_arrow(lag_rows(account, window_s, since_ms, until_ms), staging / "subscriber_lag")

        device_totals = (
            spark.read.parquet(str(staging / "device_fanout"))
            .agg(
                F.count(F.lit(1)).alias("devices"),
                F.sum("messages").alias("messages"),
                F.sum("bytes").alias("bytes"),
                F.sum("deliveries").alias("deliveries"),
                F.sum("deliveries_qos0").alias("deliveries_qos0"),
                F.sum("eligible").alias("eligible"),
                F.sum(F.when(F.col("deliveries") == 0, 1).otherwise(0)).alias("unreached"),
            )
            .collect()[0]
        )
        meta = ReportMeta(
            generated_at_ms=generated_at_ms,
            data_dir=source_label,
            since_ms=since_ms,
            until_ms=until_ms,
            window_s=window_s,
            segments=len(segments),
            compacted_segments=n_compacted,
            segments_read=len(read),
            window_segments=len(window),
            messages=int(device_totals.messages or 0),
            devices=int(totals),
            topics=int(n_topics),
            bytes=int(device_totals.bytes or 0),
            deliveries=int(device_totals.deliveries or 0),
            eligible=int(device_totals.eligible or 0),
            light_queues=int(n_queues),
            subscribers=len({p.subscriber for p in pcs}),
            deliveries_acked=int(device_totals.deliveries or 0)
            - int(device_totals.deliveries_qos0 or 0),
            deliveries_qos0=int(device_totals.deliveries_qos0 or 0),
            unreached_devices=int(device_totals.unreached or 0),
            account_records=len(account),
            gateway={
                "messages": sum(int(h.n) for h in hist_rows if h.gw),
                "bytes": sum(int(h.b) for h in hist_rows if h.gw),
                "topics": len({h.t for h in hist_rows if h.gw}),
                "deliveries": sum(int(r.d) for r in reach_rows if r.gw),
            },
            duration_s=round(time.monotonic() - started, 3),
        )
        (staging / META_FILE).write_text(json.dumps(asdict(meta), indent=1))
        shutil.rmtree(scratch, ignore_errors=True)
        _swap_in(staging, out_dir / REPORT_DIR)
        return meta
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _keys(table: pa.Table) -> list[tuple[str, str]]:
    return list(zip(table["subscriber"].to_pylist(), table["queue"].to_pylist(), strict=True))


def _filter_table(
    rows: list[Any], filters: dict[str, str | None], ends: list[QueueEnd]
) -> pa.Table:
    """filter_deliveries: per light queue, what was delivered through it in the window
    (`rows`: per subscriber, queue and gateway-or-not, the sums of d, d0 and e)."""
    by_queue: dict[str, list[int]] = {}
    reached: dict[str, set[str]] = {}
    for r in rows:
        sums = by_queue.setdefault(r.queue, [0, 0, 0])
        sums[0] += int(r.d)
        sums[1] += int(r.d0)
        sums[2] += int(r.e)
        if r.d:
            reached.setdefault(r.queue, set()).add(r.subscriber)
    names = dict(filters)
    for q in queue_ends_table(ends).to_pylist():
        names.setdefault(q["queue"], q["queue_filter"])
    out = []
    for queue in sorted(set(by_queue) | {q for q in names if q.startswith(LIGHT_QUEUE_PREFIX)}):
        d, d0, e = by_queue.get(queue, (0, 0, 0))
        out.append(
            {
                "queue": queue,
                "filter": names.get(queue),
                "deliveries": d,
                "deliveries_acked": d - d0,
                "deliveries_qos0": d0,
                "eligible": e,
                "subscribers_reached": len(reached.get(queue, ())),
            }
        )
    return pa.Table.from_pylist(out, schema=FILTER_SCHEMA)


FILTER_SCHEMA = pa.schema(
    [
        ("queue", pa.string()),
        ("filter", pa.string()),
        ("deliveries", pa.int64()),
        ("deliveries_acked", pa.int64()),
        ("deliveries_qos0", pa.int64()),
        ("eligible", pa.int64()),
        ("subscribers_reached", pa.int64()),
    ]
)


def _since_oldest(subs: pa.Table, backlog_dir: Path) -> pa.Table:
    """behind_since where the account has no history (a subscriber known only from the saved
    sessions): the store time of the oldest message it still owes, when it is its queue's
    slowest subscriber (queue_backlog's oldest_undelivered_at is that message)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    backlog = pq.read_table(
        backlog_dir, columns=["queue", "slowest_committed", "oldest_undelivered_at"]
    ).to_pylist()
    oldest = {(b["queue"], b["slowest_committed"]): b["oldest_undelivered_at"] for b in backlog}
    since = subs.column("behind_since").to_pylist()
    filled = [
        s if s is not None or not lag else oldest.get((q, acked))
        for s, q, acked, lag in zip(
            since,
            subs.column("queue").to_pylist(),
            subs.column("acked").to_pylist(),
            subs.column("lag").to_pylist(),
            strict=True,
        )
    ]
    i = subs.schema.get_field_index("behind_since")
    column = pc.cast(
        pa.array(filled, pa.timestamp("us", tz="UTC")), subs.schema.field(i).type, safe=False
    )
    return subs.set_column(i, "behind_since", column)


def _write_arrow(table: pa.Table, path: Path) -> None:
    """Write a small driver-side table as the one Parquet file of its directory."""
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path / "part-00000.parquet")


def _backlog_from(subs: list[Subscriber], ends: list[QueueEnd]) -> tuple[tuple[str, int], ...]:
    """Per subscribed queue, its first undelivered offset: the slowest committed offset, or
    the queue's first retained one if that is later (as `known` in _backlog computes it)."""
    min_offset = {q.queue: q.min_offset for q in ends}
    slowest: dict[str, int] = {}
    for s in subs:
        slowest[s.queue] = min(s.committed, slowest.get(s.queue, s.committed))
    return tuple((q, max(c, min_offset.get(q, 0))) for q, c in sorted(slowest.items()))


def _scratch_frame(
    spark: SparkSession, path: Path, ddl: str, parts: list[ScratchPart]
) -> DataFrame:
    """A scratch table (an empty one when no segment was read)."""
    if not parts:
        return spark.createDataFrame([], ddl)
    return spark.read.schema(ddl).parquet(str(path))


def _backlog(
    parts: DataFrame, subs_df: DataFrame, ends_df: DataFrame, generated_at_ms: int
) -> DataFrame:
    """Per light queue: subscribers, slowest committed offset, backlog messages/bytes/age.

    The small queue table (consume-queue ends, subscribers) is built first; the tasks' per-queue
    partials (end in the log, what waits in it) are rolled up and joined to it. They may lack
    old segments (a windowed report reads only the backlog's tail, see
    analytics.pruning): the consume queues' ends cover those.
    """
    from pyspark.sql import functions as F

    per_queue = subs_df.groupBy("queue").agg(
        F.first("filter").alias("sub_filter"),
        F.count(F.lit(1)).alias("subscribers"),
        F.sum(F.col("online").cast("int")).alias("online_subscribers"),
        F.min("committed").alias("slowest_committed"),
        F.min_by("subscriber", "committed").alias("slowest_subscriber"),
    )
    known = (
        ends_df.join(per_queue, "queue", "full")
        .withColumn("min_offset", F.coalesce("min_offset", F.lit(0)))
        .withColumn(
            "backlog_from",
            F.when(
                F.col("slowest_committed").isNotNull(),
                F.greatest("slowest_committed", "min_offset"),
            ),
        )
    )
    # The tasks aggregated the pairs per queue with the same backlog_from (_backlog_from).
    in_log = parts.groupBy("queue").agg(
        (F.max("max_qoff") + 1).alias("log_end"),
        F.sum("waiting_bytes").alias("backlog_bytes"),
        F.min("oldest").alias("oldest_undelivered_at"),
    )
    now = F.timestamp_millis(F.lit(generated_at_ms))
    return (
        known.join(in_log, "queue", "full")
        .where(F.col("queue").startswith(LIGHT_QUEUE_PREFIX))
        .withColumn("filter", F.coalesce("sub_filter", "queue_filter"))
        .withColumn("min_offset", F.coalesce("min_offset", F.lit(0)))
        .withColumn(
            "end_offset",
            F.greatest(F.coalesce("end_offset", F.lit(0)), F.coalesce("log_end", F.lit(0))),
        )
        .withColumn("subscribers", F.coalesce("subscribers", F.lit(0)))
        .withColumn("online_subscribers", F.coalesce("online_subscribers", F.lit(0)))
        .withColumn(
            "backlog_messages",
            F.coalesce(F.greatest(F.col("end_offset") - F.col("backlog_from"), F.lit(0)), F.lit(0)),
        )
        .withColumn("backlog_bytes", F.coalesce("backlog_bytes", F.lit(0)))
        .withColumn(
            "oldest_age_s",
            F.when(
                F.col("oldest_undelivered_at").isNotNull(),
                (F.unix_micros(now) - F.unix_micros("oldest_undelivered_at")) / 1e6,
            ),
        )
        .select(
            "queue",
            "filter",
            "min_offset",
            "end_offset",
            "subscribers",
            "online_subscribers",
            "slowest_committed",
            "slowest_subscriber",
            "backlog_messages",
            "backlog_bytes",
            "oldest_undelivered_at",
            "oldest_age_s",
        )
    )


def _write(frame: DataFrame, path: Path) -> int:
    """Write one table as a single Parquet file; returns its row count."""
    frame.coalesce(1).write.mode("overwrite").parquet(str(path))
    import pyarrow.parquet as pq

    return int(pq.ParquetDataset(str(path)).read(columns=[]).num_rows)


def _swap_in(staging: Path, final: Path) -> None:
    """Replace the previous report with the new one in two renames."""
    old = final.with_name(f".report-old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _spark_schema(schema):  # type: ignore[no-untyped-def]
    from pyspark.sql.types import (
        BooleanType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    types = {
        "string": StringType(),
        "int64": LongType(),
        "int32": IntegerType(),
        "bool": BooleanType(),
    }
    return StructType([StructField(f.name, types[str(f.type)], True) for f in schema])
