"""The compose demo's cluster profile for real, without Docker (issue #18, point 8): the balancer
`rmq-lb` runs docker-compose.yml's own HAProxy configuration in front of three `lmqtt serve`
processes in cluster mode on the test RocketMQ cluster, and the simulator service
`cluster-devices` runs its own command (scaled down) through the balancer's one address. One
node is SIGKILLed mid-run, as `docker compose kill rmq-node-2` does in docs/demo.md: its clients
reconnect through the same address, HAProxy sends them to the two survivors, and the
simulator's verdict is `lost 0`.

Only what cannot exist outside Docker is rewritten: the listen port and the three servers'
addresses (Docker's DNS names become 127.0.0.1 ports).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ROOT, ServeProcess, _free_port
from tests.rocketmq.test_sim_failover import _sync_nodes
from tests.sim.deployment import cluster_services, haproxy_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: The compose simulator's command, scaled down: 30 devices for 12 s instead of 60 for 10 min.
SCALE = {"--devices": "30", "--duration": "12"}
#: A sim client's connect as a gateway logs it (gateway/connection/client.py).
CONNECTED = re.compile(r"'([^']+)' connected from ")


def balancer_config(listen: int, servers: Mapping[str, int]) -> str:
    """The compose balancer's haproxy.cfg with its `bind` on 127.0.0.1:`listen` and each
    `server NAME rmq-node-N:1883` on 127.0.0.1:`servers[NAME]`; every other line as is."""
    lines, rewritten = [], set()
    for line in haproxy_config().splitlines():
        words = line.split()
        if words[:1] == ["bind"]:
            assert words == ["bind", ":1883"], line
            line = line.replace(":1883", f"127.0.0.1:{listen}")
            rewritten.add("bind")
        elif words[:1] == ["server"]:
            name, address = words[1], words[2]
            assert address.startswith("rmq-node-") and address.endswith(":1883"), line
            line = line.replace(address, f"127.0.0.1:{servers[name]}")
            rewritten.add(name)
        lines.append(line)
    assert rewritten == {"bind", *servers}, f"the compose config changed shape: {rewritten}"
    return "\n".join(lines) + "\n"


def compose_sim_command(**values: str) -> list[str]:
    """The `cluster-devices` service's `lmqtt sim ...` with the given options' values
    replaced (every one of them must be in the compose command)."""
    argv = [str(a) for a in cluster_services()["cluster-devices"]["command"]]
    assert argv[0] == "sim", argv
    for option, value in values.items():
        argv[argv.index(option) + 1] = value
    return argv


class Balancer:
    """`haproxy -db -f CFG` (foreground, its log on stdout) until stopped."""

    def __init__(self, executable: str, cfg: Path, port: int) -> None:
        self.port = port
        self.log = cfg.with_suffix(".log")
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [executable, "-db", "-f", str(cfg)], stdout=out, stderr=subprocess.STDOUT
            )

    def wait_listening(self, timeout: float = 20.0) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, "haproxy exited:\n" + self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
            except OSError:
                return False
            return True

        wait_until(up, timeout, f"haproxy listening on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        print(self.log.read_text())  # shown by pytest when the test fails


def connects(node: ServeProcess, start: int = 0, end: int | None = None) -> set[str]:
    """Client ids of the connects `node` logged in its output lines [start, end)."""
    return {m.group(1) for line in node.output[start:end] if (m := CONNECTED.search(line))}


@pytest.fixture
def watchers() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def test_compose_balancer_spreads_devices_and_survives_sigkill_of_a_node(
    haproxy: str, rocketmq: RocketMQCluster, tmp_path: Path, watchers: list[Client]
) -> None:
    nodes = _sync_nodes(rocketmq, tmp_path, 3)  # as the compose nodes: cluster mode, --flush sync
    balancer: Balancer | None = None
    sim: subprocess.Popen[str] | None = None
    try:
        names = sorted(n for n in cluster_services() if n.startswith("rmq-node-"))
        assert len(names) == 3
        # compose's `server node1 rmq-node-1:1883` ... in the order of the nodes' names
        servers = {
            f"node{n.rsplit('-', 1)[1]}": g.port for n, g in zip(names, nodes.nodes, strict=True)
        }
        cfg = tmp_path / "haproxy.cfg"
        port = _free_port()
        cfg.write_text(balancer_config(port, servers))
        balancer = Balancer(haproxy, cfg, port)
        balancer.wait_listening()
        report_file = tmp_path / "report.json"
        argv = compose_sim_command(**SCALE, **{"--host": "127.0.0.1", "--port": str(port)})
        sim = subprocess.Popen(
            [sys.executable, "-m", "gateway", *argv, "--quiet", "--json", str(report_file)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        # Publishing is under way once a watcher on a survivor (straight to the node, not
        # through the balancer) receives the devices' messages.
        victim, survivors = nodes.nodes[1], [nodes.nodes[0], nodes.nodes[2]]
        watcher = Client(survivors[0].port, "watcher")
        watchers.append(watcher)
        watcher.subscribe("site/#", qos=0)
        watcher.wait_messages(60, timeout=60)
        assert sim.poll() is None, "the run ended before the kill"
        # The balancer spread the simulator's clients over every node (leastconn).
        marks = [len(g.output) for g in nodes.nodes]
        before = [
            connects(g, 0, mark) - {"watcher"} for g, mark in zip(nodes.nodes, marks, strict=True)
        ]
        assert all(len(ids) >= len(set().union(*before)) // 6 for ids in before), before
        victim.stop(signal.SIGKILL)  # `docker compose kill rmq-node-2`
        out, _ = sim.communicate(timeout=150)
    finally:
        if sim is not None and sim.poll() is None:
            sim.kill()
            sim.wait(10)
        if balancer is not None:
            balancer.stop()
        nodes.stop()
    print(out, "clients per node before the kill:", [sorted(ids) for ids in before])
    assert report_file.exists(), out
    report = json.loads(report_file.read_text())
    assert report["acknowledged"] > 0 and report["misrouted"] == 0, out
    assert sim.returncode == 0 and "lost 0," in out, out
    # Every client that was on the victim came back through the balancer on a survivor (a
    # persistent subscriber whose session-discarding connect went elsewhere is left out: it may
    # not have been on the victim at the kill).
    on_victim = before[1] - before[0] - before[2]
    after = connects(nodes.nodes[0], marks[0]) | connects(nodes.nodes[2], marks[2])
    assert on_victim - after == set(), f"not back on a survivor: {sorted(on_victim - after)}"
    assert any(re.fullmatch(r"d\d{4}", c) for c in on_victim), f"no device on the victim: {before}"
    # ... where HAProxy's health check (compose's `check inter 2s fall 2`) took the victim out.
    assert "node2 is DOWN" in balancer.log.read_text()
