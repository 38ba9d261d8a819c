"""Shared pytest configuration for the whole suite.

Area-specific fixtures live in the conftest.py of each tests/<area>/ folder; the Spark session
is here, as tests of several areas (analytics, the RocketMQ reports) use it.

`make test` runs the suite on pytest-xdist workers with ``--dist loadgroup``. A test whose
session or module fixtures are expensive to build is put in an `xdist_group` by where it lives
(below), so one worker runs all the tests that share them and builds them once: the RocketMQ
cluster (three JVMs), the Spark session (a JVM) and the power-cut recordings. Every other test
goes to whichever worker is free. xdist runs the largest groups first, so the long ones start
at once while the other worker takes the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TESTS = Path(__file__).resolve().parent

#: Folder or file under tests/ -> the xdist group of its tests (the first that matches): the
#: RocketMQ tests that report with Spark stay with the cluster they read from; the analytics
#: tests share the Spark session and the reference store (`world`) built once.
GROUPS = {
    "rocketmq": "rocketmq",
    "analytics": "spark",
    "crash/test_power_cut.py": "power-cut",
}
#: A session fixture -> the group of a test elsewhere that uses it.
FIXTURE_GROUPS = {"rocketmq": "rocketmq", "spark": "spark"}


def xdist_group(path: Path, fixtures: list[str]) -> str | None:
    """The group of a test in file `path` using `fixtures`, or None: any worker may run it."""
    where = path.resolve().relative_to(TESTS)
    for prefix, group in GROUPS.items():
        if where.is_relative_to(prefix):
            return group
    for fixture, group in FIXTURE_GROUPS.items():
        if fixture in fixtures:
            return group
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if not path.is_relative_to(TESTS):
            continue
        group = xdist_group(path, list(getattr(item, "fixturenames", ())))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The process's one SparkSession, stopped at the end of the run."""
    from analytics.spark import get_spark, stop_spark

    session = get_spark(shuffle_partitions=2)
    yield session
    stop_spark()
