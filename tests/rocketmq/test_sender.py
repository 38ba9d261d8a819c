"""The gateway's RocketMQ sender (gateway/storage/rocketmq/sender.py) against a real broker.

A batch on an open connection goes as frames from the sender's template (binary header) with
callbacks, no coroutine per message: the broker must store and index those exactly as it does
the coroutine path's sends. A batch whose connection drops is sent again on a new connection,
in order, later sends behind it; with no resends (`resend_s` 0) it fails whole.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.storage.port import EncodedMessage, StoreError
from gateway.storage.rocketmq.broker import Broker
from gateway.storage.rocketmq.sender import Sender
from rocketmq_remoting import RemotingClient
from rocketmq_remoting.admin import create_topic
from tests.rocketmq.cluster import RocketMQCluster
from topicmap.rocketmq import EMPTY_BODY_PROPERTY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class Counted:
    """The sender's SendCounter: what it was told."""

    def __init__(self) -> None:
        self.sending_calls = 0
        self.offsets: list[int | None] = []

    def sending(self) -> None:
        self.sending_calls += 1

    def sent(self, queue_offset: int | None) -> None:
        self.offsets.append(queue_offset)


@pytest.fixture
async def client(rocketmq: RocketMQCluster) -> AsyncIterator[RemotingClient]:
    async with rocketmq.client(request_timeout=5.0) as c:
        yield c


async def _sender(
    client: RemotingClient, rocketmq: RocketMQCluster, resend_s: float = 30.0
) -> tuple[Sender, Counted]:
    addr = rocketmq.brokers["broker-a"]
    topic = f"lmqtt-send-{uuid.uuid4().hex[:10]}"
    await create_topic(client, addr, topic, queues=1)
    counted = Counted()
    broker = Broker(client, "broker-a", addr, topic, resend_s=resend_s)
    return Sender(broker, counted, sync=False), counted


async def test_frame_batches_are_stored_and_indexed_like_coroutine_sends(
    client: RemotingClient, rocketmq: RocketMQCluster
) -> None:
    sender, counted = await _sender(client, rocketmq)
    broker = sender._broker
    block = b"mqtt.topic\x01t\xc3\xb6/a\x02"
    # The first batch opens the connection (coroutine path); the next ones go as frames.
    await sender.wait_durable(sender.send_batch([("p", ("a/x",), b"first", block)]))
    conn = client.open_broker_connection(broker.addr)
    assert conn is not None
    batch: list[EncodedMessage] = [("p", ("a/x", "a/y"), f"m{i}".encode(), block) for i in range(5)]
    batch.append(("p", ("a/y",), b"", block))  # an empty payload (a retained deletion)
    ticket = sender.send_batch(batch)
    assert conn.in_flight == len(batch)  # written now, each waiting on its callback
    await sender.wait_durable(ticket)
    assert counted.sending_calls == 7 and counted.offsets == list(range(7))
    assert not sender.in_flight_sends() and not sender.in_flight()

    lmq_x, lmq_y = broker.names.lmq("a/x"), broker.names.lmq("a/y")
    got: list = []
    offset = 0
    while len(got) < 6:
        res = await client.pull(broker.addr, lmq_y, offset, consumer_group="%LMQ%t")
        got += res.messages
        offset = res.next_begin_offset
        if not res.messages:
            await asyncio.sleep(0.05)
    assert [m.body for m in got] == [b"m0", b"m1", b"m2", b"m3", b"m4", b"\x00"]
    for i, m in enumerate(got[:5]):
        assert m.light_queue_offsets() == {lmq_x: 1 + i, lmq_y: i}
        assert m.properties["WAIT"] == "false" and m.properties["mqtt.topic"] == "tö/a"
        assert m.queue_offset == 1 + i
    assert got[5].properties[EMPTY_BODY_PROPERTY] == "1"
    assert sender.log_max == got[-1].commitlog_offset + 1


async def test_a_frame_batch_whose_connection_drops_is_sent_again_in_order(
    client: RemotingClient, rocketmq: RocketMQCluster
) -> None:
    # The frames are written, then the connection is gone before any answer: stored or not
    # (close_nowait writes what is queued first), each is sent again on a new connection, one
    # at a time in order, and a batch made meanwhile goes after them, not on the frame path.
    sender, counted = await _sender(client, rocketmq)
    broker = sender._broker
    await sender.wait_durable(sender.send_batch([("p", ("a/x",), b"first", b"")]))
    conn = client.open_broker_connection(broker.addr)
    assert conn is not None
    ticket = sender.send_batch([("p", ("a/x",), f"m{i}".encode(), b"") for i in range(3)])
    assert conn.in_flight == 3
    conn.close_nowait()
    later = sender.send_batch([("p", ("a/x",), b"later", b"")])
    # Settling (cluster mode's filter registration) waits for the later batch too, though it
    # waits behind the resends: it was made before.
    await asyncio.wait_for(asyncio.ensure_future(sender.settle()), 30)
    assert not sender.in_flight()
    await asyncio.wait_for(sender.wait_durable(ticket), 30)
    await asyncio.wait_for(sender.wait_durable(later), 30)
    assert len(counted.offsets) == 5 and None not in counted.offsets
    assert not sender.in_flight_sends() and not sender.in_flight()

    lmq = broker.names.lmq("a/x")
    bodies: list[bytes] = []
    offset = 0
    while b"later" not in bodies:  # dispatch to the light queue follows SEND_OK
        res = await client.pull(broker.addr, lmq, offset, consumer_group="%LMQ%t")
        bodies += [m.body for m in res.messages]
        offset = res.next_begin_offset
        if not res.messages:
            await asyncio.sleep(0.05)
    # The copies sent again and the later batch last, in order; before them "first", and
    # whatever of the dropped frames the broker had read (a copy each at most).
    assert bodies[0] == b"first" and bodies[-4:] == [b"m0", b"m1", b"m2", b"later"]
    assert bodies[1:-4] in ([], [b"m0"], [b"m0", b"m1"], [b"m0", b"m1", b"m2"])


async def test_a_frame_batch_whose_connection_drops_fails_whole_without_resends(
    client: RemotingClient, rocketmq: RocketMQCluster
) -> None:
    # `resend_s` 0: stored or not, nothing is acknowledged; the batch's ticket fails (the
    # publishes go to the retry path), and every send is told answered (None: no offset).
    sender, counted = await _sender(client, rocketmq, resend_s=0)
    await sender.wait_durable(sender.send_batch([("p", ("a/x",), b"first", b"")]))
    conn = client.open_broker_connection(sender._broker.addr)
    assert conn is not None
    ticket = sender.send_batch([("p", ("a/x",), f"m{i}".encode(), b"") for i in range(3)])
    assert conn.in_flight == 3
    conn.close_nowait()
    with pytest.raises(StoreError, match="broker-a"):
        await asyncio.wait_for(sender.wait_durable(ticket), 30)
    assert counted.offsets == [0, None, None, None]
    assert not sender.in_flight_sends()
    # The next batch reconnects (coroutine path) and is stored.
    await sender.wait_durable(sender.send_batch([("p", ("a/x",), b"again", b"")]))
    assert counted.offsets[-1] is not None
