"""bench/stages.py and its gateway-side hook: stages resolve by name, count calls only while
the window is open, and the table reports what was counted."""

from __future__ import annotations

import bench.stage_hook as hook
from bench.stages import table
from gateway.delivery.arrivals import ArrivalHub


def test_resolve_finds_a_method_by_module_and_qualified_name() -> None:
    owner, name, fn = hook._resolve("gateway.delivery.arrivals:ArrivalHub.on_arrivals")
    assert owner is ArrivalHub
    assert name == "on_arrivals"
    assert fn is ArrivalHub.on_arrivals


def test_a_timed_stage_counts_only_inside_the_window() -> None:
    calls: list[int] = []

    def double(n: int) -> int:
        calls.append(n)
        return n * 2

    timed = hook._timed("test:stage", double)
    assert timed(1) == 2  # window closed: called, not counted
    hook._open = True
    try:
        assert timed(2) == 4
        assert timed(3) == 6
    finally:
        hook._open = False
    assert calls == [1, 2, 3]
    count, wall, cpu = hook._totals["test:stage"]
    assert count == 2
    assert wall >= 0.0 and cpu >= 0.0


def test_table_reports_per_second_and_per_call() -> None:
    figures = {
        "window_s": 2.0,
        "loop_cpu_s": 1.0,
        "stages": {"m:C.f": {"calls": 4000, "wall_s": 0.2, "cpu_s": 0.1}},
    }
    lines = table(figures).splitlines()
    assert lines[0].startswith("the compiled group ran from source")
    assert lines[1].startswith("event loop thread: 500.0 ms CPU/s")
    assert lines[3].split()[1:] == ["2000", "100.0", "50.0", "25.00"]
    assert table({"error": "no loop"}) == "no figures: no loop"
