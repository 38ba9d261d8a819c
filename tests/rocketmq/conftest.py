"""The session's RocketMQ cluster (see cluster.py): started once, stopped at the end.

Without Java or Maven (or HAProxy, for the balancer test) the tests here skip with the reason;
with LMQTT_REQUIRE_ROCKETMQ=1 (set by .ci/run) that skip is a failure instead, so CI cannot pass
without running them.
"""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.conftest import GatewayHarness
from tests.rocketmq.cluster import (
    HERE,
    REQUIRE_ENV,
    ClusterUnavailable,
    RocketMQCluster,
    ensure_jars,
    fetch_jars_for,
)

#: Why the jars are not there (None: they are, or nothing here was selected).
_jars_problem: str | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fetch the jars once, after collection, outside any test's timeout."""
    global _jars_problem
    _jars_problem = fetch_jars_for((Path(str(item.path)) for item in items), HERE)


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"RocketMQ tests are required ({REQUIRE_ENV}=1) but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def rocketmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RocketMQCluster]:
    if shutil.which("java") is None:
        _unavailable("Java is not installed: cannot run RocketMQ's name server and brokers")
    if _jars_problem is not None:
        _unavailable(_jars_problem)
    try:
        ensure_jars()  # already done after collection; cheap (a hash) when up to date
    except ClusterUnavailable as exc:
        _unavailable(str(exc))
    cluster = RocketMQCluster(Path(tmp_path_factory.mktemp("rocketmq")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop(signal.SIGKILL)  # thrown away: no graceful stop to wait for


@pytest.fixture(scope="session")
def haproxy() -> str:
    """The haproxy executable (Debian's is in /usr/sbin); `make test` installs it when missing."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    found = shutil.which("haproxy", path=path)
    if found is None:
        _unavailable("HAProxy is not installed (`make test` installs Debian's haproxy)")
    assert found is not None
    return found


def start_gateway(rocketmq: RocketMQCluster, tmp_path: Path, **overrides: Any) -> GatewayHarness:
    """A started gateway storing on broker-a of the test cluster, in a namespace
    (`rocketmq_topic`) of its own, so tests sharing the cluster do not see each other;
    `overrides` are more settings."""
    return GatewayHarness(
        tmp_path / "data",
        store="rocketmq",
        namesrv=rocketmq.namesrv_addr,
        rocketmq_broker="broker-a",
        rocketmq_topic=f"t{uuid.uuid4().hex[:12]}",
    ).start(**overrides)


@pytest.fixture
def rocketmq_gateway(rocketmq: RocketMQCluster, tmp_path: Path) -> Iterator[GatewayHarness]:
    """A gateway of `start_gateway`, stopped after the test."""
    h = start_gateway(rocketmq, tmp_path)
    try:
        yield h
    finally:
        h.stop()
