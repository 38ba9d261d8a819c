"""A light queue's mirror and its held pull (gateway/storage/rocketmq/mirrors.py) live as long as a
subscription reads the queue: subscription churn leaves no mirrors or held pulls behind (the
name memo is bounded on its own: tests/gateway/storage/test_rocketmq_names.py).
A real gateway (in-process, to count them) on the session's RocketMQ cluster, paho clients."""

from __future__ import annotations

import pytest

from gateway.storage.rocketmq.adapter import RocketMqStorage
from tests.gateway.conftest import Client, GatewayHarness, stop_clients, wait_until
from topicmap.topic import TopicFilter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_mirrors_and_held_pulls_are_released_with_the_last_reader(
    rocketmq_gateway: GatewayHarness,
) -> None:
    h = rocketmq_gateway
    assert h.gw is not None
    store = h.gw.store
    assert isinstance(store, RocketMqStorage)
    mirrors = store._mirrors

    def counts() -> tuple[int, int]:
        return len(mirrors.queues()), len(mirrors._tasks)

    base = h.call(counts)
    made: list[Client] = []
    try:
        a = Client(h.port, "a")
        b = Client(h.port, "b", clean=False)
        pub = Client(h.port, "pub")
        made += [a, b, pub]
        for i in range(20):  # churn: each filter subscribed, used, unsubscribed
            topic = f"churn/{i}"
            assert a.subscribe(topic, 1) == [1]
            assert b.subscribe(f"$share/g/{topic}", 1) == [1]
            pub.publish(topic, f"m{i}", 1)

            def at(c: Client, m: bytes = f"m{i}".encode()) -> bool:
                return m in c.payloads()

            wait_until(lambda: at(a), what=f"m{i} at a")
            wait_until(lambda: at(b), what=f"m{i} at b")
            a.unsubscribe(topic)
            assert h.call(lambda: len(mirrors.queues())) > base[0]  # b still reads it
            b.unsubscribe(f"$share/g/{topic}")
        wait_until(lambda: h.call(counts) == base, what=f"{base} (mirrors, held pulls)")
        # A queue subscribed again gets a new mirror that delivers.
        assert a.subscribe("churn/0", 1) == [1]
        pub.publish("churn/0", "again", 1)
        wait_until(lambda: b"again" in a.payloads(), what="a message after resubscribing")
    finally:
        stop_clients(made)


def test_an_observer_of_queue_ends_opens_no_mirror(rocketmq_gateway: GatewayHarness) -> None:
    # read_max_offset (what the delivery account samples, in a cluster also for the sessions
    # adopted from other nodes) answers -1 for a queue nothing here reads, and opens no mirror
    # (max_offset would, and the parent topic's tail would then decode and keep every message
    # of that queue on this node); for a queue read here, its end.
    h = rocketmq_gateway
    assert h.gw is not None
    store = h.gw.store
    assert isinstance(store, RocketMqStorage)
    queue = h.gw.publisher.router.queue_name(TopicFilter("observed/+"))
    assert h.call(lambda: store.read_max_offset(queue)) == -1
    assert h.call(lambda: store._mirrors.mirrored(queue)) is False
    made: list[Client] = []
    try:
        sub = Client(h.port, "observed-sub")
        pub = Client(h.port, "observed-pub")
        made += [sub, pub]
        assert sub.subscribe("observed/+", 1) == [1]
        pub.publish("observed/x", "one", 1)
        wait_until(lambda: b"one" in sub.payloads(), what="the message at the subscriber")
        wait_until(lambda: h.call(lambda: store.read_max_offset(queue)) == 1, what="end 1")
        sub.unsubscribe("observed/+")
        wait_until(lambda: h.call(lambda: store.read_max_offset(queue)) == -1, what="-1 again")
    finally:
        stop_clients(made)
