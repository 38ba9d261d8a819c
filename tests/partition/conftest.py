"""The partition suite's network (tests/partition/netns.py) and its own RocketMQ cluster.

The session's cluster (tests/rocketmq/conftest.py) listens on the root namespace's loopback,
which no other namespace can reach, so this suite starts a cluster of its own inside the `rmq`
namespace, on that namespace's address: once per module, with the namespaces.

Where namespaces cannot be made (not root, no iproute2, a container without the capability)
the tests skip with the reason; with LMQTT_REQUIRE_NETNS=1 (set by .ci/run) that skip is a
failure. Without Java or the jars they skip (or fail under LMQTT_REQUIRE_ROCKETMQ=1) as the
RocketMQ tests do.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.partition.netns import Network, network, unavailable
from tests.rocketmq.cluster import REQUIRE_ENV as ROCKETMQ_REQUIRE_ENV
from tests.rocketmq.cluster import RocketMQCluster, fetch_jars_for

REQUIRE_ENV = "LMQTT_REQUIRE_NETNS"
HERE = Path(__file__).resolve().parent
#: Gateway node namespaces: a cut node and a survivor.
NODES = 2

_jars_problem: str | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fetch the RocketMQ jars after collection, outside any test's timeout."""
    global _jars_problem
    _jars_problem = fetch_jars_for((Path(str(item.path)) for item in items), HERE)


def _skip_or_fail(env: str, what: str, reason: str) -> None:
    if os.environ.get(env) == "1":
        pytest.fail(f"{what} are required ({env}=1) but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    """The namespaces and links, removed after the module."""
    reason = unavailable()
    if reason is not None:
        _skip_or_fail(REQUIRE_ENV, "the partition tests", reason)
    with network(NODES) as made:
        yield made


@pytest.fixture(scope="module")
def rmq(net: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RocketMQCluster]:
    """A RocketMQ cluster (name server, two brokers) in the `rmq` namespace."""
    problem = "Java is not installed" if shutil.which("java") is None else _jars_problem
    if problem is not None:
        _skip_or_fail(ROCKETMQ_REQUIRE_ENV, "the RocketMQ tests", problem)
    cluster = RocketMQCluster(
        Path(tmp_path_factory.mktemp("rocketmq-netns")), host=net.rmq_host, wrap=net.wrap("rmq")
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop(signal.SIGKILL)
