"""The benchmark scenarios. Each runs against one already started broker and returns metrics.

A scenario is bounded in time: a publish phase of ``duration`` seconds (or a message count with a
time cap), then a drain phase that ends when every expected delivery arrived, when deliveries
stop for two seconds, or at a cap. Loss is what did not arrive by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.brokers import LMQTT_BROKERS, BrokerOptions, BrokerProcess
from bench.fleet import fleet
from bench.loadgen import DeliveryBoard
from bench.workers import CpuProbe, RssSampler, Worker

Metrics = dict[str, Any]
# Closed loop: most deliveries a publisher may be ahead of its subscribers (5,000 messages for
# 1 -> 1, 50 for 1 -> 100), enough to keep every broker's pipeline full.
LEAD_DELIVERIES = 5000
# Latency runs: the first messages (connection warm-up, first CommitLog pages) are not counted.
WARMUP_MESSAGES = 200
# Paced publisher self-check: messages leave up to ~1 ms after their slot by design (uvloop's
# millisecond timers); a p99 beyond this means the generator itself was not scheduled in time,
# and the same delay sits in the latency tail whatever the broker does.
SEND_LAG_LIMIT_MS = 2.0


@dataclass(frozen=True, slots=True)
class RunSettings:
    duration: float = 5.0
    repeat: int = 3
    backlog: int = 1_000_000
    backlog_seconds: float = 30.0
    idle: int = 10_000
    payload: int = 64
    devices: int = 2_000  # fleet: device connections
    rate: float = 5_000.0  # fleet: offered msg/s over the whole fleet
    capacity: bool = True  # fleet: also search the highest rate sustained
    device_window: int = 0  # fleet: a device's QoS 1 in-flight window (0: unbounded)
    warmup: float = 0.0  # fleet: an unmeasured paced phase first, s (the JVMs' JIT)
    drain_idle: float = 2.0  # fanout: deliveries stalled this long end the drain, s


@dataclass(frozen=True, slots=True)
class Metric:
    """How a figure is shown and judged."""

    key: str
    label: str
    unit: str
    higher_is_better: bool = True
    ratio: bool = True  # whether lmqtt/other ratios mean anything for this figure


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    run: Callable[[BrokerProcess, RunSettings, Path], Awaitable[Metrics]]
    metrics: tuple[Metric, ...]
    options: Callable[[str], BrokerOptions | None] = field(default=lambda broker: BrokerOptions())
    repeated: bool = True  # heavy scenarios run once whatever --repeat says
    manages_broker: bool = False  # the scenario restarts the broker itself
    realtime: bool = False  # broker and generator under SCHED_FIFO (bench.realtime)


async def _start_all(workers: list[Worker], timeout: float = 60.0) -> None:
    for worker in workers:
        await worker.start()
    await asyncio.gather(*(w.expect("ready", timeout) for w in workers))


async def _close_all(workers: list[Worker]) -> None:
    await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)


async def _drain(subs: list[Worker], expected: int, cap: float, idle: float = 2.0) -> int:
    """Wait until ``expected`` deliveries arrived, deliveries stall for ``idle`` s, or ``cap`` s."""
    deadline = time.monotonic() + cap
    last_total = -1
    last_change = time.monotonic()
    while True:
        reports = await asyncio.gather(*(w.request("report", "progress", 10) for w in subs))
        total = sum(int(r["count"]) for r in reports)
        now = time.monotonic()
        if total != last_total:
            last_total, last_change = total, now
        if total >= expected or now >= deadline or now - last_change >= idle:
            return total
        await asyncio.sleep(0.1)


def _split(items: list[dict[str, Any]], parts: int) -> list[list[dict[str, Any]]]:
    parts = max(1, min(parts, len(items)))
    return [items[i::parts] for i in range(parts)]


async def fanout(
    broker: BrokerProcess,
    settings: RunSettings,
    *,
    qos: int,
    connections: list[dict[str, Any]],
    topics: list[str],
    per_message: int,
    sub_processes: int = 1,
    rate: float | None = None,
    latency: bool = False,
    closed_loop: bool = True,
    pub_connections: int = 1,
    pub_processes: int = 1,
) -> Metrics:
    """Publisher connections (``pub_connections`` spread over ``pub_processes`` worker
    processes, one by default) and subscriber connections spread over worker processes;
    deliveries/s, loss.

    Closed loop (default): the publisher stays at most ``LEAD`` messages ahead of what the
    subscribers received, so every broker is measured at the rate it sustains, with bounded
    queues, instead of by how much it can buffer (amqtt stalls when flooded unpaced).
    """
    base = {"host": "127.0.0.1", "port": broker.port}
    groups = _split(connections, sub_processes)
    board = ""
    if closed_loop and rate is None:
        board = str(broker.workdir / "delivery-board")
        broker.workdir.mkdir(parents=True, exist_ok=True)
        DeliveryBoard.create(board, len(groups))
    subs = [
        Worker(
            {
                **base,
                "role": "sub",
                "qos": qos,
                "connections": group,
                "latency": latency,
                "skip_latency": WARMUP_MESSAGES if latency else 0,
                "board": board,
                "slots": len(groups),
                "slot": slot,
            },
            realtime=broker.realtime,
        )
        for slot, group in enumerate(groups)
    ]
    pub_processes = max(1, min(pub_processes, pub_connections))
    pubs = [
        Worker(
            {
                **base,
                "role": "pub",
                "id": "bench-pub" if p == 0 else f"bench-pub{p}",
                "connections": len(range(p, pub_connections, pub_processes)),
                "shares": pub_processes,
                "qos": qos,
                "topics": topics,
                "payload": settings.payload,
                "duration": settings.duration,
                "rate": rate,
                "skip_checks": WARMUP_MESSAGES if latency else 0,
                "window": 256,
                "board": board,
                "slots": len(groups),
                "per_message": per_message,
                # The publishers share the lead: each holds its share of it.
                "lead": max(1, LEAD_DELIVERIES // per_message // pub_processes),
            },
            realtime=broker.realtime,
        )
        for p in range(pub_processes)
    ]
    workers = [*subs, *pubs]
    try:
        await _start_all(workers)
        probe = CpuProbe(broker, workers)
        probe.start()
        for pub in pubs:
            pub.send("start")
        published = _merge_published(
            await asyncio.gather(*(p.expect("result", settings.duration + 30) for p in pubs))
        )
        expected = int(published["acked"]) * per_message
        await _drain(
            subs,
            expected,
            cap=max(5.0, settings.duration, 3 * settings.drain_idle),
            idle=settings.drain_idle,
        )
        cpu = probe.stop()
        results = await asyncio.gather(*(w.request("stop", "result", 30) for w in subs))
    finally:
        await _close_all(workers)
    delivered = sum(int(r["count"]) for r in results)
    if published["lost_connection"]:
        cpu["flags"].append("publisher-disconnected")
    if broker.process is not None and broker.process.returncode is not None:
        cpu["flags"].append(f"broker-exited({broker.process.returncode})")
    last = max((float(r["last"]) for r in results if r["count"]), default=published["end"])
    span = max(last - float(published["start"]), 1e-6)
    pub_span = max(float(published["end"]) - float(published["start"]), 1e-6)
    metrics: Metrics = {
        "deliveries_per_s": round(delivered / span),
        "publish_per_s": round(int(published["sent"]) / pub_span),
        "published": int(published["sent"]),
        "acked": int(published["acked"]),
        "delivered": delivered,
        "loss_pct": round(100.0 * max(0, expected - delivered) / expected, 3) if expected else 0.0,
        # Robust to a shared host: what one second of broker CPU delivers.
        "deliveries_per_cpu_s": round(delivered / max(float(cpu["broker_cpu_s"]), 1e-3)),
        **cpu,
    }
    if latency:
        metrics["sched"] = "fifo" if broker.realtime_applied else "normal"
        metrics.update(_latency_metrics(results[0], published))
        if metrics["send_lag_p99_ms"] > SEND_LAG_LIMIT_MS:
            metrics["flags"].append("generator-late")
    return metrics


def _merge_published(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One publisher's result from several: counts summed, the span from first start to last
    end (the first publisher's latency samples, which only single-publisher runs take)."""
    if len(results) == 1:
        return results[0]
    merged = dict(results[0])
    for key in ("sent", "acked"):
        merged[key] = sum(int(r[key]) for r in results)
    merged["start"] = min(float(r["start"]) for r in results)
    merged["end"] = max(float(r["end"]) for r in results)
    merged["lost_connection"] = any(r["lost_connection"] for r in results)
    return merged


