"""`lmqtt report show`: answers from the last report's Parquet files, without Spark.

Only pyarrow and rich are imported here (no pyspark, no JVM), so an answer takes a fraction of
a second even for large reports.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich import box
from rich.console import Console
from rich.table import Table

from analytics.copies import shown
from analytics.errors import ReportNotFoundError, UnknownDeviceError
from analytics.reportfiles import META_FILE, REPORT_DIR

SORT_KEYS = {
    "messages": "messages",
    "bytes": "bytes",
    "fanout": "fanout_mean",
    "deliveries": "deliveries",
    "backlog": "backlog_messages",
}


@dataclass
class Report:
    """The last finished report of an output directory; tables are read on first use."""

    root: Path
    meta: dict[str, Any]
    _tables: dict[str, pa.Table] = field(default_factory=dict)

    @classmethod
    def load(cls, out_dir: str | Path) -> Report:
        root = Path(out_dir) / REPORT_DIR
        try:
            meta = json.loads((root / META_FILE).read_text())
        except FileNotFoundError:
            raise ReportNotFoundError(
                f"no fan-out report in {out_dir}: run `lmqtt report fanout --data-dir DIR "
                f"--out {out_dir}` first"
            ) from None
        except (OSError, ValueError) as e:
            raise ReportNotFoundError(f"the report in {root} is unreadable: {e}") from None
        return cls(root, meta)

    def table(self, name: str) -> pa.Table:
        if name not in self._tables:
            path = self.root / name
            try:
                self._tables[name] = pq.read_table(path)
            except (OSError, pa.ArrowInvalid) as e:
                raise ReportNotFoundError(f"report table {path} is unreadable: {e}") from None
        return self._tables[name]

    def top(self, by: str, n: int) -> pa.Table:
        """The n first rows of device_fanout (or queue_backlog for by=backlog), descending."""
        name = "queue_backlog" if by == "backlog" else "device_fanout"
        t = self.table(name)
        key = SORT_KEYS[by]
        tie = "queue" if by == "backlog" else "client_id"
        idx = pc.sort_indices(t, sort_keys=[(key, "descending"), (tie, "ascending")])
        return t.take(idx[:n])

    def device(self, client_id: str) -> dict[str, Any]:
        t = self.table("device_fanout")
        rows = t.filter(pc.equal(t["client_id"], client_id)).to_pylist()
        if not rows:
            known = t["client_id"].to_pylist()
            close = difflib.get_close_matches(client_id, [str(k) for k in known], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownDeviceError(
                f"device {client_id!r} is not in the report ({len(known)} devices){hint}"
            )
        return dict(rows[0])

    def unreached_devices(self) -> pa.Table:
        """Devices none of whose messages in the window reached a subscriber, busiest first."""
        t = self.table("device_fanout")
        t = t.filter(pc.equal(t["deliveries"], 0))
        return t.take(pc.sort_indices(t, [("messages", "descending"), ("client_id", "ascending")]))

    def lagging(self) -> pa.Table:
        """Open subscriptions with messages not yet acknowledged, the furthest behind first."""
        t = self.table("subscribers")
        t = t.filter(pc.and_(t["open"], pc.greater(t["lag"], 0)))
        return t.take(pc.sort_indices(t, [("lag", "descending"), ("subscriber", "ascending")]))

    def lag_history(self, subscriber: str, queue: str) -> pa.Table:
        t = self.table("subscriber_lag")
        t = t.filter(pc.and_(pc.equal(t["subscriber"], subscriber), pc.equal(t["queue"], queue)))
        return t.take(pc.sort_indices(t, [("window_start", "ascending")]))

    def filters(self) -> pa.Table:
        """Deliveries per subscription filter (light queue), most first."""
        t = self.table("filter_deliveries")
        return t.take(pc.sort_indices(t, [("deliveries", "descending"), ("queue", "ascending")]))

    def top_topics(self, n: int) -> pa.Table:
        """Topics by delivered fan-out: deliveries per message, then dispatch fan-out."""
        t = self.table("topic_fanout")
        per_msg = pc.divide(pc.cast(t["deliveries"], pa.float64()), t["messages"])
        t = t.append_column("delivered_fanout", per_msg)
        idx = pc.sort_indices(
            t,
            [("delivered_fanout", "descending"), ("fanout_mean", "descending"),
             ("topic", "ascending")],
        )  # fmt: skip
        return t.take(idx[:n])

    def device_timeline(self, client_id: str) -> pa.Table:
        t = self.table("timeline")
        t = t.filter(pc.equal(t["client_id"], client_id))
        return t.take(pc.sort_indices(t, sort_keys=[("window_start", "ascending")]))


def render_summary(report: Report, console: Console) -> None:
    m = report.meta
    generated = _fmt_ms(m["generated_at_ms"])
    ratio = m["deliveries"] / m["eligible"] if m.get("eligible") else None
    span = ""
    if m.get("since_ms") or m.get("until_ms"):
        since = _fmt_ms(m["since_ms"]) if m.get("since_ms") else "start"
        until = _fmt_ms(m["until_ms"]) if m.get("until_ms") else "now"
        span = f"  window {since} .. {until}"
    console.print(
        f"[bold]lmqtt fan-out report[/] {generated}  data {m['data_dir']}{span}\n"
        f"{m['messages']:,} messages  {m['devices']:,} devices  {m['topics']:,} topics  "
        f"{_fmt_bytes(m['bytes'])}  {m['deliveries']:,} deliveries"
        + (f" ({ratio:.1%} of due)" if ratio is not None else "")
        + f"  {m['light_queues']:,} light queues  {m['subscribers']:,} subscribers"
    )
    if "deliveries_qos0" in m:
        console.print(
            f"deliveries: {m.get('deliveries_acked', 0):,} acknowledged (QoS 1/2), "
            f"{m['deliveries_qos0']:,} sent at QoS 0; "
            f"{m.get('unreached_devices', 0):,} devices reached no subscriber",
            highlight=False,
            soft_wrap=True,
        )
    gw = m.get("gateway") or {}
    if gw.get("messages"):
        console.print(
            f"gateway ($SYS, not a device): {gw['messages']:,} messages, "
            f"{_fmt_bytes(gw.get('bytes'))}, {gw.get('topics', 0):,} topics, "
            f"{gw.get('deliveries', 0):,} deliveries",
            highlight=False,
            soft_wrap=True,
        )


def render_top(report: Report, by: str, n: int, console: Console) -> None:
    rows = report.top(by, n).to_pylist()
    if by == "backlog":
        table = Table(
            title=f"light queues by backlog (top {n})", title_justify="left", box=box.SIMPLE_HEAD
        )
        for col in ("queue", "filter", "end", "subs", "slowest", "backlog", "bytes", "oldest"):
            if col in ("queue", "filter"):
                table.add_column(col, overflow="fold", min_width=10)
            else:
                table.add_column(col, justify="right")
        for r in rows:
            table.add_row(
                shown(r["queue"]),
                r["filter"] or "",
                f"{r['end_offset']:,}",
                str(r["subscribers"]),
                _opt(r["slowest_committed"]),
                f"{r['backlog_messages']:,}",
                _fmt_bytes(r["backlog_bytes"]),
                _fmt_age(r["oldest_age_s"]),
            )
    else:
        table = Table(title=f"devices by {by} (top {n})", title_justify="left", box=box.SIMPLE_HEAD)
        cols = ("device", "msgs", "bytes", "topics", "fan-out", "p99", "max", "delivered",
                "ratio", "subs")  # fmt: skip
        for col in cols:
            if col == "device":
                table.add_column(col, overflow="fold", min_width=10)
            else:
                table.add_column(col, justify="right")
        for r in rows:
            table.add_row(
                r["client_id"] or "(no client id)",
                f"{r['messages']:,}",
                _fmt_bytes(r["bytes"]),
                str(r["topics"]),
                f"{r['fanout_mean']:.2f}",
                f"{r['fanout_p99']:g}",
                str(r["fanout_max"]),
                f"{r['deliveries']:,}",
                _fmt_ratio(r["delivery_ratio"]),
                str(r["subscribers_reached"]),
            )
    console.print(table)


def render_device(report: Report, client_id: str, console: Console) -> None:
    d = report.device(client_id)
    table = Table(title=f"device {client_id}", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    share = d["messages"] / report.meta["messages"] if report.meta.get("messages") else 0.0
    for label, value in (
        ("messages", f"{d['messages']:,} ({share:.1%} of all)"),
        ("bytes", _fmt_bytes(d["bytes"])),
        ("distinct topics", str(d["topics"])),
        ("dispatch fan-out mean / p50 / p99 / max",
         f"{d['fanout_mean']:.2f} / {d['fanout_p50']:g} / {d['fanout_p99']:g} / {d['fanout_max']}"),
        ("deliveries", f"{d['deliveries']:,} of {d['eligible']:,} due"),
        ("delivery ratio", _fmt_ratio(d["delivery_ratio"])),
        ("distinct subscribers reached", str(d["subscribers_reached"])),
        ("first seen", _fmt_ts(d["first_seen"])),
        ("last seen", _fmt_ts(d["last_seen"])),
    ):  # fmt: skip
        table.add_row(label, value)
    console.print(table)
    timeline = report.device_timeline(client_id).to_pylist()
    if timeline:
        t = Table(title="activity per window", title_justify="left")
        for col in ("window start", "messages", "bytes", "deliveries"):
            t.add_column(col, justify="left" if col == "window start" else "right")
        for r in timeline[-12:]:
            t.add_row(
                _fmt_ts(r["window_start"]),
                f"{r['messages']:,}",
                _fmt_bytes(r["bytes"]),
                f"{r['deliveries']:,}",
            )
        console.print(t)


def _fmt_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt_ts(value: datetime | None, short: bool = False) -> str:
    if value is None:
        return "-"
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S")


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.1%}"


def _fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _opt(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def render_unreached(report: Report, n: int, console: Console) -> None:
    rows = report.unreached_devices().to_pylist()
    table = _table(f"devices whose messages reached no subscriber ({len(rows):,})",
                   ("device", "msgs", "bytes", "topics", "due", "last seen"))  # fmt: skip
    for r in rows[:n]:
        table.add_row(
            r["client_id"], f"{r['messages']:,}", _fmt_bytes(r["bytes"]), str(r["topics"]),
            f"{r['eligible']:,}", _fmt_ts(r["last_seen"]),
        )  # fmt: skip
    console.print(table)


def render_lagging(report: Report, n: int, console: Console) -> None:
    rows = report.lagging().to_pylist()
    table = _table(f"subscribers falling behind ({len(rows):,})",
                   ("subscriber", "filter", "kind", "on", "lag", "behind since",
                    "lag/window"))  # fmt: skip
    for r in rows[:n]:
        history = report.lag_history(r["subscriber"], r["queue"])["lag_max"].to_pylist()
        table.add_row(
            r["subscriber"], shown(r["queue"], r["filter"]), r["kind"][:5],
            "yes" if r["online"] else "no", f"{r['lag']:,}",
            _fmt_ts(r["behind_since"], short=True), _spark(history[-16:]),
        )  # fmt: skip
    console.print(table)


def render_filters(report: Report, n: int, console: Console) -> None:
    rows = report.filters().to_pylist()
    table = _table("deliveries per filter",
                   ("filter", "deliveries", "acked", "QoS 0", "due", "subs"))  # fmt: skip
    for r in rows[:n]:
        table.add_row(
            shown(r["queue"], r["filter"]), f"{r['deliveries']:,}", f"{r['deliveries_acked']:,}",
            f"{r['deliveries_qos0']:,}", f"{r['eligible']:,}", str(r["subscribers_reached"]),
        )  # fmt: skip
    console.print(table)


def render_topics(report: Report, n: int, console: Console) -> None:
    rows = report.top_topics(n).to_pylist()
    table = _table(f"topics by fan-out (top {n})",
                   ("topic", "msgs", "deliveries", "per msg", "queues/msg", "devices"))  # fmt: skip
    for r in rows:
        table.add_row(
            r["topic"], f"{r['messages']:,}", f"{r['deliveries']:,}",
            f"{r['delivered_fanout']:.2f}", f"{r['fanout_mean']:.2f}", str(r["devices"]),
        )  # fmt: skip
    console.print(table)


def _table(title: str, cols: tuple[str, ...]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i, col in enumerate(cols):
        if i == 0:
            table.add_column(col, overflow="fold", min_width=10)
        else:
            table.add_column(col, justify="right", no_wrap=True)
    return table


_BLOCKS = " ▁▂▃▄▅▆▇█"


def _spark(values: list[int]) -> str:
    """A one-line chart of a series (terminal sparkline)."""
    if not values:
        return "-"
    peak = max(values) or 1
    return "".join(_BLOCKS[round(v / peak * (len(_BLOCKS) - 1))] for v in values)
