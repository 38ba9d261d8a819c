"""Bans across cluster nodes (gateway/access/bans.py over RocketMQ's %STATE% queue): two real
`lmqtt serve --store rocketmq` cluster nodes, real paho clients, the admin API of each node.

A ban made on node A refuses the client on node B, and closes it there, within a second; a
client flapping on node A is banned on node B too; a node restarted reads the bans back from
the %STATE% queue.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from gateway.ops.admin_client import AdminClient
from tests.gateway.access.test_bans import ADMIN_LINE, connack, connack_v311
from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "cluster-ban-token"
FLAP_MAX = 3
#: The promise: a ban made on one node is in force on every node within this.
PROPAGATION_S = 1.0


class Node:
    def __init__(self, proc: ServeProcess) -> None:
        self.proc = proc
        self.api = self.start()

    def start(self) -> AdminClient:
        self.proc.start()
        wait_until(lambda: self._admin_port(), what="the admin listener's log line")
        self.api = AdminClient(f"http://127.0.0.1:{self._admin_port()}", token=TOKEN)
        return self.api

    def _admin_port(self) -> int:
        for line in self.proc.output:
            m = ADMIN_LINE.search(line)
            if m:
                return int(m.group(1))
        return 0

    @property
    def port(self) -> int:
        return self.proc.port

    def bans(self) -> dict[str, dict[str, object]]:
        return {f"{b['kind']}/{b['value']}": b for b in self.api.get("/api/bans")["bans"]}


@pytest.fixture(scope="module")
def pair(
    rocketmq: RocketMQCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Node]]:
    tmp = tmp_path_factory.mktemp("cluster-bans")
    token = tmp / "token"
    token.write_text(TOKEN)
    env = {
        "LMQTT_ROCKETMQ_TOPIC": f"b{uuid.uuid4().hex[:12]}",
        "LMQTT_ROCKETMQ_BROKER": "broker-a",
        "LMQTT_CLUSTER": "true",
        "LMQTT_CLUSTER_LEASE": "6",
        "LMQTT_CLUSTER_HEARTBEAT": "1",
        "LMQTT_ADMIN_TOKEN_FILE": str(token),
        "LMQTT_FLAPPING_MAX_CONNECTS": str(FLAP_MAX),
    }
    args = ("--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, "--admin-port", "0")
    procs = [ServeProcess(tmp / f"node{i}", *args, env=env) for i in range(2)]
    nodes: list[Node] = []
    try:
        for p in procs:
            nodes.append(Node(p))
        yield nodes
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def test_a_ban_made_on_one_node_holds_on_the_other_within_a_second(
    pair: list[Node], clients: list[Client]
) -> None:
    a, b = pair
    victim = Client(b.port, "victim-1", v5=True)
    clients.append(victim)
    victim.c.reconnect_delay_set(60, 60)
    a.api.post("/api/bans", {"client_id": "victim-1", "reason": "runaway", "for": "10m"})
    made = time.monotonic()
    # Node B closes its connection (DISCONNECT 0x98) as soon as the ban reaches it.
    victim.wait_for(lambda: victim.disconnected is not None, 5.0, "the DISCONNECT on node B")
    took = time.monotonic() - made
    assert victim.disconnected == 0x98
    assert took < PROPAGATION_S, f"node B applied the ban after {took:.2f} s"
    assert connack(b.port, "victim-1", v5=True) == 0x8A
    assert connack_v311(b.port, "victim-1") == b"\x20\x02\x00\x05"
    listed = b.bans()["client_id/victim-1"]
    assert listed["reason"] == "runaway" and listed["source"] == "admin"

    # Lifted on node B: node A admits the client again, as soon.
    b.api.delete("/api/bans/client_id/victim-1")
    lifted = time.monotonic()
    wait_until(lambda: "client_id/victim-1" not in a.bans(), 5.0, "the removal on node A")
    assert time.monotonic() - lifted < PROPAGATION_S
    assert connack(a.port, "victim-1", v5=True) == 0


def test_a_client_flapping_on_one_node_is_banned_on_every_node(pair: list[Node]) -> None:
    a, b = pair
    for _ in range(FLAP_MAX):
        assert connack(a.port, "flapper-1", v5=True) == 0
    assert connack(a.port, "flapper-1", v5=True) == 0x8A
    banned = time.monotonic()
    wait_until(lambda: "client_id/flapper-1" in b.bans(), 5.0, "the flapping ban on node B")
    assert time.monotonic() - banned < PROPAGATION_S
    ban = b.bans()["client_id/flapper-1"]
    assert ban["reason"] == "flapping" and ban["source"] == "flapping"
    assert connack(b.port, "flapper-1", v5=True) == 0x8A
    assert connack(b.port, "flapper-1", v5=False) == 0x87  # 3.1.1's 5, as paho reports it


def test_a_restarted_node_keeps_the_bans(pair: list[Node]) -> None:
    a, b = pair
    a.api.post("/api/bans", {"address": "127.0.0.0/8", "reason": "kept", "for": "1h"})
    a.api.post("/api/bans", {"client_id": "brief-r", "for": "1s"})
    b.proc.stop()
    b.start()
    try:
        bans = b.bans()
        assert bans["address/127.0.0.0/8"]["reason"] == "kept"
        assert connack(b.port, "anyone", v5=True) == 0x8A
        # The brief one ended: gone from the list on every node, by its own clock.
        wait_until(lambda: "client_id/brief-r" not in b.bans(), 5.0, "the 1 s ban to end")
        wait_until(lambda: "client_id/brief-r" not in a.bans(), 5.0, "the 1 s ban to end")
    finally:
        b.api.delete("/api/bans/address/127.0.0.0%2F8")
    wait_until(lambda: "address/127.0.0.0/8" not in a.bans(), 5.0, "the removal on node A")
    assert connack(a.port, "anyone", v5=True) == 0
