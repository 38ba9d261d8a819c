"""The RocketMQ sender's frame batches whose answers do not come in time
(gateway/storage/rocketmq/sender.py, `_Batch`): each expires on its own, is sent again as long
as a broker away is (`Broker.resend_s`, RESEND_S here), then fails its ticket whole, and a
batch answered in time is left alone; a single send (not to be stored twice) is not sent
again. A broker that stays silent on
request cannot be had, so the peer here is a scripted one: a real asyncio server on 127.0.0.1
port 0 speaking the remoting frame format (the real broker: tests/rocketmq/test_sender.py)."""

from __future__ import annotations

import asyncio
import struct

import pytest

from gateway.storage.port import StoreError
from gateway.storage.rocketmq.broker import Broker
from gateway.storage.rocketmq.sender import Sender
from rocketmq_remoting import RemotingClient, RemotingCommand, decode_frame
from rocketmq_remoting.codes import FLAG_RESPONSE

TIMEOUT = 0.3  # the client's request timeout: the silent peer's sends expire after it
RESEND_S = 1.0  # how long an expired send is sent again (each attempt expiring in turn)


class Counted:
    """The sender's SendCounter: the offsets it was told."""

    def __init__(self) -> None:
        self.offsets: list[int | None] = []

    def sending(self) -> None: ...

    def sent(self, queue_offset: int | None) -> None:
        self.offsets.append(queue_offset)


def stored(request: RemotingCommand, offset: int) -> bytes:
    """SEND_OK for `request`, stored at `offset` (a 5.3.3 broker's answer fields)."""
    return RemotingCommand(
        code=0,
        opaque=request.opaque,
        flag=FLAG_RESPONSE,
        ext_fields={
            "msgId": f"7F000001000052B3{1000 + offset:016X}",
            "queueId": "0",
            "queueOffset": str(offset),
        },
        language="JAVA",
    ).encode()


async def test_unanswered_frame_batches_expire_and_answered_ones_do_not() -> None:
    offsets = iter(range(100))
    received: list[bytes] = []

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers the sends whose body starts with b"ok", none of the others.
        while True:
            try:
                (length,) = struct.unpack(">i", await reader.readexactly(4))
                request = decode_frame(await reader.readexactly(length))
            except asyncio.IncompleteReadError:
                return
            received.append(request.body)
            if request.body.startswith(b"ok"):
                writer.write(stored(request, next(offsets)))

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = RemotingClient([addr], request_timeout=TIMEOUT, connect_timeout=1.0)
    counted = Counted()
    broker = Broker(client, "broker-a", addr, "parent", resend_s=RESEND_S)
    sender = Sender(broker, counted, sync=False)
    try:
        # The first batch opens the connection (coroutine path); the next ones go as frames.
        await sender.wait_durable(sender.send_batch([("p", ("a",), b"ok first", b"")]))
        assert client.open_broker_connection(addr) is not None
        silent = sender.send_batch([("p", ("a",), b"silent 1", b"")])
        answered = sender.send_batch([("p", ("a",), b"ok 1", b""), ("p", ("a",), b"ok 2", b"")])
        partly = sender.send_batch([("p", ("a",), b"ok 3", b""), ("p", ("a",), b"silent 2", b"")])
        await asyncio.wait_for(sender.wait_durable(answered), 10)
        for ticket in (silent, partly):
            with pytest.raises(StoreError, match="broker-a"):
                await asyncio.wait_for(sender.wait_durable(ticket), 10)
        assert sorted(o for o in counted.offsets if o is not None) == [0, 1, 2, 3]
        assert counted.offsets.count(None) == 2  # the two silent sends, told unanswered
        # The first expired send was sent again (the one behind it waits its turn, and the
        # bound counts from the first failure: its own attempts depend on the timing).
        assert received.count(b"silent 1") > 1
        assert received.count(b"ok 1") == 1
        assert not sender.in_flight() and not sender.in_flight_sends()
        # A batch after the expiries is expired in its turn.
        again = sender.send_batch([("p", ("a",), b"silent 3", b"")])
        with pytest.raises(StoreError, match="broker-a"):
            await asyncio.wait_for(sender.wait_durable(again), 10)
        # A single send (QoS 2, state: not to be stored twice) that may have been stored
        # fails at once, not sent again.
        with pytest.raises(StoreError, match="no answer"):
            await asyncio.wait_for(sender.send(("a",), b"silent single", b""), 10)
        assert received.count(b"silent single") == 1
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
