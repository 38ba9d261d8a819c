"""The HTML report as a person sees it: rendered by headless Chromium (Debian's `chromium`).

A small check script is written into a copy of the page: it records every script error into the
DOM and, once the page has laid out, counts per chart (<svg data-chart=NAME>) the bars and points
that were drawn with a non-empty size. `chromium --headless --dump-dom` prints the DOM after
that, and the counts are compared with the report's own tables.

Chromium is installed here when missing (apt-get, as root). Where that cannot be done the test
is skipped with the reason, except in CI (CI=true), where it fails instead.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from analytics.fanout import ReportMeta
from analytics.html_report import LAG_LINES, render_html
from analytics.show import Report

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

TOP = 15

_ERRORS_HOOK = """<script>
window.__errors = [];
window.addEventListener("error", function (e) { window.__errors.push(String(e.message)); });
</script>"""

_CHECK = """<pre id=__check></pre><script>
(function () {
  var out = {errors: window.__errors, charts: {}};
  document.querySelectorAll("svg[data-chart]").forEach(function (svg) {
    var box = svg.getBoundingClientRect();
    var drawn = function (sel) {
      return Array.prototype.filter.call(svg.querySelectorAll(sel), function (el) {
        var b = el.getBBox();
        return b.width > 0 && b.height > 0;
      }).length;
    };
    out.charts[svg.dataset.chart] = {
      width: box.width, height: box.height, bars: drawn("rect.bar"), points: drawn("circle.pt")
    };
  });
  document.getElementById("__check").textContent = JSON.stringify(out);
})();
</script>"""


def _install_chromium() -> str | None:
    """Install Debian's chromium; the reason it could not be done, or None."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "chromium is not installed and apt-get cannot be run here (not root / no apt)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=600", "chromium"],
    ):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{' '.join(cmd)} failed: {e}"
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}"
    return None if shutil.which("chromium") else "apt-get installed no chromium binary"


@pytest.fixture(scope="session")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        reason = _install_chromium()
        path = shutil.which("chromium")
        if path is None:
            message = f"headless Chromium unavailable: {reason}"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(message)
            pytest.skip(message)
    return path


def _render(chromium: str, page: str, tmp_path: Path) -> dict[str, Any]:
    """The check's findings for `page` as Chromium laid it out."""
    page = page.replace("<head>", "<head>" + _ERRORS_HOOK, 1)
    page = page.replace("</body>", _CHECK + "</body>", 1)
    path = tmp_path / "page.html"
    path.write_text(page, encoding="utf-8")
    profile = tmp_path / "profile"
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}", "--window-size=1000,3000", "--dump-dom", path.as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r'<pre id="__check">(.*?)</pre>', done.stdout, re.S)
    assert found is not None, f"the check did not run: {done.stdout[-1000:]}"
    return json.loads(html.unescape(found.group(1)))


def test_charts_are_drawn_without_script_errors(
    chromium: str, report: tuple[Path, ReportMeta], tmp_path: Path
) -> None:
    out, _ = report
    r = Report.load(out)
    seen = _render(chromium, render_html(r, TOP), tmp_path)
    assert seen["errors"] == []
    charts = seen["charts"]
    # What each chart must show, from the report's tables.
    timeline_windows = len(set(r.table("timeline")["window_start"].to_pylist()))
    lagging = r.lagging().to_pylist()[:LAG_LINES]
    lag_points = sum(r.lag_history(s["subscriber"], s["queue"]).num_rows for s in lagging)
    backlog_bars = sum(x["backlog_messages"] > 0 for x in r.top("backlog", TOP).to_pylist())
    expected = {
        "fanout": ("bars", r.table("fanout_histogram").num_rows),
        "devices": ("bars", min(TOP, r.table("device_fanout").num_rows)),
        "backlog": ("bars", backlog_bars),
        "timeline": ("points", 2 * timeline_windows),
        "filters": ("bars", min(TOP, sum(x["deliveries"] > 0 for x in r.filters().to_pylist()))),
        "topics": ("bars", min(TOP, r.table("topic_fanout").num_rows)),
        "lag": ("points", lag_points),
    }  # fmt: skip
    assert set(charts) == set(expected)
    for name, (kind, n) in expected.items():
        chart = charts[name]
        assert n > 0, f"the reference report should give chart {name} something to draw"
        assert chart["width"] > 0 and chart["height"] > 0, name
        assert chart[kind] == n, (name, chart)


def test_the_check_sees_script_errors(chromium: str, tmp_path: Path) -> None:
    """The harness itself: a page whose script throws is reported as such."""
    page = "<!doctype html><html><head></head><body><script>undefinedCall();</script></body></html>"
    seen = _render(chromium, page, tmp_path)
    assert len(seen["errors"]) == 1 and "undefinedCall" in seen["errors"][0]
    assert seen["charts"] == {}
