"""A/B of the fan-out report: one tree's `run_fanout` on a given store, warm JVM, N runs.

    <tree>/.venv/bin/python bench/analytics_ab.py <tree> <data dir> [runs]

Run it alternately for the old and the new tree (each with its own venv: `git worktree add
/tmp/old <rev>` + `make .venv/.installed-dev` there) on the same store (`bench/analytics_bench.py`
generates one under /tmp/lmqtt-analytics-bench/n<N>). Per run it prints one JSON line: wall
seconds, CPU seconds of this process and its children (driver, JVM and the Python workers alive
at the end of the run: workers that exited in between are missed, alike for both trees), the
deliveries counted and each phase's wall and CPU time. On a shared host compare the trees'
medians from the same session, never single figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

# Run from the project root's view: bench/ holds modules (e.g. profile) that shadow the stdlib.
sys.path[0] = str(Path(__file__).resolve().parent.parent)


def _cpu() -> float:
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


class _Phases:
    """Stands in for analytics.progress.SparkProgress: times each phase."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t, c = time.monotonic(), _cpu()
        yield
        key = name.split(" ")[0]
        self.wall[key] = round(time.monotonic() - t, 2)
        self.cpu[key] = round(_cpu() - c, 2)


def main() -> int:
    tree, data = Path(sys.argv[1]).resolve(), sys.argv[2]
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    from analytics.fanout import run_fanout
    from analytics.segments import list_segments
    from analytics.spark import get_spark, stop_spark

    spark = get_spark()
    out = Path(f"/tmp/lmqtt-report-ab-{os.getpid()}")
    first = str(list_segments(data)[0].start_offset)
    reader = spark.read.format("lmqtt-commitlog").option("segments", first)
    reader.load(data).selectExpr("count(*)").collect()  # warm the JVM on one segment
    try:
        for i in range(runs):
            phases = _Phases()
            t, c = time.monotonic(), _cpu()
            meta = run_fanout(spark, data, out, progress=phases)  # type: ignore[arg-type]
            line = {
                "tree": str(tree),
                "run": i,
                "s": round(time.monotonic() - t, 2),
                "cpu": round(_cpu() - c, 2),
                "deliveries": meta.deliveries,
                "wall": phases.wall,
                "phase_cpu": phases.cpu,
                "load": round(os.getloadavg()[0], 1),
            }
            print(json.dumps(line), flush=True)
    finally:
        stop_spark()
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
