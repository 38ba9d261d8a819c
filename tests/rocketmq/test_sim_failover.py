"""Failover under load (issue #18, point 6): `lmqtt sim` spread over three gateway processes in
cluster mode and sync mode on one RocketMQ deployment; one node is SIGKILLed mid-run; its devices
and subscribers reconnect to the surviving nodes and the run judges every acknowledged message.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sim import SimConfig, run_simulation
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_cluster_sessions import Nodes
from tests.rocketmq.test_gateway_rocketmq import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _judge(subscribers: list[tuple[str, bool, int]]) -> None:
    """(name, persistent, lost) per subscriber: nothing acknowledged is lost. Persistent sessions
    resume on the survivors; a clean one counts what was published after its (re)SUBACK, which
    the cluster's filter registry routes from every node (gateway/cluster/filter_registry.py)."""
    lost = [(name, persistent, n) for name, persistent, n in subscribers if n]
    assert not lost, f"subscribers lost acknowledged messages: {lost}"


def _sync_nodes(rocketmq: RocketMQCluster, tmp_path: Path, n: int) -> Nodes:
    nodes = Nodes(rocketmq, tmp_path, broker="broker-b")  # SYNC_FLUSH: SEND_OK after the disk
    for _ in range(n):
        nodes.start("--flush", "sync")
    return nodes


async def test_sim_spread_over_three_nodes_survives_sigkill_of_one(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    nodes = _sync_nodes(rocketmq, tmp_path, 3)
    try:
        config = SimConfig(
            gateways=tuple(("127.0.0.1", g.port) for g in nodes.nodes),
            devices=12,
            rate=10.0,
            duration=8.0,
            subscribers=6,
            qos=1,
            seed=18,
            drain_timeout=30.0,
            name="failover",
        )
        sim = asyncio.create_task(run_simulation(config))
        # Kill node 0 once publishing is well under way (its devices and subscribers are on it).
        victim = nodes.nodes[0]
        await asyncio.sleep(4.0)
        assert not sim.done(), "the run ended before the kill"
        await asyncio.to_thread(victim.stop, signal.SIGKILL)
        report = await sim
    finally:
        await asyncio.to_thread(nodes.stop)
    assert report.acknowledged > 0
    assert report.failovers >= 4, "the killed node's devices (4 of 12) moved elsewhere"
    assert report.misrouted == 0
    _judge([(s.name, s.persistent, s.lost) for s in report.subscribers])


def test_sim_cli_takes_several_gateway_addresses(rocketmq: RocketMQCluster, tmp_path: Path) -> None:
    """`lmqtt sim --gateway A --gateway B`: spread over both, nothing lost, exit status 0."""
    nodes = _sync_nodes(rocketmq, tmp_path, 2)
    try:
        args = [f"--gateway=127.0.0.1:{g.port}" for g in nodes.nodes]
        out = subprocess.run(
            [sys.executable, "-m", "gateway", "sim", *args, "--devices", "4", "--rate", "5",
             "--duration", "2", "--subscribers", "2", "--quiet", "--name", "twonodes",
             "--json", str(tmp_path / "report.json")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        nodes.stop()
    assert out.returncode in (0, 1), out.stdout + out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["acknowledged"] > 0 and report["misrouted"] == 0
    _judge([(s["name"], s["persistent"], s["lost"]) for s in report["subscribers"]])
    assert out.returncode == 0 and "lost 0" in out.stdout, out.stdout
    # Both nodes had clients: each logged connects of the sim's devices.
    for g in nodes.nodes:
        assert any("connected from" in line for line in g.output), g.output
