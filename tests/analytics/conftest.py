"""Fixtures of the analytics tests: one reference store with known traffic plus its fan-out
report, built once and shared (Spark jobs are the slow part; the session is tests/conftest.py's).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.analytics.groundtruth import World, build_world

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from analytics.fanout import ReportMeta


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """Known traffic in a store whose small segments force rolls and blank fillers."""
    return build_world(tmp_path_factory.mktemp("world") / "data", rounds=20, segment_size=8192)


@pytest.fixture(scope="session")
def report(
    spark: SparkSession, world: World, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, ReportMeta]:
    """The fan-out report of `world`, computed once."""
    from analytics.fanout import run_fanout

    out = tmp_path_factory.mktemp("reports")
    meta = run_fanout(spark, world.data_dir, out)
    return out, meta
