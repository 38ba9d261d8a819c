"""One self-contained HTML page for a fan-out report: inline CSS and SVG, no script, no CDN.

The page opens offline in any browser and can be mailed as one file. Charts: the dispatch
fan-out distribution, top devices, backlog per light queue, the timeline of messages and
deliveries, deliveries per filter, top topics by fan-out and the lag over time of the
subscribers falling behind; then the devices whose messages reached no subscriber, the lagging
subscribers and the top devices as tables. The gateway's own messages ($SYS) have their own line.

Every chart is an <svg data-chart=NAME>; each bar is a <rect class=bar> and each point a
<circle class=pt>, which is what the browser test counts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from analytics.copies import shown
from analytics.show import Report, _fmt_age, _fmt_bytes, _fmt_ms, _fmt_ratio, _fmt_ts

_W = 720
_BAR_H = 18
_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:760px;color:#1d2430;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#5b6575;margin-bottom:16px}.kpi{display:flex;flex-wrap:wrap;gap:8px}
.kpi div{border:1px solid #dde2ea;border-radius:6px;padding:8px 12px;min-width:120px}
.kpi b{display:block;font-size:18px}table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:4px 6px;border-bottom:1px solid #eef1f5;text-align:right}
th:first-child,td:first-child{text-align:left}svg text{font:11px sans-serif;fill:#1d2430}
.empty{color:#8a93a3;font-style:italic}
"""


def write_html(report: Report, path: str | Path, top: int = 15) -> Path:
    """Render the report to `path` and return it."""
    out = Path(path)
    out.write_text(render_html(report, top), encoding="utf-8")
    return out


def render_html(report: Report, top: int = 15) -> str:
    m = report.meta
    ratio = m["deliveries"] / m["eligible"] if m.get("eligible") else None
    kpis = [
        ("messages", f"{m['messages']:,}"),
        ("devices", f"{m['devices']:,}"),
        ("topics", f"{m['topics']:,}"),
        ("bytes", _fmt_bytes(m["bytes"])),
        ("deliveries", f"{m['deliveries']:,}"),
        ("acknowledged", f"{m.get('deliveries_acked', 0):,}"),
        ("sent at QoS 0", f"{m.get('deliveries_qos0', 0):,}"),
        ("devices reaching nobody", f"{m.get('unreached_devices', 0):,}"),
        ("delivery ratio", _fmt_ratio(ratio)),
        ("light queues", f"{m['light_queues']:,}"),
        ("subscribers", f"{m['subscribers']:,}"),
    ]
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        "<meta name=viewport content='width=device-width,initial-scale=1'>",
        f"<title>lmqtt fan-out report {escape(_fmt_ms(m['generated_at_ms']))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>lmqtt fan-out report</h1>",
        f"<div class=sub>generated {escape(_fmt_ms(m['generated_at_ms']))} from "
        f"{escape(m['data_dir'])}; {m['segments']} segments ({m['compacted_segments']} "
        f"compacted); window {m['window_s']} s</div>",
        "<div class=kpi>",
        *(f"<div>{escape(k)}<b>{escape(v)}</b></div>" for k, v in kpis),
        "</div>",
        _gateway_line(m),
        "<h2>Dispatch fan-out (light queues per message)</h2>",
        _fanout_chart(report),
        "<h2>Top devices by messages</h2>",
        _device_chart(report, top),
        "<h2>Backlog per light queue</h2>",
        _backlog_chart(report, top),
        "<h2>Timeline: messages and deliveries per window</h2>",
        _timeline_chart(report),
        "<h2>Deliveries per filter</h2>",
        _filter_chart(report, top),
        "<h2>Top topics by fan-out (deliveries per message)</h2>",
        _topic_chart(report, top),
        "<h2>Devices whose messages reached no subscriber</h2>",
        _unreached_table(report, 50),
        "<h2>Subscribers falling behind: lag over time</h2>",
        _lag_chart(report, LAG_LINES),
        _lagging_table(report, 50),
        "<h2>Devices</h2>",
        _device_table(report, 50),
        "</body></html>",
    ]
    return "\n".join(parts)


