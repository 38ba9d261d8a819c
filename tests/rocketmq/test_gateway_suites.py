"""Existing end-to-end gateway tests, run again with the gateway's storage on RocketMQ.

The same test functions as tests/gateway/ (imported, so they are collected here too), with the
`gateway` fixture replaced by a gateway whose store is the session's RocketMQ cluster
(broker-a, a parent topic and light-queue namespace of the test's own). Same assertions: the
guarantees do not depend on the backend.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway import test_basic, test_qos, test_sessions, test_will_retain
from tests.gateway.conftest import GatewayHarness
from tests.gateway.conftest import clients as clients  # the fixture, for the imported tests
from tests.rocketmq.cluster import RocketMQCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

test_qos0_wildcard_fanout = test_basic.test_qos0_wildcard_fanout
test_qos1_and_qos2_end_to_end = test_qos.test_qos1_and_qos2_end_to_end
test_qos_downgrade = test_qos.test_qos_downgrade_is_min_of_publish_and_subscription
test_raw_qos2_dedup_and_flow = test_qos.test_raw_qos2_inbound_dedup_and_outbound_flow
test_amqtt_client_roundtrip = test_qos.test_amqtt_client_roundtrip
test_persistent_session_backlog = test_sessions.test_persistent_session_resumes_with_backlog
test_session_survives_restart = test_sessions.test_persistent_session_survives_gateway_restart
test_resent_with_dup = test_sessions.test_unacknowledged_messages_are_resent_with_dup
test_will_on_socket_drop = test_will_retain.test_will_on_socket_drop
test_retained_replace_delete = test_will_retain.test_retained_delivery_replace_delete_and_handling
test_retained_survive_restart = test_will_retain.test_retained_survive_restart
test_delayed_will_survives_restart = test_will_retain.test_delayed_will_survives_gateway_restart


@pytest.fixture
def gateway(rocketmq: RocketMQCluster, tmp_path: Path) -> Iterator[GatewayHarness]:
    h = GatewayHarness(
        tmp_path / "data",
        store="rocketmq",
        namesrv=rocketmq.namesrv_addr,
        rocketmq_broker="broker-a",
        rocketmq_topic=f"t{uuid.uuid4().hex[:12]}",
    ).start()
    try:
        yield h
    finally:
        h.stop()
