"""CONNECT, PUBLISH and SUBSCRIBE end to end with paho-mqtt 3.1.1 and 5.0."""

from __future__ import annotations

from gateway.protocol import (
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    Properties,
    SubAck,
    Subscribe,
    Subscription,
    encode,
)
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until


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


def test_stats_count_clients_messages_and_bytes(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    gw = gateway.gw
    assert gw is not None
    s = Client(gateway.port, "st-s")
    p = Client(gateway.port, "st-p")
    clients += [s, p]
    s.subscribe("st/#", 1)
    for _i in range(5):
        p.publish("st/x", b"12345", qos=1)
    s.wait_messages(5)
    stats = gateway.call(lambda: gw.stats)
    assert stats.clients_connected == 2 and stats.clients_total == 2
    assert stats.messages_received == 5 and stats.messages_sent == 5
    assert stats.subscriptions == 1
    assert stats.bytes_received > 5 * 5 and stats.bytes_sent > 5 * 5
    p.disconnect()
    wait_until(lambda: gateway.call(lambda: gw.stats.clients_connected) == 1, what="1 client")


def test_publish_internal_is_routed_like_a_client_publish(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    gw = gateway.gw
    assert gw is not None
    s = Client(gateway.port, "sys-s")
    clients.append(s)
    s.subscribe("$SYS/#", 0)
    gateway.run(gw.publish_internal("$SYS/broker/test", b"42", retain=True))
    m = s.wait_messages(1)[0]
    assert (m.topic, m.payload) == ("$SYS/broker/test", b"42")
    late = Client(gateway.port, "sys-late")
    clients.append(late)
    late.subscribe("$SYS/broker/+", 0)
    assert late.wait_messages(1)[0].retain


def test_a_new_session_leaves_the_connection_without_packet_ids_until_qos1(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    """A device that only subscribed holds no packet-id sets (their containers are most of an
    idle connection's protocol state); its first QoS 1 PUBLISH makes them, and is stored,
    acknowledged and delivered as any other."""
    gw = gateway.gw
    assert gw is not None
    d = Client(gateway.port, "ids-d")
    clients.append(d)
    assert d.subscribe("ids/cmd", 1) == [1]

    def ids() -> object:
        (conn,) = [c.conn for c in gw.state.connections if c.client_id == "ids-d"]
        return conn._ids

    assert gateway.call(ids) is None
    d.publish("ids/cmd", b"x", 1)  # waits for its PUBACK
    assert d.wait_messages(1)[0].payload == b"x"
    assert gateway.call(ids) is not None


def test_a_connect_read_with_what_follows_it_answers_each_in_order(
    gateway: GatewayHarness,
) -> None:
    """CONNECT, SUBSCRIBE, PINGREQ and DISCONNECT in one write: the read callback takes the
    CONNECT itself (nothing in it waits), then the rest of the same read as a connected
    client's; each is answered in order and the session is stored, as when they came apart."""
    for level in (4, 5):
        c = RawClient(gateway.port, level=level)
        cid = f"burst-{level}"
        expiry = Properties(session_expiry_interval=60) if level == 5 else Properties()
        c.send_bytes(
            encode(Connect(level, cid, False, 60, properties=expiry), level)
            + encode(Subscribe(7, [Subscription(f"burst/{level}", 1)]), level)
            + encode(PingReq(), level)
            + encode(Disconnect(), level)
        )
        ack = c.recv()
        assert isinstance(ack, ConnAck) and ack.reason_code == 0 and not ack.session_present
        sub = c.recv()
        assert isinstance(sub, SubAck) and sub.packet_id == 7 and sub.reason_codes == [1]
        assert isinstance(c.recv(), PingResp)
        assert c.is_closed()
        c.close()
        again = RawClient(gateway.port, level=level)
        assert again.connect(cid, clean=False).session_present
        again.close()
