"""The floor of the sessions bench: a bare uvloop protocol that answers its exchange and
nothing else.

``python -m bench.session_floor PORT`` serves on 127.0.0.1:PORT: a CONNECT gets a CONNACK
(accepted, no session present), a SUBSCRIBE a SUBACK granting the QoS asked, a DISCONNECT
closes the connection. No session, no record, no checks: what a broker on uvloop costs per
session before it does any of its own work (accept, three reads, two writes, close).
``python -m bench.sessions_bench create --brokers session-floor lmqtt`` prints both, and the
CPU per session lmqtt spends above it.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from bench import wire

__all__ = ["FloorProtocol", "serve"]

_CONNACK = bytes([wire.CONNACK << 4, 2, 0, 0])


class FloorProtocol(asyncio.Protocol):
    """One connection of the floor: answers CONNECT, SUBSCRIBE and DISCONNECT."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        self.buf += data
        packets, used = wire.split_packets(self.buf)
        self.buf = self.buf[used:]
        for first, body in packets:
            kind = first >> 4
            if kind == wire.CONNECT:
                transport.write(_CONNACK)
            elif kind == wire.SUBSCRIBE:
                # The packet id, then (filter, options) pairs: one granted QoS per filter.
                codes = bytearray()
                pos = 2
                while pos < len(body):
                    pos += 2 + int.from_bytes(body[pos : pos + 2], "big")
                    codes.append(body[pos] & 0x03)
                    pos += 1
                suback = bytes(body[:2]) + codes
                transport.write(
                    bytes([wire.SUBACK << 4]) + wire.encode_varint(len(suback)) + suback
                )
            elif kind == wire.DISCONNECT:
                transport.close()
                return


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FloorProtocol, "127.0.0.1", port)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set_result, None)
    async with server:
        await stop


if __name__ == "__main__":
    import uvloop

    uvloop.run(serve(int(sys.argv[1])))
