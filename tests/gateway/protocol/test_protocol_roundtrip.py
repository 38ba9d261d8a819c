"""Bytes in, events out (and back) for every packet type at levels 3, 4 and 5."""

from __future__ import annotations

import pytest

from gateway.protocol import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Event,
    PingReq,
    PingResp,
    Properties,
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

LEVELS = (3, 4, 5)


def full_props() -> Properties:
    return Properties(
        payload_format_indicator=1,
        message_expiry_interval=3600,
        content_type="text/plain",
        response_topic="reply/here",
        correlation_data=b"\x00\x01corr",
        subscription_identifiers=[1, 268_435_455],
        user_properties=[("k", "v"), ("k", "v2"), ("ü", "")],
    )


def events_for(level: int) -> list[Event]:
    v5 = level == 5
    props = Properties(reason_string="why", user_properties=[("a", "b")]) if v5 else None
    connect_props = (
        Properties(
            session_expiry_interval=120,
            receive_maximum=10,
            maximum_packet_size=65536,
            topic_alias_maximum=5,
            request_response_information=1,
            request_problem_information=0,
            authentication_method="SCRAM",
            authentication_data=b"\x01\x02",
            user_properties=[("x", "y")],
        )
        if v5
        else Properties()
    )
    will_props = (
        Properties(will_delay_interval=30, payload_format_indicator=0, content_type="c")
        if v5
        else Properties()
    )
    connack_props = (
        Properties(
            session_expiry_interval=10,
            receive_maximum=100,
            maximum_qos=1,
            retain_available=0,
            maximum_packet_size=1000,
            assigned_client_identifier="auto-1",
            topic_alias_maximum=16,
            reason_string="ok",
            wildcard_subscription_available=1,
            subscription_identifier_available=0,
            shared_subscription_available=1,
            server_keep_alive=20,
            response_information="resp",
            server_reference="other:1883",
            authentication_method="SCRAM",
            authentication_data=b"x",
        )
        if v5
        else None
    )
    evs: list[Event] = [
        Connect(level, "client-1", True, 60, "user", b"pass\x00\xff", None, connect_props),
        Connect(
            level,
            "client-2",
            False,
            0,
            None,
            None,
            Will("last/will", b"gone", 2, True, will_props),
            connect_props,
        ),
        ConnAck(level != 3, 0, connack_props),
        Publish("a/b/c", b"payload", 0),
        Publish("a/b/c", b"", 1, True, True, 1),
        Publish("ü/日本", b"\x00" * 300, 2, False, False, 65535, full_props() if v5 else None),
        PubAck(7, 0x10 if v5 else 0, props),
        PubRec(8, 0x80 if v5 else 0, props),
        PubRel(9, 0x92 if v5 else 0, props),
        PubComp(10, 0, props),
        Subscribe(
            11,
            [
                Subscription("a/+", 0),
                Subscription("b/#", 1, v5, v5, 2 if v5 else 0),
                Subscription("$share/g/c", 2),
            ],
            Properties(subscription_identifiers=[42]) if v5 else None,
        ),
        SubAck(11, [0, 1, 2, 0x80], props),
        Unsubscribe(12, ["a/+", "b/#"], Properties(user_properties=[("u", "p")]) if v5 else None),
        UnsubAck(12, [0, 0x11] if v5 else [], props),
        PingReq(),
        PingResp(),
        Disconnect(0x8B if v5 else 0, Properties(session_expiry_interval=0) if v5 else None),
    ]
    if v5:
        evs.append(Auth(0x18, Properties(authentication_method="SCRAM", authentication_data=b"")))
        evs.append(Auth())
    return evs


@pytest.mark.parametrize("level", LEVELS)
def test_every_packet_type_round_trips(level: int) -> None:
    for event in events_for(level):
        data = encode(event, level)
        assert decode_packet(data, level) == event, (event, data)


def test_known_bytes_v4() -> None:
    assert encode(PingReq(), 4) == b"\xc0\x00"
    assert encode(ConnAck(True, 0), 4) == b"\x20\x02\x01\x00"
    assert encode(Publish("a/b", b"hi", 1, packet_id=10), 4) == b"\x32\x09\x00\x03a/b\x00\x0ahi"
    assert encode(PubRel(1), 4) == b"\x62\x02\x00\x01"
    assert encode(Subscribe(1, [Subscription("t", 1)]), 4) == b"\x82\x06\x00\x01\x00\x01t\x01"
    assert encode(UnsubAck(5), 4) == b"\xb0\x02\x00\x05"
    assert encode(Disconnect(), 4) == b"\xe0\x00"
    assert decode_packet(b"\x30\x05\x00\x01tab", 4) == Publish("t", b"ab")


def test_known_bytes_v5() -> None:
    assert encode(PubAck(1), 5) == b"\x40\x02\x00\x01"
    assert encode(PubAck(1, 0x10), 5) == b"\x40\x03\x00\x01\x10"
    assert encode(Disconnect(), 5) == b"\xe0\x00"
    assert encode(Disconnect(0x8E), 5) == b"\xe0\x01\x8e"
    assert encode(Publish("a", b"", 0), 5) == b"\x30\x04\x00\x01a\x00"
    # PUBACK with reason code and empty property block is also valid input
    assert decode_packet(b"\x40\x04\x00\x01\x10\x00", 5) == PubAck(1, 0x10)
    assert decode_packet(b"\xe0\x02\x04\x00", 5) == Disconnect(4)


def test_connack_return_codes_map_to_v4() -> None:
    expected = {0x00: 0, 0x84: 1, 0x85: 2, 0x88: 3, 0x89: 3, 0x86: 4, 0x87: 5, 0x80: 3}
    for reason, code in expected.items():
        assert encode(ConnAck(True, reason), 4) == bytes((0x20, 2, 0 if reason else 1, code))
    # session present never set on refusal, never at all in 3.1
    assert encode(ConnAck(True, 0), 3) == b"\x20\x02\x00\x00"


def test_suback_failure_codes_map_to_0x80_in_v4() -> None:
    assert encode(SubAck(3, [0, 1, 2, 0x87, 0x8F]), 4) == b"\x90\x07\x00\x03\x00\x01\x02\x80\x80"


def test_level_5_properties_dropped_below_level_5() -> None:
    ev = Publish("t", b"p", 0, properties=Properties(message_expiry_interval=5))
    assert encode(ev, 4) == b"\x30\x04\x00\x01tp"
