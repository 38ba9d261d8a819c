"""`lmqtt report ...` (also `python -m analytics ...`): fan-out jobs and operator answers.

    lmqtt report fanout  --data-dir D [--out DIR] [--since T] [--until T] [--window S]
                         [--master URL] [--no-progress]
    lmqtt report fanout  --store rocketmq --namesrv HOST:PORT [--rocketmq-topic T]
                         [--rocketmq-broker B] [--data-dir D] [--out DIR] ...
                         (the deployment's messages and sessions pulled from its broker:
                         analytics/rocketmq.py)
    lmqtt report compact --data-dir D [--out DIR] [--master URL]
    lmqtt report show    [--out DIR] [--device ID] [--top N]
                         [--by messages|bytes|fanout|deliveries|backlog] [--html FILE]
                         [--view summary|unreached|lagging|filters|topics]

Exit status: 0 done, 2 bad input (missing or empty data directory, corrupt segment, unknown
device, no report yet, bad arguments), 1 an unexpected Spark failure, 130 interrupted. Errors
are one line on stderr; Spark's own log goes to a file named in the message.

`show` imports neither pyspark nor the Spark job modules: it starts no JVM.

Settings: analytics may not import the gateway, so it reads none of the gateway's settings
itself. Run as `lmqtt report`, the gateway's command line resolves them (--config FILE, LMQTT_*
environment, its flags: gateway/config.py) and hands main() the store's as plain arguments
(`data_dir`, `store`, `namesrv`, `rocketmq_topic`, `rocketmq_broker`), which become the defaults
of the flags below. `python -m analytics` hands none: its flags and StoreDefaults only. (The
report directory's default, $LMQTT_REPORTS, is analytics' own: analytics/reportfiles.py.)
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from analytics.errors import AnalyticsError, recover_worker_error
from analytics.reportfiles import default_out_dir

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
VIEWS = ("summary", "unreached", "lagging", "filters", "topics")
DEFAULT_DATA_DIR = "lmqtt-data"


@dataclass(frozen=True)
class StoreDefaults:
    """The defaults of the flags naming the gateway's store (see the module docstring)."""

    # None: not configured. The embedded store's is then DEFAULT_DATA_DIR; a RocketMQ
    # deployment's report reads no local delivery account.
    data_dir: str | None = None
    store: str = "embedded"
    namesrv: str | None = None
    rocketmq_topic: str = "lmqtt"
    rocketmq_broker: str | None = None

    @classmethod
    def given(cls, settings: Mapping[str, str | None]) -> StoreDefaults:
        """These defaults with the settings given (None: not given) in their place."""
        return replace(
            cls(), **{name: value for name, value in settings.items() if value is not None}
        )


class UsageError(AnalyticsError):
    """Bad command-line arguments."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def absolute(path: str) -> str:
    """Resolve a path against this process's working directory: Spark executors on a cluster run
    elsewhere, so a relative data directory would silently read nothing there."""
    return str(Path(path).expanduser().absolute())


def parse_time(text: str, now_ms: int | None = None) -> int:
    """A point in time as epoch ms: ISO 8601 (UTC unless it says otherwise), epoch seconds or
    milliseconds, or a duration ago ("15m", "2h", "7d")."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = text.strip()
    m = _DURATION.match(value)
    if m:
        return now_ms - int(float(m.group(1)) * _UNITS[m.group(2)] * 1000)
    if re.fullmatch(r"\d+(\.\d+)?", value):
        number = float(value)
        return int(number if number >= 1e11 else number * 1000)
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(
            f"cannot read time {text!r}: use ISO 8601 (2024-05-01T12:00), epoch seconds or "
            "milliseconds, or a duration ago like 15m, 2h, 7d"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def build_parser(defaults: StoreDefaults = StoreDefaults()) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lmqtt report",
        description="Fan-out analytics over an lmqtt store. As `lmqtt report`, the store flags "
        "default to the gateway's settings (--config FILE, LMQTT_* environment).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{fanout,compact,show}")
    sub.required = True
    default_data = defaults.data_dir or DEFAULT_DATA_DIR
    default_out = str(default_out_dir())

    fan = sub.add_parser("fanout", help="run the fan-out job and write the report tables")
    fan.add_argument(
        "--data-dir",
        type=absolute,
        default=defaults.data_dir,
        help=f"the gateway's data directory (default {default_data}; with --store rocketmq: "
        "optional, where the gateway keeps its delivery account and committed offsets)",
    )
    fan.add_argument(
        "--store",
        choices=("embedded", "rocketmq"),
        default=defaults.store,
        help="the gateway's store: its data directory (embedded, default) or a RocketMQ "
        "deployment, read through pulls from its broker",
    )
    fan.add_argument(
        "--namesrv",
        default=defaults.namesrv,
        help="RocketMQ name server host:port (--store rocketmq)",
    )
    fan.add_argument(
        "--rocketmq-topic",
        default=defaults.rocketmq_topic,
        help="the gateway's rocketmq_topic (default %(default)s)",
    )
    fan.add_argument(
        "--rocketmq-broker",
        default=defaults.rocketmq_broker,
        help="the gateway's rocketmq_broker (default: the one holding the topic, as the gateway)",
    )
    fan.add_argument(
        "--out", default=default_out, type=absolute, help="report directory (default %(default)s)"
    )
    fan.add_argument("--since", help="only messages stored at or after this time")
    fan.add_argument("--until", help="only messages stored before this time")
    fan.add_argument("--window", type=int, help="timeline window in seconds (default: auto)")
    fan.add_argument("--master", help="Spark master URL (default local[*])")
    fan.add_argument("--no-progress", action="store_true", help="no progress display")

    comp = sub.add_parser("compact", help="rewrite sealed segments as Parquet once")
    comp.add_argument("--data-dir", default=default_data, type=absolute)
    comp.add_argument("--out", default=default_out, type=absolute)
    comp.add_argument("--master")

    show = sub.add_parser("show", help="answer from the last report (no Spark)")
    show.add_argument("--out", default=default_out)
    show.add_argument("--device", help="one device's numbers and activity")
    show.add_argument("--top", type=int, default=10)
    show.add_argument(
        "--by", default="messages", choices=("messages", "bytes", "fanout", "deliveries", "backlog")
    )
    show.add_argument(
        "--view",
        default="summary",
        choices=VIEWS,
        help="summary (default); unreached: devices whose messages reached no subscriber; "
        "lagging: subscribers falling behind, since when, lag over time; filters: deliveries "
        "per filter; topics: top topics by fan-out",
    )
    show.add_argument("--html", help="also write a self-contained HTML page here")
    return parser


