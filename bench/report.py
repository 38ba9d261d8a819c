"""Machine details, the results table (Markdown) and the docs page."""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from bench.brokers import LMQTT_NO_ACCOUNT
from bench.scenarios import SCENARIOS
from bench.workers import invalid_reason

THROUGHPUT = ("1to1_qos0", "1to1_qos1", "1to100_qos0", "1to100_qos1", "wildcard", "wildcard_many")
NAMES = {
    "lmqtt": "lmqtt",
    "lmqtt-rocketmq": "lmqtt on RocketMQ",
    "lmqtt-rocketmq-2n": "lmqtt on RocketMQ, 2 nodes",
    "lmqtt-rocketmq-3n": "lmqtt on RocketMQ, 3 nodes",
    "mosquitto": "Mosquitto",
    "amqtt": "amqtt",
}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(command: list[str]) -> str:
    if shutil.which(command[0]) is None and not Path(command[0]).exists():
        return "absent"
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else ""


def fsync_latency_ms(rounds: int = 100) -> str:
    """p50/p99 of a 4 KiB write + fsync in the temp dir: what sync flush waits for at best."""
    samples = []
    with tempfile.NamedTemporaryFile() as handle:
        for _ in range(rounds):
            os.write(handle.fileno(), b"\x00" * 4096)
            start = time.perf_counter()
            os.fsync(handle.fileno())
            samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return f"p50 {samples[rounds // 2]:.2f} ms, p99 {samples[int(rounds * 0.99)]:.2f} ms"


