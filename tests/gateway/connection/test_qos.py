"""QoS 0/1/2 flows, QoS downgrade, and the amqtt client against the gateway."""

from __future__ import annotations

import asyncio

from amqtt.client import MQTTClient

from gateway.protocol import PubAck, PubComp, Publish, PubRec, PubRel, Subscribe, Subscription
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until


def test_qos1_and_qos2_end_to_end(gateway: GatewayHarness, clients: list[Client]) -> None:
    sub = Client(gateway.port, "sub", v5=True)
    pub = Client(gateway.port, "pub")
    clients += [sub, pub]
    assert sub.subscribe("q/#", 2) == [2]
    for i in range(20):
        pub.publish("q/1", f"m{i}".encode(), qos=1 + i % 2)
    msgs = sub.wait_messages(20)
    # paho hands a QoS 2 message to the application only at PUBREL, so compare per QoS.
    for qos in (1, 2):
        assert [m.payload for m in msgs if m.qos == qos] == [
            f"m{i}".encode() for i in range(20) if 1 + i % 2 == qos
        ]
    # Every delivery was acknowledged: the committed offset reached the queue's end.
    gw = gateway.gw
    assert gw is not None

    def committed() -> tuple[int | None, int]:
        s = gw.sessions.get("sub")
        assert s is not None
        q = next(iter(s.subscriptions.values())).queue
        return gw.store.offsets.get("sub", q), gw.store.max_offset(q)

    wait_until(lambda: gateway.call(committed)[0] == 20, what="committed offset 20")


def test_qos_downgrade_is_min_of_publish_and_subscription(
    gateway: GatewayHarness, clients: list[Client]
) -> None:
    s0 = Client(gateway.port, "s0")
    s1 = Client(gateway.port, "s1", v5=True)
    pub = Client(gateway.port, "pub")
    clients += [s0, s1, pub]
    s0.subscribe("d/t", 0)
    s1.subscribe("d/t", 1)
    pub.publish("d/t", b"two", qos=2)
    pub.publish("d/t", b"zero", qos=0)
    m0 = s0.wait_messages(2)
    m1 = s1.wait_messages(2)
    assert [(m.payload, m.qos) for m in m0] == [(b"two", 0), (b"zero", 0)]
    assert [(m.payload, m.qos) for m in m1] == [(b"two", 1), (b"zero", 0)]


def test_raw_qos2_inbound_dedup_and_outbound_flow(gateway: GatewayHarness) -> None:
    sub = RawClient(gateway.port, level=5)
    assert sub.connect("raw-sub").reason_code == 0
    sub.send(Subscribe(1, [Subscription("r/t", 2)]))
    assert sub.recv().reason_codes == [2]
    pub = RawClient(gateway.port, level=4)
    assert pub.connect("raw-pub").reason_code == 0
    pub.send(Publish("r/t", b"once", qos=2, packet_id=7))
    assert pub.recv() == PubRec(7)
    # Re-sent before PUBREL (DUP): acknowledged again, stored once.
    pub.send(Publish("r/t", b"once", qos=2, dup=True, packet_id=7))
    assert pub.recv() == PubRec(7)
    pub.send(PubRel(7))
    assert pub.recv() == PubComp(7)
    got = sub.recv()
    assert isinstance(got, Publish) and got.payload == b"once" and got.qos == 2
    assert got.packet_id is not None
    sub.send(PubRec(got.packet_id))
    assert sub.recv() == PubRel(got.packet_id)
    sub.send(PubComp(got.packet_id))
    # No second copy arrives: the next thing is our probe.
    pub.send(Publish("r/t", b"probe", qos=1, packet_id=8))
    assert pub.recv() == PubAck(8)
    nxt = sub.recv()
    assert isinstance(nxt, Publish) and nxt.payload == b"probe"
    sub.close()
    pub.close()


def test_amqtt_client_roundtrip(gateway: GatewayHarness) -> None:
    url = f"mqtt://127.0.0.1:{gateway.port}/"

    async def scenario() -> list[tuple[str, bytes, int]]:
        sub = MQTTClient(client_id="am-sub")
        pub = MQTTClient(client_id="am-pub")
        await sub.connect(url)
        await pub.connect(url)
        await sub.subscribe([("am/+/x", 2)])
        await pub.publish("am/1/x", b"q0", qos=0)
        await pub.publish("am/2/x", b"q1", qos=1)
        await pub.publish("am/3/x", b"q2", qos=2)
        got = []
        for _ in range(3):
            msg = await asyncio.wait_for(sub.deliver_message(), 10)
            assert msg is not None and msg.publish_packet is not None
            got.append((msg.topic, bytes(msg.data), msg.qos))
        await sub.disconnect()
        await pub.disconnect()
        return got

    got = asyncio.run(scenario())
    assert got == [("am/1/x", b"q0", 0), ("am/2/x", b"q1", 1), ("am/3/x", b"q2", 2)]


def test_mqtt31_client(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=3)
    assert c.connect("old-31-client").reason_code == 0
    c.send(Subscribe(1, [Subscription("v31/t", 1)]))
    assert c.recv().reason_codes == [1]
    c.send(Publish("v31/t", b"mqisdp", qos=1, packet_id=2))
    first, second = c.recv(), c.recv()
    got = {type(first), type(second)}
    assert got == {PubAck, Publish}
    msg = first if isinstance(first, Publish) else second
    assert msg.payload == b"mqisdp"
    c.close()
    bad = RawClient(gateway.port, level=3)
    assert bad.connect("").reason_code == 0x85  # 3.1 needs a client id
    bad.close()
