"""The fan-out report of a RocketMQ deployment (analytics/rocketmq.py), end to end: a real
`lmqtt serve --store rocketmq` on the session's real cluster, real paho clients publishing with
fan-out, then the report job (Spark in local mode) reading the deployment through pulls, and
`lmqtt report fanout --store rocketmq` as an operator runs it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
import pytest

from tests.analytics.test_gateway_traffic import TRAFFIC, drive_traffic
from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ROOT, ServeProcess

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(900)]


def test_report_of_a_rocketmq_deployment(
    rocketmq: RocketMQCluster, spark: SparkSession, tmp_path: Path
) -> None:
    from analytics.fanout import run_fanout
    from analytics.rocketmq import Deployment, read_deployment

    topic = f"r{uuid.uuid4().hex[:12]}"
    data = tmp_path / "data"
    g = ServeProcess(
        data,
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
        env={"LMQTT_ROCKETMQ_TOPIC": topic, "LMQTT_ROCKETMQ_BROKER": "broker-a"},
    ).start()  # fmt: skip
    made: list[Client] = []
    try:
        everything, offline, g1, g2 = drive_traffic(g.port, made)
        plant = sum(n for ts in TRAFFIC.values() for t, n in ts if t.startswith("plant/"))
        plant1 = sum(n for _, n in TRAFFIC["dev-1"])
        everything.wait_messages(plant)
        wait_until(lambda: len(g1.messages) + len(g2.messages) >= plant1, what="shared")
        # A RocketMQ application's command through the inbound topic: a device of the report
        # too (gateway/messages/inbound.py), delivered to one persistent subscriber.
        cmd = Client(g.port, "cmd-sub", clean=False)
        made.append(cmd)
        cmd.subscribe("cmd/#", 1)
        asyncio.run(_send_inbound(rocketmq, topic))
        cmd.wait_messages(1)
    finally:
        stop_clients(made)
        assert g.stop() == 0  # graceful: the committed offsets are pushed to the broker

    received: Counter[str] = Counter()
    for c in (everything, g1, g2, offline):
        for m in c.messages:
            received[m.payload.decode().split(":")[0]] += 1

    def check(out: Path) -> None:
        table = pq.read_table(out / "report" / "device_fanout").to_pylist()
        rows = {r["client_id"]: r for r in table}
        # The state batches and the probe are no device; the inbound producer is one.
        assert set(rows) == {*TRAFFIC, INBOUND}
        inbound = rows[INBOUND]
        assert (inbound["messages"], inbound["deliveries"], inbound["fanout_max"]) == (1, 1, 1)
        for device, topics in TRAFFIC.items():
            row = rows[device]
            assert row["messages"] == sum(n for _, n in topics), device
            assert row["deliveries"] == received[device], device
        assert rows["dev-1"]["fanout_max"] == 3  # plant/#, plant/+/temp, plant/1/#
        assert rows["dev-1"]["fanout_mean"] == pytest.approx((10 * 3 + 5 * 2) / 15)
        assert rows["dev-2"]["fanout_max"] == 2  # plant/#, plant/+/temp
        assert rows["dev-3"]["fanout_max"] == 0
        assert rows["dev-3"]["deliveries"] == 0
        # Due but not delivered: the offline subscriber's temperature readings.
        assert rows["dev-1"]["eligible"] - rows["dev-1"]["deliveries"] == 10
        assert rows["dev-2"]["eligible"] - rows["dev-2"]["deliveries"] == 8
        assert rows["dev-1"]["subscribers_reached"] == 2  # sub-all and the shared group
        backlog = {
            r["filter"]: r for r in pq.read_table(out / "report" / "queue_backlog").to_pylist()
        }
        assert backlog["plant/+/temp"]["backlog_messages"] == 18
        assert backlog["plant/#"]["backlog_messages"] == 0

    # With the gateway's data directory: its delivery account (committed offsets: the broker's).
    dep = Deployment(rocketmq.namesrv_addr, topic, "broker-a", str(data))
    meta = run_fanout(spark, "", tmp_path / "with-data", rocketmq=read_deployment(dep))
    assert meta.data_dir == f"rocketmq://{rocketmq.namesrv_addr}/{topic}"
    assert meta.messages == sum(n for ts in TRAFFIC.values() for _, n in ts) + 1
    check(tmp_path / "with-data")

    # The operator's command, from anywhere that reaches the name server: nothing local at
    # all (no delivery account: deliveries counted from the committed offsets).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "broker-only"
    done = subprocess.run(
        [sys.executable, "-m", "analytics", "fanout", "--store", "rocketmq",
         "--namesrv", rocketmq.namesrv_addr, "--rocketmq-topic", topic,
         "--out", str(out), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "5 devices" not in done.stderr  # four devices: the gateway's own records are none
    assert f"{meta.messages} messages from 4 devices" in done.stderr
    check(out)


INBOUND = "rocketmq:svc"


async def _send_inbound(rocketmq: RocketMQCluster, topic: str) -> None:
    """One message to the deployment's inbound topic, as a RocketMQ producer sends it."""
    async with rocketmq.client() as client:
        await client.send_message(
            rocketmq.brokers["broker-a"], f"{topic}-in", b"open",
            properties={"mqttTopic": "cmd/9/open", "mqttQos": "1", "mqttPublisher": "svc"},
        )  # fmt: skip


def test_report_names_what_is_wrong(rocketmq: RocketMQCluster, tmp_path: Path) -> None:
    """An unknown topic and an unreachable name server: one line each, exit 2, no Spark."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "analytics", "fanout", "--store", "rocketmq", *args,
             "--out", str(tmp_path / "out"), "--no-progress"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    empty = run("--namesrv", rocketmq.namesrv_addr, "--rocketmq-topic", "nosuchdeployment")
    assert empty.returncode == 2, empty.stderr
    assert "holds no messages" in empty.stderr and "Traceback" not in empty.stderr
    down = run("--namesrv", "127.0.0.1:9")
    assert down.returncode == 2, down.stderr
    assert "unreachable" in down.stderr and "Traceback" not in down.stderr
    missing = run()
    assert missing.returncode == 2 and "--namesrv" in missing.stderr