def _latency_metrics(sub: dict[str, Any], pub: dict[str, Any]) -> Metrics:
    """End-to-end percentiles, and the self-check: publisher send lag, PUBACK round trip (one
    broker hop), the generator's own GC pauses."""
    lat, lag, ack = sub["latency_ms"], pub.get("send_lag_ms") or {}, pub.get("puback_ms") or {}
    gc_max = max((w.get("gc_ms") or {}).get("max", 0.0) for w in (sub, pub))
    return {
        "p50_ms": round(lat.get("p50", 0.0), 3),
        "p99_ms": round(lat.get("p99", 0.0), 3),
        "p999_ms": round(lat.get("p999", 0.0), 3),
        "max_ms": round(lat.get("max", 0.0), 3),
        "puback_p50_ms": round(ack.get("p50", 0.0), 3),
        "puback_p99_ms": round(ack.get("p99", 0.0), 3),
        "send_lag_p50_ms": round(lag.get("p50", 0.0), 3),
        "send_lag_p99_ms": round(lag.get("p99", 0.0), 3),
        "send_lag_p999_ms": round(lag.get("p999", 0.0), 3),
        "gen_gc_max_ms": round(gc_max, 3),
    }


async def one_to_one(broker: BrokerProcess, settings: RunSettings, qos: int) -> Metrics:
    return await fanout(
        broker,
        settings,
        qos=qos,
        connections=[{"id": "bench-sub-0", "filters": ["bench/one"]}],
        topics=["bench/one"],
        per_message=1,
    )


