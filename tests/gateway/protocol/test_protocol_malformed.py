"""Every malformed or protocol-violating input raises RemoteProtocolError with the right code.

Each case is raw bytes sent after an accepted CONNECT (or instead of one), so the rules are
checked end to end through `Connection`, including what `error_packet` answers.
"""

from __future__ import annotations

import pytest

from gateway.protocol import (
    Connection,
    Properties,
    Publish,
    RemoteProtocolError,
    encode,
)

from .helpers import connect_packet, open_connection

MALFORMED, PROTOCOL_ERROR = 0x81, 0x82


def pkt(first: int, body: bytes) -> bytes:
    """A packet with a correct one-byte remaining length (bodies here are short)."""
    assert len(body) < 128
    return bytes((first, len(body))) + body


def pub5(props: bytes, topic: bytes = b"\x00\x01t") -> bytes:
    """MQTT 5 QoS 0 PUBLISH with the given raw property block contents."""
    return pkt(0x30, topic + bytes((len(props),)) + props)


# (id, level, bytes, reason code). Sent on an open connection (CONNECT + CONNACK done).
OPEN_CASES: list[tuple[str, int, bytes, int]] = [
    ("reserved type 0", 4, b"\x00\x00", MALFORMED),
    ("AUTH before MQTT 5", 4, b"\xf0\x00", MALFORMED),
    ("PUBREL flags 0000", 4, b"\x60\x02\x00\x01", MALFORMED),
    ("SUBSCRIBE flags 0000", 4, b"\x80\x06\x00\x01\x00\x01t\x00", MALFORMED),
    ("UNSUBSCRIBE flags 0000", 4, b"\xa0\x05\x00\x01\x00\x01t", MALFORMED),
    ("PINGREQ flags 0001", 4, b"\xc1\x00", MALFORMED),
    ("PUBACK flags 0010", 5, b"\x42\x02\x00\x01", MALFORMED),
    ("DISCONNECT flags 0001", 5, b"\xe1\x00", MALFORMED),
    ("PUBREL with DUP in 3.1.1", 4, b"\x6a\x02\x00\x01", MALFORMED),
    ("PUBLISH QoS 3", 4, b"\x36\x05\x00\x01t\x00\x01", MALFORMED),
    ("PUBLISH QoS 0 with DUP", 4, b"\x38\x03\x00\x01t", MALFORMED),
    ("PUBLISH packet id 0", 4, b"\x32\x05\x00\x01t\x00\x00", MALFORMED),
    ("PUBLISH QoS 2 packet id 0", 5, b"\x34\x06\x00\x01t\x00\x00\x00", MALFORMED),
    ("PUBLISH without packet id", 4, b"\x32\x03\x00\x01t", MALFORMED),
    ("PUBLISH topic invalid UTF-8", 4, b"\x30\x03\x00\x01\xff", MALFORMED),
    ("PUBLISH topic U+0000", 4, b"\x30\x04\x00\x02a\x00", MALFORMED),
    ("PUBLISH topic surrogate", 4, b"\x30\x05\x00\x03\xed\xa0\x80", MALFORMED),
    ("PUBLISH topic overlong UTF-8", 4, b"\x30\x04\x00\x02\xc0\xaf", MALFORMED),
    ("PUBLISH topic past end", 4, b"\x30\x03\x00\x05a", MALFORMED),
    ("PUBLISH shorter than topic length", 4, b"\x30\x01\x00", MALFORMED),
    ("PUBLISH empty", 4, b"\x30\x00", MALFORMED),
    ("PUBLISH wildcard +", 4, b"\x30\x05\x00\x03a/+", 0x90),
    ("PUBLISH wildcard #", 5, b"\x30\x04\x00\x01#\x00", 0x90),
    ("PUBLISH empty topic 3.1.1", 4, b"\x30\x02\x00\x00", PROTOCOL_ERROR),
    ("PUBLISH empty topic no alias", 5, b"\x30\x03\x00\x00\x00", PROTOCOL_ERROR),
    ("PUBLISH 5.0 without property length", 5, b"\x30\x03\x00\x01t", MALFORMED),
    ("remaining length of 5 bytes", 4, b"\x30\xff\xff\xff\xff\x01", MALFORMED),
    ("remaining length not minimal", 4, b"\xc0\x80\x00", MALFORMED),
    ("remaining length 2 bytes not minimal", 4, b"\x30\x80\x80\x00", MALFORMED),
    ("declared length beyond maximum", 4, b"\x30\xff\xff\xff\x7f", 0x95),
    ("PUBACK too long 3.1.1", 4, b"\x40\x03\x00\x01\x00", MALFORMED),
    ("PUBACK too short", 4, b"\x40\x01\x00", MALFORMED),
    ("PUBACK packet id 0", 5, b"\x40\x02\x00\x00", MALFORMED),
    ("PUBACK bad reason code", 5, b"\x40\x03\x00\x01\x05", MALFORMED),
    ("PUBREL reason code of PUBACK", 5, b"\x62\x03\x00\x01\x10", MALFORMED),
    ("PUBCOMP trailing after properties", 5, b"\x70\x05\x00\x01\x00\x00\x00", MALFORMED),
    ("PINGREQ with body", 4, b"\xc0\x01\x00", MALFORMED),
    ("DISCONNECT with body 3.1.1", 4, b"\xe0\x01\x00", MALFORMED),
    ("DISCONNECT bad reason", 5, b"\xe0\x01\x05", MALFORMED),
    ("SUBSCRIBE without subscriptions", 4, b"\x82\x02\x00\x01", PROTOCOL_ERROR),
    ("SUBSCRIBE packet id 0", 4, b"\x82\x06\x00\x00\x00\x01t\x00", MALFORMED),
    ("SUBSCRIBE QoS 3", 4, b"\x82\x06\x00\x01\x00\x01t\x03", MALFORMED),
    ("SUBSCRIBE 3.1.1 option bits", 4, b"\x82\x06\x00\x01\x00\x01t\x04", MALFORMED),
    ("SUBSCRIBE 5.0 reserved bits", 5, b"\x82\x07\x00\x01\x00\x00\x01t\x40", MALFORMED),
    ("SUBSCRIBE retain handling 3", 5, b"\x82\x07\x00\x01\x00\x00\x01t\x30", PROTOCOL_ERROR),
    (
        "SUBSCRIBE no local on shared",
        5,
        b"\x82\x10\x00\x01\x00\x00\x0a$share/g/t\x04",
        PROTOCOL_ERROR,
    ),
    ("SUBSCRIBE missing options", 4, b"\x82\x05\x00\x01\x00\x01t", MALFORMED),
    ("SUBSCRIBE filter bad UTF-8", 4, b"\x82\x06\x00\x01\x00\x01\xfe\x00", MALFORMED),
    ("UNSUBSCRIBE without filters", 4, b"\xa2\x02\x00\x01", PROTOCOL_ERROR),
    ("UNSUBSCRIBE truncated filter", 4, b"\xa2\x05\x00\x01\x00\x05t", MALFORMED),
    ("CONNACK from a client", 4, b"\x20\x02\x00\x00", PROTOCOL_ERROR),
    ("SUBACK from a client", 4, b"\x90\x03\x00\x01\x00", PROTOCOL_ERROR),
    ("UNSUBACK from a client", 4, b"\xb0\x02\x00\x01", PROTOCOL_ERROR),
    ("PINGRESP from a client", 4, b"\xd0\x00", PROTOCOL_ERROR),
    ("second CONNECT", 4, connect_packet(4), PROTOCOL_ERROR),
    ("second CONNECT 5.0", 5, connect_packet(5), PROTOCOL_ERROR),
    # MQTT 5 properties
    (
        "duplicate property",
        5,
        pub5(b"\x02\x00\x00\x00\x01\x02\x00\x00\x00\x02"),
        PROTOCOL_ERROR,
    ),
    ("property not allowed in PUBLISH", 5, pub5(b"\x11\x00\x00\x00\x01"), MALFORMED),
    ("unknown property id", 5, pub5(b"\x7f\x00"), MALFORMED),
    ("property id as 2-byte varint", 5, pub5(b"\x81\x01\x00"), MALFORMED),
    ("property length past end", 5, pkt(0x30, b"\x00\x01t\x09"), MALFORMED),
    ("property value past length", 5, pkt(0x30, b"\x00\x01t\x02\x02\x00\x00\x00"), MALFORMED),
    ("payload format indicator 2", 5, pub5(b"\x01\x02"), PROTOCOL_ERROR),
    ("topic alias 0", 5, pub5(b"\x23\x00\x00"), 0x94),
    ("topic alias above maximum", 5, pub5(b"\x23\x00\x01"), 0x94),
    ("subscription id from client", 5, pub5(b"\x0b\x01"), PROTOCOL_ERROR),
    (
        "subscription id 0 in SUBSCRIBE",
        5,
        pkt(0x82, b"\x00\x01\x02\x0b\x00\x00\x01t\x00"),
        PROTOCOL_ERROR,
    ),
    (
        "two subscription ids in SUBSCRIBE",
        5,
        pkt(0x82, b"\x00\x01\x04\x0b\x01\x0b\x02\x00\x01t\x00"),
        PROTOCOL_ERROR,
    ),
    ("user property bad UTF-8", 5, pub5(b"\x26\x00\x01\xff\x00\x00"), MALFORMED),
    ("user property U+0000", 5, pub5(b"\x26\x00\x01\x00\x00\x00"), MALFORMED),
    ("correlation data past end", 5, pub5(b"\x09\x00\x05"), MALFORMED),
    ("reason string in PUBLISH", 5, pub5(b"\x1f\x00\x01x"), MALFORMED),
    ("session expiry in DISCONNECT after 0", 5, pkt(0xE0, b"\x00\x05\x11\x00\x00\x00\x05"), 0x82),
    ("AUTH without auth method", 5, b"\xf0\x02\x18\x00", PROTOCOL_ERROR),
    ("AUTH bad reason", 5, b"\xf0\x02\x05\x00", MALFORMED),
    ("varint past 4 bytes in property", 5, pub5(b"\x0b\xff\xff\xff\xff"), MALFORMED),
]


