"""State-log compaction at scale: how long the event loop stalls while it runs.

    python -m bench.compaction_bench --sessions 1000000 [--backend embedded|rocketmq|both]

N persistent sessions (one subscription each, the records the gateway writes:
gateway/session/registry.py) are written to the state log, then compacted through the
storage port's `compact_state()` on a uvloop event loop, as the registry's housekeeping does.
Meanwhile a probe measures the loop's lag the way the overload guard does
(gateway/connection/overload.py: a timer due every TICK_S, how late it fires); reported: the
largest lag during the compaction, its 99th percentile and the compaction's wall time, then
the same for BASELINE_S with the loop idle (what the host's load alone does: wall-clock lags
include the scheduler's delays). And the longest stretch of CPU time the compaction ran
without yielding (`longest_cpu_without_yield_ms`, which a loaded host does not inflate): the
embedded compaction thread's between two offers of the GIL (its `step` hook), the event
loop's longest turn for RocketMQ (the compaction runs on the loop).

embedded  the records go through the store's writer into a fresh data directory, twice
          (a second generation of the same keys: half the log is dead), then the embedded
          state log compacts.
rocketmq  starts the tests' RocketMQ cluster (tests/rocketmq/cluster.py), applies the
          records to the RocketMQ state log in memory and sends them once, then compacts
          (the snapshot's batches are real broker messages).

Figures taken on a shared, loaded host: compare the runs of one host, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop
from pydantic_core import to_json

from gateway.connection.overload import TICK_S
from gateway.session.model import Session, SubscriptionState
from gateway.session.registry import SESSION_KEY_PREFIX
from store.statelog import give_way

WRITE_BATCH = 10_000
BASELINE_S = 5.0


def session_records(sessions: int, generation: int = 0) -> list[tuple[str, bytes | None]]:
    """N session records as the registry writes them (`generation` varies their position)."""
    now = int(time.time() * 1000)
    out: list[tuple[str, bytes | None]] = []
    for n in range(sessions):
        cid = f"dev-{n}"
        s = Session(cid, 4, 7 * 24 * 3600)
        s.disconnected_at_ms = now
        text = f"dev/{n}/cmd"
        s.add_subscription(SubscriptionState(text, f"%LMQ%dev%{n}%cmd", None, 1))
        s.subscriptions[text].next_offset = generation
        out.append((SESSION_KEY_PREFIX + cid, to_json(s.to_json())))
    return out


class LagProbe:
    """A timer due every TICK_S, as the overload guard's (gateway/connection/overload.py);
    records how late each one fires: the loop's lag (wall clock: on a loaded host the
    scheduler's delays are in it too)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            self.lags.append(loop.time() - due)

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]
        return {
            "max_stall_ms": round(lags[-1] * 1000, 1),
            "p99_stall_ms": round(lags[int(0.99 * (len(lags) - 1))] * 1000, 1),
            "ticks": len(lags),
        }


class TurnProbe:
    """The CPU time of the event loop's thread per turn of the loop (a task that yields at
    every turn): the longest is the longest the loop ran without coming back to its other
    tasks, measured in CPU time, which a loaded host does not inflate."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.turns = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.thread_time()
            await asyncio.sleep(0)
            self.longest = max(self.longest, time.thread_time() - t)
            self.turns += 1

    def __enter__(self) -> TurnProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


class StepProbe:
    """The `step` hook of the embedded state log's compaction (store/statelog.py) that
    measures the compaction thread's CPU time between two of its calls, then gives way as
    the default hook does: the longest is the longest the compaction ran without offering
    the GIL, in CPU time."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.calls = 0
        self._last: float | None = None

    def __call__(self) -> None:
        now = time.thread_time()
        if self._last is not None:
            self.longest = max(self.longest, now - self._last)
        self.calls += 1
        give_way()
        self._last = time.thread_time()


