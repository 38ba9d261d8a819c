"""The `lmqtt` command: serve, inspect, passwd, replay, ban, top, report, sim.

Exit codes::

    0    normal end (serve: stopped by SIGINT/SIGTERM after a graceful shutdown)
    1    runtime failure (port busy when chosen explicitly, store locked or damaged, ...)
    2    usage or settings error (bad flag, bad LMQTT_* value, bad TOML, unknown key)
    130  second SIGINT/SIGTERM while the graceful shutdown was still running

Errors are one clear line (or one per problem) on stderr, never a traceback; run with
--log-level DEBUG to have tracebacks of unexpected failures logged.

Settings: every command that reads the gateway's settings (serve, inspect, replay, report)
resolves them one way, gateway/config.py `load_settings`: its command-line flags > LMQTT_*
environment > the --config TOML file (or $LMQTT_CONFIG) > defaults, validated together, once.
The command then uses the resolved values only; nothing here reads the environment itself.

`report` and `sim` are other packages' commands, imported lazily (the gateway must never import
pyspark): `lmqtt sim ARGS` calls `sim.cli.main(ARGS)`. The fan-out report reads the gateway's
store, but analytics may not import the gateway, so the settings cross as plain arguments:
`lmqtt report` takes --config and the store flags (STORE_FLAGS) off its arguments, resolves
them as above and calls `analytics.cli.main(REST, data_dir=..., store=..., namesrv=...,
rocketmq_topic=..., rocketmq_broker=...)`, where they are the defaults of analytics' own flags
(`python -m analytics` has those flags and built-in defaults only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.config import DEFAULT_PORT, GatewaySettings, SettingsError, load_settings
from gateway.logs import configure_logging
from gateway.ops.ban_command import add_ban_parser, run_ban

__all__ = ["main"]

log = logging.getLogger("lmqtt.cli")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_FORCED = 130

# The settings naming the gateway's store: flags of `replay` and `report`, handed to analytics.
STORE_FLAGS = ("data_dir", "store", "namesrv", "rocketmq_topic", "rocketmq_broker")

# name -> (module, what to install when it is missing)
SUBTOOLS: dict[str, tuple[str, str]] = {
    "report": ("analytics.cli", "pip install 'lmqtt[analytics]' (PySpark, pyarrow, pandas)"),
    "sim": ("sim.cli", "pip install 'lmqtt[sim]' (amqtt)"),
}


def _err(message: str) -> None:
    print(f"lmqtt: {message}", file=sys.stderr, flush=True)


def _shown_dir(path: Path) -> str:
    text = str(path)
    return text if path.is_absolute() or text.startswith(".") else f"./{text}"


def _load(config: Path | None, **flags: Any) -> GatewaySettings | None:
    """The settings (see the module docstring), or None after printing why they are invalid.
    `flags`: the command's flags by setting name, None when not given."""
    try:
        return load_settings(config, **flags)
    except SettingsError as exc:
        _err(str(exc))
        return None