def _fanout_chart(report: Report) -> str:
    t = report.table("fanout_histogram")
    pairs = sorted(zip(t["fanout"].to_pylist(), t["messages"].to_pylist(), strict=True))
    if not pairs:
        return "<p class=empty>no messages</p>"
    h, pad = 180, 30
    peak = max(n for _, n in pairs) or 1
    slot = (_W - 2 * pad) / len(pairs)
    bars = []
    for i, (fanout, n) in enumerate(pairs):
        bh = (h - 2 * pad) * n / peak
        x = pad + i * slot
        bars.append(
            f"<rect class=bar x={x + 2:.1f} y={h - pad - bh:.1f} width={max(1.0, slot - 4):.1f} "
            f"height={bh:.1f} fill='#3b7dd8'><title>{fanout} queues: {n:,} messages</title></rect>"
            f"<text x={x + slot / 2:.1f} y={h - pad + 14} text-anchor=middle>{fanout}</text>"
            f"<text x={x + slot / 2:.1f} y={h - pad - bh - 4:.1f} text-anchor=middle>{n:,}</text>"
        )
    return _svg(h, "".join(bars), "messages per dispatch fan-out", "fanout")


def _hbars(rows: list[tuple[str, float, str]], color: str, title: str, name: str) -> str:
    if not rows:
        return "<p class=empty>nothing to show</p>"
    label_w = 220
    h = len(rows) * (_BAR_H + 4) + 8
    peak = max(v for _, v, _ in rows) or 1
    items = []
    for i, (label, value, text) in enumerate(rows):
        y = 4 + i * (_BAR_H + 4)
        w = (_W - label_w - 90) * value / peak
        short = label if len(label) <= 32 else label[:31] + "…"
        items.append(
            f"<text x={label_w - 6} y={y + 13} text-anchor=end>{escape(short)}</text>"
            f"<rect class=bar x={label_w} y={y} width={max(w, 1):.1f} height={_BAR_H} "
            f"fill='{color}'>"
            f"<title>{escape(label)}: {escape(text)}</title></rect>"
            f"<text x={label_w + w + 4:.1f} y={y + 13}>{escape(text)}</text>"
        )
    return _svg(h, "".join(items), title, name)


def _device_chart(report: Report, top: int) -> str:
    rows = report.top("messages", top).to_pylist()
    return _hbars(
        [
            (
                r["client_id"] or "(no client id)",
                float(r["messages"]),
                f"{r['messages']:,} msgs, {r['deliveries']:,} deliveries",
            )
            for r in rows
        ],
        "#3b7dd8",
        "top devices",
        "devices",
    )


def _backlog_chart(report: Report, top: int) -> str:
    rows = [r for r in report.top("backlog", top).to_pylist() if r["backlog_messages"] > 0]
    return _hbars(
        [
            (
                shown(r["queue"], r["filter"]),
                float(r["backlog_messages"]),
                f"{r['backlog_messages']:,} msgs, {_fmt_bytes(r['backlog_bytes'])}, "
                f"oldest {_fmt_age(r['oldest_age_s'])}",
            )
            for r in rows
        ],
        "#d8743b",
        "backlog per queue",
        "backlog",
    )