@pytest.mark.parametrize(
    ("level", "data", "code"), [c[1:] for c in OPEN_CASES], ids=[c[0] for c in OPEN_CASES]
)
def test_open_connection_rejects(level: int, data: bytes, code: int) -> None:
    conn = open_connection(level)
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    err = info.value
    assert err.reason_code == code, err
    assert not err.send_connack
    assert err.send_disconnect == (level == 5)
    answer = conn.error_packet(err)
    if level == 5:
        assert answer == bytes((0xE0, 1, code))
    else:
        assert answer == b""  # 3.1.1: close the connection, nothing to send
    # The connection stays failed.
    with pytest.raises(RemoteProtocolError):
        conn.next_event()


@pytest.mark.parametrize(
    ("level", "data", "code"), [c[1:] for c in OPEN_CASES], ids=[c[0] for c in OPEN_CASES]
)
def test_next_event_agrees_with_events(level: int, data: bytes, code: int) -> None:
    conn = open_connection(level)
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.reason_code == code


def connect_bytes(level: int, flags: int, payload: bytes, props: bytes = b"") -> bytes:
    name = b"\x00\x06MQIsdp" if level == 3 else b"\x00\x04MQTT"
    body = name + bytes((level, flags)) + b"\x00\x3c"
    if level == 5:
        body += bytes((len(props),)) + props
    body += payload
    return bytes((0x10, len(body))) + body


