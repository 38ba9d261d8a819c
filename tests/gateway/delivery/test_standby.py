"""A subscriber's delivery loop starts at its first message, not at its SUBSCRIBE
(gateway/delivery/loop.py, "Standby"): until then its connection watches the session's queues
with the ArrivalHub. Real gateway, real paho clients; the state is read on the gateway's loop."""

from __future__ import annotations

from gateway.connection.client import ClientConnection
from tests.gateway.conftest import Client, GatewayHarness, wait_until


def _standby(gateway: GatewayHarness, client_id: str) -> dict[str, object]:
    """The client's connection: whether it has a loop, and who watches each of its session's
    queues (and the queues its subscriptions had, by filter)."""
    gw = gateway.gw
    assert gw is not None

    def look() -> dict[str, object]:
        conn = next(c for c in gw.connections if c.client_id == client_id)
        assert isinstance(conn, ClientConnection) and conn.session is not None
        hub = gw.shared.arrivals
        found = hub._waiters
        return {
            "loop": conn.delivery is not None,
            "watchers": {
                sub.topic_filter: (
                    hub.watchers(sub.queue),
                    "loop" if found.get(sub.queue) is conn.delivery else "connection",
                )
                for sub in conn.session.by_queue.values()
            },
            "queues": {sub.topic_filter: sub.queue for sub in conn.session.by_queue.values()},
        }

    return gateway.call(look)


def _watchers(gateway: GatewayHarness, queue: str) -> int:
    gw = gateway.gw
    assert gw is not None
    return gateway.call(lambda: gw.shared.arrivals.watchers(queue))


def test_a_subscriber_loop_starts_at_its_first_message(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """Failed before the change (main 5d64935: the loop started at the SUBACK, and the hub
    held the loop, not the connection)."""
    sub = Client(gateway.port, "sb-dev", v5=True)
    pub = Client(gateway.port, "sb-pub")
    clients += [sub, pub]
    assert sub.subscribe("sb/cmd/1", 1) == [1]
    state = _standby(gateway, "sb-dev")
    assert state["loop"] is False
    assert state["watchers"] == {"sb/cmd/1": (1, "connection")}
    pub.publish("sb/cmd/1", b"first", qos=1)
    assert [bytes(m.payload) for m in sub.wait_messages(1)] == [b"first"]
    state = _standby(gateway, "sb-dev")
    assert state["loop"] is True
    assert state["watchers"] == {"sb/cmd/1": (1, "loop")}  # taken over, not shared
    pub.publish("sb/cmd/1", b"second", qos=1)
    wait_until(lambda: sub.payloads() == [b"first", b"second"], what="the second message")


def test_a_standing_by_connection_lets_go_of_its_queues(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """UNSUBSCRIBE and the connection's end release what it watched for its loop-to-be; a
    retained message to send starts the loop at once."""
    pub = Client(gateway.port, "sb-pub2")
    sub = Client(gateway.port, "sb-dev2", v5=True)
    clients += [pub, sub]
    assert sub.subscribe("sb/a", 1) == [1]
    assert sub.subscribe("sb/b", 1) == [1]
    queues = _standby(gateway, "sb-dev2")["queues"]
    assert isinstance(queues, dict)
    sub.unsubscribe("sb/a")
    assert _watchers(gateway, queues["sb/a"]) == 0
    assert _standby(gateway, "sb-dev2")["watchers"] == {"sb/b": (1, "connection")}
    pub.publish("sb/a", b"gone", qos=1)
    sub.disconnect()
    wait_until(lambda: _watchers(gateway, queues["sb/b"]) == 0, what="the watch released")
    assert sub.payloads() == []

    pub.publish("sb/kept", b"retained", qos=1, retain=True)
    late = Client(gateway.port, "sb-dev3", v5=True)
    clients.append(late)
    assert late.subscribe("sb/kept", 1) == [1]
    assert [bytes(m.payload) for m in late.wait_messages(1)] == [b"retained"]
    assert _standby(gateway, "sb-dev3")["watchers"] == {"sb/kept": (1, "loop")}
