"""Delayed publish on RocketMQ: the broker's timer messages (timerWheelEnable=true, the
TIMER_DELIVER_MS property) carrying the light queues of publish time.

The same scenario as the embedded store's (tests/gateway/messages/delayed_scenario.py), on
real `lmqtt serve --store rocketmq` processes against the test cluster: delivery on time, a
SIGKILL right after one fired and before another is due (the broker fires it meanwhile), a
graceful stop, each message once at QoS 2; and the refusals (0x90, the ACL's 0x87).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.crash.gateway_proc import GatewayProcess
from tests.gateway.conftest import GatewayHarness
from tests.gateway.messages import delayed_scenario
from tests.rocketmq.cluster import RocketMQCluster


def test_delayed_across_restart_and_sigkill(rocketmq: RocketMQCluster, tmp_path: Path) -> None:
    """Over 10 s: three gateway processes, a restart costing seconds on a loaded host."""
    env = {
        "LMQTT_STORE": "rocketmq",
        "LMQTT_NAMESRV": rocketmq.namesrv_addr,
        "LMQTT_ROCKETMQ_BROKER": "broker-a",
        "LMQTT_ROCKETMQ_TOPIC": f"t{uuid.uuid4().hex[:12]}",
    }
    delayed_scenario.run(lambda: GatewayProcess(tmp_path / "data", segment_size=1 << 20, env=env))


@pytest.fixture
def acl_gateway(rocketmq: RocketMQCluster, tmp_path: Path) -> Iterator[GatewayHarness]:
    (tmp_path / "acl").write_text(delayed_scenario.ACL)
    h = GatewayHarness(
        tmp_path / "data",
        store="rocketmq",
        namesrv=rocketmq.namesrv_addr,
        rocketmq_broker="broker-a",
        rocketmq_topic=f"t{uuid.uuid4().hex[:12]}",
        acl_file=tmp_path / "acl",
        max_delay=60,
    ).start()
    try:
        yield h
    finally:
        h.stop()


def test_bad_delay_or_topic_and_acl(acl_gateway: GatewayHarness) -> None:
    delayed_scenario.check_refusals(acl_gateway.port, 5)