def main(argv: list[str] | None = None, **settings: str | None) -> int:
    """Run one command. `settings`: the store flags' defaults by StoreDefaults field name, as
    `lmqtt report` resolved them (None: not configured)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    out = Console()
    err = Console(stderr=True)
    try:
        args = build_parser(StoreDefaults.given(settings)).parse_args(argv)
        if args.command == "show":
            return _show(args, out)
        if args.command == "compact":
            return _with_spark(lambda: _compact(args, err), err)
        return _with_spark(lambda: _fanout(args, err), err)
    except AnalyticsError as e:
        err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except SystemExit as e:  # --help
        return int(e.code or 0)


def _show(args: argparse.Namespace, console: Console) -> int:
    from analytics import show
    from analytics.show import Report, render_device, render_summary, render_top

    if args.top < 1:
        raise UsageError("--top must be at least 1")
    report = Report.load(args.out)
    if args.device is not None:
        render_device(report, args.device, console)
    elif args.view != "summary":
        getattr(show, f"render_{args.view}")(report, args.top, console)
    else:
        render_summary(report, console)
        render_top(report, args.by, args.top, console)
    if args.html:
        from analytics.html_report import write_html

        path = write_html(report, args.html)
        console.print(f"wrote {path}")
    return 0


def _with_spark(job, err: Console) -> int:  # type: ignore[no-untyped-def]
    """Run a Spark job; turn any Spark/JVM failure into one clear line."""
    from analytics.spark import has_spark, spark_log_path, stop_spark

    owned = not has_spark()  # embedded callers (tests, notebooks) keep their session
    try:
        return int(job())
    except AnalyticsError:
        raise
    except KeyboardInterrupt:
        raise
    except Exception as e:  # Py4J / PySpark failures carry JVM stack traces: never show them
        found = recover_worker_error(str(e))
        if found is not None:
            raise found from None
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        err.print(
            f"[red]error:[/] Spark job failed: {first[:300]}\n(Spark's log: {spark_log_path()})",
            highlight=False,
            soft_wrap=True,
        )
        return 1
    finally:
        try:
            if owned:
                stop_spark()
        except Exception:
            pass


def _fanout(args: argparse.Namespace, err: Console) -> int:
    from analytics.fanout import check_data_dir, run_fanout
    from analytics.progress import SparkProgress
    from analytics.spark import get_spark

    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until) if args.until else None
    if since is not None and until is not None and since >= until:
        raise UsageError("--since must be before --until")
    if args.window is not None and args.window < 1:
        raise UsageError("--window must be at least 1 second")
    deployment = None
    if args.store == "rocketmq":
        from analytics.rocketmq import Deployment, read_deployment

        if not args.namesrv:
            raise UsageError("--store rocketmq needs the name server: --namesrv host:port")
        # Read before starting a JVM: a deployment that cannot be read fails in a second.
        deployment = read_deployment(
            Deployment(args.namesrv, args.rocketmq_topic, args.rocketmq_broker, args.data_dir)
        )
    else:
        if args.data_dir is None:
            args.data_dir = absolute(DEFAULT_DATA_DIR)
        check_data_dir(args.data_dir)  # before starting a JVM: bad input fails in milliseconds
    Path(args.out).mkdir(parents=True, exist_ok=True)
    err.print("starting Spark ...", highlight=False)
    spark = get_spark(args.master)
    with SparkProgress(spark.sparkContext, err, enabled=not args.no_progress) as progress:
        meta = run_fanout(
            spark,
            args.data_dir or "",
            args.out,
            since,
            until,
            args.window,
            progress,
            rocketmq=deployment,
        )
    err.print(
        f"report: {meta.messages:,} messages from {meta.devices:,} devices, "
        f"{meta.deliveries:,} deliveries, in {meta.duration_s:.1f}s -> "
        f"{Path(args.out) / 'report'}  (see: lmqtt report show --out {args.out})",
        highlight=False,
    )
    return 0


def _compact(args: argparse.Namespace, err: Console) -> int:
    from analytics.compaction import COMPACTED_DIR, compact
    from analytics.fanout import check_data_dir
    from analytics.spark import get_spark

    check_data_dir(args.data_dir)
    target = Path(args.out) / COMPACTED_DIR
    spark = get_spark(args.master)
    started = time.monotonic()
    result = compact(spark, args.data_dir, target)
    records = sum(c.records for c in result.compacted)
    err.print(
        f"compacted {len(result.compacted)} segments ({records:,} records) in "
        f"{time.monotonic() - started:.1f}s; {result.already} already compacted, "
        f"{result.pending} active segment(s) left raw -> {target}",
        highlight=False,
    )
    return 0
