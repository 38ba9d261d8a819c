"""Fan-out analytics over the store's own files: a Spark data source, jobs and reports.

Public names are loaded lazily so that `lmqtt report show` (pyarrow only) never imports pyspark.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AnalyticsError": "analytics.errors",
    "CorruptSegmentError": "analytics.errors",
    "DataDirError": "analytics.errors",
    "ReportNotFoundError": "analytics.errors",
    "SnapshotError": "analytics.errors",
    "UnknownDeviceError": "analytics.errors",
    "SegmentFile": "analytics.segments",
    "SegmentParser": "analytics.segments",
    "list_segments": "analytics.segments",
    "ARROW_SCHEMA": "analytics.segments",
    "CommitLogDataSource": "analytics.datasource",
    "SPARK_SCHEMA": "analytics.datasource",
    "get_spark": "analytics.spark",
    "stop_spark": "analytics.spark",
    "run_fanout": "analytics.fanout",
    "load_messages": "analytics.fanout",
    "snapshot_frames": "analytics.fanout",
    "compact": "analytics.compaction",
    "Report": "analytics.show",
    "write_html": "analytics.html_report",
    "main": "analytics.cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'analytics' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
