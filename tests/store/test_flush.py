"""The flusher thread on its own: real threads, real event loop, flush steps as plain callables.

The store hands the Flusher three callables; here they record what ran and can be held back,
which is how the ordering promises of store/flush.py are checked without timing anything.
"""

from __future__ import annotations

import asyncio
import threading

from store.flush import Flusher


class FlushSteps:
    """CommitLog position and flush steps; the full flush blocks until ``release_full``."""

    def __init__(self) -> None:
        self.write_pos = 0
        self.calls: list[str] = []
        self.full_started = threading.Event()
        self.release_full = threading.Event()

    def flush_log(self) -> int:
        self.calls.append("log")
        return self.write_pos

    def flush_all(self) -> int:
        self.calls.append("all")
        self.full_started.set()
        assert self.release_full.wait(10), "test never released the full flush"
        return self.write_pos

    def maintain(self) -> None:
        pass


def _flusher(steps: FlushSteps, *, full_interval_s: float) -> Flusher:
    return Flusher(
        flush_log=steps.flush_log,
        flush_all=steps.flush_all,
        maintain=steps.maintain,
        sync=True,
        interval_s=60.0,
        full_interval_s=full_interval_s,
        maintain_interval_s=60.0,
        timeout_s=10.0,
    )


async def test_sync_waiter_is_released_before_a_due_full_flush_runs() -> None:
    steps = FlushSteps()
    flusher = _flusher(steps, full_interval_s=0.0)  # every pass is a full flush
    steps.write_pos = 100
    # Registered before the thread starts: its first pass finds a waiter and a full flush due.
    waiter = flusher.flushed_future(100)
    flusher.start(0)
    try:
        # Resolved while the full flush is still held back: the CommitLog fsync came first.
        await asyncio.wait_for(waiter, 10)
        assert await asyncio.to_thread(steps.full_started.wait, 10)
        assert steps.calls[:2] == ["log", "all"]
    finally:
        steps.release_full.set()
        await asyncio.to_thread(flusher.stop)


async def test_full_flush_alone_when_nobody_waits() -> None:
    steps = FlushSteps()
    steps.release_full.set()
    flusher = _flusher(steps, full_interval_s=60.0)
    flusher.start(0, full_flush_now=True)
    try:
        assert await asyncio.to_thread(steps.full_started.wait, 10)
    finally:
        await asyncio.to_thread(flusher.stop)
    assert steps.calls[0] == "all"