async def one_to_many(broker: BrokerProcess, settings: RunSettings, qos: int) -> Metrics:
    return await fanout(
        broker,
        settings,
        qos=qos,
        connections=[{"id": f"bench-sub-{i}", "filters": ["bench/fan"]} for i in range(100)],
        topics=["bench/fan"],
        per_message=100,
        sub_processes=2,
    )


def _device_backends() -> tuple[list[str], list[dict[str, Any]]]:
    """1,000 device topics ``dev/{id}/temp`` and the backends reading them: one connection
    each with ``dev/+/temp`` and ``dev/#``, and ten connections with 100 exact filters each."""
    topics = [f"dev/{i}/temp" for i in range(1000)]
    connections: list[dict[str, Any]] = [
        {"id": "bench-plus", "filters": ["dev/+/temp"]},
        {"id": "bench-hash", "filters": ["dev/#"]},
    ]
    connections += [
        {"id": f"bench-exact-{i}", "filters": topics[i * 100 : (i + 1) * 100]} for i in range(10)
    ]
    return topics, connections


async def wildcard(broker: BrokerProcess, settings: RunSettings, _: Path) -> Metrics:
    topics, connections = _device_backends()
    return await fanout(
        broker, settings, qos=1, connections=connections, topics=topics, per_message=3
    )


