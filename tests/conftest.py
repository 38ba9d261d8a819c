"""Shared pytest configuration for the whole suite.

Area-specific fixtures live in the conftest.py of each tests/<area>/ folder; the Spark session
is here, as tests of several areas (analytics, the RocketMQ reports) use it.

`make test` runs the suite on pytest-xdist workers with ``--dist loadgroup``. The tests whose
module or session fixtures are expensive to build are grouped by where they live (GROUPS), so
one worker runs all the tests that share them and builds them once: the Spark session (a JVM)
and the power-cut recordings. The RocketMQ tests are grouped by file instead: each file's module
fixtures stay on one worker, and the files spread over both workers, each of which starts its own
session cluster (three JVMs) when it first needs one. One cluster on one worker made that worker
the suite's long pole; a second cluster costs a start and some memory, and the files then
balance on their own. xdist hands out the groups with the most tests first, so the long ones
start at once while the single tests fill in; among units of one size, those holding a test
marked slow or spark go first (`pytest_collection_modifyitems` below), so a long single test
does not start last and leave the other worker idle.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from analytics.spark import JAVA_OPTIONS_ENV as SPARK_JAVA_OPTIONS_ENV

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: Folder or file under tests/ -> the group of its tests (the first that matches); None: each
#: file under the folder is a group of its own. The analytics tests share the Spark session
#: and the reference store (`world`) built once; a worker that runs a RocketMQ report test
#: starts its own Spark session.
GROUPS: dict[str, str | None] = {
    "tests/rocketmq/": None,
    "tests/analytics/": "spark",
    "tests/crash/test_power_cut.py": "power-cut",
    # Its own RocketMQ cluster in a network namespace (the session's is on the root namespace's
    # loopback, out of a namespace's reach), built once per module: one worker builds it.
    "tests/partition/": "partition",
}


def xdist_group(nodeid: str) -> str | None:
    """The group of the test `nodeid`, or None: any worker may run it."""
    for prefix, group in GROUPS.items():
        if nodeid.startswith(prefix):
            return group if group is not None else nodeid.split("::", 1)[0]
    return None


class GroupScheduling:
    """Registers the scheduler of ``--dist loadgroup`` with the groups above.

    pytest-xdist's own loadgroup passes `xdist_group` marks on by rewriting `item._nodeid`,
    which pytest 9 ignores (it reads a test's id from elsewhere), so the marks would be lost;
    the groups are a rule on the test ids anyway, so the controller applies it itself: a group
    is one work unit, any other test is its own.
    """

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_group(nodeid) or nodeid

        return Scheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(GroupScheduling(), "lmqtt-xdist-groups")
    # The suite's Spark jobs are small and short: C2's compiles of Spark's code cost more than
    # they win back, and G1's threads compete for the 2 cores. Set here, before any session
    # starts, so the `lmqtt report` processes the tests run get them too.
    os.environ.setdefault(SPARK_JAVA_OPTIONS_ENV, "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


#: A test with one of these marks is a long one (pyproject.toml's markers).
LONG_MARKS = ("slow", "spark")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, the work units holding a long test come first in the collection.

    The scheduler hands out the units with the most tests first; among units of the same size
    it keeps this order, so a long single test starts early instead of after hundreds of short
    ones, and the short ones fill in at the end. A unit's tests keep their order among
    themselves (the sort is stable and moves whole units).
    """
    if not hasattr(config, "workerinput"):
        return

    def unit(item: pytest.Item) -> str:
        return xdist_group(item.nodeid) or item.nodeid

    long_units = {
        unit(item) for item in items if any(item.get_closest_marker(m) for m in LONG_MARKS)
    }
    items.sort(key=lambda item: unit(item) not in long_units)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The process's one SparkSession, stopped at the end of the run."""
    from analytics.spark import get_spark, stop_spark

    session = get_spark(shuffle_partitions=2)
    yield session
    stop_spark()
