"""`lmqtt sim` as users run it: a subprocess, its exit status, its output."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from sim.cli import main
from tests.sim.conftest import SIM_USER, closed_port

SIM = [sys.executable, "-m", "sim"]


async def run_sim(*args: str, timeout: float = 60.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *SIM, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_clean_run_exits_0_with_a_summary_and_a_json_report(
    amqtt_broker: int, tmp_path: Path
) -> None:
    report_file = tmp_path / "report.json"
    code, out, err = await run_sim(
        "--port", str(amqtt_broker), "--username", SIM_USER, "--devices", "3", "--rate", "10",
        "--duration", "1", "--subscribers", "1", "--json", str(report_file),
    )  # fmt: skip
    assert code == 0, out + err
    assert "OK: every acknowledged message" in out
    assert "all-temperatures-1" in out
    report = json.loads(report_file.read_text())
    assert report["ok"] is True and report["lost"] == 0
    assert report["acknowledged"] == report["sent"] > 0
    assert report["subscribers"][0]["expected"] > 0


async def test_an_unreachable_gateway_exits_2_with_one_line_and_no_traceback() -> None:
    code, out, err = await run_sim("--port", str(closed_port()), "--duration", "1")
    assert code == 2
    assert "cannot connect" in err and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


async def test_clients_spread_over_several_gateways_fail_over_from_a_dead_one(
    amqtt_broker: int, tmp_path: Path
) -> None:
    """`--gateway` twice, the first address dead: the clients that start there (every other
    one) connect to the next address instead; nothing is lost, the report counts them."""
    report_file = tmp_path / "report.json"
    code, out, err = await run_sim(
        "--gateway", f"127.0.0.1:{closed_port()}", "--gateway", f"127.0.0.1:{amqtt_broker}",
        "--username", SIM_USER, "--devices", "4", "--rate", "10", "--duration", "1",
        "--subscribers", "1", "--json", str(report_file),
    )  # fmt: skip
    # (One subscriber: amqtt forgets QoS 1 messages in flight to a persistent subscriber that
    # goes offline, see test_simulation.py; the gateways' own failover is tests/rocketmq's.)
    assert code == 0, out + err
    report = json.loads(report_file.read_text())
    assert report["ok"] is True and report["acknowledged"] == report["sent"] > 0
    # Devices 0 and 2 and subscriber 0 start at the dead address (client i: address i mod 2).
    assert report["failovers"] == 3
    assert "failed over to another gateway node" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--gateway", "nohost"],
        ["--gateway", "127.0.0.1:http"],
        ["--qos", "3"],
        ["--devices", "-1"],
        ["--rate", "0"],
        ["--duration", "abc"],
        ["--no-such-option"],
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert err and "Traceback" not in err


async def test_ctrl_c_stops_publishing_drains_and_summarises(amqtt_broker: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        *SIM, "--port", str(amqtt_broker), "--username", SIM_USER, "--devices", "3",
        "--rate", "10", "--duration", "120", "--subscribers", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    try:
        async with asyncio.timeout(30):
            while "[publishing" not in (line := (await proc.stdout.readline()).decode()):
                assert line, "the simulator ended before publishing"
                lines.append(line)
        proc.send_signal(signal.SIGINT)
        out, _err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130
    text = out.decode()
    assert "stopping: draining" in text
    assert "interrupted" in text and "OK: every acknowledged message" in text
