"""Held pulls O(brokers), not O(subscribed queues) (`rocketmq_notify_pulls`): the mirrors take
their messages from one tail of the parent topic (gateway/storage/rocketmq/tail.py). A real
gateway (in-process, to count its mirrors) on the session's RocketMQ cluster, paho clients, the
held pulls read from its /metrics and from the broker itself (its JVM's live PullRequest
objects, RocketMQCluster.held_pulls)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.storage.rocketmq.adapter import RocketMqStorage
from tests.gateway.conftest import Client, GatewayHarness, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.conftest import start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 200
#: The tail of the parent topic, plus the inbound consumer's queues (4): a few, whatever N.
MOST_HELD = 8


@pytest.fixture(scope="module")
def gateway(
    rocketmq: RocketMQCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    tmp: Path = tmp_path_factory.mktemp("notify")
    h = start_gateway(rocketmq, tmp, rocketmq_notify_pulls=True, admin_port=0)
    try:
        yield h
    finally:
        h.stop()


def held_pulls(h: GatewayHarness) -> float:
    assert h.gw is not None
    url = f"http://127.0.0.1:{h.gw.listeners.port('admin')}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lmqtt_rocketmq_held_pulls":
                return sample.value
    raise AssertionError("no lmqtt_rocketmq_held_pulls in /metrics")


def broker_held_pulls(rocketmq: RocketMQCluster) -> int:
    """The pulls broker-a (the gateways' broker) holds now, as it counts them."""
    count = rocketmq.held_pulls().get("broker-a")
    assert count is not None, "jcmd could not read broker-a's held pulls"
    return count


def test_many_subscribed_queues_hold_a_few_pulls_and_deliver(
    gateway: GatewayHarness, rocketmq: RocketMQCluster
) -> None:
    h = gateway
    assert h.gw is not None and isinstance(h.gw.store, RocketMqStorage)
    store = h.gw.store
    made: list[Client] = []
    try:
        dev = Client(h.port, "devices")
        pub = Client(h.port, "pub")
        made += [dev, pub]
        for k in range(0, N, 25):  # each filter opens its queue before the SUBACK
            assert dev.subscribe([(f"cmd/{i}", 1) for i in range(k, k + 25)]) == [1] * 25
        assert h.call(lambda: len(store.queues())) >= N  # a mirror per subscribed queue
        # Read twice: a held pull is re-issued after each answer, never more than a few.
        for _ in range(2):
            assert 1 <= held_pulls(h) <= MOST_HELD
        # The broker's own count: a gateway stopped by an earlier test of this worker may have
        # left held pulls behind, answered into the void at their suspend time (15 s).
        wait_until(
            lambda: broker_held_pulls(rocketmq) <= MOST_HELD,
            timeout=40,
            what=f"at most {MOST_HELD} pulls held on the broker",
        )
        pub.publish("cmd/137", "go", 1)
        pub.publish("other/1", "nobody", 1)  # on the tail too, dispatched to no mirror
        pub.publish("cmd/5", "five", 1)
        wait_until(lambda: len(dev.messages) >= 2, what="go, five at the device")
        assert sorted((m.topic, bytes(m.payload)) for m in dev.messages) == [
            ("cmd/137", b"go"),
            ("cmd/5", b"five"),
        ]
        assert held_pulls(h) <= MOST_HELD
    finally:
        stop_clients(made)


def test_without_it_each_subscribed_queue_holds_a_pull(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    """The setting off: a held pull per mirror (what the gauge above would show)."""
    h = start_gateway(rocketmq, tmp_path, rocketmq_notify_pulls=False, admin_port=0)
    made: list[Client] = []
    try:
        dev = Client(h.port, "devices")
        pub = Client(h.port, "pub")
        made += [dev, pub]
        for k in range(0, N, 25):
            assert dev.subscribe([(f"cmd/{i}", 1) for i in range(k, k + 25)]) == [1] * 25
        wait_until(lambda: held_pulls(h) >= N, what=f"{N} held pulls")
        wait_until(lambda: broker_held_pulls(rocketmq) >= N, what=f"{N} pulls held on the broker")
        pub.publish("cmd/137", "go", 1)
        wait_until(lambda: dev.payloads() == [b"go"], what="go at the device")
    finally:
        stop_clients(made)
        h.stop()
