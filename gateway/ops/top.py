"""`lmqtt top`: the live view of one or more gateways' clients in the terminal, like htop.

    lmqtt top --admin http://10.0.0.1:9100 --admin http://10.0.0.2:9100 --token-file admin.token

Each second it asks every node for `/api/clients` (each answers for the clients connected to
it) and `/api/slow-subscriptions`, merges the rows and shows the top `--limit` by the sort key.
Keys (shown under the table) choose the sort column; q quits. `--once` prints one table and
exits (for scripts). A node that cannot be reached is named under the table; the others are
still shown.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import select
import sys
import termios
import time
import tty
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Group

    from gateway.ops.admin_client import AdminClient

# rich and the HTTP client are imported by the functions that use them: `lmqtt` builds this
# command's parser for every command, `lmqtt serve` included.

__all__ = ["add_arguments", "main"]

# Keys and the columns they sort by: (key, row field, header).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("c", "client_id", "CLIENT"),
    ("", "address", "ADDRESS"),
    ("", "protocol", "MQTT"),
    ("a", "connected_s", "UP"),
    ("i", "msgs_in_rate", "IN/s"),
    ("o", "msgs_out_rate", "OUT/s"),
    ("I", "bytes_in_rate", "IN B/s"),
    ("O", "bytes_out_rate", "OUT B/s"),
    ("s", "subscriptions", "SUBS"),
    ("f", "inflight", "INFL"),
    ("b", "backlog", "BACKLOG"),
    ("l", "backlog_s", "LAG s"),
    ("u", "oldest_unacked_s", "UNACK s"),
)
KEYS = {key: name for key, name, _ in COLUMNS if key}
# What --sort accepts (the server's /api/clients accepts these and a few more).
SORT_KEYS = tuple(name for _, name, _ in COLUMNS)
ASCENDING = frozenset({"client_id", "address", "protocol"})
SLOW_SHOWN = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin",
        action="append",
        metavar="URL",
        help="a gateway's admin listener, e.g. http://127.0.0.1:9100; repeat for every node "
        "of a cluster (default: admin_host and admin_port of the settings)",
    )
    parser.add_argument(
        "--token-file", type=Path, metavar="FILE", help="file holding the admin token"
    )
    parser.add_argument(
        "--user",
        metavar="USER",
        help="HTTP basic auth as USER of the password file ($LMQTT_ADMIN_PASSWORD or asked)",
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="the gateway's settings")
    parser.add_argument(
        "--sort", default="msgs_in_rate", choices=SORT_KEYS, help="the column to sort by"
    )
    parser.add_argument("--limit", type=int, default=50, help="clients shown (default 50)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one table and exit")


@dataclass
class Node:
    """One gateway's admin API and what it said last."""

    client: AdminClient
    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    slow: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def fetch(self, limit: int, sort: str) -> None:
        from gateway.ops.admin_client import AdminClientError

        try:
            got = self.client.get("/api/clients", {"sort": sort, "limit": str(limit)})
            slow = self.client.get("/api/slow-subscriptions", {"limit": str(SLOW_SHOWN)})
        except AdminClientError as exc:
            self.error = str(exc)
            return
        self.error = None
        self.rows = [{**row, "node": self.name} for row in got["clients"]]
        self.slow = [{**s, "node": self.name} for s in slow["by_ack_lag"]]


def _sorted(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    def value(row: dict[str, Any]) -> Any:
        v = row.get(key)
        return "" if v is None else v

    return sorted(rows, key=value, reverse=key not in ASCENDING)


def _number(value: float, unit: str = "") -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}{suffix}{unit}"
    return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def _cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "connected_s":
        return _duration(float(value))
    if name in ("backlog_s", "oldest_unacked_s"):
        return f"{float(value):.1f}" if value else "0"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _number(float(value))
    return str(value)


