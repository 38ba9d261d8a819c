"""Delayed publish on RocketMQ: the broker's timer messages (timerWheelEnable=true, the
TIMER_DELIVER_MS property) carrying the light queues of publish time.

The same scenario as the embedded store's (tests/gateway/messages/delayed_scenario.py), on
real `lmqtt serve --store rocketmq` processes against the test cluster: delivery on time, a
SIGKILL right after one fired and before another is due (the broker fires it meanwhile), a
graceful stop, each message once at QoS 2; the refusals (0x90, the ACL's 0x87); and
`lmqtt inspect --store rocketmq` listing what the broker still holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.protocol import PubAck, Publish
from tests.crash.gateway_proc import ROOT, GatewayProcess
from tests.gateway.conftest import GatewayHarness, RawClient
from tests.gateway.messages import delayed_scenario
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.conftest import start_gateway


def test_delayed_across_restart_and_sigkill(rocketmq: RocketMQCluster, tmp_path: Path) -> None:
    """Over 10 s: three gateway processes, a restart costing seconds on a loaded host."""
    topic = f"t{uuid.uuid4().hex[:12]}"
    env = {
        "LMQTT_STORE": "rocketmq",
        "LMQTT_NAMESRV": rocketmq.namesrv_addr,
        "LMQTT_ROCKETMQ_BROKER": "broker-a",
        "LMQTT_ROCKETMQ_TOPIC": topic,
    }
    delayed_scenario.run(
        lambda: GatewayProcess(tmp_path / "data", segment_size=1 << 20, env=env),
        ["--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, "--rocketmq-topic", topic],
    )


@pytest.fixture
def acl_gateway(rocketmq: RocketMQCluster, tmp_path: Path) -> Iterator[GatewayHarness]:
    (tmp_path / "acl").write_text(delayed_scenario.ACL)
    h = start_gateway(rocketmq, tmp_path, acl_file=tmp_path / "acl", max_delay=60)
    try:
        yield h
    finally:
        h.stop()


def test_bad_delay_or_topic_and_acl(acl_gateway: GatewayHarness) -> None:
    delayed_scenario.check_refusals(acl_gateway.port, 5)


def test_inspect_lists_pending(acl_gateway: GatewayHarness, rocketmq: RocketMQCluster) -> None:
    """`lmqtt inspect --store rocketmq` lists the deployment's delayed messages the broker holds
    (its timer topic, where other tests' deployments have theirs too)."""
    c = RawClient(acl_gateway.port, level=5)
    assert c.connect("inspected", username="bob").reason_code == 0
    c.send(Publish("$delayed/50/cmd/later", b"12345", qos=1, packet_id=1))
    assert isinstance(c.recv(), PubAck)
    c.close()
    s = acl_gateway.settings
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "inspect", "--store", "rocketmq", "--namesrv",
         rocketmq.namesrv_addr, "--rocketmq-topic", s.rocketmq_topic, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    (pending,) = json.loads(out.stdout)["delayed"]
    assert (pending["topic"], pending["client_id"], pending["qos"], pending["bytes"]) == (
        "cmd/later",
        "inspected",
        1,
        5,
    )
    assert abs(pending["due_ms"] - (time.time() + 50) * 1000) < 10_000
