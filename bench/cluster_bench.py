"""What cluster mode costs a client: SUBACK and CONNACK round trips with `cluster = true`.

Starts the tests' RocketMQ cluster (tests/rocketmq/cluster.py), then for each mode in turn a
fresh namespace with `lmqtt serve --store rocketmq` processes: "single" (one node, cluster
off), "cluster-1" (one node, cluster on: its own records read back) and "cluster-2" (two
nodes: SUBACK waits for the other node's acknowledgement). In each, one paho client connects
and subscribes `--rounds` new wildcard filters one after the other; CONNECT round trips are
timed with fresh clients (their CONNACK is polled every 5 ms: coarse). Wall-clock latencies
on a shared host: compare modes of one run only.

    .venv/bin/python -m bench.cluster_bench --rounds 300
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt

from tests.gateway.conftest import Client
from tests.rocketmq.cluster import RocketMQCluster, ensure_jars
from tests.rocketmq.test_gateway_rocketmq import ServeProcess


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _run_mode(cluster: RocketMQCluster, root: Path, mode: str, rounds: int) -> str:
    topic = f"b{uuid.uuid4().hex[:12]}"
    env = {"LMQTT_ROCKETMQ_TOPIC": topic, "LMQTT_ROCKETMQ_BROKER": "broker-a"}
    if mode != "single":
        env["LMQTT_CLUSTER"] = "true"
    count = 2 if mode == "cluster-2" else 1
    nodes = [
        ServeProcess(
            root / f"{mode}-{i}", "--store", "rocketmq", "--namesrv", cluster.namesrv_addr, env=env
        ).start()
        for i in range(count)
    ]
    try:
        sub = Client(nodes[0].port, "bench-sub")
        acked = threading.Event()
        sub.c.on_subscribe = lambda *_a: acked.set()  # paho's thread: no polling delay
        subacks: list[float] = []
        for i in range(rounds):
            acked.clear()
            t0 = time.perf_counter()
            rc, _mid = sub.c.subscribe(f"bench/{i}/+", 1)
            assert rc == mqtt.MQTT_ERR_SUCCESS
            assert acked.wait(30), "no SUBACK"
            subacks.append((time.perf_counter() - t0) * 1000)
        sub.disconnect()
        connacks: list[float] = []
        for i in range(min(rounds, 100)):
            t0 = time.perf_counter()
            c = Client(nodes[-1].port, f"bench-c{i}")
            connacks.append((time.perf_counter() - t0) * 1000)
            c.disconnect()
    finally:
        for n in nodes:
            n.stop()
    return (
        f"{mode:10} SUBACK ms p50 {statistics.median(subacks):6.1f} p90 {_pct(subacks, 0.9):6.1f}"
        f" p99 {_pct(subacks, 0.99):6.1f} | CONNACK ms p50 {statistics.median(connacks):6.1f}"
        f" p90 {_pct(connacks, 0.9):6.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmqtt-cluster-bench-") as tmp:
        root = Path(tmp)
        (root / "rocketmq").mkdir()
        ensure_jars()
        cluster = RocketMQCluster(root / "rocketmq")
        cluster.start()
        try:
            for mode in ("single", "cluster-1", "cluster-2"):
                print(_run_mode(cluster, root, mode, args.rounds), flush=True)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
