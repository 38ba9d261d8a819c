"""The gateway's end-to-end tests, run again with the gateway's storage on RocketMQ.

Every test of the modules below that takes the `gateway` fixture is collected here too, under
`<module>__<test>`, with `gateway` replaced by a gateway whose store is the session's RocketMQ
cluster (broker-a, with a parent topic and light-queue namespace of the test's own). Same
assertions: the guarantees do not depend on the backend. EXCLUDED says which are not, and why.
"""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

from tests.gateway.conftest import GatewayHarness
from tests.gateway.conftest import clients as clients  # the fixture, for the collected tests
from tests.gateway.connection import test_basic, test_flow, test_mqtt5, test_qos
from tests.gateway.delivery import test_shared
from tests.gateway.session import test_replay, test_sessions, test_will_retain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODULES: tuple[ModuleType, ...] = (test_basic, test_qos, test_sessions, test_will_retain)
MODULES += (test_mqtt5, test_shared, test_flow, test_replay)

EXCLUDED = {
    # Asserts the queue's end equals the count right after the PUBACKs: in async mode a
    # RocketMQ gateway acknowledges before SEND_OK and learns the end from its held pull, a
    # moment later (a timing of the embedded store, not a guarantee).
    "test_flow__test_slow_subscriber_pauses_delivery_with_bounded_buffer",
    # Read or rewrite the embedded state log's files under data_dir/state (to look at a
    # session record, or to fake a crash by restoring them); on RocketMQ the state log is the
    # %STATE% light queue. Their guarantees are tested on RocketMQ in test_gateway_rocketmq.py
    # (sessions across restarts with the data directory wiped, SIGKILL in sync mode).
    "test_sessions__test_persistent_session_survives_gateway_restart",
    "test_will_retain__test_wills_of_connections_cut_by_a_crash_are_published",
    # The same kind (a crash image written into data_dir/state); the RocketMQ counterpart is
    # tests/rocketmq/test_cluster_wills.py.
    "test_will_retain__test_a_will_published_before_a_crash_is_not_published_again_at_the_restart",
}

for _module in MODULES:
    _short = _module.__name__.rsplit(".", 1)[-1]
    for _name, _fn in list(vars(_module).items()):
        if not _name.startswith("test_") or not inspect.isfunction(_fn):
            continue
        if "gateway" not in inspect.signature(_fn).parameters:
            continue
        if f"{_short}__{_name}" not in EXCLUDED:
            globals()[f"{_short}__{_name}"] = _fn


@pytest.fixture
def gateway(rocketmq_gateway: GatewayHarness) -> GatewayHarness:
    return rocketmq_gateway
