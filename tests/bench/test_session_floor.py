"""The sessions bench's floor answers the bench's exchange as a broker would."""

from __future__ import annotations

import asyncio
import functools

from bench.session_floor import FloorProtocol
from bench.sessions_bench import _Exchange


def test_the_floor_completes_the_session_exchange() -> None:
    async def run() -> int:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(FloorProtocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            for n in range(3):  # one after another, as a bench client creates them
                done: asyncio.Future[None] = loop.create_future()
                exchange = functools.partial(_Exchange, n, done)
                await loop.create_connection(exchange, "127.0.0.1", port)
                # CONNACK, SUBACK granting QoS 1, then the floor's close after DISCONNECT.
                await asyncio.wait_for(done, 10)
        return n + 1

    assert asyncio.run(run()) == 3
