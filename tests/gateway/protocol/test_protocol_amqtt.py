"""Cross-check with an independent codec: amqtt 0.12.1 (MQTT 3.1.1 only).

Packets built by amqtt's packet classes decode to the expected events, and our encodings
decode in amqtt. amqtt decodes only from a stream, so bytes go through an asyncio.StreamReader.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from amqtt.adapters import StreamReaderAdapter
from amqtt.mqtt import packet_class
from amqtt.mqtt.connack import ConnackPacket
from amqtt.mqtt.connect import ConnectPacket, ConnectPayload, ConnectVariableHeader
from amqtt.mqtt.disconnect import DisconnectPacket
from amqtt.mqtt.packet import MQTTFixedHeader
from amqtt.mqtt.pingreq import PingReqPacket
from amqtt.mqtt.pingresp import PingRespPacket
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.publish import PublishPacket
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.mqtt.pubrel import PubrelPacket
from amqtt.mqtt.suback import SubackPacket
from amqtt.mqtt.subscribe import SubscribePacket
from amqtt.mqtt.unsuback import UnsubackPacket
from amqtt.mqtt.unsubscribe import UnsubscribePacket

from gateway.protocol import (
    ConnAck,
    Connect,
    Connection,
    Disconnect,
    Event,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
    decode_packet,
    encode,
)


def amqtt_connect() -> bytes:
    header = ConnectVariableHeader(0, 30, "MQTT", 4)
    header.clean_session_flag = True
    header.will_flag = True
    header.will_qos = 1
    header.will_retain_flag = True
    header.username_flag = True
    header.password_flag = True
    payload = ConnectPayload("amqtt-client", "dev/status", b"offline", "alice", "s3cret")
    return ConnectPacket(variable_header=header, payload=payload).to_bytes()


AMQTT_BUILT: list[tuple[str, Any, Event]] = [
    (
        "CONNECT",
        amqtt_connect,
        Connect(
            4, "amqtt-client", True, 30, "alice", b"s3cret", Will("dev/status", b"offline", 1, True)
        ),
    ),
    ("CONNACK", lambda: ConnackPacket.build(1, 0).to_bytes(), ConnAck(True, 0)),
    ("CONNACK refused", lambda: ConnackPacket.build(0, 5).to_bytes(), ConnAck(False, 0x87)),
    (
        "PUBLISH QoS 0",
        lambda: PublishPacket.build("a/b", b"m", None, False, 0, False).to_bytes(),
        Publish("a/b", b"m"),
    ),
    (
        "PUBLISH QoS 1 retain",
        lambda: PublishPacket.build("a/ü", b"\x00" * 200, 7, False, 1, True).to_bytes(),
        Publish("a/ü", b"\x00" * 200, 1, True, False, 7),
    ),
    (
        "PUBLISH QoS 2 dup",
        lambda: PublishPacket.build("x", b"", 65535, True, 2, False).to_bytes(),
        Publish("x", b"", 2, False, True, 65535),
    ),
    ("PUBACK", lambda: PubackPacket.build(3).to_bytes(), PubAck(3)),
    ("PUBREC", lambda: PubrecPacket.build(4).to_bytes(), PubRec(4)),
    ("PUBREL", lambda: PubrelPacket.build(5).to_bytes(), PubRel(5)),
    ("PUBCOMP", lambda: PubcompPacket.build(6).to_bytes(), PubComp(6)),
    (
        "SUBSCRIBE",
        lambda: SubscribePacket.build([("a/+", 0), ("b/#", 2)], 8).to_bytes(),
        Subscribe(8, [Subscription("a/+", 0), Subscription("b/#", 2)]),
    ),
    ("SUBACK", lambda: SubackPacket.build(8, [0, 2, 0x80]).to_bytes(), SubAck(8, [0, 2, 0x80])),
    (
        "UNSUBSCRIBE",
        lambda: UnsubscribePacket.build(["a/+", "b/#"], 9).to_bytes(),
        Unsubscribe(9, ["a/+", "b/#"]),
    ),
    ("UNSUBACK", lambda: UnsubackPacket.build(9).to_bytes(), UnsubAck(9)),
    ("PINGREQ", lambda: PingReqPacket().to_bytes(), PingReq()),
    ("PINGRESP", lambda: PingRespPacket.build().to_bytes(), PingResp()),
    ("DISCONNECT", lambda: DisconnectPacket().to_bytes(), Disconnect()),
]


@pytest.mark.parametrize(
    ("build", "expected"), [c[1:] for c in AMQTT_BUILT], ids=[c[0] for c in AMQTT_BUILT]
)
def test_amqtt_packets_decode(build: Any, expected: Event) -> None:
    data = build()
    assert decode_packet(data, 4) == expected
    # and our encoding of the same event is byte-identical
    assert encode(expected, 4) == data


def test_amqtt_client_stream_through_connection() -> None:
    stream = b"".join(c[1]() for c in AMQTT_BUILT if c[0] in {"CONNECT", "PUBLISH QoS 1 retain"})
    conn = Connection()
    conn.receive_data(stream + PingReqPacket().to_bytes() + DisconnectPacket().to_bytes())
    events = conn.events()
    assert [type(e) for e in events] == [Connect, Publish, PingReq, Disconnect]


async def amqtt_decode(data: bytes) -> Any:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    adapter = StreamReaderAdapter(reader)
    header = await MQTTFixedHeader.from_stream(adapter)
    assert header is not None
    packet = await packet_class(header).from_stream(adapter, fixed_header=header)
    assert header.remaining_length + header.bytes_length == len(data)
    return packet


async def test_our_encodings_decode_in_amqtt() -> None:
    publish = await amqtt_decode(encode(Publish("t/ü", b"p" * 300, 1, True, True, 513), 4))
    assert (publish.topic_name, publish.data, publish.qos) == ("t/ü", b"p" * 300, 1)
    assert (publish.packet_id, publish.retain_flag, publish.dup_flag) == (513, True, True)

    publish0 = await amqtt_decode(encode(Publish("a", b"", 0), 4))
    assert publish0.topic_name == "a" and publish0.qos == 0

    connect = await amqtt_decode(
        encode(Connect(4, "me", False, 15, "u", b"pw", Will("w", b"bye", 2, False)), 4)
    )
    assert connect.proto_name == "MQTT" and connect.proto_level == 4
    assert connect.client_id == "me" and connect.keep_alive == 15
    assert not connect.clean_session_flag and connect.will_flag and connect.will_qos == 2
    assert connect.will_topic == "w" and connect.will_message == b"bye"
    assert connect.username == "u" and connect.password == "pw"

    connack = await amqtt_decode(encode(ConnAck(True, 0x86), 4))
    assert connack.return_code == 4 and connack.session_parent == 0

    subscribe = await amqtt_decode(encode(Subscribe(4, [Subscription("a/#", 1)]), 4))
    assert subscribe.variable_header.packet_id == 4 and subscribe.payload.topics == [("a/#", 1)]

    suback = await amqtt_decode(encode(SubAck(4, [1, 0x80]), 4))
    assert suback.variable_header.packet_id == 4 and suback.payload.return_codes == [1, 0x80]

    unsubscribe = await amqtt_decode(encode(Unsubscribe(5, ["a/#", "b"]), 4))
    assert unsubscribe.variable_header.packet_id == 5 and unsubscribe.payload.topics == ["a/#", "b"]

    for event, cls in (
        (PubAck(10), PubackPacket),
        (PubRec(11), PubrecPacket),
        (PubRel(12), PubrelPacket),
        (PubComp(13), PubcompPacket),
        (UnsubAck(14), UnsubackPacket),
    ):
        packet = await amqtt_decode(encode(event, 4))
        assert isinstance(packet, cls)
        assert packet.variable_header.packet_id == event.packet_id

    for bare, cls in (
        (PingReq(), PingReqPacket),
        (PingResp(), PingRespPacket),
        (Disconnect(), DisconnectPacket),
    ):
        assert isinstance(await amqtt_decode(encode(bare, 4)), cls)