async def wildcard_many(broker: BrokerProcess, settings: RunSettings, _: Path) -> Metrics:
    """The backend shape: 1,000 device topics published from ten connections (QoS 0); one
    connection each with ``dev/+/temp`` and ``dev/#``, and ten connections with 100 exact
    filters each, so every exact subscription gets a trickle of the flood."""
    topics, connections = _device_backends()
    return await fanout(
        broker,
        settings,
        qos=0,
        connections=connections,
        topics=topics,
        per_message=3,
        sub_processes=2,
        pub_connections=10,
        pub_processes=2,
    )


async def latency(broker: BrokerProcess, settings: RunSettings, _: Path) -> Metrics:
    return await fanout(
        broker,
        settings,
        qos=1,
        connections=[{"id": "bench-lat", "filters": ["bench/lat"]}],
        topics=["bench/lat"],
        per_message=1,
        rate=1000.0,
        latency=True,
    )


async def idle_connections(broker: BrokerProcess, settings: RunSettings, _: Path) -> Metrics:
    await asyncio.sleep(1.0)
    baseline = broker.rss()
    baseline_anon = broker.anon()
    processes = 2
    share = settings.idle // processes
    workers = [
        Worker(
            {
                "role": "idle",
                "host": "127.0.0.1",
                "port": broker.port,
                "count": share,
                "concurrency": 100,
                "timeout": 40.0,
                "prefix": f"idle{p}",
            }
        )
        for p in range(processes)
    ]
    try:
        await _start_all(workers)
        probe = CpuProbe(broker, workers)
        probe.start()
        for worker in workers:
            worker.send("start")
        reports = await asyncio.gather(*(w.expect("connected", 90) for w in workers))
        cpu = probe.stop()
        await asyncio.sleep(1.5)
        after = broker.rss()
        after_anon = broker.anon()
    finally:
        await _close_all(workers)
    connected = sum(int(r["connected"]) for r in reports)
    span = max(float(r["end"]) for r in reports) - min(float(r["start"]) for r in reports)
    return {
        "connected": connected,
        "failures": sum(int(r["failures"]) for r in reports),
        "connects_per_s": round(connected / max(span, 1e-6)),
        "kib_per_connection": round((after - baseline) / 1024 / max(connected, 1), 2),
        "anon_kib_per_connection": round(
            (after_anon - baseline_anon) / 1024 / max(connected, 1), 2
        ),
        "rss_mb": round(after / 2**20, 1),
        **cpu,
    }


async def _session(broker: BrokerProcess, client_id: str, topic: str) -> None:
    """Create a persistent session subscribed (QoS 1) to ``topic``, then disconnect."""
    worker = Worker(
        {
            "role": "sub",
            "host": "127.0.0.1",
            "port": broker.port,
            "qos": 1,
            "connections": [{"id": client_id, "clean": False, "filters": [topic]}],
        }
    )
    try:
        await _start_all([worker])
        await worker.request("stop", "result", 10)
    finally:
        await _close_all([worker])


def _resume(broker: BrokerProcess, client_id: str, track: bool) -> Worker:
    return Worker(
        {
            "role": "sub",
            "host": "127.0.0.1",
            "port": broker.port,
            "qos": 1,
            "track": track,
            "connections": [{"id": client_id, "clean": False, "filters": []}],
        }
    )


