"""Shared subscriptions: one copy per group, offsets advanced on PUBACK, nothing lost when a
member leaves with messages in flight."""

from __future__ import annotations

from gateway.protocol import PubAck, Publish, Subscribe, Subscription
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until


def test_each_message_to_one_member(gateway: GatewayHarness, clients: list[Client]) -> None:
    a = Client(gateway.port, "a", v5=True)
    b = Client(gateway.port, "b")
    plain = Client(gateway.port, "plain")
    p = Client(gateway.port, "p")
    clients += [a, b, plain, p]
    a.subscribe("$share/g/sh/#", 1)
    b.subscribe("$share/g/sh/#", 1)
    plain.subscribe("sh/#", 0)
    for i in range(40):
        p.publish("sh/x", f"{i}".encode(), qos=1)
    plain.wait_messages(40)
    wait_until(lambda: len(a.messages) + len(b.messages) >= 40, what="40 shared deliveries")
    got = sorted(a.payloads() + b.payloads(), key=int)
    assert got == [f"{i}".encode() for i in range(40)]  # each exactly once
    assert a.messages and b.messages  # spread over the members
    gw = gateway.gw
    assert gw is not None

    def group_offset() -> int | None:
        q = gw.router.queue_of("sh/#")
        assert q is not None
        return gw.store.offsets.get("$share/g", q)

    wait_until(lambda: gateway.call(group_offset) == 40, what="group offset 40")


def test_group_offset_waits_for_puback_and_member_leaving_loses_nothing(
    gateway: GatewayHarness,
) -> None:
    slow = RawClient(gateway.port, level=5)
    slow.connect("slow")
    slow.send(Subscribe(1, [Subscription("$share/w/job/+", 1)]))
    slow.recv()
    p = RawClient(gateway.port, level=4)
    p.connect("jobs")
    for i in range(3):
        p.send(Publish("job/1", f"j{i}".encode(), qos=1, packet_id=i + 1))
        p.recv()
    held = [slow.recv() for _ in range(3)]  # delivered, never acknowledged
    assert [m.payload for m in held] == [b"j0", b"j1", b"j2"]
    gw = gateway.gw
    assert gw is not None

    def offset() -> int | None:
        q = gw.router.queue_of("job/+")
        assert q is not None
        return gw.store.offsets.get("$share/w", q)

    assert gateway.call(offset) == 0  # written to the network is not done
    slow.send(PubAck(held[0].packet_id))
    wait_until(lambda: gateway.call(offset) == 1, what="offset 1 after one PUBACK")
    worker = RawClient(gateway.port, level=5)
    worker.connect("worker")
    worker.send(Subscribe(1, [Subscription("$share/w/job/+", 1)]))
    worker.recv()
    slow.close()  # leaves with j1, j2 in flight
    got = [worker.recv() for _ in range(2)]
    assert sorted(m.payload for m in got) == [b"j1", b"j2"]
    for m in got:
        worker.send(PubAck(m.packet_id))
    wait_until(lambda: gateway.call(offset) == 3, what="offset 3")
    worker.close()
    p.close()