def _timeline_chart(report: Report) -> str:
    t = report.table("timeline")
    if t.num_rows == 0:
        return "<p class=empty>no messages</p>"
    msgs: dict[datetime, int] = defaultdict(int)
    deliv: dict[datetime, int] = defaultdict(int)
    for start, n, d in zip(
        t["window_start"].to_pylist(),
        t["messages"].to_pylist(),
        t["deliveries"].to_pylist(),
        strict=True,
    ):
        msgs[start] += n
        deliv[start] += d
    keys = sorted(msgs)
    h, pad = 220, 36
    peak = max([*msgs.values(), *deliv.values(), 1])
    step = (_W - 2 * pad) / max(1, len(keys) - 1)

    def line(series: dict[datetime, int], color: str) -> str:
        pts = " ".join(
            f"{pad + i * step:.1f},{h - pad - (h - 2 * pad) * series[k] / peak:.1f}"
            for i, k in enumerate(keys)
        )
        dots = "".join(
            f"<circle class=pt cx={pad + i * step:.1f} "
            f"cy={h - pad - (h - 2 * pad) * series[k] / peak:.1f}"
            f" r=2 fill='{color}'><title>{escape(_fmt_ts(k))}: {series[k]:,}</title></circle>"
            for i, k in enumerate(keys)
        )
        return f"<polyline fill=none stroke='{color}' stroke-width=2 points='{pts}'/>{dots}"

    axis = (
        f"<line x1={pad} y1={h - pad} x2={_W - pad} y2={h - pad} stroke='#99a'/>"
        f"<text x={pad} y={h - pad + 16}>{escape(_fmt_ts(keys[0]))}</text>"
        f"<text x={_W - pad} y={h - pad + 16} text-anchor=end>{escape(_fmt_ts(keys[-1]))}</text>"
        f"<text x={pad} y={pad - 10}>peak {peak:,} per window</text>"
        f"<rect x={_W - 230} y=8 width=10 height=10 fill='#3b7dd8'/>"
        f"<text x={_W - 215} y=17>messages</text>"
        f"<rect x={_W - 140} y=8 width=10 height=10 fill='#2c9c5a'/>"
        f"<text x={_W - 125} y=17>deliveries</text>"
    )
    return _svg(h, axis + line(msgs, "#3b7dd8") + line(deliv, "#2c9c5a"), "timeline", "timeline")


def _device_table(report: Report, n: int) -> str:
    t = report.top("messages", n)
    if t.num_rows == 0:
        return "<p class=empty>no devices</p>"
    head = ("device", "messages", "bytes", "topics", "fan-out mean", "p99", "deliveries",
            "ratio", "reached", "last seen")  # fmt: skip
    rows = []
    for r in t.to_pylist():
        cells = (
            r["client_id"] or "(no client id)",
            f"{r['messages']:,}",
            _fmt_bytes(r["bytes"]),
            str(r["topics"]),
            f"{r['fanout_mean']:.2f}",
            f"{r['fanout_p99']:g}",
            f"{r['deliveries']:,}",
            _fmt_ratio(r["delivery_ratio"]),
            str(r["subscribers_reached"]),
            _fmt_ts(r["last_seen"]),
        )
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    total = int(pc.count(report.table("device_fanout")["client_id"]).as_py())
    more = f"<p class=sub>{total - t.num_rows:,} more devices</p>" if total > t.num_rows else ""
    return (
        "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"
        + "".join(rows) + "</table>" + more
    )  # fmt: skip


def _svg(height: int, body: str, label: str, name: str) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' data-chart={name} width={_W} height={height} "
        f"viewBox='0 0 {_W} {height}' role=img aria-label='{escape(label)}'>{body}</svg>"
    )


LAG_LINES = 6  # subscribers drawn in the lag chart
_PALETTE = ("#d8743b", "#3b7dd8", "#2c9c5a", "#9c2c8e", "#8e7a1d", "#1d8e8a")


def _gateway_line(m: dict[str, Any]) -> str:
    gw = m.get("gateway") or {}
    if not gw.get("messages"):
        return ""
    return (
        f"<p class=sub>gateway ($SYS, not a device): {gw['messages']:,} messages, "
        f"{escape(_fmt_bytes(gw.get('bytes')))}, {gw.get('topics', 0):,} topics, "
        f"{gw.get('deliveries', 0):,} deliveries</p>"
    )


def _filter_chart(report: Report, top: int) -> str:
    rows = [r for r in report.filters().to_pylist() if r["deliveries"] > 0][:top]
    return _hbars(
        [
            (
                shown(r["queue"], r["filter"]),
                float(r["deliveries"]),
                f"{r['deliveries']:,} ({r['deliveries_acked']:,} acked, "
                f"{r['deliveries_qos0']:,} QoS 0)",
            )
            for r in rows
        ],
        "#2c9c5a",
        "deliveries per filter",
        "filters",
    )