async def measure(
    compact: Callable[[], Awaitable[None]], longest_cpu: Callable[[], float]
) -> dict[str, Any]:
    """The loop's lag while `compact` runs, and for comparison while nothing runs for
    BASELINE_S (on a loaded host the scheduler alone makes stalls of its own);
    `longest_cpu()`: the longest CPU stretch without yielding, seconds."""
    await asyncio.sleep(0.1)  # the probe's first tick is on time
    with LagProbe() as probe:
        await asyncio.sleep(5 * TICK_S)
        t0 = time.perf_counter()
        await compact()
        took = time.perf_counter() - t0
    with LagProbe() as idle:
        await asyncio.sleep(BASELINE_S)
    baseline = {f"idle_{k}": v for k, v in idle.summary().items() if k != "ticks"}
    return {
        "compaction_s": round(took, 2),
        "longest_cpu_without_yield_ms": round(longest_cpu() * 1000, 1),
        **probe.summary(),
        **baseline,
    }


async def run_embedded(root: Path, sessions: int) -> dict[str, Any]:
    from gateway.storage.embedded import EmbeddedStorage
    from store import StoreConfig

    store = EmbeddedStorage.open(StoreConfig(data_dir=root / "embedded"))
    try:
        for generation in (0, 1):
            records = session_records(sessions, generation)
            for i in range(0, len(records), WRITE_BATCH):
                store.append_state(records[i : i + WRITE_BATCH])
            del records
        store.sync_state()
    finally:
        store.close()
    store = EmbeddedStorage.open(StoreConfig(data_dir=root / "embedded"))
    try:
        assert store.state_needs_compaction() and store.state is not None
        steps = StepProbe()
        log = store.state

        async def compact() -> None:
            # EmbeddedStorage.compact_state's executor call, with the measuring hook.
            await asyncio.get_running_loop().run_in_executor(None, log.compact, steps)

        out = await measure(compact, lambda: steps.longest)
        assert not store.state_needs_compaction()
    finally:
        store.close()
    return {"backend": "embedded", "sessions": sessions, **out}


async def run_rocketmq(namesrv: str, root: Path, sessions: int) -> dict[str, Any]:
    from gateway.config import GatewaySettings
    from gateway.storage.embedded import open_storage
    from gateway.storage.rocketmq.adapter import RocketMqStorage
    from gateway.storage.rocketmq.start import open_rocketmq

    settings = GatewaySettings(
        data_dir=root / "gateway",
        store="rocketmq",
        namesrv=namesrv,
        rocketmq_broker="broker-a",
        rocketmq_topic=f"cb{int(time.time())}",
    )
    storage = await open_rocketmq(settings, open_storage(settings), node_id="bench")
    assert isinstance(storage, RocketMqStorage)
    try:
        state = storage._state_log
        records = session_records(sessions)
        ticket = 0
        for i in range(0, len(records), 1000):
            ticket = state.append(records[i : i + 1000])
        await state.wait_durable(ticket)
        state.history += 3 * sessions  # as if every session had been written 4 times
        del records
        with TurnProbe() as turns:
            out = await measure(storage.compact_state, lambda: turns.longest)
        assert state.history == sessions, state.history
    finally:
        storage.close()
    return {"backend": "rocketmq", "sessions": sessions, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--backend", choices=["embedded", "rocketmq", "both"], default="embedded")
    args = ap.parse_args()
    backends = ["embedded", "rocketmq"] if args.backend == "both" else [args.backend]
    with tempfile.TemporaryDirectory(prefix="lmqtt-compaction-") as tmp:
        root = Path(tmp)
        if "embedded" in backends:
            print(json.dumps(uvloop.run(run_embedded(root, args.sessions))), flush=True)
        if "rocketmq" in backends:
            from tests.rocketmq.cluster import RocketMQCluster, ensure_jars

            ensure_jars()
            (root / "rocketmq").mkdir()
            cluster = RocketMQCluster(root / "rocketmq")
            cluster.start()
            try:
                result = uvloop.run(run_rocketmq(cluster.namesrv_addr, root, args.sessions))
            finally:
                cluster.stop()
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
