"""StallWatch: a gateway with ``stall_watch_ms`` names what held its event loop, and how."""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from gateway.ops.stall_watch import histogram
from tests.gateway.conftest import GatewayHarness, wait_until


def spin_on_the_loop(ms: float) -> None:
    """Python code that keeps the loop's thread busy for `ms` of CPU (a callback that runs
    too long; CPU time, so that a busy host's descheduling does not shorten it)."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


def block_the_loop(ms: float) -> None:
    """The loop's thread blocked (a system call such as fsync): no CPU used."""
    time.sleep(ms / 1000)


class Cycle:
    def __init__(self) -> None:
        self.me = self
        self.data = [self]


HEAP: list[Cycle] = []


def build_a_large_heap() -> None:
    """300,000 cycles, built with the collector off and left off: a young collection finding no
    garbage would freeze them (gateway/ops/gc_monitor.py). Built in a callback of its own: in
    the collection's, a host that deschedules the build would make it most of that stall."""
    gc.disable()
    HEAP.extend(Cycle() for _ in range(300_000))


def collect_the_large_heap() -> None:
    """A full collection that finds the 300,000 cycles to free (and leaves none behind): a
    stall made of the collection alone. The gateway's tick freezes what is alive every 100 ms
    (gc_monitor.py), the heap included by now: unfrozen first, or the collection skips it."""
    HEAP.clear()
    gc.unfreeze()
    gc.enable()
    gc.collect()


def test_stalls_are_named_by_what_held_the_loop(tmp_path: Path) -> None:
    switch = sys.getswitchinterval()
    file = tmp_path / "stalls.jsonl"
    h = GatewayHarness(tmp_path / "data", stall_watch_ms=10, stall_watch_file=file).start()
    try:
        watch = h.gw.stall_watch if h.gw is not None else None
        assert watch is not None

        def records() -> list[dict[str, Any]]:
            # Whole lines only: the watch may be writing a long record's last part now.
            return [json.loads(line) for line in file.read_text().split("\n")[:-1]]

        def seen(what: str) -> bool:
            return any(what in json.dumps(r) for r in records())

        # No automatic collection during the spin's and the sleep's stalls: one of this
        # process's heap (a worker of a whole run holds a large one, and the gateway's tick
        # unfreezes it now and then) holds the GIL, so it stalls the loop too, and one over
        # half the stall is rightly named "gc" instead (it failed so once under load).
        collecting = gc.isenabled()
        gc.disable()
        try:
            h.call(lambda: spin_on_the_loop(60))
            wait_until(lambda: seen("spin_on_the_loop"), what="the spin's stall")
            h.call(lambda: block_the_loop(60))
            wait_until(lambda: seen("block_the_loop"), what="the blocked loop's stall")
        finally:
            if collecting:
                gc.enable()
        try:
            h.call(build_a_large_heap)
            h.call(collect_the_large_heap)
        finally:
            HEAP.clear()
            gc.enable()
        wait_until(lambda: seen('"gc"'), what="the collection's stall")
    finally:
        h.stop()
    assert sys.getswitchinterval() == switch  # restored by stop()
    stalls = records()
    spin = next(r for r in stalls if "spin_on_the_loop" in json.dumps(r["stacks"]))
    assert spin["ms"] >= 30 and spin["cpu_ms"] >= 30
    if spin["cpu_ms"] >= spin["ms"] / 2:  # not descheduled most of the time (a busy host)
        assert "spin_on_the_loop" in spin["cause"]
    sleep = next(r for r in stalls if "block_the_loop" in json.dumps(r["stacks"]))
    assert sleep["cause"] == "off-cpu" and sleep["cpu_ms"] < sleep["ms"] / 2
    collection = next(r for r in stalls if r["cause"] == "gc")
    assert collection["gc_gen"] == 2 and collection["gc_ms"] >= collection["ms"] / 2
    # The summary counts every stall by cause.
    summary = watch.summary()
    assert sum(int(v["count"]) for v in summary.values()) == watch.stalls == len(stalls)
    # ... and so does the file's histogram (python -m gateway.ops.stall_watch FILE).
    rows = histogram(file.read_text().splitlines())
    assert {cause: count for cause, count, *_ in rows} == {
        cause: int(v["count"]) for cause, v in summary.items()
    }
