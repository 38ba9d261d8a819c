"""``python -m bench [scenario ...] [--duration S] [--repeat N] [--brokers ...]``.

Brokers run one after another, never at the same time, each on a fresh port and directory.
Every (scenario, broker) pair is repeated ``--repeat`` times (heavy scenarios once) and the
median of each figure is reported, next to the CPU shares that say who limited the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import resource
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.brokers import (
    BROKERS,
    LMQTT_NO_ACCOUNT,
    OPTIONAL_BROKERS,
    ROCKETMQ_NODES,
    BrokerOptions,
    BrokerProcess,
    BrokerUnavailable,
)
from bench.report import (
    account_cost,
    describe_account_cost,
    machine_details,
    render_markdown,
    write_docs,
)
from bench.scenarios import SCENARIOS, RunSettings, run_scenario
from bench.workers import WorkerError, wait_for_quiet_host

if TYPE_CHECKING:
    from tests.rocketmq.cluster import RocketMQCluster

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.asynccontextmanager
async def rocketmq_cluster(
    wanted: bool, root: Path, jvm: str = "test"
) -> AsyncIterator[RocketMQCluster | str | None]:
    """The RocketMQ cluster ``lmqtt-rocketmq`` stores on, started once for the whole run and
    stopped (every JVM) at the end; the reason as a string when it cannot run here. `jvm`: the
    test suite's JVM flags or production ones (tests/rocketmq/cluster.py JVM_SETS)."""
    if not wanted:
        yield None
        return
    import shutil

    from tests.rocketmq.cluster import ClusterUnavailable, RocketMQCluster, ensure_jars

    if shutil.which("java") is None:
        yield "Java is not installed: no RocketMQ cluster"
        return
    try:
        await asyncio.to_thread(ensure_jars)
    except ClusterUnavailable as exc:
        yield str(exc)
        return
    root.mkdir(parents=True, exist_ok=True)
    cluster = RocketMQCluster(root, jvm=jvm)
    try:
        print("... starting the RocketMQ cluster", file=sys.stderr, flush=True)
        try:
            await asyncio.to_thread(cluster.start)  # it runs its own event loop while it waits
        except RuntimeError as exc:  # not ready in time, a JVM exited: the rows say so
            yield f"RocketMQ cluster did not start: {str(exc).splitlines()[0]}"
            return
        print(f"    name server {cluster.namesrv_addr}", file=sys.stderr, flush=True)
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def raise_open_files_limit(wanted: int = 262_144) -> int:
    """Idle and fleet runs need up to 50,000+ sockets on each side; children (brokers and
    generators) inherit the limit. Raising the hard limit needs root, as for an operator."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target_hard in (max(hard, wanted), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, target_hard), target_hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    keys = {k for run in runs for k in run}
    for key in sorted(keys):
        values = [run[key] for run in runs if key in run]
        if all(isinstance(v, bool) for v in values):
            merged[key] = all(values)
        elif all(isinstance(v, int | float) for v in values):
            merged[key] = statistics.median(values)
        elif key == "flags":
            merged[key] = sorted({f for v in values for f in v})
        else:
            merged[key] = values[-1]
    return merged


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    settings = RunSettings(
        duration=args.duration,
        repeat=args.repeat,
        backlog=args.backlog,
        backlog_seconds=args.backlog_seconds,
        idle=args.idle,
        devices=args.devices,
        rate=args.rate,
        capacity=args.capacity,
        device_window=args.device_window,
        warmup=args.warmup,
    )
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lmqtt-bench-") as tmp:
        wanted = any(b in ROCKETMQ_NODES for b in brokers)
        async with rocketmq_cluster(wanted, Path(tmp) / "rocketmq", args.rocketmq_jvm) as rmq:
            await _run_scenarios(args, settings, brokers, Path(tmp), rmq, results)
    return results


async def _run_scenarios(
    args: argparse.Namespace,
    settings: RunSettings,
    brokers: list[str],
    tmp: Path,
    rocketmq: RocketMQCluster | str | None,
    results: dict[str, Any],
) -> None:
    for name in args.scenarios:
        scenario = SCENARIOS[name]
        results[name] = {}
        realtime = scenario.realtime and args.realtime
        plan: list[tuple[str, BrokerOptions]] = []
        pricing = args.account_cost and "lmqtt" in brokers
        for broker_name in brokers:
            options = scenario.options(broker_name)
            if options is not None and broker_name in ROCKETMQ_NODES and args.rocketmq_flush:
                options = replace(options, flush=args.rocketmq_flush)
            entry: dict[str, Any] = {"runs": [], "notes": []}
            results[name][broker_name] = entry
            if options is None:
                entry["notes"].append("n/a for this broker")
            else:
                plan.append((broker_name, options))
                if broker_name == "lmqtt" and pricing:
                    # Right after lmqtt, so the two take turns (see below).
                    results[name][LMQTT_NO_ACCOUNT] = {"runs": [], "notes": []}
                    plan.append((LMQTT_NO_ACCOUNT, replace(options, delivery_account=False)))
        repeats = settings.repeat if scenario.repeated or pricing else 1
        # Brokers take turns (lmqtt #1, Mosquitto #1, amqtt #1, lmqtt #2, ...) so that a
        # burst of other load on the shared host falls on every broker alike, not on all
        # the runs of one of them.
        skipped: set[str] = set()
        for attempt in range(repeats):
            for broker_name, options in plan:
                if broker_name in skipped:
                    continue
                entry = results[name][broker_name]
                workdir = tmp / f"{name}-{broker_name}-{attempt}"
                if broker_name in ROCKETMQ_NODES and isinstance(rocketmq, str):
                    entry["notes"].append(f"skipped: {rocketmq}")
                    skipped.add(broker_name)
                    continue
                broker = BrokerProcess(
                    broker_name,
                    workdir,
                    options,
                    realtime=realtime,
                    rocketmq=rocketmq if not isinstance(rocketmq, str) else None,
                )
                label = f"{name} {broker_name} #{attempt + 1}/{repeats}"
                busy = await wait_for_quiet_host(args.quiet_wait)
                print(f"... {label} (host busy {busy:.2f} cores)", file=sys.stderr, flush=True)
                try:
                    metrics = await asyncio.wait_for(
                        run_scenario(scenario, broker, settings, workdir),
                        timeout=args.scenario_timeout,
                    )
                except BrokerUnavailable as exc:
                    entry["notes"].append(f"skipped: {exc}")
                    skipped.add(broker_name)
                    continue
                except (WorkerError, TimeoutError, OSError) as exc:
                    entry["notes"].append(f"run {attempt + 1} failed: {exc or 'timeout'}")
                    print(f"    failed: {exc}  [{broker.log_tail(3)}]", file=sys.stderr)
                    broker.kill()
                    continue
                finally:
                    broker.kill()
                metrics["host_busy_before"] = round(busy, 2)
                if any("disconnected" in f or "exited" in f for f in metrics.get("flags", [])):
                    entry["notes"].append(f"run {attempt + 1}: {broker.log_tail(3)}")
                if realtime and not broker.realtime_applied:
                    note = "SCHED_FIFO not permitted (needs CAP_SYS_NICE): normal priority"
                    if note not in entry["notes"]:
                        entry["notes"].append(note)
                entry["runs"].append(metrics)
                print(f"    {json.dumps(metrics)}", file=sys.stderr, flush=True)
        for broker_name, _ in plan:
            entry = results[name][broker_name]
            if entry["runs"]:
                entry["median"] = median_metrics(entry["runs"])
        cost = account_cost(results[name])
        if cost is not None:
            results[name]["account_cost"] = cost
            print(f"    {name}: {describe_account_cost(cost)}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "scenarios", nargs="*", metavar="scenario", help=f"any of: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--duration", type=float, default=5.0, help="publish phase, s")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--brokers",
        default=",".join(BROKERS),
        help=f"comma-separated, any of: {', '.join((*BROKERS, *OPTIONAL_BROKERS))}"
        " (lmqtt-rocketmq: the gateway with --store rocketmq on a RocketMQ cluster the bench"
        " starts; needs Java and Maven; lmqtt-rocketmq-2n / -3n: 2 or 3 gateway processes on"
        " it, clients spread over them)",
    )
    parser.add_argument(
        "--rocketmq-jvm",
        choices=("test", "production"),
        default="test",
        help="the RocketMQ cluster's JVM flags: the test suite's (small heaps, serial GC, C1"
        " only) or a production broker's (G1, C2; tests/rocketmq/cluster.py, docs/rocketmq.md)",
    )
    parser.add_argument(
        "--rocketmq-flush",
        choices=("async", "sync"),
        help="lmqtt-rocketmq rows: sync stores on the SYNC_FLUSH broker with lmqtt's sync mode"
        " (PUBACK after the flush), async on the ASYNC_FLUSH one (default: the scenario's)",
    )
    parser.add_argument("--backlog", type=int, default=1_000_000, help="offline backlog size")
    parser.add_argument(
        "--backlog-seconds", type=float, default=20.0, help="cap on backlog fill and drain, s"
    )
    parser.add_argument("--idle", type=int, default=10_000, help="idle connections")
    parser.add_argument("--devices", type=int, default=2000, help="fleet: device connections")
    parser.add_argument("--rate", type=float, default=5000.0, help="fleet: offered msg/s in all")
    parser.add_argument(
        "--no-capacity",
        dest="capacity",
        action="store_false",
        help="fleet: skip the capacity search (highest rate with p99 <= 10 ms, nothing lost)",
    )
    parser.add_argument(
        "--device-window",
        type=int,
        default=0,
        help="fleet: QoS 1 PUBLISHes a device leaves unacknowledged before it waits (0: no "
        "limit, devices write on schedule whatever the broker does; see bench/fleetgen.py)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="fleet: first publish this many s at the offered rate, unmeasured (the RocketMQ"
        " JVMs' JIT compiles their hot paths then: C2 with --rocketmq-jvm production)",
    )
    parser.add_argument(
        "--account-cost",
        action="store_true",
        help="also run lmqtt without its delivery account (taking turns with lmqtt, --repeat "
        "times each) and print the account's CPU cost per delivery",
    )
    parser.add_argument("--scenario-timeout", type=float, default=600.0)
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=3.0,
        help="wait up to this many s before each run for the shared host to go idle",
    )
    parser.add_argument(
        "--no-realtime",
        dest="realtime",
        action="store_false",
        help="run the latency scenarios at normal priority instead of SCHED_FIFO "
        "(see bench/realtime.py: on a shared host the tail is then the scheduler's)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--from-json", type=Path, help="only render the table of a saved run")
    parser.add_argument(
        "--merge",
        type=Path,
        help="start from this saved run and replace only the scenarios run now (re-runs)",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    args.scenarios = args.scenarios or list(SCENARIOS)
    known = (*BROKERS, *OPTIONAL_BROKERS)
    wrong = [b for b in args.brokers.split(",") if b.strip() and b.strip() not in known]
    if wrong:
        parser.error(f"unknown broker(s) {wrong}; choose from {list(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        markdown = render_markdown(json.loads(args.from_json.read_text()))
        if args.docs:
            write_docs(args.docs, markdown)
        print(markdown)
        return 0
    nofile = raise_open_files_limit()
    started = dt.datetime.now(dt.UTC)
    results = asyncio.run(run_all(args))
    finished = dt.datetime.now(dt.UTC)
    merged_from = None
    if args.merge:
        previous = json.loads(args.merge.read_text())
        merged_from = previous.get("started")
        started = dt.datetime.fromisoformat(previous["started"])
        results = {**previous["results"], **results}
        results = {name: results[name] for name in SCENARIOS if name in results}
    document = {
        "merged_from": merged_from,
        "started": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {**machine_details(), "open_files_limit": nofile},
        "results": results,
    }
    markdown = render_markdown(document)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    (args.out / f"bench-{stamp}.json").write_text(json.dumps(document, indent=2))
    (args.out / f"bench-{stamp}.md").write_text(markdown)
    (args.out / "latest.json").write_text(json.dumps(document, indent=2))
    (args.out / "latest.md").write_text(markdown)
    if args.docs:
        write_docs(args.docs, markdown)
    print(markdown)
    return 0
