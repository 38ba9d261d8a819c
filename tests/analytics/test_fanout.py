"""The fan-out job on a store with known traffic: exact numbers per device, topic and queue."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import pytest

from analytics.cli import main
from analytics.fanout import ReportMeta
from analytics.segments import list_segments
from analytics.show import Report
from store import format as fmt
from tests.analytics.groundtruth import World
from topicmap import LMQ_PREFIX

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Spark start-up and jobs are slow on a shared 2-core machine: generous per-test limits.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]


def _rows(out: Path, table: str, key: str) -> dict[str, dict[str, Any]]:
    return {r[key]: r for r in pq.read_table(out / "report" / table).to_pylist()}


def test_device_fanout_is_exact(report: tuple[Path, ReportMeta], world: World) -> None:
    out, meta = report
    got = _rows(out, "device_fanout", "client_id")
    expected = world.expected_devices()
    assert set(got) == set(expected)
    for client, exp in expected.items():
        row = got[client]
        for key, value in exp.items():
            assert row[key] == value, (client, key)
        mine = [m for m in world.messages if m.client_id == client]
        fanouts = [sum(q.startswith(LMQ_PREFIX) for q in m.queues) for m in mine]
        assert row["fanout_mean"] == pytest.approx(sum(fanouts) / len(fanouts))
        ratio = exp["deliveries"] / exp["eligible"] if exp["eligible"] else None
        assert row["delivery_ratio"] == (pytest.approx(ratio) if ratio is not None else None)
        assert row["first_seen"] <= row["last_seen"]
    # Spot checks a reader can verify by hand from groundtruth.SUBS: dev-quiet reaches nobody;
    # dev-c's fleet/9/gps is seen only by s-late, from the 31st publish on (6 per round: rounds
    # 5..19, 15 of 20 messages).
    assert got["dev-quiet"]["deliveries"] == 0 and got["dev-quiet"]["eligible"] == 0
    assert (got["dev-c"]["deliveries"], got["dev-c"]["subscribers_reached"]) == (15, 1)
    assert meta.messages == len(world.device_messages())
    assert meta.deliveries == sum(e["deliveries"] for e in expected.values())
    assert meta.deliveries_qos0 == sum(e["deliveries_qos0"] for e in expected.values())
    assert meta.deliveries_acked == meta.deliveries - meta.deliveries_qos0
    # Clean sessions count: c-gone (ended, 2 due messages never acknowledged) and c-open (QoS 0,
    # still subscribed while the report runs, 3 not acknowledged yet).
    assert got["dev-a"]["deliveries"] > 0 and got["dev-b"]["deliveries_qos0"] > 0
    # The gateway's $SYS messages: their own line, never a device with an empty id.
    assert "" not in got and None not in got
    gateway = [m for m in world.messages if not m.client_id]
    assert meta.gateway["messages"] == len(gateway) > 0
    assert meta.gateway["deliveries"] == sum(len(world.reach(m)[1]) for m in gateway)
    assert meta.unreached_devices == 1  # dev-quiet


def test_topic_fanout_is_exact(report: tuple[Path, ReportMeta], world: World) -> None:
    out, _ = report
    got = _rows(out, "topic_fanout", "topic")
    by_topic: dict[str, list] = defaultdict(list)
    for m in world.device_messages():
        by_topic[m.topic].append(m)
    assert set(got) == set(by_topic)
    for topic, msgs in by_topic.items():
        row = got[topic]
        assert row["messages"] == len(msgs)
        assert row["bytes"] == sum(m.body_size for m in msgs)
        assert row["devices"] == len({m.client_id for m in msgs})
        assert row["deliveries"] == sum(len(world.reach(m)[1]) for m in msgs)
        assert row["eligible"] == sum(len(world.reach(m)[0]) for m in msgs)
        assert row["deliveries_qos0"] == sum(len(world.reach_qos0(m)) for m in msgs)
        assert row["messages_unreached"] == sum(not world.reach(m)[1] for m in msgs)


def test_queue_backlog_is_exact(report: tuple[Path, ReportMeta], world: World) -> None:
    out, _ = report
    got = _rows(out, "queue_backlog", "queue")
    assert set(got) == set(world.ends)
    for queue, end in world.ends.items():
        ranges = {k: v for (k, q), v in world.ranges.items() if q == queue}
        row = got[queue]
        assert row["end_offset"] == end
        assert row["subscribers"] == len(ranges)
        if not ranges:  # c-gone's queue: nobody subscribed any more, nothing waits
            assert row["backlog_messages"] == 0
            continue
        slowest = min(c for _, c in ranges.values())
        assert row["slowest_committed"] == slowest
        assert row["backlog_messages"] == end - slowest
        waiting = [
            m for m in world.messages
            for q, off in zip(m.queues, m.offsets, strict=True) if q == queue and off >= slowest
        ]  # fmt: skip
        assert row["backlog_bytes"] == sum(m.body_size for m in waiting)
        assert (row["oldest_age_s"] is None) == (not waiting)
    assert got[next(q for q in world.ends if q.endswith("fleet.%23"))]["backlog_messages"] == 0


def test_timeline_and_histogram_add_up(report: tuple[Path, ReportMeta], world: World) -> None:
    out, meta = report
    timeline = pq.read_table(out / "report" / "timeline").to_pylist()
    devices = _rows(out, "device_fanout", "client_id")
    for client, row in devices.items():
        mine = [t for t in timeline if t["client_id"] == client]
        assert sum(t["messages"] for t in mine) == row["messages"]
        assert sum(t["bytes"] for t in mine) == row["bytes"]
        assert sum(t["deliveries"] for t in mine) == row["deliveries"]
        assert all(
            (t["window_end"] - t["window_start"]).total_seconds() == meta.window_s for t in mine
        )
    hist = {
        r["fanout"]: r["messages"]
        for r in pq.read_table(out / "report" / "fanout_histogram").to_pylist()
    }
    expected: dict[int, int] = defaultdict(int)
    for m in world.messages:
        expected[sum(q.startswith(LMQ_PREFIX) for q in m.queues)] += 1
    assert hist == expected


def test_show_reads_the_real_report(report: tuple[Path, ReportMeta], tmp_path: Path) -> None:
    out, _ = report
    assert (
        main(["show", "--out", str(out), "--device", "dev-a", "--html", str(tmp_path / "r.html")])
        == 0
    )
    r = Report.load(out)
    assert r.device("dev-a")["messages"] == 40
    assert (tmp_path / "r.html").read_text().count("<svg") == 7  # every chart has data


def test_data_source_reads_every_segment(spark: SparkSession, world: World) -> None:
    df = spark.read.format("lmqtt-commitlog").load(str(world.data_dir))
    assert df.rdd.getNumPartitions() == len(list_segments(world.data_dir))
    row = df.selectExpr("count(*) n", "sum(body_size) b", "sum(size(queues)) q").collect()[0]
    assert row.n == len(world.messages)
    assert row.b == sum(m.body_size for m in world.messages)
    assert row.q == sum(len(m.queues) for m in world.messages)


def test_compaction_gives_the_same_rows(
    spark: SparkSession, world: World, report: tuple[Path, ReportMeta], tmp_path: Path
) -> None:
    from analytics.compaction import compact
    from analytics.fanout import load_messages

    result = compact(spark, world.data_dir, tmp_path / "compacted")
    sealed = [s for s in list_segments(world.data_dir) if s.sealed]
    assert [c.segment for c in result.compacted] == [s.start_offset for s in sealed]
    assert compact(spark, world.data_dir, tmp_path / "compacted").compacted == []  # once
    cols = "physical_offset, topic, client_id, body_size, queues, queue_offsets, store_timestamp"
    raw = (
        spark.read.format("lmqtt-commitlog").load(str(world.data_dir)).selectExpr(*cols.split(", "))
    )
    mixed = load_messages(spark, world.data_dir, tmp_path / "compacted").selectExpr(
        *cols.split(", ")
    )
    via_source = (
        spark.read.format("lmqtt-commitlog").option("compacted", str(tmp_path / "compacted"))
        .load(str(world.data_dir)).selectExpr(*cols.split(", "))
    )  # fmt: skip
    want = sorted(raw.collect())
    assert sorted(mixed.collect()) == want
    assert sorted(via_source.collect()) == want
    # A report over compacted segments (tmp_path/compacted is where --out tmp_path looks).
    from analytics.fanout import run_fanout

    meta = run_fanout(spark, world.data_dir, tmp_path)
    assert meta.compacted_segments == len(sealed)
    before = pq.read_table(report[0] / "report" / "device_fanout").sort_by("client_id")
    after = pq.read_table(tmp_path / "report" / "device_fanout").sort_by("client_id")
    assert after.drop(["first_seen", "last_seen"]).equals(before.drop(["first_seen", "last_seen"]))


def test_corrupt_segment_is_one_clear_error(
    spark: SparkSession,
    world: World,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "data"
    shutil.copytree(world.data_dir, data)
    sealed = list_segments(data)[1]
    with open(sealed.path, "r+b") as f:
        f.seek(fmt.OFF_BODY)
        byte = f.read(1)
        f.seek(fmt.OFF_BODY)
        f.write(bytes([byte[0] ^ 0x55]))
    rc = main(["fanout", "--data-dir", str(data), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        f"corrupt CommitLog segment {sealed.path} at physical offset {sealed.start_offset}" in err
    )
    assert "CRC mismatch" in err
    assert "Traceback" not in err and "java" not in err.lower() and "Py4J" not in err


@pytest.mark.slow
def test_since_until_restrict_the_messages(
    spark: SparkSession, world: World, tmp_path: Path
) -> None:
    from analytics.fanout import run_fanout
    from analytics.segments import read_segment_table

    stamps = sorted(
        int(ts.timestamp() * 1000)
        for seg in list_segments(world.data_dir)
        for ts in read_segment_table(seg).column("store_timestamp").to_pylist()
    )
    since, until = stamps[len(stamps) // 4], stamps[3 * len(stamps) // 4]
    assert since < until, "the puts must span more than one millisecond"
    meta = run_fanout(spark, world.data_dir, tmp_path, since_ms=since, until_ms=until)
    assert meta.messages == sum(1 for m in world.device_messages() if since <= m.store_ms < until)
    assert meta.gateway["messages"] == sum(
        1 for m in world.messages if not m.client_id and since <= m.store_ms < until
    )
    assert (meta.since_ms, meta.until_ms) == (since, until)
    # The backlog is the queues' state now, whatever the window.
    backlog = _rows(tmp_path, "queue_backlog", "queue")
    assert {q: r["end_offset"] for q, r in backlog.items()} == world.ends


def test_source_errors_surface_as_analytics_errors(spark: SparkSession, tmp_path: Path) -> None:
    from analytics.errors import DataDirError, recover_worker_error

    with pytest.raises(Exception) as raised:
        spark.read.format("lmqtt-commitlog").load(str(tmp_path / "gone")).count()
    found = recover_worker_error(str(raised.value))
    assert isinstance(found, DataDirError)
    assert str(found) == f"data directory {tmp_path / 'gone'} does not exist"


def test_filter_and_subscriber_tables_are_exact(
    report: tuple[Path, ReportMeta], world: World
) -> None:
    out, _ = report
    per_queue: dict[str, int] = defaultdict(int)
    for m in world.messages:
        for key in world.reach(m)[1]:
            # delivered through the first (by name) of the subscriber's queues holding it
            mine = sorted(
                q for q, off in zip(m.queues, m.offsets, strict=True)
                for k, pq_, start, end, acked, _ in world.pieces
                if k == key and pq_ == q and start <= off < acked and (end is None or off < end)
            )  # fmt: skip
            per_queue[mine[0]] += 1
    got = _rows(out, "filter_deliveries", "queue")
    for queue, n in per_queue.items():
        assert got[queue]["deliveries"] == n, queue
    assert sum(r["deliveries"] for r in got.values()) == sum(per_queue.values())
    subs = pq.read_table(out / "report" / "subscribers").to_pylist()
    gone = [r for r in subs if r["subscriber"] == "c-gone"]
    assert len(gone) == 1 and not gone[0]["open"] and gone[0]["kind"] == "clean"
    assert gone[0]["lag"] == 2  # due when it ended, never acknowledged
    (c_open,) = [r for r in subs if r["subscriber"] == "c-open"]
    assert c_open["open"] and c_open["qos"] == 0 and c_open["lag"] == 3
    assert c_open["behind_since"] is not None
    lag = pq.read_table(out / "report" / "subscriber_lag").to_pylist()
    assert {r["subscriber"] for r in lag} >= {"c-gone", "c-open"}
    assert max(r["lag_max"] for r in lag if r["subscriber"] == "c-open") == 3
    # s-slow is known only from sessions.json: behind since its oldest owed message was stored.
    (slow,) = [r for r in subs if r["subscriber"] == "s-slow"]
    _, committed = next(v for (k, _), v in world.ranges.items() if k == "s-slow")
    owed = next(
        m.store_ms for m in world.messages
        for q, off in zip(m.queues, m.offsets, strict=True)
        if q == slow["queue"] and off == committed
    )  # fmt: skip
    assert slow["lag"] > 0 and int(slow["behind_since"].timestamp() * 1000) == owed
