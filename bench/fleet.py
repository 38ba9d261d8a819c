"""The fleet scenario: many devices, one small message per write, wildcard backends.

What an IoT deployment looks like, unlike the floods (one or a few connections pushing as fast
as they can, which is a bridge's load):

    N device connections (bench.fleetgen, a few processes)        backend subscribers
      device d: SUBSCRIBE cmd/{d} (QoS 1)                           site/#            persistent
                PUBLISH site/{d % 50}/dev/{d}/temp, 64 B,     -->   site/+/dev/+/temp clean
                its own TCP write, evenly paced                     site/{k}/#, k=0..4 clean

Each message reaches 2 backends, or 3 when its site is 0..4 (2.1 on average). Latency is from
the device's write (timestamp in the payload) to the backend's read, per backend process; the
worst backend process's percentile is reported (never a blend that hides one slow subscriber).
"After the first second" leaves out the messages sent in a run's first second: there every
device publishes its first message (2,000 devices at 20k msg/s: all within 100 ms), each to a
topic the broker has not routed before, so a broker whose first publish to a topic costs more
than the next falls behind for a moment; the two figures side by side say whether the tail is
that start or the steady run.

Figures per broker: the offered run (``--rate`` for ``--duration`` s) and, unless
``--no-capacity``, the capacity: the highest offered rate sustained with p99 <= 10 ms, nothing
lost and the rate achieved, found by doubling from ``CAPACITY_START`` then bisecting
(``capacity_search``). A phase where a generator process passed ``GENERATOR_SATURATED`` of a
core or the host ran out of CPU ends the search ("generator-bound": the broker was not the
limit), and such a row shows no ratio (bench.report).
"""

from __future__ import annotations

import asyncio
import math
import re
import resource
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bench.brokers import ROCKETMQ_NODES, BrokerProcess, BrokerUnavailable
from bench.realtime import make_normal, make_realtime
from bench.workers import CpuProbe, RssSampler, Worker, invalid_reason

Metrics = dict[str, Any]

SITE_BACKENDS = 5
DEVICES_PER_PROCESS = 12_500
FD_HEADROOM = 200  # the broker's own files, backends, admin
WARMUP_DELIVERIES = 200
CAPACITY_P99_MS = 10.0
CAPACITY_START = 2_500.0
CAPACITY_CEILING = 80_000.0
CAPACITY_PHASE_S = 3.0
CAPACITY_REFINE = 2
# A phase counts as sustained when this share of the offered rate was really sent.
ACHIEVED_SHARE = 0.95


@dataclass(frozen=True, slots=True)
class PhaseResult:
    """One paced publishing phase over the connected fleet."""

    offered: float
    metrics: Metrics

    @property
    def verdict(self) -> str:
        return phase_verdict(self.offered, self.metrics)


def phase_verdict(offered: float, metrics: Metrics) -> str:
    """``ok``, ``fail`` (the broker did not keep up) or ``invalid: <flag>`` (the generator or
    the host was the limit: no verdict about the broker)."""
    if "broker-exited" in metrics.get("flags", []):
        # Before the invalidating flags: those are judged from the broker's CPU, which a
        # process that ended no longer reports.
        return "fail"
    reason = invalid_reason(metrics.get("flags", []))
    if reason is not None:
        return reason
    if metrics.get("loss_pct", 100.0) > 0 or metrics.get("lost_connections", 0):
        return "fail"
    if metrics.get("publish_per_s", 0.0) < ACHIEVED_SHARE * offered:
        return "fail"
    if metrics.get("p99_ms", math.inf) > CAPACITY_P99_MS:
        return "fail"
    return "ok"