def _topic_chart(report: Report, top: int) -> str:
    rows = [r for r in report.top_topics(top).to_pylist() if r["messages"] > 0]
    return _hbars(
        [
            (
                r["topic"],
                float(r["delivered_fanout"]),
                f"{r['delivered_fanout']:.2f} per msg, {r['messages']:,} msgs",
            )
            for r in rows
        ],
        "#9c2c8e",
        "top topics by fan-out",
        "topics",
    )


def _lag_chart(report: Report, lines: int) -> str:
    lagging = report.lagging().to_pylist()[:lines]
    series = []
    for r in lagging:
        hist = report.lag_history(r["subscriber"], r["queue"])
        pts = list(zip(hist["window_start"].to_pylist(), hist["lag_max"].to_pylist(), strict=True))
        if pts:
            series.append((f"{r['subscriber']} ({shown(r['queue'], r['filter'])})", pts))
    if not series:
        return "<p class=empty>no subscriber is behind</p>"
    h, pad = 220, 36
    keys = sorted({k for _, pts in series for k, _ in pts})
    pos = {k: i for i, k in enumerate(keys)}
    step = (_W - 2 * pad) / max(1, len(keys) - 1)
    peak = max(v for _, pts in series for _, v in pts) or 1
    body = [
        f"<line x1={pad} y1={h - pad} x2={_W - pad} y2={h - pad} stroke='#99a'/>",
        f"<text x={pad} y={h - pad + 16}>{escape(_fmt_ts(keys[0]))}</text>",
        f"<text x={_W - pad} y={h - pad + 16} text-anchor=end>{escape(_fmt_ts(keys[-1]))}</text>",
        f"<text x={pad} y={pad - 10}>peak lag {peak:,} messages</text>",
    ]
    for n, (label, pts) in enumerate(series):
        color = _PALETTE[n % len(_PALETTE)]
        xy = [(pad + pos[k] * step, h - pad - (h - 2 * pad) * v / peak, k, v) for k, v in pts]
        body.append(
            f"<polyline fill=none stroke='{color}' stroke-width=2 "
            f"points='{' '.join(f'{x:.1f},{y:.1f}' for x, y, _, _ in xy)}'/>"
        )
        body.extend(
            f"<circle class=pt cx={x:.1f} cy={y:.1f} r=2.5 fill='{color}'><title>"
            f"{escape(label)} {escape(_fmt_ts(k))}: lag {v:,}</title></circle>"
            for x, y, k, v in xy
        )
        body.append(
            f"<text x={_W - pad} y={16 + 13 * n} text-anchor=end fill='{color}'>"
            f"{escape(label)}</text>"
        )
    return _svg(h, "".join(body), "lag over time", "lag")


def _unreached_table(report: Report, n: int) -> str:
    t = report.unreached_devices()
    rows = [
        (r["client_id"], f"{r['messages']:,}", _fmt_bytes(r["bytes"]), str(r["topics"]),
         f"{r['eligible']:,}", _fmt_ts(r["last_seen"]))
        for r in t.to_pylist()[:n]
    ]  # fmt: skip
    if not rows:
        return "<p class=empty>every device reached at least one subscriber</p>"
    return _html_table(("device", "messages", "bytes", "topics", "due", "last seen"), rows)


def _lagging_table(report: Report, n: int) -> str:
    rows = [
        (r["subscriber"], shown(r["queue"], r["filter"]), r["kind"], "yes" if r["online"] else "no",
         f"{r['lag']:,}", _fmt_ts(r["behind_since"]))
        for r in report.lagging().to_pylist()[:n]
    ]  # fmt: skip
    if not rows:
        return ""
    return _html_table(("subscriber", "filter", "kind", "online", "lag", "behind since"), rows)


def _html_table(head: tuple[str, ...], rows: Sequence[tuple[Any, ...]]) -> str:
    return (
        "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"
        + "".join(
            "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows
        )
        + "</table>"
    )  # fmt: skip