# ---------------------------------------------------------------- argument parsing


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmqtt",
        description="MQTT 3.1.1/5.0 gateway on a CommitLog with light message queues.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the MQTT gateway. Every option is also an LMQTT_<NAME> environment "
        "variable and a key of the --config TOML file (command line > environment > file).",
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--port",
        type=int,
        help=f"TCP port (default {DEFAULT_PORT}, or a free port if it is taken; 0 = any free port)",
    )
    serve.add_argument("--data-dir", type=Path, metavar="DIR", help="default ./lmqtt-data")
    serve.add_argument("--flush", help="async (default) or sync: acknowledge after fsync")
    serve.add_argument(
        "--store", help="embedded (default: the CommitLog in --data-dir) or rocketmq"
    )
    serve.add_argument(
        "--namesrv", metavar="HOST:PORT", help="RocketMQ name server (with --store rocketmq)"
    )
    serve.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING (default), ...")
    serve.add_argument("--log-format", metavar="FMT", help="text (default) or json")
    serve.add_argument("--loop", dest="event_loop", help="auto (default), uvloop or asyncio")
    serve.add_argument("--sys-interval", type=float, metavar="S", help="$SYS period, 0 = off")
    serve.add_argument(
        "--password-file", type=Path, metavar="FILE", help="users (see 'lmqtt passwd')"
    )
    serve.add_argument("--acl-file", type=Path, metavar="FILE", help="Mosquitto-syntax ACL")
    serve.add_argument(
        "--admin-port", type=int, metavar="PORT", help="HTTP /metrics and /health (default off)"
    )
    serve.add_argument(
        "--no-delivery-account",
        dest="delivery_account",
        action="store_const",
        const=False,
        help="keep no delivery account (reports then count persistent sessions' deliveries only)",
    )

    inspect = sub.add_parser(
        "inspect",
        help="show a data directory's queues, offsets, sessions (read-only)",
        description="Print the store's queues, offsets and backlogs, sessions and "
        "subscriptions, without a running server. Never writes.",
    )
    _add_store_flags(inspect)  # --store rocketmq: the deployment's pending delayed messages
    inspect.add_argument("--json", action="store_true", help="machine-readable output (all rows)")
    inspect.add_argument(
        "--all", action="store_true", help="every row (default: the 50 most significant per table)"
    )

    passwd = sub.add_parser(
        "passwd",
        help="add, change or delete a user of a password file",
        description="Add or change USER in the password file FILE (created when missing), or "
        "delete USER with -D. Without -b the password is asked for twice on the terminal.",
    )
    passwd.add_argument("file", type=Path, metavar="FILE")
    passwd.add_argument("user", metavar="USER")
    passwd.add_argument("-b", dest="password", metavar="PASSWORD", help="password (batch mode)")
    passwd.add_argument("-D", dest="delete", action="store_true", help="delete USER")

    replay = sub.add_parser(
        "replay",
        help="export stored messages matching a filter from a time (offline, read-only)",
        description="Write the messages a replay subscription would deliver: those matching "
        "FILTER stored from --since (up to --until), in store order, read-only and without a "
        "running gateway. Times: 'earliest', epoch milliseconds or RFC 3339.",
    )
    _add_store_flags(replay)
    replay.add_argument("--filter", required=True, metavar="FILTER", help="MQTT topic filter")
    replay.add_argument("--since", required=True, metavar="T", help="first store time")
    replay.add_argument("--until", metavar="T", help="stop before this store time")
    replay.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    replay.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="default stdout (jsonl only)"
    )

    top = sub.add_parser(
        "top",
        help="live view of a running gateway's clients (htop-like; several nodes merged)",
        description="Per client: rates in and out over the last 10 s, subscriptions, in-flight, "
        "backlog and lag, from each node's admin API; keys choose the sort column.",
    )
    from gateway.ops import top as live_top  # rich: imported by the commands that use it

    live_top.add_arguments(top)
    add_ban_parser(sub)  # lmqtt ban (gateway/ops/ban_command.py)

    for name, (module, _) in SUBTOOLS.items():
        # Listed for --help only: main() hands their arguments over untouched.
        sub.add_parser(
            name, help=f"{name} tool ({module}); see 'lmqtt {name} --help'", add_help=False
        )
    return parser


def _add_store_flags(parser: argparse.ArgumentParser) -> None:
    """--config and the STORE_FLAGS, every one None when not given (the settings decide)."""
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    parser.add_argument("--data-dir", type=Path, metavar="DIR", help="default ./lmqtt-data")
    parser.add_argument(
        "--store",
        help="the gateway's store: its data directory (embedded, default) or a RocketMQ "
        "deployment, pulled from its broker (--namesrv, --rocketmq-topic, --rocketmq-broker)",
    )
    parser.add_argument("--namesrv", metavar="HOST:PORT", help="RocketMQ name server")
    parser.add_argument("--rocketmq-topic", metavar="T", help="the deployment's topic (lmqtt)")
    parser.add_argument("--rocketmq-broker", metavar="B", help="its home broker")


def _store_settings(args: argparse.Namespace) -> GatewaySettings | None:
    return _load(args.config, **{name: getattr(args, name) for name in STORE_FLAGS})


# ---------------------------------------------------------------- serve