CID = b"\x00\x02id"

# (id, bytes, reason code, expected answer)
CONNECT_CASES: list[tuple[str, bytes, int, bytes]] = [
    ("PINGREQ first", b"\xc0\x00", PROTOCOL_ERROR, b""),
    ("PUBLISH first", b"\x30\x03\x00\x01t", PROTOCOL_ERROR, b""),
    ("unknown protocol name", b"\x10\x0c\x00\x04HTTP\x04\x02\x00\x3c\x00\x00", MALFORMED, b""),
    ("MQTT level 6", b"\x10\x0c\x00\x04MQTT\x06\x02\x00\x3c\x00\x00", 0x84, b"\x20\x02\x00\x01"),
    ("MQTT level 3", b"\x10\x0e\x00\x04MQTT\x03\x02\x00\x3c\x00\x02id", 0x84, b"\x20\x02\x00\x01"),
    (
        "MQIsdp level 4",
        connect_bytes(3, 2, CID).replace(b"\x03\x02", b"\x04\x02"),
        0x84,
        b"\x20\x02\x00\x01",
    ),
    ("reserved flag 3.1.1", connect_bytes(4, 0x03, CID), MALFORMED, b""),
    ("reserved flag 5.0", connect_bytes(5, 0x03, CID), MALFORMED, b"\x20\x03\x00\x81\x00"),
    ("will QoS without will", connect_bytes(4, 0x0A, CID), MALFORMED, b""),
    ("will retain without will", connect_bytes(4, 0x22, CID), MALFORMED, b""),
    ("will QoS 3", connect_bytes(4, 0x1E, CID + b"\x00\x01w\x00\x00"), MALFORMED, b""),
    ("password without user name", connect_bytes(4, 0x42, CID + b"\x00\x01p"), MALFORMED, b""),
    ("password without user name 3.1", connect_bytes(3, 0x42, CID + b"\x00\x01p"), MALFORMED, b""),
    ("bytes after payload", connect_bytes(4, 0x02, CID + b"x"), MALFORMED, b""),
    ("missing user name", connect_bytes(4, 0x82, CID), MALFORMED, b""),
    (
        "empty id without clean session",
        connect_bytes(4, 0x00, b"\x00\x00"),
        0x85,
        b"\x20\x02\x00\x02",
    ),
    ("empty id in 3.1", connect_bytes(3, 0x02, b"\x00\x00"), 0x85, b"\x20\x02\x00\x02"),
    ("client id bad UTF-8", connect_bytes(4, 0x02, b"\x00\x01\xff"), MALFORMED, b""),
    (
        "client id U+0000",
        connect_bytes(5, 0x02, b"\x00\x01\x00"),
        MALFORMED,
        b"\x20\x03\x00\x81\x00",
    ),
    ("will topic wildcard", connect_bytes(4, 0x06, CID + b"\x00\x01#\x00\x00"), 0x90, b""),
    (
        "will topic wildcard 5.0",
        connect_bytes(5, 0x06, CID + b"\x00\x00\x01#\x00\x00"),
        0x90,
        b"\x20\x03\x00\x90\x00",
    ),
    (
        "topic alias in will properties",
        connect_bytes(5, 0x06, CID + b"\x03\x23\x00\x01\x00\x01w\x00\x00"),
        MALFORMED,
        b"\x20\x03\x00\x81\x00",
    ),
    (
        "receive maximum 0",
        connect_bytes(5, 0x02, CID, b"\x21\x00\x00"),
        0x82,
        b"\x20\x03\x00\x82\x00",
    ),
    (
        "maximum packet size 0",
        connect_bytes(5, 0x02, CID, b"\x27\x00\x00\x00\x00"),
        0x82,
        b"\x20\x03\x00\x82\x00",
    ),
    (
        "duplicate CONNECT property",
        connect_bytes(5, 0x02, CID, b"\x22\x00\x01\x22\x00\x01"),
        0x82,
        b"\x20\x03\x00\x82\x00",
    ),
    (
        "server property in CONNECT",
        connect_bytes(5, 0x02, CID, b"\x24\x01"),
        MALFORMED,
        b"\x20\x03\x00\x81\x00",
    ),
    (
        "request problem information 2",
        connect_bytes(5, 0x02, CID, b"\x17\x02"),
        0x82,
        b"\x20\x03\x00\x82\x00",
    ),
    ("CONNECT flags 0001 in header", b"\x11" + connect_bytes(4, 0x02, CID)[1:], MALFORMED, b""),
]


