"""`lmqtt ban`: add, list and remove bans on a running gateway, through its admin API
(gateway/ops/ban_routes.py; where the gateway is and how to authenticate:
gateway/ops/admin_client.py).

    lmqtt ban add --client-id dev-42 --for 1h --reason "firmware loop"
    lmqtt ban add --address 10.9.0.0/16
    lmqtt ban list [--json]
    lmqtt ban remove --client-id dev-42

Exit codes: 0 done, 1 the gateway refused (the message says why: a malformed CIDR, an empty
id, a duration of 0, no such ban) or could not be reached, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from typing import Any

from gateway.ops.admin_client import AdminClientError, add_admin_flags, client_from_args

__all__ = ["add_ban_parser", "run_ban"]

TARGETS = (("--client-id", "client_id"), ("--username", "username"), ("--address", "address"))


def _target_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--client-id", dest="client_id", metavar="ID", help="a client id")
    group.add_argument("--username", metavar="USER", help="a user name")
    group.add_argument("--address", metavar="CIDR", help="an address or CIDR, e.g. 10.1.2.0/24")


def add_ban_parser(sub: Any) -> None:
    """The `ban` sub-command on the `lmqtt` parser's subparsers."""
    ban = sub.add_parser(
        "ban",
        help="add, list or remove bans on a running gateway (admin API)",
        description="Ban client ids, user names or source addresses on a running gateway "
        "through its admin API. A banned client's CONNECT is refused (MQTT 5: 0x8A Banned; "
        "3.1.1: 0x05), a connected one is closed; bans are durable and cluster-wide.",
    )
    actions = ban.add_subparsers(dest="ban_action", metavar="ACTION")
    actions.required = True
    add = actions.add_parser("add", help="ban a client id, user name or address")
    _target_flags(add)
    add.add_argument("--for", dest="duration", metavar="DURATION", help="e.g. 90s, 5m, 2h, 1d")
    add.add_argument("--reason", default="", metavar="TEXT", help="shown by 'lmqtt ban list'")
    add_admin_flags(add)
    listed = actions.add_parser("list", help="the bans in force")
    listed.add_argument("--json", action="store_true", help="machine-readable output")
    add_admin_flags(listed)
    remove = actions.add_parser("remove", help="lift a ban")
    _target_flags(remove)
    add_admin_flags(remove)


def _target(args: argparse.Namespace) -> tuple[str, str]:
    for _flag, kind in TARGETS:
        value = getattr(args, kind, None)
        if value is not None:
            return kind, value
    raise AdminClientError(0, "name one of --client-id, --username, --address")


def _ends(ban: dict[str, Any]) -> str:
    remaining = ban.get("remaining_s")
    if remaining is None:
        return "never"
    until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ban["until_ms"] / 1000))
    return f"{until} (in {int(remaining)} s)"


def _table(bans: list[dict[str, Any]]) -> str:
    rows = [("KIND", "VALUE", "SOURCE", "ENDS", "REASON")]
    rows += [(b["kind"], b["value"], b["source"], _ends(b), b["reason"]) for b in bans]
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
        for r in rows
    )


def run_ban(args: argparse.Namespace) -> int:
    try:
        client = client_from_args(args)
        if args.ban_action == "list":
            bans = client.get("/api/bans")["bans"]
            print(json.dumps(bans, indent=2) if args.json else _table(bans))
            return 0
        kind, value = _target(args)
        if args.ban_action == "add":
            body: dict[str, Any] = {kind: value, "reason": args.reason}
            if args.duration is not None:
                body["for"] = args.duration
            ban = client.post("/api/bans", body)["ban"]
            print(f"banned {ban['kind']} {ban['value']} until {_ends(ban)}")
            return 0
        path = f"/api/bans/{kind}/{urllib.parse.quote(value, safe='')}"
        ban = client.delete(path)["removed"]
        print(f"ban lifted: {ban['kind']} {ban['value']}")
        return 0
    except AdminClientError as exc:
        print(f"lmqtt ban: {exc}", file=sys.stderr, flush=True)
        return 1
