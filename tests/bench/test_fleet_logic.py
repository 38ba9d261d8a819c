"""The fleet harness's decisions, without timing: when a row is invalid, how the capacity
search walks, how the fleet is split and what a phase's GC figures are."""

from __future__ import annotations

import asyncio
import math
import sys

import pytest

from bench.fleet import (
    CAPACITY_P99_MS,
    capacity_search,
    device_slices,
    gc_phase,
    phase_verdict,
)
from bench.fleetgen import Fleet, deliveries_per_message, device_topic
from bench.report import _ratio, row_validity, target_checks
from bench.workers import GENERATOR_SATURATED, CpuProbe, invalid_reason


def _ok(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "flags": [],
        "loss_pct": 0.0,
        "lost_connections": 0,
        "publish_per_s": 10_000,
        "p99_ms": 2.0,
    }
    base.update(over)
    return base


def test_invalid_reason_names_the_flag_that_voids_a_row() -> None:
    assert invalid_reason([]) is None
    assert invalid_reason(["other-load"]) is None
    assert invalid_reason(["other-load", "generator-bound"]) == "invalid: generator-bound"
    assert invalid_reason(["host-saturated"]) == "invalid: host-saturated"


def test_a_generator_process_past_the_limit_flags_the_run() -> None:
    class Fixed:
        processes: list[object] = []  # the broker's processes: none ended

        def __init__(self, seconds: list[float]) -> None:
            self.seconds = seconds

        def cpu_seconds(self) -> float:
            return self.seconds.pop(0)

        def cpu_split(self) -> tuple[float, float]:  # all of it user time
            return self.cpu_seconds(), 0.0

        def store_cpu_seconds(self) -> float:  # a broker storing in its own process
            return 0.0

    # CpuProbe reads broker, workers and host CPU; feed it counters with known deltas.
    broker = Fixed([0.0, 0.1])
    busy = Fixed([0.0, 0.0])
    hot = Fixed([0.0, 0.0])
    # Fixed stands in for BrokerProcess and Worker: only the counters CpuProbe reads.
    probe = CpuProbe(broker, [busy, hot])  # type: ignore[arg-type, list-item]
    probe.start()
    wall = probe.wall0
    probe.wall0 = wall - 1.0  # one second of wall time
    busy.seconds = [0.2]
    hot.seconds = [GENERATOR_SATURATED + 0.05]
    flags = probe.stop()["flags"]
    assert "generator-bound" in flags


def test_the_brokers_cpu_is_split_into_its_own_code_and_the_kernels_work() -> None:
    class Split:
        processes: list[object] = []

        def __init__(self) -> None:
            self.times = [(1.0, 2.0), (1.3, 2.1)]  # (user, system) at start, then at stop

        def cpu_split(self) -> tuple[float, float]:
            return self.times.pop(0)

        def store_cpu_seconds(self) -> float:
            return 0.0

    probe = CpuProbe(Split(), [])  # type: ignore[arg-type]
    probe.start()
    probe.wall0 -= 2.0  # two seconds of wall time
    cpu = probe.stop()
    assert cpu["broker_user_s"] == pytest.approx(0.3)
    assert cpu["broker_system_s"] == pytest.approx(0.1)
    assert cpu["broker_cpu_s"] == pytest.approx(0.4)
    assert cpu["broker_cpu"] == pytest.approx(0.2, abs=0.01)


def test_row_validity_looks_at_both_brokers() -> None:
    results = {
        "fleet": {
            "lmqtt": {"median": {"flags": []}},
            "mosquitto": {"median": {"flags": ["generator-bound"]}},
            "amqtt": {"median": {"flags": ["other-load"]}},
        }
    }
    assert row_validity(results, "fleet", "lmqtt", "mosquitto") == "invalid: generator-bound"
    assert row_validity(results, "fleet", "lmqtt", "amqtt") is None


def test_phase_verdict() -> None:
    assert phase_verdict(10_000, _ok()) == "ok"
    assert phase_verdict(10_000, _ok(p99_ms=CAPACITY_P99_MS + 0.1)) == "fail"
    assert phase_verdict(10_000, _ok(loss_pct=0.01)) == "fail"
    assert phase_verdict(10_000, _ok(publish_per_s=9_000)) == "fail"  # offered rate not reached
    assert phase_verdict(10_000, _ok(lost_connections=1)) == "fail"
    # The bench being the limit outranks everything: no verdict about the broker.
    verdict = phase_verdict(10_000, _ok(flags=["generator-bound"], p99_ms=50.0))
    assert verdict == "invalid: generator-bound"
    assert phase_verdict(10_000, _ok(flags=["host-saturated"])) == "invalid: host-saturated"
    # A node that ended mid-phase (fenced by its lease) fails it, whatever else was flagged.
    assert phase_verdict(10_000, _ok(flags=["broker-exited", "host-saturated"])) == "fail"


async def test_a_broker_process_that_ended_flags_the_run() -> None:
    class Nodes:
        def __init__(self, processes: list[asyncio.subprocess.Process]) -> None:
            self.processes = processes

        def cpu_split(self) -> tuple[float, float]:
            return 0.0, 0.0

        def store_cpu_seconds(self) -> float:
            return 0.0

    alive = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(30)"
    )
    ended = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await ended.wait()
    try:
        probe = CpuProbe(Nodes([alive]), [])  # type: ignore[arg-type]
        probe.start()
        assert "broker-exited" not in probe.stop()["flags"]
        probe = CpuProbe(Nodes([alive, ended]), [])  # type: ignore[arg-type]
        probe.start()
        assert "broker-exited" in probe.stop()["flags"]
    finally:
        alive.kill()
        await alive.wait()


