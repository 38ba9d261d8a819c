"""StallWatch: what holds the event loop when it is late (off unless ``stall_watch_ms`` is set).

Every client of the process waits while one callback runs, so a callback (or one loop turn of
many) that takes milliseconds is the latency tail. The overload guard sees the loop's lag
(its own timer's lateness); this watch says what was running.

A watchdog thread posts a probe onto the loop (``call_soon_threadsafe``) every PROBE_S and waits
for it on a threading.Event (no GIL held while it waits). A probe that has not run after
``threshold`` is a stall in progress: the watchdog then samples the loop thread's Python stack
(``sys._current_frames``) every SAMPLE_S until the probe runs. What each stall records:

    ms       how late the probe ran (the loop was not back in its poll for that long)
    cpu_ms   CPU time the loop thread used meanwhile (well under ms: descheduled on a busy
             host, or blocked in a system call such as fsync)
    others_cpu_ms  CPU time the process's other threads used meanwhile (the store's flusher,
             executor threads: near ms while the loop's thread waited, they held the GIL)
    gc_ms    time spent in garbage collections meanwhile (timed with gc.callbacks: a collection
             holds the GIL, so the watchdog cannot sample during it)
    stacks   the sampled stacks, innermost frame last
    threads  the other Python threads' innermost frames at the first sample
    cause    ``gc``, ``other threads``, ``off-cpu``, the sampled callback (its outermost and
             innermost frames in this project, ``module:function > module:function``),
             ``between callbacks`` (the loop in its C part with the GIL let go: socket reads
             and writes of a long turn of many callbacks), or ``unsampled`` (one C call that
             held the GIL throughout)

Each stall is logged (WARNING, at most LOG_PER_S lines a second), appended as one JSON line to
``stall_watch_file`` when set, and counted by cause; ``summary()`` (logged when the gateway
stops) gives count, total and longest per cause; ``python -m gateway.ops.stall_watch FILE``
prints the same histogram from a ``stall_watch_file``.

Cost: nothing when off (no thread, no probe, no gc callback). When on, a probe every PROBE_S
(one callback and one eventfd write each), a thread that wakes once per probe, and the
interpreter's switch interval lowered to SWITCH_INTERVAL_S so that the sampler gets the GIL
during a stall of Python code (a stall inside one C call, which holds the GIL throughout, shows
as ``unsampled`` with the loop's CPU near its duration). That interval also bounds how long the
process's other threads keep the GIL from the loop, so ``other threads`` stalls read shorter
while the watch is on than they are without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["StallWatch", "histogram", "main"]

log = logging.getLogger("lmqtt.gateway")

# How often a probe is posted (between one probe running and the next being posted).
PROBE_S = 0.001
# How often the stack is sampled while a stall lasts (the GIL is taken by the sampler only
# when the loop thread lets go of it: at most every sys.getswitchinterval() while it runs).
SAMPLE_S = 0.001
MAX_SAMPLES = 50
LOG_PER_S = 5
# A stall whose loop-thread CPU is under this share of its duration is ``off-cpu``.
OFF_CPU_SHARE = 0.5
ROOTS = ("gateway", "store", "topicmap", "rocketmq_remoting")
# The frames that run the loop (the lmqtt script, the CLI, asyncio's runner); a callback's
# frames follow them (uvloop runs callbacks from C, with no Python frame of its own).
RUNNER = ("lmqtt", "gateway/cli", "runners", "base_events", "events", "threading")
# While the watch is on, a thread waiting for the GIL asks for it after this (Python's default
# is 5 ms): the sampler then sees a stall of pure-Python callbacks within a fraction of a ms.
SWITCH_INTERVAL_S = 0.0005


class StallWatch:
    """``start(loop)`` on the loop's thread, ``stop()``; ``summary()`` anytime."""

    def __init__(self, threshold_ms: float, file: Path | None = None) -> None:
        self.threshold = threshold_ms / 1000
        self.file = file
        self.stalls = 0
        self.by_cause: dict[str, list[float]] = {}  # cause -> [count, total ms, max ms]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._clock = time.CLOCK_THREAD_CPUTIME_ID
        self._ran = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gc_ns = 0  # total time in collections
        self._gc_started = 0
        self._gc_starting = -1
        self._gc_gen = -1  # the oldest generation collected (reset at each look)
        self._switch_interval = 0.005
        self._ran_at = 0.0
        self._ran_cpu = 0.0
        self._ran_process = 0.0
        self._logged_at = 0.0
        self._logged = 0
        self._out: Any = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._clock = time.pthread_getcpuclockid(self._loop_thread)
        gc.callbacks.append(self._on_gc)
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        if self.file is not None:
            self._out = open(self.file, "a", buffering=1)  # noqa: SIM115 - closed by stop()
        self._thread = threading.Thread(target=self._run, name="lmqtt-stall-watch", daemon=True)
        self._thread.start()
        log.warning(
            "stall watch on: event-loop stalls over %.1f ms are logged", self.threshold * 1e3
        )

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._ran.set()
        self._thread.join(1.0)
        self._thread = None
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        sys.setswitchinterval(self._switch_interval)
        if self._out is not None:
            self._out.close()
            self._out = None
        log.warning("stall watch: %d stalls over %.1f ms: %s", self.stalls, self.threshold * 1e3,
                    self.summary())  # fmt: skip

    def summary(self) -> dict[str, dict[str, float]]:
        """Per cause, longest total first: count, total and longest stall (ms)."""
        ranked = sorted(self.by_cause.items(), key=lambda item: -item[1][1])
        return {
            cause: {"count": int(c), "total_ms": round(t, 1), "max_ms": round(m, 1)}
            for cause, (c, t, m) in ranked
        }

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter_ns()
            self._gc_starting = int(info.get("generation", 2))
        elif self._gc_started:
            took = time.perf_counter_ns() - self._gc_started
            gen = self._gc_starting
            # The time and the generation change together, with no call between them (the
            # watchdog's thread could take the GIL at a call) to read them as one.
            self._gc_ns += took
            if gen > self._gc_gen:
                self._gc_gen = gen
            self._gc_started = 0

    def _probe(self) -> None:
        # Timed here, on the loop's thread: the watchdog may wait for the GIL once woken.
        self._ran_at = time.perf_counter()
        self._ran_cpu = time.thread_time()
        self._ran_process = time.process_time()
        self._ran.set()

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        ran, stopping, threshold = self._ran, self._stop, self.threshold
        clock, loop_thread = self._clock, self._loop_thread
        # Time in collections up to here is accounted for: seen by a probe, or too short.
        gc0 = self._gc_ns
        cpu0 = time.clock_gettime(clock)
        process0 = time.process_time()
        while not stopping.is_set():
            # Read together, with no call between them that could let a collection end.
            gen, gc_now, self._gc_gen = self._gc_gen, self._gc_ns, -1
            if (gc_now - gc0) / 1e9 >= threshold:
                cpu = time.clock_gettime(clock) - cpu0
                others = time.process_time() - process0 - cpu
                self._unseen_collection((gc_now - gc0) / 1e9, gen, cpu, others)
            gc0 = gc_now
            ran.clear()
            posted = time.perf_counter()
            cpu0 = time.clock_gettime(clock)
            process0 = time.process_time()
            try:
                loop.call_soon_threadsafe(self._probe)
            except RuntimeError:  # the loop closed
                return
            if ran.wait(threshold):
                stopping.wait(PROBE_S)
                continue
            stacks: list[list[str]] = []
            threads: dict[str, list[str]] = {}
            while True:
                if len(stacks) < MAX_SAMPLES:
                    frames = sys._current_frames()
                    frame = frames.get(loop_thread)
                    # Taken once the GIL was ours: the stall may have ended meanwhile.
                    if frame is not None and not ran.is_set():
                        stacks.append(_stack(frame))
                        if not threads:
                            threads = _other_threads(frames, loop_thread)
                if ran.wait(SAMPLE_S):
                    break
            if stopping.is_set():
                return
            late = self._ran_at - posted
            if late < threshold:
                continue  # the watchdog itself was late to look (a busy host)
            cpu = self._ran_cpu - cpu0
            others = self._ran_process - process0 - cpu
            gen, gc_now, self._gc_gen = self._gc_gen, self._gc_ns, -1
            in_gc = (gc_now - gc0) / 1e9
            gc0 = gc_now
            # A collection that began before the probe was posted stalled the loop too.
            self._record(max(late, in_gc), cpu, others, in_gc, gen, stacks, threads)

    def _unseen_collection(self, in_gc: float, gen: int, cpu: float, others: float) -> None:
        """Collections that no probe saw: one that starts after a probe ran, or before the one
        just posted is queued, holds the GIL until it ends, so this thread cannot post or look
        meanwhile. Counted from the time in collections, the stall's least length; what the
        loop's thread and the others used since the last look goes with it."""
        self._record(in_gc, cpu, others, in_gc, gen, [], {})

    def _record(
        self,
        late: float,
        cpu: float,
        others: float,
        in_gc: float,
        gen: int,
        stacks: list[list[str]],
        threads: dict[str, list[str]],
    ) -> None:
        cause = _cause(late, cpu, in_gc, stacks, others)
        self.stalls += 1
        entry = self.by_cause.setdefault(cause, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += late * 1e3
        entry[2] = max(entry[2], late * 1e3)
        record = {
            "at": round(time.time(), 3),
            "ms": round(late * 1e3, 2),
            "cpu_ms": round(cpu * 1e3, 2),
            "others_cpu_ms": round(others * 1e3, 2),
            "gc_ms": round(in_gc * 1e3, 2),
            "gc_gen": gen,
            "cause": cause,
            "stacks": stacks,
            "threads": threads,
        }
        if self._out is not None:
            self._out.write(json.dumps(record) + "\n")
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            self._logged_at, self._logged = now, 0
        if self._logged < LOG_PER_S:
            self._logged += 1
            log.warning(
                "event loop stalled %.1f ms (loop cpu %.1f ms, other threads %.1f ms, gc %.1f ms):"
                " %s",
                late * 1e3, cpu * 1e3, others * 1e3, in_gc * 1e3, cause,
            )  # fmt: skip


def _stack(frame: FrameType | None) -> list[str]:
    """`module:function:line` from the outermost frame to the innermost."""
    out: list[str] = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{_module(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    out.reverse()
    return out


def _module(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ROOTS:
            return "/".join(parts[i:]).removesuffix(".py")
    return parts[-1].removesuffix(".py")


def _other_threads(frames: dict[int, FrameType], loop_thread: int) -> dict[str, list[str]]:
    """The innermost frames of the process's other Python threads (this one left out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return {
        names.get(ident, str(ident)): _stack(frame)[-4:]
        for ident, frame in frames.items()
        if ident not in (loop_thread, me)
    }


def _cause(
    late: float, cpu: float, in_gc: float, stacks: list[list[str]], others: float = 0.0
) -> str:
    if in_gc >= late / 2:
        return "gc"
    if cpu < late * OFF_CPU_SHARE:
        # The loop's thread did not run: the process's other threads did (the GIL), or not.
        return "other threads" if others >= late * OFF_CPU_SHARE else "off-cpu"
    if not stacks:
        return "unsampled"
    # The most frequent sample's callback (its outermost frame under the loop's run) and its
    # innermost frame in this project, then the innermost frame when that is outside it.
    counts: dict[str, int] = {}
    for stack in stacks:
        frames = [f.rsplit(":", 1)[0] for f in stack]
        while frames and frames[0].split(":", 1)[0] in RUNNER:
            del frames[0]
        if not frames:
            key = "between callbacks"
        else:
            ours = [f for f in frames if f.split("/", 1)[0] in ROOTS]
            key = frames[0]
            if ours and ours[-1] != frames[0]:
                key += " > " + ours[-1]
            if frames[-1] not in key:
                key += " > " + frames[-1]
        counts[key] = counts.get(key, 0) + 1
    return max(counts, key=counts.__getitem__)


def histogram(lines: Iterable[str]) -> list[tuple[str, int, float, float, float]]:
    """(cause, count, total ms, longest ms, loop CPU ms) per cause of a ``stall_watch_file``'s
    lines, longest total first."""
    by: dict[str, list[float]] = {}
    for line in lines:
        if not line.strip():
            continue
        r = json.loads(line)
        e = by.setdefault(r["cause"], [0, 0.0, 0.0, 0.0])
        e[0] += 1
        e[1] += r["ms"]
        e[2] = max(e[2], r["ms"])
        e[3] += r["cpu_ms"]
    rows = [(cause, int(e[0]), e[1], e[2], e[3]) for cause, e in by.items()]
    return sorted(rows, key=lambda row: -row[2])


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway.ops.stall_watch FILE...``: the stalls of stall_watch_file(s) by
    cause."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m gateway.ops.stall_watch STALLS.jsonl...", file=sys.stderr)
        return 2
    lines: list[str] = []
    for path in paths:
        lines += Path(path).read_text().splitlines()
    print(f"{'count':>6} {'total ms':>9} {'max ms':>8} {'cpu ms':>8}  cause")
    for cause, count, total, longest, cpu in histogram(lines):
        print(f"{count:6d} {total:9.1f} {longest:8.1f} {cpu:8.1f}  {cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
