"""Profile lmqtt under a benchmark scenario with py-spy.

``python -m bench.profile [scenario ...] [--duration S] [--top N]`` starts lmqtt, attaches
``py-spy record`` (pip install py-spy) to it while the scenario runs, and writes per scenario a
collapsed-stack file (for flamegraph.pl or speedscope) to bench/results/, then prints the
functions with the most samples, by own time and by inclusive time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.brokers import BrokerOptions, BrokerProcess
from bench.cli import RESULTS, raise_open_files_limit
from bench.scenarios import SCENARIOS, RunSettings


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
    return found


LINE = re.compile(r":\d+\)$")


def summarize(collapsed: Path, top: int) -> str:
    """Own and inclusive sample counts per function from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        # "func (path:line)" -> "func (path)": aggregate a function over its lines.
        frames = [LINE.sub(")", frame) for frame in stack.split(";")]
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{total} samples", "", "own time:"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive time:"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top * 2)]
    return "\n".join(lines)


async def profile(
    name: str, settings: RunSettings, out: Path, top: int, gil_only: bool = True
) -> str:
    scenario = SCENARIOS[name]
    with tempfile.TemporaryDirectory(prefix="lmqtt-profile-") as tmp:
        options = scenario.options("lmqtt") or BrokerOptions()
        broker = BrokerProcess("lmqtt", Path(tmp), options)
        await broker.start()
        collapsed = out / f"profile-{name}.txt"
        recorder = subprocess.Popen(
            [
                py_spy(),
                "record",
                "--pid",
                str(broker.pid),
                "--rate",
                "200",
                "--format",
                "raw",
                "--output",
                str(collapsed),
                "--nonblocking",
                # Only the thread holding the GIL: what costs the event loop CPU, not threads
                # parked in fsync (--all-threads shows those too).
                *(["--gil"] if gil_only else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await asyncio.sleep(0.5)
            metrics = await scenario.run(broker, settings, Path(tmp))
        finally:
            recorder.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
            try:
                recorder.wait(15)
            except subprocess.TimeoutExpired:
                recorder.kill()
            await broker.stop()
        summary = summarize(collapsed, top) if collapsed.exists() else "no profile written"
        deliveries = metrics.get("deliveries_per_s")
        header = f"== {name}: {deliveries} deliveries/s, broker CPU {metrics.get('broker_cpu')}"
        (out / f"profile-{name}.summary.txt").write_text(header + "\n" + summary + "\n")
        return header + "\n" + summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("scenarios", nargs="*", default=["1to1_qos1", "1to100_qos1"])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--all-threads", action="store_true", help="not only the GIL holder")
    parser.add_argument("--devices", type=int, default=2000, help="fleet: device connections")
    parser.add_argument("--rate", type=float, default=5000.0, help="fleet: offered msg/s")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        settings = RunSettings(
            duration=args.duration, devices=args.devices, rate=args.rate, capacity=False
        )
        print(asyncio.run(profile(name, settings, args.out, args.top, not args.all_threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
