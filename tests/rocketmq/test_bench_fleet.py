"""The bench's ``lmqtt-rocketmq`` broker on the real cluster: the fleet scenario end to end with
the gateway storing through RocketMQ, and the JVMs' CPU counted beside the gateway's. Not a
timed test: it checks that every message arrives and that the figures the report needs exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.brokers import BrokerOptions, BrokerProcess, BrokerUnavailable
from bench.fleet import fleet
from tests.rocketmq.cluster import RocketMQCluster


async def test_the_fleet_runs_on_the_rocketmq_backend(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    options = BrokerOptions(admin=True)
    broker = BrokerProcess("lmqtt-rocketmq", tmp_path, options, rocketmq=rocketmq)
    assert broker.command()[broker.command().index("--namesrv") + 1] == rocketmq.namesrv_addr
    await broker.start()
    try:
        metrics = await fleet(
            broker,
            devices=60,
            rate=120.0,
            duration=1.0,
            qos=1,
            capacity=False,
            admin_port=broker.admin_port,
        )
    finally:
        await broker.stop()
    # Every PUBLISH went to the run's own parent topic on broker-a (async mode's broker).
    topic = broker.environment()["LMQTT_ROCKETMQ_TOPIC"]
    async with rocketmq.client() as client:
        assert await client.get_max_offset(rocketmq.brokers["broker-a"], topic, 0) >= 120
    assert metrics["connected"] == 60 and metrics["connect_failures"] == 0
    assert metrics["published"] == 120
    assert metrics["delivered"] == metrics["expected"] == 2 * (60 * 2 + 10)
    assert metrics["loss_pct"] == 0.0
    # The brokers did the storing: their CPU is measured, not left in "other".
    assert metrics["store_cpu_s"] > 0
    assert metrics["us_store_cpu_per_publish"] > 0
    for key in ("p50_ms", "p99_ms", "us_cpu_per_publish"):
        assert key in metrics
    # Held pulls with 60 devices each subscribed to its cmd/{id}: the parent topic's tail and
    # the inbound consumer's queues, not one per device (the gateway's gauge); the brokers'
    # own count is read too (it may include pulls other tests' gateways left held).
    assert 1 <= metrics["held_pulls"] <= 8
    assert metrics["broker_held_pulls"] >= 1


def test_without_a_cluster_the_rocketmq_broker_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(BrokerUnavailable, match="RocketMQ"):
        BrokerProcess("lmqtt-rocketmq", tmp_path, BrokerOptions()).command()


async def test_the_fleet_runs_through_three_gateway_nodes(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    """lmqtt-rocketmq-3n: three gateway processes on one namespace; backends and devices
    spread over them, so deliveries cross nodes through the broker; nothing lost."""
    broker = BrokerProcess("lmqtt-rocketmq-3n", tmp_path, BrokerOptions(), rocketmq=rocketmq)
    ports = [broker.command(n)[broker.command(n).index("--port") + 1] for n in range(3)]
    assert len(set(ports)) == 3 and [int(p) for p in ports] == broker.ports
    await broker.start()
    try:
        assert len(broker.pids) == 3
        metrics = await fleet(broker, devices=60, rate=120.0, duration=1.0, qos=1, capacity=False)
        assert all(p.returncode is None for p in broker.processes)
    finally:
        await broker.stop()
    assert metrics["connected"] == 60 and metrics["connect_failures"] == 0
    assert metrics["delivered"] == metrics["expected"] == 2 * (60 * 2 + 10)
    assert metrics["loss_pct"] == 0.0
    assert metrics["broker_cpu_s"] > 0 and metrics["store_cpu_s"] > 0
