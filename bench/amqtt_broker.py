"""Run amqtt's broker (the pinned PyPI release) on 127.0.0.1:PORT in its own process.

``python -m bench.amqtt_broker PORT``. Only the anonymous-auth plugin is loaded: the packet and
event logger plugins and $SYS would cost amqtt time that a tuned deployment would not spend.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from amqtt.broker import Broker


async def serve(port: int) -> None:
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    broker = Broker(config)
    await broker.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    await stopped.wait()
    await broker.shutdown()


def main() -> None:
    # Warnings too: amqtt logs a delivery it gave up on (no PUBACK in 5 s) as one.
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