async def capacity_search(
    probe: Callable[[float], Awaitable[str]],
    start: float = CAPACITY_START,
    ceiling: float = CAPACITY_CEILING,
    refine: int = CAPACITY_REFINE,
    step: float = 500.0,
) -> tuple[float, str]:
    """Highest rate ``probe`` called ``ok``: doubling from ``start``, then ``refine`` bisection
    steps (rounded to ``step``) between the last ok and the first failing rate.

    Returns ``(rate, note)``: note ``""`` when the limit was found, the flag (``"generator-bound"``,
    ``"host-saturated"``) when a probe said ``invalid: <flag>`` (the bench or the host was the
    limit: the rate is a lower bound), ``"ceiling"`` when
    every rate up to ``ceiling`` held. When ``start`` already fails the bisection runs between
    0 and ``start``; 0.0 means nothing it tried held.
    """
    good, bad = 0.0, 0.0
    rate = start
    while True:
        if rate > ceiling:
            return good, "ceiling"
        verdict = await probe(rate)
        if verdict.startswith("invalid"):
            return good, verdict.removeprefix("invalid: ")
        if verdict != "ok":
            bad = rate
            break
        good = rate
        rate *= 2
    for _ in range(refine):
        mid = round((good + bad) / 2 / step) * step
        if mid <= good or mid >= bad:
            break
        verdict = await probe(mid)
        if verdict.startswith("invalid"):
            return good, verdict.removeprefix("invalid: ")
        if verdict == "ok":
            good = mid
        else:
            bad = mid
    return good, ""


def backend_specs(host: str, port: int, qos: int, prefix: str) -> list[dict[str, Any]]:
    """The backend subscriber processes: one per kind of filter."""
    base = {
        "role": "sub",
        "host": host,
        "port": port,
        "qos": qos,
        "latency": True,
        "skip_latency": WARMUP_DELIVERIES,
    }
    return [
        {**base, "connections": [{"id": f"{prefix}-all", "clean": False, "filters": ["site/#"]}]},
        {**base, "connections": [{"id": f"{prefix}-plus", "filters": ["site/+/dev/+/temp"]}]},
        {
            **base,
            "connections": [
                {"id": f"{prefix}-site{k}", "filters": [f"site/{k}/#"]}
                for k in range(SITE_BACKENDS)
            ],
        },
    ]


def device_slices(devices: int, processes: int) -> list[tuple[int, int]]:
    per = math.ceil(devices / processes)
    return [(i * per, min(devices, (i + 1) * per)) for i in range(processes) if i * per < devices]


def scrape_gc(admin_port: int) -> dict[str, float]:
    """The gateway's GC pause histogram from its /metrics: ``{"le=<bound s>": cumulative
    count, ..., "sum": seconds, "max": longest pause since start, s}``; empty if unreachable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for match in re.finditer(
        r'^lmqtt_gc_pause_seconds_bucket\{le="([^"]+)"\} ([0-9.e+-]+)$', text, re.MULTILINE
    ):
        out[f"le={match.group(1)}"] = float(match.group(2))
    for name, key in (("lmqtt_gc_pause_seconds_sum", "sum"), ("lmqtt_gc_pause_max_seconds", "max")):
        found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
        if found:
            out[key] = float(found.group(1))
    return out


def scrape_held_pulls(admin_port: int) -> int | None:
    """The gateway's own count of the pulls it holds on its brokers (the gauge
    ``lmqtt_rocketmq_held_pulls`` of its /metrics); None if unreachable or not on RocketMQ."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    found = re.search(r"^lmqtt_rocketmq_held_pulls ([0-9.e+-]+)$", text, re.MULTILINE)
    return int(float(found.group(1))) if found else None


async def held_pulls(broker: BrokerProcess, admin_port: int | None) -> Metrics:
    """Pulls held with the fleet connected and subscribed (each device to its ``cmd/{id}``):
    the gateway's gauge (the first node's) and the brokers' own count (their JVMs' live
    ``PullRequest`` objects, tests/rocketmq/cluster.py held_pulls), summed over the brokers.
    Empty for a broker that stores in its own process."""
    if broker.rocketmq is None or broker.name not in ROCKETMQ_NODES:
        return {}
    out: Metrics = {}
    if admin_port is not None:
        gauge = scrape_held_pulls(admin_port)
        if gauge is not None:
            out["held_pulls"] = gauge
    counts = await asyncio.to_thread(broker.rocketmq.held_pulls)
    if counts and all(n is not None for n in counts.values()):
        out["broker_held_pulls"] = sum(n or 0 for n in counts.values())
    return out