@pytest.mark.parametrize(
    ("data", "code", "answer"), [c[1:] for c in CONNECT_CASES], ids=[c[0] for c in CONNECT_CASES]
)
def test_connect_rejects(data: bytes, code: int, answer: bytes) -> None:
    conn = Connection()
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == code
    assert not info.value.send_disconnect
    assert info.value.send_connack == bool(answer)
    assert conn.error_packet(info.value) == answer
    assert conn.protocol_level is None


def test_accepted_connect_variants() -> None:
    # MQTT 5 allows a password without a user name and an empty id without clean start.
    for data in (
        connect_bytes(5, 0x42, CID + b"\x00\x01p"),
        connect_bytes(5, 0x00, b"\x00\x00"),
        connect_bytes(4, 0x02, b"\x00\x00"),
        connect_bytes(3, 0x02, CID),
    ):
        conn = Connection()
        conn.receive_data(data)
        assert len(conn.events()) == 1


def test_packet_too_large_is_refused_from_the_header() -> None:
    conn = open_connection(5, max_packet_size=100)
    conn.receive_data(b"\x30\x62")  # 2 + 98 = 100 bytes: fits
    assert conn.events() == []
    conn = open_connection(5, max_packet_size=100)
    conn.receive_data(b"\x30\x63")  # 101 bytes: refused before any body arrives
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x95
    assert conn.error_packet(info.value) == b"\xe0\x01\x95"


def test_too_large_connect_gets_no_answer_before_the_level_is_known() -> None:
    conn = Connection(max_packet_size=64)
    conn.receive_data(connect_packet(5, "x" * 100))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.reason_code == 0x95
    assert conn.error_packet(info.value) == b""


def test_receive_maximum_exceeded() -> None:
    conn = open_connection(5, connack_properties=Properties(receive_maximum=2))
    data = b"".join(encode(Publish("t", b"", 1, packet_id=i), 5) for i in (1, 2, 3))
    conn.receive_data(data)
    assert len(conn.events()) == 2
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x93