async def backlog(broker: BrokerProcess, settings: RunSettings, _: Path) -> Metrics:
    topic = "bench/backlog"
    await _session(broker, "bench-backlog", topic)
    await asyncio.sleep(0.5)
    baseline = broker.rss()
    baseline_anon = broker.anon()
    pub = Worker(
        {
            "role": "pub",
            "host": "127.0.0.1",
            "port": broker.port,
            "qos": 1,
            "topics": [topic],
            "payload": settings.payload,
            "count": settings.backlog,
            "duration": settings.backlog_seconds,
            "window": 256,
        }
    )
    with RssSampler(broker) as rss:
        try:
            await _start_all([pub])
            probe = CpuProbe(broker, [pub])
            probe.start()
            pub.send("start")
            published = await pub.expect("result", settings.backlog_seconds + 30)
            cpu = probe.stop()
        finally:
            await _close_all([pub])
        stored_peak = rss.peak
        sub = _resume(broker, "bench-backlog", track=False)
        connect_at = time.monotonic()
        try:
            await _start_all([sub])
            expected = int(published["acked"])
            delivered = await _drain([sub], expected, cap=settings.backlog_seconds, idle=5.0)
            result = await sub.request("stop", "result", 30)
        finally:
            await _close_all([sub])
    acked = int(published["acked"])
    if published["lost_connection"]:
        cpu["flags"].append("publisher-disconnected")
    drain_span = max(float(result["last"] or connect_at) - connect_at, 1e-6)
    growth = (rss.peak - baseline) / 2**20
    growth_anon = (rss.peak_anon - baseline_anon) / 2**20
    per_million = 1_000_000 / max(acked, 1)
    return {
        "backlog": acked,
        "complete": acked >= settings.backlog,
        "publish_per_s": round(acked / max(published["end"] - published["start"], 1e-6)),
        "growth_mb": round(growth, 1),
        "growth_mb_per_million": round(growth * per_million, 1),
        "anon_growth_mb": round(growth_anon, 1),
        "anon_growth_mb_per_million": round(growth_anon * per_million, 1),
        "stored_growth_mb": round((stored_peak - baseline) / 2**20, 1),
        "drain_per_s": round(delivered / drain_span),
        "drained": delivered,
        **cpu,
    }


async def durability(broker: BrokerProcess, settings: RunSettings, _: Path) -> Metrics:
    """SIGKILL the broker during a QoS 1 flood; count acknowledged messages that never arrive."""
    topic = "bench/durable"
    await broker.start()
    try:
        await _session(broker, "bench-durable", topic)
        await asyncio.sleep(1.5)  # let periodic session saving happen before the flood
        pub = Worker(
            {
                "role": "pub",
                "host": "127.0.0.1",
                "port": broker.port,
                "qos": 1,
                "topics": [topic],
                "payload": settings.payload,
                "duration": 60.0,
                "window": 256,
                "track": True,
            }
        )
        try:
            await _start_all([pub])
            pub.send("start")
            await asyncio.sleep(min(3.0, settings.duration))
            broker.kill()
            await broker.wait()
            published = await pub.expect("result", 30)
        finally:
            await _close_all([pub])
        acked = set(published["acked_seqs"] or [])
        await broker.start()
        sub = _resume(broker, "bench-durable", track=True)
        try:
            await _start_all([sub])
            await _drain([sub], len(acked), cap=30.0, idle=3.0)
            result = await sub.request("stop", "result", 60)
        finally:
            await _close_all([sub])
    finally:
        await broker.stop()
    received = set(result["seqs"] or [])
    return {
        "acked": len(acked),
        "received": len(received),
        "acked_lost": len(acked - received),
        "unacked_received": len(received - acked),
    }


def _fleet(qos: int) -> Callable[[BrokerProcess, RunSettings, Path], Awaitable[Metrics]]:
    async def run(broker: BrokerProcess, settings: RunSettings, _: Path) -> Metrics:
        return await fleet(
            broker,
            devices=settings.devices,
            rate=settings.rate,
            duration=settings.duration,
            qos=qos,
            payload=settings.payload,
            capacity=settings.capacity,
            admin_port=broker.admin_port,
            window=settings.device_window,
            warmup=settings.warmup,
        )

    return run


def _with_admin(broker: str) -> BrokerOptions | None:
    return BrokerOptions(admin=broker in LMQTT_BROKERS)


