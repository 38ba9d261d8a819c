"""Stage timers: what named gateway functions cost per call and per second under a scenario.

``python -m bench.stages [scenario] [--devices D] [--rate R] [--after S] [--window S]
[--stage module:Qualified.name ...]`` starts lmqtt with bench/stage_hook.py loaded at
interpreter start, runs the scenario (the fleet by default), and prints for each stage its
calls per second, wall and thread-CPU milliseconds per second and microseconds per call over a
window of the run, with the event loop thread's CPU over the same window. Where py-spy samples
(bench/profile.py), this counts: a stage's cost per call does not depend on catching it in a
sample, so a per-batch stage and a per-message one compare directly.

The window opens `--after` seconds after the gateway starts (pick it inside the scenario's
steady phase: the fleet connects its devices first; by default 5 s + 1 s per 2,000 devices) and
lasts `--window` seconds. Each timer costs about 1 us a call, included in its own figure and in
those of the stages that call it.

The gateway runs its mypyc group from source here (accelerators/compiled.py SWITCH; the C
kernels stay): a compiled method calls the group's others directly, past a timer set on the
class, so most stages would count only their calls from interpreted code. The figures are
therefore the group's interpreted costs, which the output's first line says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from accelerators import compiled
from bench.brokers import BrokerOptions, BrokerProcess
from bench.cli import raise_open_files_limit
from bench.scenarios import SCENARIOS, RunSettings

ROOT = Path(__file__).resolve().parents[1]

# The fleet's stages: a device's read and its PUBACK, the turn's store of its publishes (the
# append, the recent cache, the arrival notices), a delivery pass and a subscriber's PUBACKs.
STAGES = (
    "gateway.connection.client:ClientConnection.feed",
    "gateway.connection.transport:ClientTransport.acknowledge_stored",
    "gateway.connection.ingest:IngestBatch.flush",
    "gateway.messages.publishing:PublishPath.append_publishes",
    "store.append:Appender._append_common",
    "store.segment:Segment.write",
    "gateway.messages.recent:RecentMessages.add_many",
    "gateway.delivery.arrivals:ArrivalHub.on_arrivals",
    "gateway.delivery.loop:DeliveryLoop._pass",
    "gateway.delivery.acks:Acknowledgements.on_pubacks",
)

SITECUSTOMIZE = "import bench.stage_hook\n\nbench.stage_hook.install()\n"


def table(figures: dict[str, Any]) -> str:
    """The hook's JSON as lines: per stage calls/s, ms/s (wall, CPU), us per call (CPU)."""
    if "error" in figures:
        return f"no figures: {figures['error']}"
    wall = figures["window_s"]
    lines = [
        "the compiled group ran from source (its timers see every call): interpreted costs",
        f"event loop thread: {1000 * figures['loop_cpu_s'] / wall:.1f} ms CPU/s over {wall:.1f} s",
        f"{'stage':60s} {'calls/s':>9s} {'wall ms/s':>10s} {'cpu ms/s':>9s} {'us/call':>8s}",
    ]
    for name, st in figures["stages"].items():
        calls = st["calls"]
        per_call = 1e6 * st["cpu_s"] / calls if calls else 0.0
        lines.append(
            f"{name:60s} {calls / wall:9.0f} {1000 * st['wall_s'] / wall:10.1f} "
            f"{1000 * st['cpu_s'] / wall:9.1f} {per_call:8.2f}"
        )
    return "\n".join(lines)


async def measure(
    name: str, settings: RunSettings, stages: list[str], after: float, window: float
) -> str:
    scenario = SCENARIOS[name]
    with tempfile.TemporaryDirectory(prefix="lmqtt-stages-") as tmp:
        hook_dir = Path(tmp) / "hook"
        hook_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = Path(tmp) / "stages.json"
        env = {
            "PYTHONPATH": os.pathsep.join(
                [str(hook_dir), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "LMQTT_STAGES": ",".join(stages),
            "LMQTT_STAGES_AFTER": str(after),
            "LMQTT_STAGES_WINDOW": str(window),
            "LMQTT_STAGES_OUT": str(out),
            compiled.SWITCH: "1",
        }
        saved = {key: os.environ.get(key) for key in env}
        options = scenario.options("lmqtt") or BrokerOptions()
        # Scheduled as `python -m bench` schedules it (bench/realtime.py): the wall figures then
        # hold no preemption by other processes, and the scenario's paced phase is the same.
        broker = BrokerProcess("lmqtt", Path(tmp), options, realtime=scenario.realtime)
        os.environ.update(env)  # the broker's environment only: restored before the clients
        try:
            await broker.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        try:
            metrics = await scenario.run(broker, settings, Path(tmp))
        finally:
            await broker.stop()
        figures = json.loads(out.read_text()) if out.exists() else {"error": "window not closed"}
        header = (
            f"== {name}: {metrics.get('deliveries_per_s')} deliveries/s, broker CPU "
            f"{metrics.get('broker_cpu')}, {metrics.get('us_cpu_per_delivery')} us per delivery"
        )
        return header + "\n" + table(figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__)
    parser.add_argument("scenario", nargs="?", default="fleet")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--devices", type=int, default=2000, help="fleet: device connections")
    parser.add_argument("--rate", type=float, default=10000.0, help="fleet: offered msg/s")
    parser.add_argument("--after", type=float, default=None, help="s after the gateway starts")
    parser.add_argument("--window", type=float, default=4.0, help="s timed")
    parser.add_argument("--stage", action="append", help="module:Qualified.name (repeatable)")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    # The fleet connects first (no quiet-host wait here: 2,000 devices took 1.5-3 s, 10,000
    # about 5-8 s on the loaded host), then publishes for --duration: start a little into it.
    after = args.after if args.after is not None else 5.0 + args.devices / 2000
    settings = RunSettings(
        duration=args.duration, devices=args.devices, rate=args.rate, capacity=False, repeat=1
    )
    stages = args.stage or list(STAGES)
    print(asyncio.run(measure(args.scenario, settings, stages, after, args.window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
