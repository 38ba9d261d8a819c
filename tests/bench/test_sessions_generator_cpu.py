"""The sessions bench's generator CPU never falls when a worker process ends before the run."""

from __future__ import annotations

import subprocess
import sys

import psutil

from bench.sessions_bench import GeneratorCpu


def test_a_worker_that_exited_keeps_the_cpu_it_used() -> None:
    # A worker that spends 0.3 s of CPU, says so, and exits when told.
    busy = (
        "import time\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "print('done', flush=True)\n"
        "import sys\n"
        "sys.stdin.read()"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", busy], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline() == "done\n"  # its CPU is spent, it still runs
        cpu = GeneratorCpu([psutil.Process(worker.pid)])
        before, busiest = cpu.read()
        assert busiest >= 0.3
        worker.stdin.close()
        assert worker.wait(10) == 0  # finished its share and reaped: no process to read
        after, busiest_after = cpu.read()
        assert after >= before
        assert busiest_after == busiest
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
