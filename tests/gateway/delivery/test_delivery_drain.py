"""A subscriber behind drains in passes larger than BATCH (gateway/delivery/loop.py): a pass
over a queue with more than BATCH messages waiting reads up to what the window lets out, at most
PASS_LIMIT, so a backlog left by a long turn of the event loop drains in fewer turns; each pass
still ends, and the next runs in the next turn, after the reads of the other connections."""

from __future__ import annotations

import asyncio
import math

from gateway.connection.client import ClientConnection
from gateway.delivery.loop import BATCH, PASS_LIMIT, DeliveryLoop
from gateway.protocol import ConnAck, PubAck, Publish
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until


def _delivery(gateway: GatewayHarness, client_id: str) -> DeliveryLoop:
    gw = gateway.gw
    assert gw is not None
    conn: ClientConnection = next(c for c in gw.connections if c.client_id == client_id)
    assert conn.delivery is not None
    return conn.delivery


async def _backlog(gateway: GatewayHarness, loop: DeliveryLoop, topic: str, n: int) -> None:
    """Store `n` messages for `loop`'s subscriber with no pass in between (as if the event loop
    had been away for as long as they took to arrive), then ask for its pass."""
    gw = gateway.gw
    assert gw is not None
    loop._scheduled = True  # the arrivals mark the queue ready; no pass runs meanwhile
    try:
        for i in range(n):
            await gw.publisher.publish_internal(topic, b"%d" % i, qos=1)
    finally:
        loop._scheduled = False
    loop._last_write = -math.inf  # not paced: only the pass size is measured
    loop._busy = False
    loop._schedule()


async def _turns_until(loop: DeliveryLoop, done: int, limit: int = 10_000) -> list[int]:
    """What each turn of the event loop sent to `loop`'s subscriber until it sent `done`."""
    start = loop.sent
    per_turn: list[int] = []
    while loop.sent - start < done and len(per_turn) < limit:
        before = loop.sent
        await asyncio.sleep(0)  # one turn: the callbacks queued before this one run first
        per_turn.append(loop.sent - before)
    return per_turn


def test_a_subscriber_behind_fills_its_window_in_one_pass(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """QoS 1, nothing acknowledged: the first pass sends the whole window (100), where passes
    of BATCH took four turns (32, 32, 32, 4)."""
    sub = Client(gateway.port, "window-sub", auto_ack=False)
    clients.append(sub)
    assert sub.subscribe("window/#", 1) == [1]
    gw = gateway.gw
    assert gw is not None
    gateway.run(gw.publisher.publish_internal("window/0", b"first", qos=1))
    sub.wait_messages(1)
    loop = gateway.call(lambda: _delivery(gateway, "window-sub"))
    window = loop.window
    assert BATCH < window - 1 <= PASS_LIMIT

    async def drain() -> list[int]:
        await _backlog(gateway, loop, "window/1", 2 * window)
        return await _turns_until(loop, window - 1)

    per_turn = gateway.run(drain())
    assert per_turn[0] == window - 1, f"the first pass sent {per_turn[0]} of {window - 1}"
    wait_until(lambda: len(sub.messages) == window, what="the window's messages")


def test_a_backlog_drains_in_passes_of_the_limit_with_other_connections_read_between(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """QoS 0 (no window): 4 x PASS_LIMIT messages behind leave in four turns (32 of BATCH each);
    a publisher's PUBLISH written before the drain is read, stored and acknowledged while it is
    under way: a pass ends at its limit and the next one runs after the turn's reads."""
    sub = Client(gateway.port, "drain-sub")
    clients.append(sub)
    assert sub.subscribe("drain/#", 0) == [0]
    gw = gateway.gw
    assert gw is not None
    gateway.run(gw.publisher.publish_internal("drain/0", b"first", qos=0))
    sub.wait_messages(1)
    loop = gateway.call(lambda: _delivery(gateway, "drain-sub"))
    device = RawClient(gateway.port)
    try:
        assert isinstance(device.connect("drain-device"), ConnAck)
        n = 4 * PASS_LIMIT

        async def drain() -> tuple[list[int], int | None]:
            await _backlog(gateway, loop, "drain/1", n)
            received = gw.stats.messages_received
            device.send(Publish(topic="other/1", payload=b"x", qos=1, packet_id=7))
            start = loop.sent
            per_turn: list[int] = []
            stored_at: int | None = None
            while loop.sent - start < n and len(per_turn) < 10_000:
                before = loop.sent
                await asyncio.sleep(0)
                per_turn.append(loop.sent - before)
                if stored_at is None and gw.stats.messages_received > received:
                    stored_at = loop.sent - start
            return per_turn, stored_at

        per_turn, stored_at = gateway.run(drain())
        passes = [k for k in per_turn if k]
        assert sum(passes) == n
        assert len(passes) <= math.ceil(n / PASS_LIMIT), f"{len(passes)} passes: {passes}"
        assert max(passes) <= PASS_LIMIT
        assert stored_at is not None and stored_at < n, "the device's PUBLISH waited the drain"
        ack = device.recv_until(PubAck)
        assert isinstance(ack, PubAck) and ack.packet_id == 7
        wait_until(lambda: len(sub.messages) == n + 1, what="the backlog at the subscriber")
    finally:
        device.close()
