"""Delivery pacing (gateway/delivery/pacing.py, PASS_INTERVAL): while the event loop is under
load (gateway/delivery/load.py), a pass asked for within a millisecond of a busy subscriber's
last write runs from a timer. Nothing else has to happen for it to run: a message stored then
is delivered with no further traffic on any connection. A subscriber that is not busy (its last
write came after a quiet spell) gets it at once; a busy one on a loop with time to spare sends
it with the next arrival (company), or alone from the same timer."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from gateway.connection.client import ClientConnection
from gateway.delivery.loop import DeliveryLoop
from gateway.delivery.state import UNKNOWN_END
from gateway.protocol import Publish
from tests.gateway.conftest import Client, GatewayHarness, wait_until


def _loop_load(loop: DeliveryLoop, loaded: bool) -> None:
    """Fix the loop-load measure for this turn (its window cannot end: it started at +inf)."""
    load = loop.ctx.load
    load.loaded = loaded
    load._since = math.inf


def test_a_message_stored_right_after_a_write_arrives_without_more_traffic(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    sub = Client(gateway.port, "paced-sub")
    pub = Client(gateway.port, "paced-pub")
    clients += [sub, pub]
    assert sub.subscribe("paced/#", 1) == [1]
    pub.publish("paced/1", b"one", qos=1)
    sub.wait_messages(1)
    gw = gateway.gw
    assert gw is not None

    async def store_right_after_a_write() -> bool:
        conn: ClientConnection = next(c for c in gw.connections if c.client_id == "paced-sub")
        loop = conn.delivery
        assert loop is not None
        # As if a pass had just written to the subscriber under load (that write came right
        # after the one before), in a way the clock cannot move past (uvloop's may tick during
        # the publish): the arrival must take the timer.
        loop._last_write = math.inf
        loop._busy = True
        _loop_load(loop, True)
        await gw.publisher.publish_internal("paced/2", b"two", qos=1)
        return loop._pass_timer is not None

    assert gateway.run(store_right_after_a_write()), "the pass was not paced"
    wait_until(lambda: sub.payloads() == [b"one", b"two"], what="the paced message")


def test_a_message_right_after_a_write_to_an_idle_subscriber_is_not_paced(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    sub = Client(gateway.port, "idle-sub")
    pub = Client(gateway.port, "idle-pub")
    clients += [sub, pub]
    assert sub.subscribe("idle/#", 1) == [1]
    pub.publish("idle/1", b"one", qos=1)
    sub.wait_messages(1)
    gw = gateway.gw
    assert gw is not None

    async def store_right_after_a_lone_write() -> tuple[bool, bool]:
        conn: ClientConnection = next(c for c in gw.connections if c.client_id == "idle-sub")
        loop = conn.delivery
        assert loop is not None
        # As if a pass had just written the first message after a quiet spell (the clock
        # cannot move past it): the next arrival is not load, so no pacing timer.
        loop._last_write = math.inf
        loop._busy = False
        await gw.publisher.publish_internal("idle/2", b"two", qos=1)
        return loop._pass_timer is None, loop._scheduled or loop._last_write != math.inf

    no_timer, passed = gateway.run(store_right_after_a_lone_write())
    assert no_timer, "an idle subscriber's message waited for the pacing timer"
    assert passed, "no pass was scheduled in this turn's callbacks"
    wait_until(lambda: sub.payloads() == [b"one", b"two"], what="the unpaced message")


def test_arrival_notices_keep_the_furthest_end_and_an_unknown_one(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """A notice tells where the queue ends; one handed over late (the flusher thread's) may
    tell less than one before it: the pass must read up to the furthest. A queue marked ready
    without a notice (end unknown: the pass asks the store) stays so."""
    sub = Client(gateway.port, "ends-sub")
    pub = Client(gateway.port, "ends-pub")
    clients += [sub, pub]
    assert sub.subscribe("ends/#", 0) == [0]
    gw = gateway.gw
    assert gw is not None

    def notices() -> tuple[int, int]:
        conn: ClientConnection = next(c for c in gw.connections if c.client_id == "ends-sub")
        loop = conn.ctx.packets.subscribe.delivery_loop(conn)  # started as a message would
        queue = next(iter(loop.session.by_queue))
        loop._scheduled = True  # no pass in between: only what the notices leave
        try:
            loop.arrived(queue, 7)
            loop.arrived(queue, 3)
            assert loop._ready is not None  # the notices made it
            furthest = loop._ready[queue]
            loop._ready[queue] = UNKNOWN_END
            loop.arrived(queue, 9)
            unknown = loop._ready[queue]
        finally:
            loop._scheduled = False
            loop.wake()
        return furthest, unknown

    assert gateway.call(notices) == (7, UNKNOWN_END)
    pub.publish("ends/1", b"one", qos=0)
    wait_until(lambda: sub.payloads() == [b"one"], what="delivery after the notices")


def _acknowledged_subscriber(
    gateway: GatewayHarness, clients: list[Client], name: str
) -> tuple[Client, Client, Callable[[], DeliveryLoop]]:
    """A subscriber to `name`/# that got one message and acknowledged it (nothing in flight:
    with its PUBACK outstanding the subscriber is the one short of time, and the pass is paced,
    the last test), its publisher, and its delivery loop."""
    sub = Client(gateway.port, f"{name}-sub")
    pub = Client(gateway.port, f"{name}-pub")
    clients += [sub, pub]
    assert sub.subscribe(f"{name}/#", 1) == [1]
    pub.publish(f"{name}/1", b"one", qos=1)
    sub.wait_messages(1)
    gw = gateway.gw
    assert gw is not None

    def delivery() -> DeliveryLoop:
        conn: ClientConnection = next(c for c in gw.connections if c.client_id == f"{name}-sub")
        assert conn.delivery is not None
        return conn.delivery

    wait_until(lambda: not gateway.call(delivery).session.inflight, what="the first PUBACK")
    return sub, pub, delivery


def _busy_on_an_idle_loop(loop: DeliveryLoop) -> None:
    """As if a pass had just written to the subscriber under sustained traffic (that write came
    right after the one before; the clock cannot move past it), on a loop with time to spare."""
    loop._last_write = math.inf
    loop._busy = True
    _loop_load(loop, False)


def test_a_busy_subscribers_message_on_an_idle_loop_goes_with_the_next_arrival(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """Company: the first arrival waits (the pacing timer is its bound), the second sends both
    in this turn's callbacks, without waiting for the timer."""
    sub, _, delivery = _acknowledged_subscriber(gateway, clients, "company")
    gw = gateway.gw
    assert gw is not None

    async def two_arrivals() -> tuple[bool, bool]:
        loop = delivery()
        _busy_on_an_idle_loop(loop)
        await gw.publisher.publish_internal("company/2", b"two", qos=1)
        held = loop._waiting and not loop._scheduled and loop._pass_timer is not None
        await gw.publisher.publish_internal("company/3", b"three", qos=1)
        return held, loop._scheduled and not loop._waiting

    held, released = gateway.run(two_arrivals())
    assert held, "a busy subscriber's message on an idle loop did not wait for company"
    assert released, "the next arrival did not send the waiting one in this turn's callbacks"
    wait_until(lambda: sub.payloads() == [b"one", b"two", b"three"], what="both messages")


