"""CONNECT, PUBLISH and SUBSCRIBE end to end with paho-mqtt 3.1.1 and 5.0."""

from __future__ import annotations

from tests.gateway.conftest import Client, GatewayHarness


def test_qos0_wildcard_fanout(gateway: GatewayHarness, clients: list[Client]) -> None:
    a = Client(gateway.port, "a")
    b = Client(gateway.port, "b", v5=True)
    p = Client(gateway.port, "p")
    clients += [a, b, p]
    assert a.subscribe("site/+/temp", 0) == [0]
    assert b.subscribe("site/#", 0) == [0]
    p.publish("site/7/temp", b"21.5")
    p.publish("site/7/hum", b"40")
    p.publish("other/7/temp", b"x")
    a.wait_messages(1)
    b.wait_messages(2)
    assert a.payloads() == [b"21.5"]
    assert b.payloads() == [b"21.5", b"40"]
    assert [m.topic for m in b.messages] == ["site/7/temp", "site/7/hum"]
