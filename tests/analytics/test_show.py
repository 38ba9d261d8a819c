"""`report show` and the HTML page, on report files written here with pyarrow (no Spark)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analytics.cli import main
from analytics.reportfiles import TABLES
from analytics.show import Report

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
DEVICES = {  # client id -> (messages, bytes, deliveries, eligible)
    "sensor-1": (120, 12_000, 240, 360),
    "sensor-2": (80, 64_000, 0, 80),
    "gw-<b>&": (5, 10, 5, 5),
}


def make_report(out: Path) -> Path:
    root = out / "report"
    for name in TABLES:
        (root / name).mkdir(parents=True)
    ts = pa.timestamp("us", tz="UTC")
    device_rows = [
        {"client_id": c, "messages": m, "bytes": b, "topics": 2, "fanout_mean": 1.5,
         "fanout_p50": 1.0, "fanout_p99": 3.0, "fanout_max": 3, "deliveries": d, "eligible": e,
         "delivery_ratio": d / e, "subscribers_reached": 2, "first_seen": T0,
         "last_seen": T0 + timedelta(minutes=5)}
        for c, (m, b, d, e) in DEVICES.items()
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(device_rows), root / "device_fanout" / "part-0.parquet")
    topics = [
        {"topic": "a/b", "messages": 200, "deliveries": 240, "fanout_mean": 1.0, "devices": 2},
        {"topic": "a/c", "messages": 5, "deliveries": 5, "fanout_mean": 3.0, "devices": 1},
        {"topic": "z/quiet", "messages": 4, "deliveries": 0, "fanout_mean": 0.0, "devices": 1},
    ]
    pq.write_table(pa.Table.from_pylist(topics), root / "topic_fanout" / "part-0.parquet")
    filters = [
        {"queue": "%LMQ%a", "filter": "a/#", "deliveries": 200, "deliveries_acked": 150,
         "deliveries_qos0": 50, "eligible": 300, "subscribers_reached": 2},
        {"queue": "%LMQ%b", "filter": "b", "deliveries": 45, "deliveries_acked": 45,
         "deliveries_qos0": 0, "eligible": 45, "subscribers_reached": 1},
        {"queue": "%LMQ%c", "filter": "c/+", "deliveries": 0, "deliveries_acked": 0,
         "deliveries_qos0": 0, "eligible": 0, "subscribers_reached": 0},
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(filters), root / "filter_deliveries" / "part-0.parquet")
    subs = [
        {"subscriber": s, "queue": "%LMQ%a", "filter": "a/#", "kind": k, "qos": 1, "open": o,
         "online": o, "start_offset": 0, "end_offset": None if o else 50, "acked": a,
         "sent": a, "queue_end": 100 if o else 50, "lag": lag, "behind_since": since,
         "first_record": T0, "last_record": T0}
        for s, k, o, a, lag, since in (
            ("slow-1", "persistent", True, 40, 60, T0 + timedelta(minutes=1)),
            ("fast-1", "clean", True, 100, 0, None),
            ("gone-1", "clean", False, 48, 2, None),
        )
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(subs), root / "subscribers" / "part-0.parquet")
    lag = [
        {"subscriber": "slow-1", "queue": "%LMQ%a", "window_start": T0 + timedelta(minutes=i),
         "lag_max": 12 * i, "lag_last": 12 * i, "records": 1}
        for i in range(6)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(lag), root / "subscriber_lag" / "part-0.parquet")
    backlog = [
        {"queue": "%LMQ%a", "filter": "a/#", "min_offset": 0, "end_offset": 100,
         "subscribers": 2, "online_subscribers": 1, "slowest_committed": 40,
         "slowest_subscriber": "s", "backlog_messages": 60, "backlog_bytes": 6000,
         "oldest_undelivered_at": T0, "oldest_age_s": 3600.0},
        {"queue": "%LMQ%b", "filter": "b", "min_offset": 0, "end_offset": 10,
         "subscribers": 0, "online_subscribers": 0, "slowest_committed": None,
         "slowest_subscriber": None, "backlog_messages": 0, "backlog_bytes": 0,
         "oldest_undelivered_at": None, "oldest_age_s": None},
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(backlog), root / "queue_backlog" / "part-0.parquet")
    timeline = [
        {"client_id": "sensor-1", "window_start": T0 + timedelta(minutes=i),
         "window_end": T0 + timedelta(minutes=i + 1), "messages": 24, "bytes": 2400,
         "deliveries": 48}
        for i in range(5)
    ]  # fmt: skip
    table = pa.Table.from_pylist(timeline)
    table = table.set_column(1, "window_start", table["window_start"].cast(ts))
    pq.write_table(table, root / "timeline" / "part-0.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"fanout": 0, "messages": 5}, {"fanout": 2, "messages": 200}]),
        root / "fanout_histogram" / "part-0.parquet",
    )
    meta = {
        "generated_at_ms": int(T0.timestamp() * 1000), "data_dir": "/data", "since_ms": None,
        "until_ms": None, "window_s": 60, "segments": 3, "compacted_segments": 2,
        "messages": 205, "devices": 3, "topics": 1, "bytes": 76_010, "deliveries": 245,
        "eligible": 445, "light_queues": 2, "subscribers": 3, "duration_s": 1.0,
        "deliveries_acked": 195, "deliveries_qos0": 50, "unreached_devices": 1,
        "gateway": {"messages": 7, "bytes": 70, "topics": 2, "deliveries": 3},
    }  # fmt: skip
    (root / "meta.json").write_text(json.dumps(meta))
    return out


def test_top_devices_sorted_by_each_key(tmp_path: Path) -> None:
    report = Report.load(make_report(tmp_path))
    assert report.top("messages", 2)["client_id"].to_pylist() == ["sensor-1", "sensor-2"]
    assert report.top("bytes", 1)["client_id"].to_pylist() == ["sensor-2"]
    assert report.top("deliveries", 3)["client_id"].to_pylist() == [
        "sensor-1", "gw-<b>&", "sensor-2"]  # fmt: skip
    assert report.top("backlog", 1)["queue"].to_pylist() == ["%LMQ%a"]


def test_show_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = make_report(tmp_path)
    assert main(["show", "--out", str(out), "--top", "2", "--by", "bytes"]) == 0
    text = capsys.readouterr().out
    assert "205 messages" in text
    assert text.index("sensor-2") < text.index("sensor-1")
    assert "gw-<b>&" not in text  # --top 2


def test_show_device_and_backlog(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = make_report(tmp_path)
    assert main(["show", "--out", str(out), "--device", "sensor-1"]) == 0
    text = capsys.readouterr().out
    assert "240 of 360 due" in text and "66.7%" in text
    assert main(["show", "--out", str(out), "--by", "backlog"]) == 0
    assert "1.0h" in capsys.readouterr().out


def test_unknown_device_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = make_report(tmp_path)
    assert main(["show", "--out", str(out), "--device", "sensor-9"]) == 2
    err = capsys.readouterr().err
    assert "'sensor-9' is not in the report (3 devices)" in err
    assert "did you mean" in err and "Traceback" not in err


def test_no_report_yet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--out", str(tmp_path)]) == 2
    assert "no fan-out report in" in capsys.readouterr().err


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--out", str(tmp_path), "--by", "color"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["show", "--out", str(make_report(tmp_path)), "--top", "0"]) == 2


def test_html_is_self_contained(tmp_path: Path) -> None:
    out = make_report(tmp_path)
    page = tmp_path / "r.html"
    assert main(["show", "--out", str(out), "--html", str(page)]) == 0
    html = page.read_text()
    assert html.count("<svg") == 7
    assert "<script" not in html
    assert "gateway ($SYS, not a device): 7 messages" in html
    # Nothing is fetched: the only URL is the SVG namespace name.
    assert "http" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "gw-&lt;b&gt;&amp;" in html and "gw-<b>&" not in html
    assert "60 msgs" in html  # backlog bar of %LMQ%a


def test_show_starts_no_spark(tmp_path: Path) -> None:
    out = make_report(tmp_path)
    code = (
        "import sys; from analytics.cli import main; "
        f"rc = main(['show', '--out', {str(out)!r}, '--html', {str(tmp_path / 'x.html')!r}]); "
        "assert 'pyspark' not in sys.modules, 'show imported pyspark'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_show_answers_the_operator_questions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(make_report(tmp_path))
    assert main(["show", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "195 acknowledged (QoS 1/2), 50 sent at QoS 0; 1 devices reached no subscriber" in text
    assert "gateway ($SYS, not a device): 7 messages" in text
    # Which devices' messages reached no subscriber.
    assert main(["show", "--out", out, "--view", "unreached"]) == 0
    text = capsys.readouterr().out
    assert "sensor-2" in text and "sensor-1" not in text
    # Which subscribers fall behind, since when, and their lag over time.
    assert main(["show", "--out", out, "--view", "lagging"]) == 0
    text = capsys.readouterr().out
    assert "slow-1" in text and "05-01 12:01" in text
    assert "fast-1" not in text and "gone-1" not in text  # caught up / ended
    assert " ▂▃▅▆█" in text  # 0, 12 .. 60 per window
    # Deliveries per filter, most first.
    assert main(["show", "--out", out, "--view", "filters"]) == 0
    text = capsys.readouterr().out
    assert text.index("a/#") < text.index("c/+") and "150" in text
    # Top topics by fan-out: deliveries per message first.
    assert main(["show", "--out", out, "--view", "topics", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert text.index("a/b") < text.index("a/c") and "z/quiet" not in text
    assert Report.load(out).top_topics(3)["topic"].to_pylist() == ["a/b", "a/c", "z/quiet"]