def _port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails because something listens there. Mirrors asyncio's
    create_server (SO_REUSEADDR on POSIX), so a TIME_WAIT leftover does not count as busy."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return False  # let the real bind report the bad host
    for family, socktype, proto, _, addr in infos:
        with socket.socket(family, socktype, proto) as probe:
            if os.name == "posix":
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def _resolve_port(settings: GatewaySettings) -> tuple[GatewaySettings, bool]:
    """Apply the 'default port, or a free one' rule; returns (settings, fell_back)."""
    if settings.port is not None:
        return settings, False
    if _port_in_use(settings.host, DEFAULT_PORT):
        return settings.model_copy(update={"port": 0}), True
    return settings.model_copy(update={"port": DEFAULT_PORT}), False


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """None = asyncio's default loop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:  # Windows, or a minimal install: the standard loop works too
        if choice == "uvloop":
            raise SettingsError(
                "event_loop: uvloop is not installed (pip install uvloop, or use asyncio)"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def _serve(settings: GatewaySettings, fell_back: bool) -> int:
    from gateway.app import Gateway

    gateway = Gateway(settings)
    await gateway.start()
    # Everything allocated so far (modules, settings, the recovered store's tables) lives as
    # long as the process: move it out of the collector's generations, so a collection only
    # walks what traffic allocated and its pauses of the event loop stay short.
    gc.collect()
    gc.freeze()
    if fell_back:
        log.warning(
            "port %d is in use on %s; listening on free port %d instead",
            DEFAULT_PORT,
            settings.host,
            gateway.port,
        )
        _err(
            f"port {DEFAULT_PORT} is in use; listening on free port {gateway.port} instead"
            " (pass --port to choose one)"
        )
    print(
        f"lmqtt listening on {settings.host}:{gateway.port},"
        f" data in {_shown_dir(settings.data_dir)}",
        flush=True,
    )
    extra = gateway.listeners
    for name in sorted(extra.servers):
        print(f"lmqtt {name} listening on {settings.host}:{extra.port(name)}", flush=True)
    if extra.admin is not None:
        print(
            f"lmqtt admin (/metrics, /health) on {settings.admin_host}:{extra.admin.port}",
            flush=True,
        )
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stopping.is_set():
            # The operator insists: the store's recovery handles an unclean end.
            _err(f"{signal.Signals(signum).name} again: exiting without finishing shutdown")
            os._exit(EXIT_FORCED)
        log.warning("%s received: shutting down", signal.Signals(signum).name)
        stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, on_signal, signum)
        except (NotImplementedError, RuntimeError):  # non-POSIX loops
            signal.signal(signum, lambda s, _f: loop.call_soon_threadsafe(on_signal, s))
    if hasattr(signal, "SIGHUP"):
        # Re-read password and ACL files; connections stay open (Mosquitto's SIGHUP).
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(
                signal.SIGHUP, lambda: gateway.access.reload(list(gateway.connections))
            )

    serving = asyncio.ensure_future(gateway.serve_forever())
    stop_wait = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({serving, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
        await gateway.stop()
        if not serving.done():
            serving.cancel()
        try:
            await serving
        except asyncio.CancelledError:
            pass
    if gateway.fenced:
        _err("stopped: this node's cluster lease ran out (fenced); start it again")
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_serve(args: argparse.Namespace) -> int:
    settings = _load(
        args.config,
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        flush=args.flush,
        store=args.store,
        namesrv=args.namesrv,
        log_level=args.log_level,
        log_format=args.log_format,
        sys_interval=args.sys_interval,
        password_file=args.password_file,
        acl_file=args.acl_file,
        admin_port=args.admin_port,
        event_loop=args.event_loop,
        delivery_account=args.delivery_account,
    )
    if settings is None:
        return EXIT_USAGE
    configure_logging(settings.log_level, settings.log_format)
    try:
        loop_factory = _loop_factory(settings.event_loop)
    except SettingsError as exc:
        _err(str(exc))
        return EXIT_USAGE
    settings, fell_back = _resolve_port(settings)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve(settings, fell_back))
    except KeyboardInterrupt:  # SIGINT before the handlers were installed
        return EXIT_OK
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            _err(f"cannot listen on {settings.host}:{settings.port}: address already in use")
        else:
            _err(f"cannot start: {exc}")
        log.debug("start failure", exc_info=True)
        return EXIT_FAILURE
    except ImportError as exc:
        _err(f"the gateway core is not installed correctly: {exc}")
        return EXIT_FAILURE
    except SettingsError as exc:  # security files, TLS certificates, anonymous-access rule
        _err(str(exc))
        return EXIT_USAGE
    except Exception as exc:
        from gateway.storage.port import StorageUnavailable, StoreError, StoreLockedError

        if isinstance(exc, StorageUnavailable):
            log.error("cannot start: %s", exc)
            _err(f"cannot start: {exc}")
        elif isinstance(exc, StoreLockedError):
            _err(f"{exc} (is another 'lmqtt serve' using {_shown_dir(settings.data_dir)}?)")
        elif isinstance(exc, StoreError):  # operator-readable already
            _err(f"data directory {_shown_dir(settings.data_dir)}: {exc}")
        else:
            _err(f"{type(exc).__name__}: {exc}")
        log.debug("fatal error", exc_info=True)
        return EXIT_FAILURE


# ---------------------------------------------------------------- inspect


def _cmd_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gateway.ops.inspection import (
        InspectError,
        inspect_data_dir,
        inspect_rocketmq,
        render_json,
        render_text,
    )

    settings = _store_settings(args)
    if settings is None:
        return EXIT_USAGE
    try:
        if settings.store == "rocketmq":
            assert settings.namesrv is not None  # the settings require it with store = rocketmq
            report = inspect_rocketmq(
                settings.namesrv, settings.rocketmq_topic, settings.rocketmq_broker
            )
        else:
            report = inspect_data_dir(settings.data_dir)
    except InspectError as exc:
        _err(str(exc))
        return EXIT_FAILURE
    if args.json:
        print(render_json(report), flush=True)
    else:
        console = Console(width=None if sys.stdout.isatty() else 160)
        render_text(report, console, limit=None if args.all else 50)
    return EXIT_OK


# ---------------------------------------------------------------- passwd


def _cmd_passwd(args: argparse.Namespace) -> int:
    import getpass

    from gateway.access.auth import PasswordFile, SecurityError

    path: Path = args.file
    try:
        users = PasswordFile.load(path) if path.exists() else PasswordFile(path=path)
    except SecurityError as exc:
        _err(str(exc))
        return EXIT_FAILURE
    if args.delete:
        if args.password is not None:
            _err("-D and -b cannot be combined")
            return EXIT_USAGE
        if not users.delete(args.user):
            _err(f"user {args.user!r} is not in {path}")
            return EXIT_FAILURE
    else:
        password = args.password
        if password is None:
            try:
                password = getpass.getpass("Password: ")
                again = getpass.getpass("Reenter password: ")
            except (EOFError, KeyboardInterrupt):
                _err("no password given")
                return EXIT_USAGE
            if password != again:
                _err("passwords do not match")
                return EXIT_USAGE
        if not password:
            _err("empty passwords are not allowed")
            return EXIT_USAGE
        try:
            users.set(args.user, password)
        except ValueError as exc:
            _err(str(exc))
            return EXIT_USAGE
    try:
        users.save(path)
    except OSError as exc:
        _err(f"cannot write {path}: {exc.strerror or exc}")
        return EXIT_FAILURE
    return EXIT_OK


# ---------------------------------------------------------------- replay


def _cmd_replay(args: argparse.Namespace) -> int:
    from gateway.ops.replay_export import (
        open_rocketmq_history,
        open_store,
        replay_rows,
        write_jsonl,
        write_parquet,
    )
    from gateway.protocol import ReasonCode
    from gateway.storage.port import StoreError
    from topicmap import TopicError, TopicFilter, parse_replay_from

    try:
        tf = TopicFilter(args.filter)
        if tf.is_shared:
            raise TopicError(
                "a shared subscription cannot be replayed",
                reason_code=ReasonCode.TOPIC_FILTER_INVALID,
            )
        since = parse_replay_from(args.since)
        until = parse_replay_from(args.until) if args.until is not None else None
    except TopicError as exc:
        _err(str(exc))
        return EXIT_USAGE
    if args.format == "parquet" and args.output is None:
        _err("--format parquet needs --output FILE")
        return EXIT_USAGE
    settings = _store_settings(args)
    if settings is None:
        return EXIT_USAGE
    if settings.store == "rocketmq":
        from rocketmq_remoting import RemotingError

        namesrv = settings.namesrv
        assert namesrv is not None  # the settings require it with store = rocketmq
        try:
            store = open_rocketmq_history(
                namesrv, settings.rocketmq_topic, settings.rocketmq_broker
            )
        except RemotingError as exc:
            _err(f"RocketMQ name server {namesrv}: {exc}")
            return EXIT_FAILURE
    else:
        data_dir = settings.data_dir
        if not (data_dir / "commitlog").is_dir():
            _err(f"{_shown_dir(data_dir)} is not an lmqtt data directory (no commitlog/)")
            return EXIT_FAILURE
        try:
            store = open_store(data_dir)
        except StoreError as exc:
            _err(f"data directory {_shown_dir(data_dir)}: {exc}")
            return EXIT_FAILURE
    try:
        rows, note = replay_rows(store, tf, since, until, args.since)
        if note is not None:
            _err(f"note: {note}")
        if args.format == "parquet":
            n = write_parquet(rows, args.output)
        elif args.output is None:
            n = write_jsonl(rows, sys.stdout)
            sys.stdout.flush()
        else:
            with args.output.open("w", encoding="utf-8") as out:
                n = write_jsonl(rows, out)
    except ModuleNotFoundError as exc:
        _err(f"--format parquet needs {exc.name}: pip install 'lmqtt[analytics]'")
        return EXIT_FAILURE
    except OSError as exc:
        _err(f"cannot write {args.output}: {exc.strerror or exc}")
        return EXIT_FAILURE
    finally:
        store.close()
    print(f"lmqtt: {n} messages exported", file=sys.stderr, flush=True)
    return EXIT_OK


# ---------------------------------------------------------------- sub-tools


def _report(argv: list[str]) -> int:
    """`lmqtt report`: analytics' command, handed the store's settings (module docstring)."""
    flags = argparse.ArgumentParser(prog="lmqtt report", add_help=False, allow_abbrev=False)
    _add_store_flags(flags)
    args, rest = flags.parse_known_args(argv)  # exits 2 with usage on a flag without value
    settings = _store_settings(args)
    if settings is None:
        return EXIT_USAGE
    return _run_subtool(
        "report",
        rest,
        # A data directory nobody configured is none of a RocketMQ deployment's report (it
        # then reads no local delivery account); the embedded store's is analytics' default.
        data_dir=str(settings.data_dir) if "data_dir" in settings.model_fields_set else None,
        store=settings.store,
        namesrv=settings.namesrv,
        rocketmq_topic=settings.rocketmq_topic,
        rocketmq_broker=settings.rocketmq_broker,
    )


def _run_subtool(name: str, argv: list[str], **settings: str | None) -> int:
    """The sub-tool's main(argv, **settings)."""
    module_name, install_hint = SUBTOOLS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            _err(f"'lmqtt {name}' is not available in this installation ({module_name} is missing)")
        else:  # the tool is there, one of its dependencies is not
            _err(f"'lmqtt {name}' needs the {missing} package: {install_hint}")
        return EXIT_FAILURE
    entry: Any = getattr(module, "main", None)
    if not callable(entry):
        _err(f"'lmqtt {name}' is not available: {module_name} has no main()")
        return EXIT_FAILURE
    result = entry(argv, **settings)
    return int(result) if isinstance(result, int) else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "report":
        return _report(args_list[1:])
    if args_list and args_list[0] in SUBTOOLS:
        return _run_subtool(args_list[0], args_list[1:])
    args = _parser().parse_args(args_list)  # exits 2 with usage on bad arguments
    if args.command == "serve":
        return _cmd_serve(args)
    if args.command == "inspect":
        return _cmd_inspect(args)
    if args.command == "passwd":
        return _cmd_passwd(args)
    if args.command == "replay":
        return _cmd_replay(args)
    if args.command == "top":
        from gateway.ops import top as live_top

        return live_top.main(args)
    if args.command == "ban":
        return run_ban(args)
    return EXIT_USAGE  # pragma: no cover - argparse requires a known command
