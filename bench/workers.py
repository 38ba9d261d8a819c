"""Orchestrator side of the load generator: worker processes and CPU accounting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from bench.brokers import BrokerProcess
from bench.realtime import make_realtime

# A generator process above this share of one core may have limited the result: its row shows
# "invalid: generator-bound" instead of a ratio (bench.report).
GENERATOR_SATURATED = 0.7
# CPU used by processes outside the benchmark above this many cores means the host was shared.
OTHER_LOAD_CORES = 0.3


# Flags under which a row measured the bench or the host rather than the broker.
INVALIDATING_FLAGS = ("generator-bound", "host-saturated")


def invalid_reason(flags: list[str]) -> str | None:
    """``"invalid: <flag>"`` when a run's flags say the broker was not what limited it."""
    for flag in INVALIDATING_FLAGS:
        if flag in flags:
            return f"invalid: {flag}"
    return None


class WorkerError(Exception):
    """A load-generator process failed or answered something unexpected."""


class Worker:
    """One ``python -m bench.loadgen`` process."""

    def __init__(self, spec: dict[str, Any], *, realtime: bool = False) -> None:
        self.spec = spec
        self.realtime = realtime
        self.process: asyncio.subprocess.Process | None = None
        self.ps: psutil.Process | None = None
        self.last_cpu = 0.0

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.loadgen",
            json.dumps(self.spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            limit=1 << 28,
        )
        self.ps = psutil.Process(self.process.pid)
        if self.realtime:
            make_realtime(self.process.pid)

    def send(self, command: str) -> None:
        assert self.process is not None and self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.process.stdin.write((command + "\n").encode())

    async def expect(self, event: str, timeout: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"{self.spec['role']} worker: no '{event}' in {timeout:.0f} s")
            try:
                line = await asyncio.wait_for(self.process.stdout.readline(), remaining)
            except TimeoutError as exc:
                raise WorkerError(
                    f"{self.spec['role']} worker: no '{event}' in {timeout:.0f} s"
                ) from exc
            if not line:
                raise WorkerError(f"{self.spec['role']} worker exited before '{event}'")
            message: dict[str, Any] = json.loads(line)
            if message["event"] == "error":
                raise WorkerError(f"{self.spec['role']} worker: {message['message']}")
            if message["event"] == event:
                return message

    async def request(self, command: str, event: str, timeout: float) -> dict[str, Any]:
        self.send(command)
        return await self.expect(event, timeout)

    def cpu_seconds(self) -> float:
        if self.ps is None:
            return self.last_cpu
        try:
            times = self.ps.cpu_times()
        except psutil.Error:
            return self.last_cpu
        self.last_cpu = float(times.user + times.system)
        return self.last_cpu

    async def close(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.send("stop")
        with contextlib.suppress(Exception):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()


def _busy_seconds() -> float:
    times = psutil.cpu_times()
    return float(times.user + times.nice + times.system + times.irq + times.softirq)


async def wait_for_quiet_host(max_wait: float, busy_limit: float = 0.5) -> float:
    """Wait (at most ``max_wait`` s) until the host's busy CPU drops below ``busy_limit`` cores.

    The machine is shared; starting a run while someone else's job owns both cores measures
    that job. Returns the last busy figure seen, for the record.
    """
    deadline = time.monotonic() + max_wait
    while True:
        before, t0 = _busy_seconds(), time.monotonic()
        await asyncio.sleep(0.5)
        busy = (_busy_seconds() - before) / (time.monotonic() - t0)
        if busy < busy_limit or time.monotonic() >= deadline:
            return busy


@dataclass(slots=True)
class CpuProbe:
    """CPU of the broker, of each generator process and of the whole host over one window."""

    broker: BrokerProcess
    workers: list[Worker]
    wall0: float = 0.0
    broker0: tuple[float, float] = (0.0, 0.0)  # (user, system)
    store0: float = 0.0
    workers0: tuple[float, ...] = ()
    host0: float = 0.0

    def start(self) -> None:
        self.wall0 = time.monotonic()
        self.broker0 = self.broker.cpu_split()
        self.store0 = self.broker.store_cpu_seconds()
        self.workers0 = tuple(w.cpu_seconds() for w in self.workers)
        self.host0 = _busy_seconds()

    def stop(self) -> dict[str, Any]:
        wall = max(time.monotonic() - self.wall0, 1e-6)
        user, system = (b - a for a, b in zip(self.broker0, self.broker.cpu_split(), strict=True))
        broker = (user + system) / wall
        per_worker = [
            (w.cpu_seconds() - before) / wall
            for w, before in zip(self.workers, self.workers0, strict=True)
        ]
        host = (_busy_seconds() - self.host0) / wall
        # The processes the broker stores through (RocketMQ's JVMs): part of the system
        # under test, not other load.
        store = (self.broker.store_cpu_seconds() - self.store0) / wall
        generator = sum(per_worker)
        other = max(0.0, host - broker - store - generator)
        flags = []
        if per_worker and max(per_worker) >= GENERATOR_SATURATED:
            flags.append("generator-bound")
        if other >= OTHER_LOAD_CORES:
            flags.append("other-load")
        if any(p.returncode is not None for p in self.broker.processes):
            # A node that ended mid-window (a cluster node fenced by its lease) took its CPU
            # time with it: the broker's figure is no measurement then.
            flags.append("broker-exited")
        cores = psutil.cpu_count() or 1
        # The JVMs a gateway stores through are the broker's own work, not what saturated it.
        if host >= 0.92 * cores and broker + store < 0.85:
            flags.append("host-saturated")
        return {
            "broker_cpu_s": round(broker * wall, 3),
            "broker_cpu": round(broker, 3),
            # The broker's CPU split: its own code (user) and the kernel's work for it.
            "broker_user_s": round(user, 3),
            "broker_system_s": round(system, 3),
            "store_cpu_s": round(store * wall, 3),
            "store_cpu": round(store, 3),
            "gen_cpu": round(generator, 3),
            "gen_cpu_max_process": round(max(per_worker, default=0.0), 3),
            "other_cpu": round(other, 3),
            "flags": flags,
        }


class RssSampler:
    """Polls the broker's RSS in the background and keeps the peak."""

    def __init__(self, broker: BrokerProcess, interval: float = 0.1) -> None:
        self.broker = broker
        self.interval = interval
        self.peak = broker.rss()
        self.peak_anon = broker.anon()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.broker.rss())
            self.peak_anon = max(self.peak_anon, self.broker.anon())
            await asyncio.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.peak = max(self.peak, self.broker.rss())
        self.peak_anon = max(self.peak_anon, self.broker.anon())
