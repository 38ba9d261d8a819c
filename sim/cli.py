"""`lmqtt sim`: run the device simulator against a gateway and judge delivery.

Exit status: 0 nothing acknowledged was lost; 1 something acknowledged was lost or misrouted;
2 bad arguments, the gateway cannot be reached, or the run overran its time bound;
130 interrupted with Ctrl-C (and nothing lost among what was checked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

from rich.console import Console

from sim.errors import SimError
from sim.progress import follow, summary, verdict
from sim.simulation import (
    MAX_DEVICES,
    MAX_DURATION,
    MAX_RATE,
    MAX_SUBSCRIBERS,
    SimConfig,
    SimReport,
    Simulation,
)

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmqtt sim",
        description=(
            "Simulate IoT devices publishing JSON telemetry to site/{site}/dev/{device}/{metric} "
            "and subscribers using exact, + and # filters (some persistent, going offline and "
            "coming back); report sent, acknowledged, received and lost messages."
        ),
        epilog=(
            "Exit status: 0 no acknowledged message lost; 1 loss or misrouting; "
            "2 bad arguments or gateway unreachable; 130 interrupted."
        ),
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="gateway host (default: %(default)s)")
    add("--port", type=int, default=1883, help="gateway MQTT port (default: %(default)s)")
    add(
        "--gateway",
        action="append",
        default=[],
        metavar="HOST:PORT",
        type=parse_address,
        help="a node of a gateway cluster (repeat for each; replaces --host/--port): devices "
        "and subscribers are spread over them and reconnect to the next one when theirs fails",
    )
    add("--devices", type=int, default=10, help=f"devices, 0..{MAX_DEVICES} (default: %(default)s)")
    add(
        "--rate",
        type=float,
        default=1.0,
        help=f"messages per second per device, up to {MAX_RATE:g} (default: %(default)s)",
    )
    add(
        "--duration",
        type=float,
        default=30.0,
        help=f"seconds of publishing, up to {MAX_DURATION:g} (default: %(default)s)",
    )
    add(
        "--subscribers",
        type=int,
        default=4,
        help=f"subscribers, 0..{MAX_SUBSCRIBERS} (default: %(default)s)",
    )
    add("--qos", type=int, choices=(0, 1, 2), default=1, help="publish and subscription QoS")
    add("--seed", type=int, default=None, help="seed for reproducible telemetry values")
    add("--sites", type=int, default=4, help="sites the devices are spread over (default: 4)")
    add(
        "--max-messages",
        type=int,
        default=1_000_000,
        help="stop publishing after this many messages in total (default: %(default)s)",
    )
    add(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for outstanding deliveries after publishing (default: %(default)s)",
    )
    add("--username", default=None, help="MQTT user name, if the gateway wants one")
    add("--password", default=None, help="MQTT password")
    add(
        "--name",
        default="sim",
        help="client-id prefix of the subscribers (SIM-site-archive-2, ...): give simultaneous "
        "simulators different names (default: %(default)s)",
    )
    add(
        "--drop-sessions",
        action="store_true",
        help="discard the persistent subscribers' sessions at the end (default: keep them, "
        "so the analytics report still sees their deliveries and backlogs)",
    )
    add("--json", type=Path, default=None, metavar="FILE", help="also write the report as JSON")
    add("--quiet", action="store_true", help="no progress line, only the summary")
    return parser


def parse_address(text: str) -> tuple[str, int]:
    """`host:port` or `[v6 address]:port`."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        host=args.host,
        port=args.port,
        gateways=tuple(args.gateway),
        devices=args.devices,
        rate=args.rate,
        duration=args.duration,
        subscribers=args.subscribers,
        qos=args.qos,
        seed=args.seed,
        sites=args.sites,
        max_messages=args.max_messages,
        drain_timeout=args.drain_timeout,
        name=args.name,
        drop_sessions=args.drop_sessions,
        username=args.username,
        password=args.password,
    )


async def _run(sim: Simulation, console: Console, quiet: bool) -> SimReport:
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            console.print("stopping: draining outstanding deliveries (Ctrl-C again to skip)")
            sim.stop()
        else:
            sim.abort()

    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, on_signal)
    display = None if quiet else asyncio.create_task(follow(sim, console))
    try:
        return await sim.run()
    finally:
        if display is not None:
            display.cancel()
            await asyncio.gather(display, return_exceptions=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Logs (docker compose, CI) are not terminals; rich would squeeze the table into 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        config = config_from_args(args)
        config.check()
        report = asyncio.run(_run(Simulation(config), console, args.quiet))
    except SimError as exc:
        print(f"lmqtt sim: {exc}", file=sys.stderr)
        return EXIT_USAGE
    console.print(summary(report, console.width))
    console.print(verdict(report))
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            print(f"lmqtt sim: cannot write {args.json}: {exc.strerror}", file=sys.stderr)
            return EXIT_USAGE
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