async def _search(limit: float, invalid_from: float = math.inf) -> tuple[float, str, list[float]]:
    asked: list[float] = []

    async def probe(rate: float) -> str:
        asked.append(rate)
        if rate >= invalid_from:
            return "invalid: generator-bound"
        return "ok" if rate <= limit else "fail"

    found, note = await capacity_search(probe, start=2_500, ceiling=80_000, refine=2)
    return found, note, asked


async def test_capacity_search_doubles_then_bisects() -> None:
    found, note, asked = await _search(limit=13_000)
    assert asked == [2_500, 5_000, 10_000, 20_000, 15_000, 12_500]
    assert (found, note) == (12_500, "")


async def test_capacity_search_stops_at_a_generator_bound_phase() -> None:
    found, note, asked = await _search(limit=1e9, invalid_from=40_000)
    assert (found, note) == (20_000, "generator-bound")
    assert asked[-1] == 40_000


async def test_capacity_search_reports_the_ceiling_and_a_failing_start() -> None:
    found, note, _ = await _search(limit=1e9)
    assert (found, note) == (80_000, "ceiling")
    # A failing start rate is bisected from below (0 .. start).
    found, note, asked = await _search(limit=1_000)
    assert (found, note, asked) == (1_000, "", [2_500, 1_000, 2_000])
    found, note, asked = await _search(limit=100)
    assert (found, note) == (0.0, "")


def test_device_slices_cover_every_device_once() -> None:
    for devices, processes in ((2_000, 2), (10_001, 3), (50_000, 4), (3, 5)):
        slices = device_slices(devices, processes)
        covered = [d for first, last in slices for d in range(first, last)]
        assert covered == list(range(devices))
        assert len(slices) <= processes


def test_fleet_topics_and_fanout() -> None:
    assert device_topic(123) == "site/23/dev/123/temp"
    # site/#, site/+/dev/+/temp, and site/{k}/# for sites 0..4
    assert deliveries_per_message(3) == 3
    assert deliveries_per_message(53) == 3
    assert deliveries_per_message(7) == 2
    assert sum(deliveries_per_message(d) for d in range(50)) == 105


def test_gc_phase_from_two_histogram_scrapes() -> None:
    before = {"le=0.001": 10.0, "le=0.005": 12.0, "le=0.05": 13.0, "le=+Inf": 13.0, "sum": 0.1}
    after = {"le=0.001": 40.0, "le=0.005": 45.0, "le=0.05": 49.0, "le=+Inf": 49.0, "sum": 0.3}
    after["max"] = 0.04
    phase = gc_phase(before, after)
    assert phase["gc_count"] == 36
    assert phase["gc_over_5ms"] == 3  # 36 - (45 - 12)
    assert phase["gc_total_ms"] == 200.0
    assert phase["gc_longest_under_ms"] == 50.0
    assert gc_phase({}, after) == {}


def test_a_ratio_cell_says_invalid_only_where_there_is_a_ratio() -> None:
    assert _ratio(2.0, 1.0) == "2.00x"
    assert _ratio(2.0, 1.0, invalid="invalid: generator-bound") == "invalid: generator-bound"
    assert _ratio(2.0, None, invalid="invalid: generator-bound") == "-"  # broker not run
    assert _ratio(2.0, 1.0, meaningful=False, invalid="invalid: host-saturated") == "-"


def test_fleet_targets_follow_the_device_count() -> None:
    def run(connected: int, p99: float, p999: float, kib: float) -> dict[str, object]:
        median = {"connected": connected, "p99_ms": p99, "p999_ms": p999, "kib_per_device": kib}
        return {"fleet": {"lmqtt": {"median": median}}}

    checks = target_checks(run(10_000, 4.0, 25.0, 4.9))
    assert checks[("fleet", "p99_ms")] == "<=5 ms at 10k: held"
    assert checks[("fleet", "p999_ms")] == "<=20 ms at 10k: MISSED"
    assert checks[("fleet", "kib_per_device")] == "<=5 KiB: held"
    checks = target_checks(run(50_000, 9.0, 99.0, 6.0))
    assert checks[("fleet", "p99_ms")] == "<=10 ms at 50k: held"
    assert ("fleet", "p999_ms") not in checks
    assert checks[("fleet", "kib_per_device")] == "<=5 KiB: MISSED"
    assert ("fleet", "p99_ms") not in target_checks(run(2_000, 50.0, 99.0, 4.0))


async def test_a_generator_with_no_connected_device_runs_its_phase_sending_nothing() -> None:
    """The fleet hands a process whose devices all failed to connect rate 0 (its share of the
    offered rate): the phase ends with nothing sent instead of a ZeroDivisionError."""
    fleet = Fleet({"host": "127.0.0.1", "port": 1, "first": 0, "last": 0})
    result = await fleet.run(0.0, 0.2)
    assert (result["sent"], result["expected"], result["acked"]) == (0, 0, 0)
