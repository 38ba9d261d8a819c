"""The demo, run for real: the lmqtt gateway, the simulator's whole subscriber mix, zero loss.

`test_the_compose_demo_runs_locally` runs the very commands of docker-compose.yml (the gateway's
environment, its health check, the devices and subscribers services, then the analytics
service) as local processes, with only host, port, paths and durations rewritten.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.config import load_settings
from sim import SimConfig, Simulation, run_simulation
from sim.client import SimClient
from tests.sim.conftest import closed_port
from tests.sim.deployment import compose, lmqtt_commands_in_compose, lmqtt_executable


async def test_the_whole_mix_loses_nothing_through_the_lmqtt_gateway(lmqtt_gateway: int) -> None:
    report = await run_simulation(
        SimConfig(
            port=lmqtt_gateway, devices=6, rate=8.0, duration=3.0, subscribers=6, seed=3,
            drain_timeout=15.0,
        )
    )  # fmt: skip

    assert report.ok, report
    assert report.exit_code == 0
    assert report.sent == report.acknowledged > 0 and report.failed == 0
    assert report.lost == 0 and report.misrouted == 0 and report.dropped == 0
    by_name = {s.name: s for s in report.subscribers}
    # Every subscriber had something to receive, and got all of it.
    assert all(s.expected > 0 and s.lost == 0 for s in report.subscribers)
    # The persistent ones that went offline got what was published while they were away.
    away = [s for s in report.subscribers if s.went_offline]
    assert {s.name for s in away} == {"site-archive-2", "device-twin-4"}
    assert all(s.persistent and s.received >= s.expected for s in away)
    # `site/#` sees every acknowledged message exactly once (duplicates counted apart).
    assert by_name["everything-6"].expected == report.acknowledged


async def test_a_gateway_restart_loses_nothing_acknowledged(tmp_path: Path) -> None:
    # Persistent sessions survive the restart (the gateway saves them) and resume; clean ones
    # re-subscribe; devices reconnect. Publishes refused while it is down are "failed".
    settings = load_settings(
        host="127.0.0.1", port=closed_port(), data_dir=tmp_path / "data", sys_interval=0
    )
    gateway = Gateway(settings)
    await gateway.start()
    sim = Simulation(
        SimConfig(
            port=settings.port or 0, devices=4, rate=8.0, duration=5.0, subscribers=6,
            drain_timeout=15.0,
        )
    )  # fmt: skip
    run = asyncio.create_task(sim.run())
    try:
        while sim.snapshot().acknowledged < 40:
            await asyncio.wait([run], timeout=0.05)
            assert not run.done(), run
        await gateway.stop()
        gateway = Gateway(settings)
        await gateway.start()
        report = await asyncio.wait_for(run, 60)
    finally:
        await gateway.stop()

    assert report.dropped >= 6  # every subscriber noticed
    assert report.failed < report.sent
    assert report.lost == 0 and report.ok, report
    everything = next(s for s in report.subscribers if s.name == "everything-6")
    assert everything.persistent and everything.expected == report.acknowledged


async def test_sessions_stay_for_analytics_and_the_next_run_starts_them_afresh(
    lmqtt_gateway: int,
) -> None:
    # A session of an earlier run (same client id) subscribed to more than today's plan.
    leftover = SimClient("sim-site-archive-2", "127.0.0.1", lmqtt_gateway, clean_session=False)
    await leftover.connect()
    await leftover.subscribe(("site/#",), 1)
    await leftover.disconnect()

    settings = {"port": lmqtt_gateway, "devices": 4, "rate": 8.0, "duration": 1.5}
    first = await run_simulation(SimConfig(**settings, subscribers=2))  # type: ignore[arg-type]
    assert first.ok and first.misrouted == 0
    archive = first.subscribers[1]
    assert archive.client_id == "sim-site-archive-2" and archive.received == archive.expected

    # The sessions were kept: a subscriber resuming it now gets what was published since.
    devices_only = SimConfig(**settings, subscribers=0, run_id="later")  # type: ignore[arg-type]
    later = await run_simulation(devices_only)
    resumed = SimClient("sim-site-archive-2", "127.0.0.1", lmqtt_gateway, clean_session=False)
    await resumed.connect()
    try:
        delivery = await asyncio.wait_for(resumed.next_delivery(), 10)
    finally:
        await resumed.disconnect()
    assert later.acknowledged > 0 and b'"run":"later"' in delivery.payload


def rewritten(argv: list[str], replace: dict[str, str], extra: list[str]) -> list[str]:
    out = list(argv)
    for option, value in replace.items():
        if option in out:
            out[out.index(option) + 1] = value
    return out + extra


def healthcheck(port: int) -> list[str]:
    test = compose()["services"]["gateway"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    return [sys.executable, *[t.replace("1883", str(port)) for t in test[2:]]]


def wait_healthy(port: int, gateway: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(healthcheck(port), capture_output=True, timeout=10).returncode != 0:
        assert gateway.poll() is None, "the gateway exited"
        assert time.monotonic() < deadline, "the gateway never became healthy"


def run_compose_demo(tmp_path: Path, duration: float) -> tuple[Path, dict[str, dict[str, Any]]]:
    """Run the gateway, devices and subscribers services' commands locally.

    Returns the gateway's data directory and the two simulators' JSON reports.
    """
    services = compose()["services"]
    port = closed_port()
    data = tmp_path / "data"
    env = {**os.environ, **{k: str(v) for k, v in services["gateway"]["environment"].items()}}
    env.update(LMQTT_HOST="127.0.0.1", LMQTT_PORT=str(port), LMQTT_DATA_DIR=str(data))

    assert subprocess.run(healthcheck(port), capture_output=True).returncode != 0  # not yet up
    gateway = subprocess.Popen(
        [*lmqtt_executable(), *services["gateway"]["command"]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(port, gateway)
        commands = dict(lmqtt_commands_in_compose())
        at = {"--host": "127.0.0.1", "--port": str(port)}
        reports = {name: tmp_path / f"{name}.json" for name in ("devices", "subscribers")}
        durations = {"devices": str(duration), "subscribers": str(duration + 2)}
        sims = {
            name: subprocess.Popen(
                [
                    *lmqtt_executable(),
                    *rewritten(
                        commands[name],
                        {**at, "--duration": durations[name]},
                        ["--json", str(reports[name]), "--quiet"],
                    ),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for name in ("subscribers", "devices")
        }
        outputs = {name: proc.communicate(timeout=120)[0].decode() for name, proc in sims.items()}
        assert sims["devices"].returncode == 0, outputs["devices"]
        assert sims["subscribers"].returncode == 0, outputs["subscribers"]
    finally:
        gateway.send_signal(signal.SIGINT)
        gateway_log = gateway.communicate(timeout=60)[0].decode()
    assert gateway.returncode == 0, gateway_log
    return data, {name: json.loads(path.read_text()) for name, path in reports.items()}


def test_the_compose_demo_runs_locally(tmp_path: Path) -> None:
    data, reports = run_compose_demo(tmp_path, duration=3.0)

    devices = reports["devices"]
    assert devices["ok"] and devices["lost"] == 0 and devices["acknowledged"] > 0
    assert all(s["expected"] > 0 for s in devices["subscribers"])
    # The observers publish nothing; they received the devices' telemetry as "other".
    observers = reports["subscribers"]
    assert observers["expected"] == 0 and observers["foreign"] > 0
    assert (data / "commitlog").is_dir()


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_the_compose_analytics_step_reports_on_the_demos_data(tmp_path: Path) -> None:
    data, reports = run_compose_demo(tmp_path, duration=2.0)
    run_analytics(compose()["services"]["analytics"], data, tmp_path / "reports")

    # Spark's per-device counts agree with what the simulator's devices had acknowledged.
    import pandas as pd

    devices = reports["devices"]
    table = pd.read_parquet(tmp_path / "reports" / "fanout" / "report" / "device_fanout")
    simulated = table[table["client_id"].str.fullmatch(r"d\d{4}")]
    assert devices["failed"] == 0
    assert int(simulated["messages"].sum()) == devices["acknowledged"]
    assert int(simulated["deliveries"].sum()) > 0  # the kept persistent sessions count


def run_analytics(service: dict[str, Any], data: Path, reports: Path) -> None:
    """The analytics service's script with /data and /reports pointing at local folders."""
    reports.mkdir()
    command = service["command"]
    assert isinstance(command, list)
    script = command[0].replace("/data", str(data)).replace("/reports", str(reports))
    lmqtt = shlex.join(lmqtt_executable())
    script = " ".join(lmqtt if word == "lmqtt" else word for word in script.split(" "))
    result = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, timeout=600,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    html = reports / "report.html"
    assert html.exists() and "<html" in html.read_text()[:2000].lower()
