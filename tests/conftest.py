"""Shared pytest configuration for the whole suite.

Area-specific fixtures live in the conftest.py of each tests/<area>/ folder; the Spark session
is here, as tests of several areas (analytics, the RocketMQ reports) use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The process's one SparkSession, stopped at the end of the run."""
    from analytics.spark import get_spark, stop_spark

    session = get_spark(shuffle_partitions=2)
    yield session
    stop_spark()