def test_receive_maximum_frees_on_ack() -> None:
    from gateway.protocol import PubAck, PubComp, PubRec

    conn = open_connection(5, connack_properties=Properties(receive_maximum=1))
    for packet_id in range(1, 5):
        conn.receive_data(encode(Publish("t", b"", 1, packet_id=packet_id), 5))
        assert len(conn.events()) == 1
        conn.send(PubAck(packet_id))
    conn.receive_data(encode(Publish("t", b"", 2, packet_id=9), 5))
    assert len(conn.events()) == 1
    conn.send(PubRec(9))
    conn.receive_data(b"\x62\x02\x00\x09")
    assert len(conn.events()) == 1
    conn.receive_data(encode(Publish("t", b"", 1, packet_id=10), 5))
    with pytest.raises(RemoteProtocolError):
        conn.events()  # PUBCOMP not sent yet: the QoS 2 flow still counts
    conn2 = open_connection(5, connack_properties=Properties(receive_maximum=1))
    conn2.receive_data(encode(Publish("t", b"", 2, packet_id=9), 5) + b"\x62\x02\x00\x09")
    conn2.events()
    conn2.send(PubRec(9))
    conn2.send(PubComp(9))
    conn2.receive_data(encode(Publish("t", b"", 1, packet_id=10), 5))
    assert len(conn2.events()) == 1


def test_maximum_qos_and_retain_available() -> None:
    conn = open_connection(5, connack_properties=Properties(maximum_qos=1))
    conn.receive_data(encode(Publish("t", b"", 2, packet_id=1), 5))
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x9B
    conn = open_connection(5, connack_properties=Properties(retain_available=0))
    conn.receive_data(encode(Publish("t", b"", 0, retain=True), 5))
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x9A


def test_error_after_connect_before_connack_answers_with_connack() -> None:
    conn = Connection()
    conn.receive_data(connect_packet(5) + b"\x30\x03\x00\x01\xff")
    events = conn.events()
    assert len(events) == 1
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.send_connack
    assert conn.error_packet(info.value) == b"\x20\x03\x00\x81\x00"


def test_events_returns_good_events_before_raising() -> None:
    conn = open_connection(4)
    conn.receive_data(b"\xc0\x00" + encode(Publish("a", b"1"), 4) + b"\x00\x00" + b"\xc0\x00")
    assert len(conn.events()) == 2
    with pytest.raises(RemoteProtocolError):
        conn.events()
    with pytest.raises(RemoteProtocolError):
        conn.events()


def test_packets_after_disconnect_are_refused() -> None:
    conn = open_connection(4)
    conn.receive_data(b"\xe0\x00\xc0\x00")
    assert len(conn.events()) == 1
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert conn.error_packet(info.value) == b""


@pytest.mark.parametrize("limit", [129, 130, 200, 301])
def test_packet_size_limit_on_the_inline_path(limit: int) -> None:
    conn = open_connection(4, max_packet_size=limit)
    small = encode(Publish("t", b"x" * 100), 4)  # 105 bytes
    large = encode(Publish("t", b"x" * 296), 4)  # 302 bytes
    conn.receive_data(small + small + large)
    assert len(conn.events()) == 2
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x95


def test_payload_format_and_response_topic_rules() -> None:
    conn = open_connection(5)
    ok = Publish("t", "grüße".encode(), properties=Properties(payload_format_indicator=1))
    conn.receive_data(encode(ok, 5))
    assert conn.events() == [ok]
    bad = Publish("t", b"\xff\xfe", properties=Properties(payload_format_indicator=1))
    conn.receive_data(encode(bad, 5))
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x99
    assert conn.error_packet(info.value) == b"\xe0\x01\x99"

    conn = open_connection(5)
    conn.receive_data(encode(Publish("t", b"", properties=Properties(response_topic="r/#")), 5))
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == PROTOCOL_ERROR


def test_will_payload_format_checked_in_connect() -> None:
    from gateway.protocol import Connect, Will

    will = Will("w", b"\xff", 0, False, Properties(payload_format_indicator=1))
    conn = Connection()
    conn.receive_data(encode(Connect(5, "c", will=will), 5))
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert conn.error_packet(info.value) == b"\x20\x03\x00\x99\x00"


def test_auth_method_must_match_connect() -> None:
    from gateway.protocol import Auth, Connect

    conn = Connection()
    conn.receive_data(
        encode(Connect(5, "c", properties=Properties(authentication_method="A")), 5)
        + encode(Auth(0x18, Properties(authentication_method="B")), 5)
    )
    assert len(conn.events()) == 1
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == PROTOCOL_ERROR