FLEET_METRICS = (
    Metric("connected", "devices connected", "conns", ratio=False),
    Metric("offered_per_s", "offered", "msg/s", ratio=False),
    Metric("publish_per_s", "achieved publish rate", "msg/s"),
    Metric("deliveries_per_s", "deliveries/s", "msg/s"),
    Metric("p50_ms", "latency p50", "ms", False),
    Metric("p99_ms", "latency p99", "ms", False),
    Metric("p999_ms", "latency p99.9", "ms", False),
    Metric("p99_steady_ms", "latency p99 after the first second", "ms", False),
    Metric("p999_steady_ms", "latency p99.9 after the first second", "ms", False),
    Metric("us_cpu_per_delivery", "broker CPU per delivery", "us", False),
    Metric("us_cpu_per_publish", "broker CPU per publish", "us", False),
    Metric("us_user_cpu_per_publish", "broker CPU per publish, user (its own code)", "us", False),
    Metric("us_system_cpu_per_publish", "broker CPU per publish, system (the kernel)", "us", False),
    Metric("broker_cpu", "broker CPU", "cores", False),
    Metric("us_store_cpu_per_publish", "RocketMQ JVMs' CPU per publish", "us", False, ratio=False),
    Metric("store_cpu", "RocketMQ JVMs' CPU", "cores", False, ratio=False),
    Metric("held_pulls", "pulls held on RocketMQ, the gateway's gauge", "n", False, ratio=False),
    Metric("broker_held_pulls", "pulls held on RocketMQ, the brokers' count", "n", False, False),
    Metric("rss_mb", "RSS with the fleet connected", "MB", False),
    Metric("kib_per_device", "RSS growth per device", "KiB", False),
    Metric("loss_pct", "undelivered at end", "%", False, ratio=False),
    Metric("held_back_pct", "device turns skipped (window full)", "%", False, ratio=False),
    Metric("puback_p99_ms", "device PUBACK wait p99", "ms", False, ratio=False),
    Metric("device_rate_min", "per-device publish rate, min", "msg/s", ratio=False),
    Metric("device_rate_p1", "per-device publish rate, p1", "msg/s", ratio=False),
    Metric("device_rate_p50", "per-device publish rate, median", "msg/s", ratio=False),
    Metric("device_rate_max", "per-device publish rate, max", "msg/s", ratio=False),
    Metric("rss_peak_mb", "RSS peak", "MB", False, ratio=False),
    Metric("capacity_per_s", "capacity (p99 <= 10 ms, no loss)", "msg/s"),
    Metric("capacity_note", "capacity, when the search hit a bound", "msg/s", ratio=False),
    Metric("gc_count", "broker GC collections in the run", "n", False, ratio=False),
    Metric("gc_over_5ms", "broker GC pauses over 5 ms", "n", False, ratio=False),
    Metric("gc_longest_under_ms", "broker longest GC pause, at most", "ms", False, ratio=False),
)


M_DELIV = Metric("deliveries_per_s", "deliveries/s", "msg/s")
M_LOSS = Metric("loss_pct", "undelivered at end", "%", higher_is_better=False, ratio=False)
M_EFF = Metric("deliveries_per_cpu_s", "deliveries per broker CPU-s", "msg")
THROUGHPUT = (M_DELIV, M_EFF, M_LOSS)


def _lmqtt_only_sync(broker: str) -> BrokerOptions | None:
    return BrokerOptions(flush="sync") if broker == "lmqtt" else None


def _durable(broker: str) -> BrokerOptions | None:
    if broker == "lmqtt":
        return BrokerOptions(flush="sync")
    if broker == "mosquitto":
        return BrokerOptions(persistence=True)
    return None  # amqtt 0.12.1 keeps sessions and queues only in memory


def _scenario_fn(fn: Callable[..., Awaitable[Metrics]], *args: Any) -> Any:
    async def run(broker: BrokerProcess, settings: RunSettings, workdir: Path) -> Metrics:
        return await fn(broker, settings, *args)

    return run