def render(nodes: list[Node], sort: str, limit: int) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    many = len(nodes) > 1
    rows = _sorted([r for n in nodes for r in n.rows], sort)[:limit]
    total = sum(len(n.rows) for n in nodes)
    table = Table(
        title=f"lmqtt top: {total} clients on {len(nodes)} node(s), sorted by {sort}",
        expand=True,
        show_edge=False,
        pad_edge=False,
    )
    if many:
        table.add_column("NODE", no_wrap=True)
    for _, name, header in COLUMNS:
        shown = header + (" v" if name == sort and name not in ASCENDING else "")
        shown = shown + (" ^" if name == sort and name in ASCENDING else "")
        numeric = name not in ASCENDING
        table.add_column(
            shown,
            justify="right" if numeric else "left",
            no_wrap=True,
            style="bold" if name == sort else None,
        )
    for row in rows:
        cells = [_cell(name, row.get(name)) for _, name, _ in COLUMNS]
        table.add_row(*([row["node"]] if many else []), *cells)
    parts: list[Any] = [table]
    slow = sorted((s for n in nodes for s in n.slow), key=lambda s: -s["ack_lag_s"])
    if slow:
        slow_table = Table(title="slowest to acknowledge", show_edge=False, pad_edge=False)
        for header in ("CLIENT", "FILTER", "UNACK s", "LAG s", "BACKLOG"):
            slow_table.add_column(header, no_wrap=True)
        for s in slow[:SLOW_SHOWN]:
            slow_table.add_row(
                s["client_id"], s["topic_filter"], f"{s['ack_lag_s']:.1f}",
                f"{s['delivery_lag_s']:.1f}", str(s["backlog"]),
            )  # fmt: skip
        parts.append(slow_table)
    keys = "  ".join(f"[{k}] {name}" for k, name in KEYS.items())
    parts.append(Text(f"sort: {keys}  [q] quit", style="dim"))
    for n in nodes:
        if n.error is not None:
            parts.append(Text(f"{n.name}: {n.error}", style="red"))
    return Group(*parts)


@contextlib.contextmanager
def _keys_unbuffered() -> Iterator[int | None]:
    """stdin's descriptor in cbreak mode (keys arrive one by one, unechoed), None when it is
    not a terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _read_key(fd: int | None, timeout: float) -> str | None:
    """A key pressed within `timeout` seconds, or None."""
    if fd is None:
        time.sleep(timeout)
        return None
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return None
    data = os.read(fd, 16)
    return data.decode(errors="replace")[:1] if data else "q"


def _nodes(args: argparse.Namespace) -> list[Node]:
    from gateway.ops.admin_client import client_from_args

    nodes = []
    for url in args.admin or [None]:
        one = copy.copy(args)
        one.admin = url
        client = client_from_args(one)
        name = urllib.parse.urlsplit(client.base_url).netloc or client.base_url
        nodes.append(Node(client, name))
    return nodes


def main(args: argparse.Namespace) -> int:
    """`lmqtt top`; returns the exit status (2: bad arguments; 1: no node answered --once)."""
    from rich.console import Console
    from rich.live import Live

    from gateway.ops.admin_client import AdminClientError

    console = Console()
    if args.limit < 1:
        console.print("lmqtt top: --limit must be at least 1", style="red")
        return 2
    try:
        nodes = _nodes(args)
    except AdminClientError as exc:
        print(f"lmqtt: {exc}", file=sys.stderr)
        return 2
    sort = args.sort
    if args.once:
        for node in nodes:
            node.fetch(args.limit, sort)
        console.print(render(nodes, sort, args.limit))
        return 1 if all(n.error is not None for n in nodes) else 0
    with (
        contextlib.suppress(KeyboardInterrupt),
        _keys_unbuffered() as fd,
        Live(console=console, screen=True, auto_refresh=False) as live,
    ):
        while True:
            for node in nodes:
                node.fetch(args.limit, sort)
            live.update(render(nodes, sort, args.limit), refresh=True)
            deadline = time.monotonic() + args.interval
            while (left := deadline - time.monotonic()) > 0:
                key = _read_key(fd, left)
                if key is None:
                    continue
                if key in ("q", "\x03"):
                    return 0
                if key in KEYS:
                    sort = KEYS[key]
                    live.update(render(nodes, sort, args.limit), refresh=True)
                    break
    return 0
