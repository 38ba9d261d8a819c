"""`python -m rocketmq_remoting send`: send one message to a RocketMQ topic, with user properties.

    python -m rocketmq_remoting send --namesrv HOST:9876 --topic lmqtt-in \\
        --property mqttTopic=cmd/valve-1/open --property mqttQos=1 BODY

What a RocketMQ application's producer does, from a shell: the message goes to the first
writable broker of the topic's route, queue 0; prints the broker's message id. lmqtt's inbound
topic turns such a message into an MQTT publish (docs/rocketmq-apps.md).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from rocketmq_remoting.client import RemotingClient
from rocketmq_remoting.errors import RemotingError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rocketmq_remoting")
    sub = parser.add_subparsers(dest="command", required=True)
    send = sub.add_parser("send", help="send one message to a topic")
    send.add_argument("--namesrv", required=True, help="name server, HOST:PORT")
    send.add_argument("--topic", required=True)
    send.add_argument("--group", default="rocketmq-remoting-cli", help="producer group")
    send.add_argument(
        "--property", action="append", default=[], metavar="NAME=VALUE", help="a user property"
    )
    send.add_argument("body", help="the message body (UTF-8 text)")
    return parser


async def _send(args: argparse.Namespace) -> str:
    properties = {}
    for item in args.property:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--property {item!r}: expected NAME=VALUE")
        properties[name] = value
    async with RemotingClient([args.namesrv], producer_group=args.group) as client:
        route = await client.get_route(args.topic)
        writable = route.writable_brokers()
        if not writable:
            raise RemotingError(f"topic {args.topic!r} has no writable broker")
        addr = route.master_addrs()[writable[0]]
        result = await client.send_message(
            addr, args.topic, args.body.encode(), properties=properties
        )
        return result.msg_id


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(asyncio.run(_send(args)))
    except RemotingError as exc:
        print(f"not sent: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
