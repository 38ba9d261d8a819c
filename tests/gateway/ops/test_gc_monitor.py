"""GcMonitor: real collections are timed; the freeze policy follows the connection count."""

from __future__ import annotations

import asyncio
import gc

from gateway.ops.gc_monitor import BUCKETS_S, FREEZE_MIN, RECLAIM_GARBAGE, RECLAIM_MAX_S, GcMonitor


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_cyclic_garbage_found_by_older_generations_is_counted() -> None:
    monitor = GcMonitor()
    monitor.install()
    try:
        gc.collect()
        for _ in range(100):
            Cycle()
        gc.collect(1)
    finally:
        monitor.uninstall()
    assert monitor.escaped >= 100


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


def test_freeze_each_tick_burst_and_reclaim() -> None:
    monitor = GcMonitor()
    try:
        assert monitor.tick(FREEZE_MIN - 1, now=0.0) == "freeze"  # too few for a burst
        assert monitor.tick(FREEZE_MIN * 10, now=1.0) == "burst"
        assert gc.get_freeze_count() > 0
        assert monitor.tick(FREEZE_MIN * 10 + 1, now=2.0) == "freeze"  # no new burst
        assert monitor.tick(FREEZE_MIN * 20, now=3.0) == "burst"
        assert monitor.tick(FREEZE_MIN * 5, now=4.0) == "unfreeze"  # shrank below half
        assert gc.get_freeze_count() == 0
        assert monitor.tick(FREEZE_MIN * 5, now=5.0) == "freeze"
        assert monitor.tick(FREEZE_MIN * 5, now=4.0 + RECLAIM_MAX_S) == "unfreeze"  # periodic
        assert monitor.tick(FREEZE_MIN * 5, now=5.0 + RECLAIM_MAX_S) == "freeze"
        monitor.escaped = RECLAIM_GARBAGE  # cyclic garbage outlived young collections
        assert monitor.tick(FREEZE_MIN * 5, now=6.0 + RECLAIM_MAX_S) == "unfreeze"
        assert monitor.escaped == 0
        assert (monitor.freezes, monitor.unfreezes) == (6, 3)
    finally:
        gc.unfreeze()


def test_a_young_collection_without_garbage_freezes_its_survivors_while_running() -> None:
    loop = asyncio.new_event_loop()
    monitor = GcMonitor()
    try:
        gc.collect()
        gc.unfreeze()
        kept = [[i] for i in range(1000)]  # new long-lived objects: no garbage among them
        monitor.install()  # timing only: a young collection promotes as usual
        gc.collect(0)
        assert gc.get_freeze_count() == 0
        monitor.start(loop, lambda: 0)
        kept += [[i] for i in range(1000)]
        gc.collect(0)
        frozen = gc.get_freeze_count()
        assert frozen >= 2000  # the survivors, not left to generation 1's walks
        gc.disable()  # only the collection below runs (no automatic one in between)
        try:
            kept += [[i] for i in range(1000)]  # its survivors...
            for _ in range(100):
                Cycle()  # ...with cyclic garbage: the collection that finds it freezes nothing
            gc.collect(0)
        finally:
            gc.enable()
        # Not `== frozen`: a frozen object of another thread (pytest-xdist's) may die meanwhile.
        assert gc.get_freeze_count() < frozen + 1000
        assert len(kept) == 3000
    finally:
        monitor.uninstall()
        loop.close()
        gc.unfreeze()