def machine_details() -> dict[str, Any]:
    def pkg(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    commit = _version(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"])
    return {
        "cpu": _cpu_model(),
        "cores": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "lmqtt": f"{pkg('lmqtt')} ({commit})",
        "amqtt": pkg("amqtt"),
        "mosquitto": _version(["mosquitto", "-h"]).replace("mosquitto version ", ""),
        "uvloop": pkg("uvloop"),
        "fsync": fsync_latency_ms(),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and value > 99):
        return f"{int(value):,}"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _ratio(a: Any, b: Any, meaningful: bool = True, invalid: str | None = None) -> str:
    if not meaningful or not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return "-"
    if invalid is not None:
        return invalid
    return f"{a / b:.2f}x"


Check = Callable[[dict[str, Any]], str]


def _get(results: dict[str, Any], scenario: str, broker: str, key: str) -> Any:
    median = results.get(scenario, {}).get(broker, {}).get("median")
    return None if median is None else median.get(key)


def row_validity(results: dict[str, Any], scenario: str, a: str, b: str) -> str | None:
    """Why a ratio between brokers ``a`` and ``b`` in ``scenario`` means nothing, or None.

    A run where a generator process passed GENERATOR_SATURATED of a core, or the host ran out of
    CPU, measured the bench: its ratio is replaced by the reason.
    """
    for broker in (a, b):
        flags = _get(results, scenario, broker, "flags") or []
        reason = invalid_reason(list(flags))
        if reason is not None:
            return reason
    return None


def fleet_checks(
    results: dict[str, Any], verdict: Callable[[bool | None, str], str]
) -> dict[tuple[str, str], str]:
    """Issue 21's targets for lmqtt's fleet row, by the number of devices connected: 10,000
    and more: p99 <= 5 ms, p99.9 <= 20 ms; 50,000 and more: p99 <= 10 ms; any size: RSS growth
    per device <= 5 KiB. (The latency targets hold only for a row without an invalid flag.)"""
    out: dict[tuple[str, str], str] = {}
    for name in ("fleet", "fleet_qos0"):
        connected = _get(results, name, "lmqtt", "connected")
        if connected is None:
            continue
        p99 = _get(results, name, "lmqtt", "p99_ms")
        p999 = _get(results, name, "lmqtt", "p999_ms")
        if connected >= 50_000 and p99 is not None:
            out[(name, "p99_ms")] = verdict(p99 <= 10.0, "<=10 ms at 50k")
        elif connected >= 10_000:
            if p99 is not None:
                out[(name, "p99_ms")] = verdict(p99 <= 5.0, "<=5 ms at 10k")
            if p999 is not None:
                out[(name, "p999_ms")] = verdict(p999 <= 20.0, "<=20 ms at 10k")
        kib = _get(results, name, "lmqtt", "kib_per_device")
        if kib is not None:
            out[(name, "kib_per_device")] = verdict(kib <= 5.0, "<=5 KiB")
    return out


def target_checks(results: dict[str, Any]) -> dict[tuple[str, str], str]:
    """``(scenario, metric) -> 'target: held / missed'`` for every figure the issue targets."""
    verdicts: dict[tuple[str, str], str] = {}

    def verdict(ok: bool | None, text: str) -> str:
        if ok is None:
            return f"{text}: n/a"
        return f"{text}: {'held' if ok else 'MISSED'}"

    for name in THROUGHPUT:
        for key in ("deliveries_per_s", "deliveries_per_cpu_s"):
            lm = _get(results, name, "lmqtt", key)
            mo = _get(results, name, "mosquitto", key)
            am = _get(results, name, "amqtt", key)
            parts = []
            if lm is not None and mo:
                parts.append(verdict(lm >= 0.5 * mo, ">=0.5x Mosq"))
            if lm is not None and am:
                parts.append(verdict(lm >= 10 * am, ">=10x amqtt"))
            verdicts[(name, key)] = "; ".join(parts) or "n/a"
    p99 = _get(results, "latency_async", "lmqtt", "p99_ms")
    verdicts[("latency_async", "p99_ms")] = verdict(None if p99 is None else p99 <= 3.0, "<=3 ms")
    kib = _get(results, "idle", "lmqtt", "kib_per_connection")
    verdicts[("idle", "kib_per_connection")] = verdict(
        None if kib is None else kib <= 5.0, "<=5 KiB"
    )
    rate = _get(results, "idle", "lmqtt", "connects_per_s")
    verdicts[("idle", "connects_per_s")] = verdict(None if rate is None else rate >= 5000, ">=5k/s")
    for key in ("growth_mb_per_million", "anon_growth_mb_per_million"):
        growth = _get(results, "backlog", "lmqtt", key)
        verdicts[("backlog", key)] = verdict(None if growth is None else growth <= 100, "<=100 MB")
    verdicts.update(fleet_checks(results, verdict))
    lost = _get(results, "durability", "lmqtt", "acked_lost")
    verdicts[("durability", "acked_lost")] = verdict(None if lost is None else lost == 0, "0 lost")
    return verdicts


def render_markdown(document: dict[str, Any]) -> str:
    results: dict[str, Any] = document["results"]
    settings = document["settings"]
    machine = document["machine"]
    brokers = [b for b in NAMES if any(b in r for r in results.values())]
    verdicts = target_checks(results)
    lines = [
        f"Run {document['started']} .. {document['finished']} UTC;"
        f" duration {settings['duration']} s per run, median of {settings['repeat']}"
        " (idle, backlog, durability: 1 run)"
        + (
            f"; {', '.join(settings['scenarios'])} re-run and merged in"
            if document.get("merged_from")
            else ""
        ),
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "open_files_limit"),
        "",
        "| scenario | figure | "
        + " | ".join(NAMES[b] for b in brokers)
        + " | lmqtt/Mosquitto | lmqtt/amqtt | target |",
        "| --- | --- | " + " | ".join("---:" for _ in brokers) + " | ---: | ---: | --- |",
    ]
    for name in results:
        scenario = SCENARIOS[name]
        for metric in scenario.metrics:
            values = {b: _get(results, name, b, metric.key) for b in brokers}
            cells = [_fmt(values[b]) for b in brokers]
            vs_mosquitto = row_validity(results, name, "lmqtt", "mosquitto")
            vs_amqtt = row_validity(results, name, "lmqtt", "amqtt")
            lines.append(
                f"| {scenario.title} | {metric.label} ({metric.unit}) | "
                + " | ".join(cells)
                + " | "
                + _ratio(values.get("lmqtt"), values.get("mosquitto"), metric.ratio, vs_mosquitto)
                + " | "
                + _ratio(values.get("lmqtt"), values.get("amqtt"), metric.ratio, vs_amqtt)
                + f" | {verdicts.get((name, metric.key), '')} |"
            )
    lines += [
        "",
        "CPU (cores; 1.0 = one core busy) of broker / the JVMs it stores on (RocketMQ) / load"
        " generator / other processes, and flags:",
        "",
        "| scenario | broker | broker CPU | store CPU | generator CPU | other CPU | flags"
        " | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name, per_broker in results.items():
        for broker in brokers:
            entry = per_broker.get(broker)
            if entry is None:
                continue
            median = entry.get("median") or {}
            notes = "; ".join(entry.get("notes", []))
            lines.append(
                f"| {name} | {NAMES[broker]} | {_fmt(median.get('broker_cpu'))} | "
                f"{_fmt(median.get('store_cpu'))} | {_fmt(median.get('gen_cpu'))} | "
                f"{_fmt(median.get('other_cpu'))} | "
                f"{', '.join(median.get('flags', []))} | {notes} |"
            )
    priced = [(name, r["account_cost"]) for name, r in results.items() if "account_cost" in r]
    if priced:
        lines += ["", "lmqtt with and without its delivery account (bench --account-cost):", ""]
        lines += [f"- {name}: {describe_account_cost(cost)}" for name, cost in priced]
    lines += _latency_self_check(results, brokers)
    return "\n".join(lines) + "\n"


def account_cost(per_broker: dict[str, Any]) -> dict[str, Any] | None:
    """What the delivery account costs lmqtt: CPU per delivery with it minus without it, from
    the runs of lmqtt and lmqtt-noaccount (taken in turns: median of the paired differences),
    or None when either has no runs."""
    on = [r for r in per_broker.get("lmqtt", {}).get("runs", []) if "us_cpu_per_delivery" in r]
    off = [
        r for r in per_broker.get(LMQTT_NO_ACCOUNT, {}).get("runs", [])
        if "us_cpu_per_delivery" in r
    ]  # fmt: skip
    if not on or not off:
        return None
    with_ = statistics.median(r["us_cpu_per_delivery"] for r in on)
    without = statistics.median(r["us_cpu_per_delivery"] for r in off)
    diffs = [
        a["us_cpu_per_delivery"] - b["us_cpu_per_delivery"] for a, b in zip(on, off, strict=False)
    ]
    return {
        "us_cpu_per_delivery_with": with_,
        "us_cpu_per_delivery_without": without,
        "us_cpu_per_delivery_account": round(statistics.median(diffs), 2),
        "paired_diffs": [round(d, 2) for d in diffs],
        "share_pct": round(100 * statistics.median(diffs) / with_, 1) if with_ else None,
    }


def describe_account_cost(cost: dict[str, Any]) -> str:
    return (
        f"delivery account {cost['us_cpu_per_delivery_account']:+.2f} us CPU per delivery "
        f"({cost['share_pct']}% of lmqtt's {cost['us_cpu_per_delivery_with']:.2f} us; "
        f"without it {cost['us_cpu_per_delivery_without']:.2f} us; "
        f"paired runs {cost['paired_diffs']})"
    )


def _latency_self_check(results: dict[str, Any], brokers: list[str]) -> list[str]:
    """Latency runs: scheduling, one-hop PUBACK round trip, and whether the generator kept time."""
    rows = []
    for name, per_broker in results.items():
        for broker in brokers:
            median = (per_broker.get(broker) or {}).get("median") or {}
            if "send_lag_p99_ms" not in median:
                continue
            rows.append(
                f"| {name} | {NAMES[broker]} | {median.get('sched', '-')} | "
                f"{_fmt(median.get('puback_p50_ms'))} / {_fmt(median.get('puback_p99_ms'))} | "
                f"{_fmt(median.get('send_lag_p50_ms'))} / {_fmt(median.get('send_lag_p99_ms'))} | "
                f"{_fmt(median.get('gen_gc_max_ms'))} |"
            )
    if not rows:
        return []
    return [
        "",
        "Latency self-check: scheduling of broker and generator (fifo = SCHED_FIFO, see"
        " bench/realtime.py), PUBACK round trip (publisher -> broker -> publisher, ms), how late"
        " the paced publisher sent against its schedule (ms; up to ~1 ms by design, more means"
        " the generator was not scheduled in time: flag generator-late) and the generator's"
        " longest GC pause (ms):",
        "",
        "| scenario | broker | scheduling | PUBACK p50 / p99 | send lag p50 / p99"
        " | generator GC max |",
        "| --- | --- | --- | ---: | ---: | ---: |",
        *rows,
    ]


DOC_HEAD = """# Benchmarks

`make bench` (or `.venv/bin/python -m bench [scenario ...] [--duration S] [--repeat N]
[--brokers lmqtt,mosquitto,amqtt] [--backlog N] [--docs docs/benchmarks.md]`) starts lmqtt,
Mosquitto and amqtt's broker one after another on free loopback ports and drives each with the
same load generator (`bench/loadgen.py`: a hand-written MQTT 3.1.1 client on asyncio + uvloop,
one process per role). Results land in `bench/results/` (JSON + Markdown, not committed).

How to read the table:
- deliveries/s counts messages received by all subscribers from the first publish to the last
  delivery; "undelivered at end" is what had not arrived when deliveries had stalled for two
  seconds (or after a drain cap of max(5 s, duration)).
- Flags: `generator-bound` = a generator process used >= 0.7 of a core, so the broker may be
  faster than shown (the row prints "invalid: generator-bound" instead of a ratio);
  `host-saturated` = both cores busy while the broker was not; `other-load` =
  processes outside the benchmark used >= 0.3 core (the machine is shared).
- Mosquitto runs with `max_queued_messages 0` (no per-client queue limit) so that slow delivery
  is not counted as loss; for durability it runs with `persistence true` and
  `autosave_interval 1`, its most frequent save.
- amqtt runs with only the anonymous-auth plugin (no packet logger, no $SYS); it keeps
  sessions in memory, so it has no durability row.
- deliveries per broker CPU-s divides deliveries by the CPU time the broker process used in the
  window: on a shared host it is the steadier figure, since it does not depend on how much CPU
  other jobs left to the broker.
- Publishers run closed loop: at most 5,000 deliveries ahead of the subscribers (5,000 messages
  for 1 -> 1, 50 for 1 -> 100), so a run measures the rate a broker sustains with bounded
  queues, not how much it can buffer.
- Backlog: the publish phase is capped (`--backlog-seconds`, default 20 s); when the cap hits
  before `--backlog` messages, growth per 1M messages is extrapolated linearly. "RSS" includes
  the CommitLog segments lmqtt maps into memory (file-backed page cache the kernel can write
  back and drop); "heap (anon)" is RSS minus file-backed and shared pages.
- Latency (`latency_async`, `latency_sync`): the publisher is paced at 1,000 msg/s, QoS 1;
  latency runs from the publisher's send timestamp (taken just before the write;
  CLOCK_MONOTONIC, shared by all processes) to the subscriber's read, the first 200 messages
  skipped. Broker and generator run under SCHED_FIFO, lowest real-time priority
  (`bench/realtime.py`; `--no-realtime` turns it off; it needs root or CAP_SYS_NICE, else a
  note says the run was at normal priority): on this shared 2-core host the fair scheduler
  otherwise adds 3-6 ms at p99 to every broker, Mosquitto included. The self-check table shows
  the PUBACK round trip (one broker hop) and how late the paced publisher sent; a send-lag p99
  over 2 ms flags the run `generator-late`: the tail then holds the generator's own delays.
- Repeats take turns between brokers (lmqtt, Mosquitto, amqtt, lmqtt, ...), so a burst of other
  load on the host falls on all of them alike.

## Latest results

"""


BEGIN = "<!-- bench:begin (generated by python -m bench --docs) -->"
END = "<!-- bench:end -->"


def write_docs(path: Path, markdown: str) -> None:
    """Replace the generated block of ``path``, keeping the hand-written text around it."""
    block = f"{BEGIN}\n{markdown}{END}\n"
    if path.exists():
        text = path.read_text()
        if BEGIN in text and END in text:
            head, _, rest = text.partition(BEGIN)
            _, _, tail = rest.partition(END)
            path.write_text(head + block + tail.lstrip("\n"))
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DOC_HEAD + block)