def gc_phase(before: dict[str, float], after: dict[str, float]) -> Metrics:
    """GC pauses between two scrapes: how many, how many over 5 ms, total, and the bound of the
    histogram bucket holding the longest (the max itself is not kept per phase)."""
    if not before or not after:
        return {}
    bounds = sorted(
        (float(k[3:]), after[k] - before.get(k, 0.0)) for k in after if k.startswith("le=")
    )
    count = bounds[-1][1] if bounds else 0.0
    over_5ms = count - next((n for bound, n in bounds if bound >= 0.005), count)
    longest = next((bound for bound, n in bounds if n >= count), math.inf)
    return {
        "gc_count": int(count),
        "gc_over_5ms": int(over_5ms),
        "gc_total_ms": round((after.get("sum", 0.0) - before.get("sum", 0.0)) * 1000, 2),
        "gc_longest_under_ms": round(longest * 1000, 2) if count else 0.0,
        "gc_max_since_start_ms": round(after.get("max", 0.0) * 1000, 2),
    }


class FleetRun:
    """Backends and device generators around one broker; phases at chosen rates."""

    def __init__(
        self, broker: BrokerProcess, devices: int, qos: int, payload: int, window: int = 0
    ) -> None:
        self.broker = broker
        host, ports = "127.0.0.1", broker.ports
        # Several nodes (lmqtt-rocketmq-2n, -3n): backends and device processes are spread
        # over them, so most deliveries cross from one node to another through the broker.
        specs = backend_specs(host, ports[0], qos, "fleet-backend")
        self.backends = [Worker({**s, "port": ports[i % len(ports)]}) for i, s in enumerate(specs)]
        processes = max(2, len(ports), math.ceil(devices / DEVICES_PER_PROCESS))
        # Each generator process connects from its own loopback address: one source address
        # has ~28,000 ephemeral ports, fewer than a 50,000-device fleet needs.
        self.generators = [
            Worker(
                {
                    "role": "fleet",
                    "host": host,
                    "port": ports[i % len(ports)],
                    "source": f"127.0.0.{2 + i}",
                    "first": first,
                    "last": last,
                    "qos": qos,
                    "payload": payload,
                    "window": window,
                    "prefix": "dev",
                }
            )
            for i, (first, last) in enumerate(device_slices(devices, processes))
        ]
        self.devices = devices
        self.connected: list[int] = []
        self.delivered = 0

    @property
    def workers(self) -> list[Worker]:
        return [*self.backends, *self.generators]

    def scheduling(self, realtime: bool) -> bool:
        """SCHED_FIFO (bench.realtime) for broker and generators during a paced phase, or back
        to normal (connects and the capacity search: an overloaded broker at real-time
        priority would starve the shared host). True if the kernel allowed it.

        The RocketMQ JVMs a gateway stores through go with it: left at normal priority under
        gateway nodes at real-time priority they got the CPU last, the nodes' heartbeats on the
        cluster bus (sends to those JVMs) were not read back within the lease, and every node
        fenced itself and closed its devices' connections mid-phase."""
        pids = [*self.broker.pids, *self.broker.store_pids]
        pids += [w.process.pid for w in self.workers if w.process]
        if not realtime:
            for pid in pids:
                make_normal(pid)
            return False
        return all([make_realtime(pid) for pid in pids])

    async def start(self) -> Metrics:
        for worker in self.workers:
            await worker.start()
        await asyncio.gather(*(w.expect("ready", 60) for w in self.workers))
        for gen in self.generators:
            gen.send("connect")
        # Allows 100 connects/s: a RocketMQ-backed gateway on a shared host connects slower
        # than 500/s (each subscription reads its queue's bounds from the broker).
        timeout = 60 + self.devices / 100
        reports = await asyncio.gather(*(g.expect("connected", timeout) for g in self.generators))
        self.connected = [int(r["connected"]) for r in reports]
        span = max(float(r["end"]) for r in reports) - min(float(r["start"]) for r in reports)
        return {
            "connected": sum(self.connected),
            "connect_failures": sum(int(r["failures"]) for r in reports),
            "connects_per_s": round(sum(self.connected) / max(span, 1e-6)),
        }

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)

    async def _counts(self, command: str, event: str) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(w.request(command, event, 30) for w in self.backends)))

    async def phase(self, rate: float, duration: float) -> PhaseResult:
        snaps = await self._counts("snapshot", "snapshot")  # drops earlier latency samples
        before = sum(int(s["count"]) for s in snaps)
        total = sum(self.connected) or 1
        probe = CpuProbe(self.broker, self.workers)
        probe.start()
        for gen, connected in zip(self.generators, self.connected, strict=True):
            gen.send(f"run {rate * connected / total} {duration}")
        results = await asyncio.gather(
            *(g.expect("result", duration + 60) for g in self.generators)
        )
        expected = sum(int(r["expected"]) for r in results)
        await self._drain(before, expected, cap=max(10.0, duration * 2))
        cpu = probe.stop()
        snaps = await self._counts("snapshot", "snapshot")
        delivered = sum(int(s["count"]) for s in snaps) - before
        sent = sum(int(r["sent"]) for r in results)
        start = min(float(r["start"]) for r in results)
        pub_end = max(float(r["end"]) for r in results)
        last = max((float(s["last"]) for s in snaps), default=pub_end)
        broker_cpu = max(float(cpu["broker_cpu_s"]), 1e-6)
        store_cpu = float(cpu["store_cpu_s"])

        def worst(key: str) -> float:
            return round(max(float(s["latency_ms"].get(key, 0.0)) for s in snaps), 3)

        def steady(key: str) -> float:
            return round(
                max(float((s.get("steady_latency_ms") or {}).get(key, 0.0)) for s in snaps), 3
            )

        lag = max(float((r["send_lag_ms"] or {}).get("p99", 0.0)) for r in results)
        puback = max(float((r.get("puback_ms") or {}).get("p99", 0.0)) for r in results)
        held_back = sum(int(r.get("held_back", 0)) for r in results)
        # Each device's publish rate: a broker that holds publishers must not starve some.
        window = max(pub_end - start, 1e-6)
        rates = sorted(int(c) / window for r in results for c in r.get("per_device", []))
        metrics: Metrics = {
            "offered_per_s": rate,
            "publish_per_s": round(sent / max(pub_end - start, 1e-6)),
            "deliveries_per_s": round(delivered / max(last - start, 1e-6)),
            "published": sent,
            "delivered": delivered,
            "expected": expected,
            "loss_pct": round(100.0 * max(0, expected - delivered) / max(expected, 1), 3),
            "p50_ms": worst("p50"),
            "p99_ms": worst("p99"),
            "p999_ms": worst("p999"),
            "max_ms": worst("max"),
            # Without the messages sent in the first second (see bench/loadgen.py Deliveries).
            "p99_steady_ms": steady("p99"),
            "p999_steady_ms": steady("p999"),
            "us_cpu_per_delivery": round(1e6 * broker_cpu / max(delivered, 1), 2),
            "us_cpu_per_publish": round(1e6 * broker_cpu / max(sent, 1), 2),
            # The same, split: the broker's own code (for lmqtt: the interpreter and its C
            # kernels) and the kernel's work for it (syscalls, the TCP stack).
            "us_user_cpu_per_publish": round(1e6 * float(cpu["broker_user_s"]) / max(sent, 1), 2),
            "us_system_cpu_per_publish": round(
                1e6 * float(cpu["broker_system_s"]) / max(sent, 1), 2
            ),
            # RocketMQ's JVMs (lmqtt-rocketmq; 0 for brokers storing in their own process).
            "us_store_cpu_per_publish": round(1e6 * store_cpu / max(sent, 1), 2),
            "send_lag_p99_ms": round(lag, 3),
            # Turns a device skipped, waiting for PUBACKs (in-flight window; see fleetgen).
            "held_back_pct": round(100.0 * held_back / max(sent + held_back, 1), 2),
            "puback_p99_ms": round(puback, 3),
            "device_rate_min": round(rates[0], 2) if rates else 0.0,
            "device_rate_p1": round(rates[len(rates) // 100], 2) if rates else 0.0,
            "device_rate_p50": round(rates[len(rates) // 2], 2) if rates else 0.0,
            "device_rate_max": round(rates[-1], 2) if rates else 0.0,
            "lost_connections": sum(int(r["lost_connections"]) for r in results),
            **cpu,
        }
        return PhaseResult(rate, metrics)

    async def _drain(self, before: int, expected: int, cap: float, idle: float = 2.0) -> None:
        deadline = time.monotonic() + cap
        last_total, last_change = -1, time.monotonic()
        while True:
            reports = await self._counts("report", "progress")
            total = sum(int(r["count"]) for r in reports) - before
            now = time.monotonic()
            if total != last_total:
                last_total, last_change = total, now
            if total >= expected or now >= deadline or now - last_change >= idle:
                return
            await asyncio.sleep(0.05)


async def fleet(
    broker: BrokerProcess,
    *,
    devices: int,
    rate: float,
    duration: float,
    qos: int,
    payload: int = 64,
    capacity: bool = True,
    admin_port: int | None = None,
    window: int = 0,
    warmup: float = 0.0,
) -> Metrics:
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if devices + FD_HEADROOM > limit:
        # The broker needs a descriptor per device: past the limit a broker refuses or, worse,
        # leaves connections unanswered in its accept queue.
        raise BrokerUnavailable(
            f"open-file limit {limit} too low for {devices} devices (raise the hard limit: root"
            " with CAP_SYS_RESOURCE, or ulimit -Hn in the shell that starts the bench)"
        )
    await asyncio.sleep(0.5)
    run = FleetRun(broker, devices, qos, payload, window)
    run.scheduling(False)
    with RssSampler(broker) as rss:
        try:
            baseline = broker.rss()
            connect = await run.start()
            await asyncio.sleep(2.0)  # let the broker settle (lmqtt freezes after connects)
            after = broker.rss()
            per_device = (after - baseline) / 1024 / max(connect["connected"], 1)
            held = await held_pulls(broker, admin_port)
            if warmup > 0:
                await run.phase(rate, warmup)  # unmeasured: JIT compilation, caches
            gc_before = scrape_gc(admin_port) if admin_port is not None else {}
            fifo = broker.realtime and run.scheduling(True)
            try:
                main = await run.phase(rate, duration)
            finally:
                run.scheduling(False)
            gc_after = scrape_gc(admin_port) if admin_port is not None else {}
            metrics: Metrics = {
                **connect,
                **main.metrics,
                "rss_mb": round(after / 2**20, 1),
                "kib_per_device": round(per_device, 2),
                "sched": "fifo" if fifo else "normal",
                **held,
                **gc_phase(gc_before, gc_after),
            }
            if capacity:
                phases: list[Metrics] = []

                async def probe(offered: float) -> str:
                    result = await run.phase(offered, CAPACITY_PHASE_S)
                    phases.append(
                        {
                            "rate": offered,
                            "verdict": result.verdict,
                            **{
                                k: result.metrics[k]
                                for k in ("p99_ms", "loss_pct", "publish_per_s", "flags")
                            },
                        }
                    )
                    return result.verdict

                found, note = await capacity_search(probe)
                if note:
                    metrics["capacity_note"] = f">= {found:,.0f} ({note})"
                else:
                    metrics["capacity_per_s"] = found
                metrics["capacity_phases"] = phases
        finally:
            await run.close()
        metrics["rss_peak_mb"] = round(rss.peak / 2**20, 1)
    return metrics
