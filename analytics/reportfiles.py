"""Where a fan-out report lives on disk (shared by the Spark job and the Spark-free reader).

<out>/report/               the last finished report, swapped in atomically
    meta.json               ReportMeta: coverage, totals, window
    device_fanout/          one Parquet table per directory
    topic_fanout/  queue_backlog/  timeline/  fanout_histogram/
    filter_deliveries/  subscribers/  subscriber_lag/
<out>/compacted/            Parquet copies of sealed segments (analytics.compaction)
"""

from __future__ import annotations

import os
from pathlib import Path

REPORT_DIR = "report"
META_FILE = "meta.json"
TABLES = (
    "device_fanout",
    "topic_fanout",
    "queue_backlog",
    "timeline",
    "fanout_histogram",
    "filter_deliveries",
    "subscribers",
    "subscriber_lag",
)
DEFAULT_OUT = "reports"


def default_out_dir() -> Path:
    return Path(os.environ.get("LMQTT_REPORTS", DEFAULT_OUT))