LAT_METRICS = (
    Metric("p50_ms", "latency p50", "ms", False),
    Metric("p99_ms", "latency p99", "ms", False),
    Metric("p999_ms", "latency p99.9", "ms", False),
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "fleet",
            "fleet: N devices, 1 QoS 1 msg per write, paced; wildcard backends",
            _fleet(1),
            FLEET_METRICS,
            options=_with_admin,
            repeated=False,
            realtime=True,  # the paced phase only (bench.fleet)
        ),
        Scenario(
            "fleet_qos0",
            "fleet: N devices, 1 QoS 0 msg per write, paced; wildcard backends",
            _fleet(0),
            FLEET_METRICS,
            options=_with_admin,
            repeated=False,
            realtime=True,  # the paced phase only (bench.fleet)
        ),
        # The floods: one or a few connections pushing as fast as they can, a bridge's load,
        # not a fleet's (see "fleet" above for that).
        Scenario(
            "1to1_qos0",
            "flood (bridge-shaped, 1 conn each side) 1 -> 1, QoS 0, 64 B",
            _scenario_fn(one_to_one, 0),
            THROUGHPUT,
        ),
        Scenario(
            "1to1_qos1",
            "flood (bridge-shaped, 1 conn each side) 1 -> 1, QoS 1, 64 B",
            _scenario_fn(one_to_one, 1),
            THROUGHPUT,
        ),
        Scenario(
            "1to100_qos0",
            "flood (1 publisher conn) 1 -> 100, QoS 0",
            _scenario_fn(one_to_many, 0),
            THROUGHPUT,
        ),
        Scenario(
            "1to100_qos1",
            "flood (1 publisher conn) 1 -> 100, QoS 1",
            _scenario_fn(one_to_many, 1),
            THROUGHPUT,
        ),
        Scenario(
            "wildcard",
            "flood (1 publisher conn) 1,000 topics dev/{id}/temp; dev/+/temp, dev/#, exact; QoS 1",
            wildcard,
            THROUGHPUT,
        ),
        Scenario(
            "wildcard_many",
            "flood (10 publisher conns) 1,000 topics dev/{id}/temp; dev/+/temp, dev/#, "
            "10 conns x 100 exact; QoS 0",
            wildcard_many,
            THROUGHPUT,
        ),
        Scenario(
            "latency_async",
            "latency @1,000 msg/s QoS 1, async flush",
            latency,
            LAT_METRICS,
            realtime=True,
        ),
        Scenario(
            "latency_sync",
            "latency @1,000 msg/s QoS 1, sync flush",
            latency,
            LAT_METRICS,
            options=_lmqtt_only_sync,
            realtime=True,
        ),
        Scenario(
            "idle",
            "idle connections",
            idle_connections,
            (
                Metric("kib_per_connection", "memory per connection", "KiB", False),
                Metric("connects_per_s", "connect rate", "conn/s"),
                Metric("connected", "connected", "conns", ratio=False),
            ),
            repeated=False,
        ),
        Scenario(
            "backlog",
            "offline backlog, QoS 1",
            backlog,
            (
                Metric("backlog", "messages queued", "msgs", ratio=False),
                Metric("growth_mb", "peak RSS growth", "MB", False),
                Metric("growth_mb_per_million", "RSS growth per 1M msgs", "MB", False),
                Metric("anon_growth_mb_per_million", "heap (anon) growth per 1M msgs", "MB", False),
                Metric("drain_per_s", "drain rate", "msg/s"),
            ),
            repeated=False,
        ),
        Scenario(
            "durability",
            "SIGKILL during QoS 1 flood",
            durability,
            (
                Metric("acked", "acknowledged", "msgs", ratio=False),
                Metric("acked_lost", "acknowledged but lost", "msgs", False, ratio=False),
            ),
            options=_durable,
            repeated=False,
            manages_broker=True,
        ),
    )
}


async def run_scenario(
    scenario: Scenario, broker: BrokerProcess, settings: RunSettings, workdir: Path
) -> Metrics:
    if scenario.manages_broker:
        return await scenario.run(broker, settings, workdir)
    await broker.start()
    try:
        return await scenario.run(broker, settings, workdir)
    finally:
        with contextlib.suppress(Exception):
            await broker.stop()
