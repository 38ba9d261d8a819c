"""GcMonitor: real collections are timed; the freeze policy follows the connection count."""

from __future__ import annotations

import gc

from gateway.gc_monitor import BUCKETS_S, FREEZE_MIN, GcMonitor


def test_collections_are_timed_into_the_histogram_and_generations() -> None:
    monitor = GcMonitor()
    monitor.install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        monitor.uninstall()
    assert monitor.collections >= 2
    assert sum(monitor.buckets) == monitor.collections
    assert len(monitor.buckets) == len(BUCKETS_S) + 1
    assert monitor.by_generation[0] >= 1 and monitor.by_generation[2] >= 1
    assert monitor.max_ns >= monitor.percentile_ns(0.5) > 0
    summary = monitor.summary()
    assert summary["collections"] == monitor.collections
    before = monitor.collections
    gc.collect(0)  # uninstalled: no longer counted
    assert monitor.collections == before


def test_freeze_after_a_burst_of_connects_and_unfreeze_after_a_shrink() -> None:
    monitor = GcMonitor()
    try:
        assert not monitor.maybe_freeze(FREEZE_MIN - 1)  # too few to bother
        assert monitor.maybe_freeze(FREEZE_MIN * 10)
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert not monitor.maybe_freeze(FREEZE_MIN * 10 + 1)  # no new burst
        assert monitor.maybe_freeze(FREEZE_MIN * 20)
        assert monitor.freezes == 2
        assert not monitor.maybe_freeze(FREEZE_MIN * 5)  # shrank below half: handed back
        assert monitor.unfreezes == 1
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