def test_a_message_waiting_for_company_arrives_alone_without_more_traffic(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """No second arrival: the pacing timer sends the waiting message (nothing else happens on
    any connection)."""
    sub, _, delivery = _acknowledged_subscriber(gateway, clients, "alone")
    gw = gateway.gw
    assert gw is not None

    async def one_arrival() -> bool:
        loop = delivery()
        _busy_on_an_idle_loop(loop)
        await gw.publisher.publish_internal("alone/2", b"two", qos=1)
        return loop._waiting and loop._pass_timer is not None

    assert gateway.run(one_arrival()), "the message did not wait for company"
    wait_until(lambda: sub.payloads() == [b"one", b"two"], what="the waiting message")


def test_a_busy_subscriber_with_unacknowledged_messages_is_paced_on_an_idle_loop(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    sub = Client(gateway.port, "unacked-sub", auto_ack=False)
    pub = Client(gateway.port, "unacked-pub")
    clients += [sub, pub]
    assert sub.subscribe("unacked/#", 1) == [1]
    pub.publish("unacked/1", b"one", qos=1)
    sub.wait_messages(1)  # and not acknowledged: its PUBLISH is in flight
    gw = gateway.gw
    assert gw is not None

    async def store_while_one_is_unacknowledged() -> bool:
        conn: ClientConnection = next(c for c in gw.connections if c.client_id == "unacked-sub")
        loop = conn.delivery
        assert loop is not None
        assert loop.session.inflight, "the first message was acknowledged"
        # The subscriber is the one short of time (its last write is not acknowledged), the
        # loop is not: the message waits for the acknowledgement or the pacing timer.
        loop._last_write = math.inf
        loop._busy = True
        _loop_load(loop, False)
        await gw.publisher.publish_internal("unacked/2", b"two", qos=1)
        return loop._pass_timer is not None

    assert gateway.run(store_while_one_is_unacknowledged()), "the pass was not paced"
    wait_until(lambda: sub.payloads() == [b"one", b"two"], what="the paced message")


def test_a_publish_read_in_the_turn_before_a_pass_leaves_with_it(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """A pass first stores what the event loop's turn read (the ingest batch, stored at the end
    of the turn otherwise): a device's message read while a subscriber's pass waits in the
    turn's callbacks goes with that pass, not in a pass and a write of its own after it."""
    sub, _, delivery = _acknowledged_subscriber(gateway, clients, "turn")
    gw = gateway.gw
    assert gw is not None and gw.ingest is not None
    ingest = gw.ingest

    async def a_read_behind_a_scheduled_pass() -> tuple[bool, int]:
        loop = delivery()
        device = next(c for c in gw.connections if c.client_id == "turn-pub")
        sent = loop.sent
        await gw.publisher.publish_internal("turn/2", b"two", qos=1)
        scheduled = loop._scheduled  # its pass waits in this turn's callbacks
        # What ClientConnection.feed does with a device's read of a plain PUBLISH.
        ingest.add(device, Publish(topic="turn/3", payload=b"three", qos=0))
        while loop.sent == sent:
            await asyncio.sleep(0)  # resumes after the callbacks queued before it
        return scheduled, loop.sent - sent

    scheduled, first_pass = gateway.run(a_read_behind_a_scheduled_pass())
    assert scheduled, "the stored message did not schedule a pass in this turn's callbacks"
    assert first_pass == 2, "the message read in the same turn made a pass of its own"
    wait_until(lambda: sub.payloads() == [b"one", b"two", b"three"], what="both messages")
