"""One self-contained HTML page for a fan-out report: inline CSS and SVG, no script, no CDN.

The page opens offline in any browser and can be mailed as one file. Charts: the dispatch
fan-out distribution, top devices, backlog per light queue and the timeline of messages and
deliveries; then the top devices as a table.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from html import escape
from pathlib import Path

import pyarrow.compute as pc

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
        "<h2>Dispatch fan-out (light queues per message)</h2>",
        _fanout_chart(report),
        "<h2>Top devices by messages</h2>",
        _device_chart(report, top),
        "<h2>Backlog per light queue</h2>",
        _backlog_chart(report, top),
        "<h2>Timeline: messages and deliveries per window</h2>",
        _timeline_chart(report),
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
            f"<rect x={x + 2:.1f} y={h - pad - bh:.1f} width={max(1.0, slot - 4):.1f} "
            f"height={bh:.1f} fill='#3b7dd8'><title>{fanout} queues: {n:,} messages</title></rect>"
            f"<text x={x + slot / 2:.1f} y={h - pad + 14} text-anchor=middle>{fanout}</text>"
            f"<text x={x + slot / 2:.1f} y={h - pad - bh - 4:.1f} text-anchor=middle>{n:,}</text>"
        )
    return _svg(h, "".join(bars), "messages per dispatch fan-out")


def _hbars(rows: list[tuple[str, float, str]], color: str, title: str) -> str:
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
            f"<rect x={label_w} y={y} width={max(w, 1):.1f} height={_BAR_H} fill='{color}'>"
            f"<title>{escape(label)}: {escape(text)}</title></rect>"
            f"<text x={label_w + w + 4:.1f} y={y + 13}>{escape(text)}</text>"
        )
    return _svg(h, "".join(items), title)


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
    )


def _backlog_chart(report: Report, top: int) -> str:
    rows = [r for r in report.top("backlog", top).to_pylist() if r["backlog_messages"] > 0]
    return _hbars(
        [
            (
                r["filter"] or r["queue"],
                float(r["backlog_messages"]),
                f"{r['backlog_messages']:,} msgs, {_fmt_bytes(r['backlog_bytes'])}, "
                f"oldest {_fmt_age(r['oldest_age_s'])}",
            )
            for r in rows
        ],
        "#d8743b",
        "backlog per queue",
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
            f"<circle cx={pad + i * step:.1f} cy={h - pad - (h - 2 * pad) * series[k] / peak:.1f}"
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
    return _svg(h, axis + line(msgs, "#3b7dd8") + line(deliv, "#2c9c5a"), "timeline")


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


def _svg(height: int, body: str, label: str) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width={_W} height={height} "
        f"viewBox='0 0 {_W} {height}' role=img aria-label='{escape(label)}'>{body}</svg>"
    )
