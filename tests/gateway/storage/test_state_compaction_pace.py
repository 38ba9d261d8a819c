"""Compacting the embedded state log never holds the event loop up (store/statelog.py compaction,
run by gateway/storage/embedded.py in a worker thread).

100,000 records of a session record's size (about 250 bytes), written twice, compacted while
an event loop of the same process keeps a timer due every 10 ms. Asserted in CPU time, which a
loaded host does not inflate: the compaction offers the GIL at least every COMPACT_STEP records
read, and runs less than 50 ms of CPU between two offers; the loop's wall-clock lag is bounded
generously (a loaded host's scheduler alone delays it by tens of milliseconds).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.compaction_bench import LagProbe, StepProbe
from gateway.storage.embedded import EmbeddedStorage
from store import StoreConfig, read_state
from store.statelog import COMPACT_STEP, INDEX_SHARDS

SESSIONS = 100_000
_VALUE = b"x" * 240


def _records(generation: int) -> list[tuple[str, bytes | None]]:
    return [(f"session/dev-{n}", b"%d:%s" % (generation, _VALUE)) for n in range(SESSIONS)]


def test_compaction_of_100000_sessions_offers_the_gil_every_step(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path)
    store = EmbeddedStorage.open(config)
    try:
        for generation in (0, 1):
            records = _records(generation)
            for i in range(0, SESSIONS, 10_000):
                store.append_state(records[i : i + 10_000])
        log = store.state
        assert log is not None
        steps = StepProbe()

        async def compact() -> LagProbe:
            with LagProbe() as probe:
                await asyncio.get_running_loop().run_in_executor(None, log.compact, steps)
            return probe

        probe = asyncio.run(compact())
    finally:
        store.close()
    read = 2 * 2 * SESSIONS  # two passes over both generations
    assert steps.calls >= read // COMPACT_STEP + INDEX_SHARDS
    assert steps.longest < 0.05, f"{steps.longest * 1000:.1f} ms of CPU without a GIL offer"
    assert probe.lags and max(probe.lags) < 1.0, max(probe.lags)
    state = read_state(tmp_path / "state")
    assert state == dict(_records(1))
