"""The PUBLISH fast paths give the general paths' bytes, events and errors.

PreparedPublish.packet (one struct per prepared packet), encode() (PUBLISH inline, packet-id
table) and the inline decode of fast_decoder.decode_batch (first-byte table per maximum QoS / retain
available, bare Publish instances) each have a slower twin; these tests hold them together.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol import (
    Connection,
    Disconnect,
    LocalProtocolError,
    PreparedPublish,
    Properties,
    PubAck,
    Publish,
    RemoteProtocolError,
    encode,
)
from gateway.protocol.readers import decode_packet
from gateway.protocol.writers import _write_publish_general

from .helpers import connect_packet, drain_one_by_one, feed, open_connection

TOPIC = st.text(
    st.characters(blacklist_characters="+#\x00", blacklist_categories=["Cs"]),
    min_size=1,
    max_size=30,
)
PAYLOAD_SIZES = st.sampled_from([0, 1, 60, 90, 120, 127, 128, 200, 16_300, 16_383, 16_400, 70_000])


@settings(max_examples=150, deadline=None)
@given(
    level=st.sampled_from([3, 4, 5]),
    topic=TOPIC,
    size=PAYLOAD_SIZES,
    qos=st.integers(1, 2),
    retain=st.booleans(),
    dup=st.booleans(),
    packet_id=st.integers(1, 0xFFFF),
    expiry=st.none() | st.integers(0, 2**32 - 1),
)
def test_prepared_packet_equals_encode(
    level: int,
    topic: str,
    size: int,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int,
    expiry: int | None,
) -> None:
    props = Properties(message_expiry_interval=expiry) if level == 5 and expiry else None
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    prepared = PreparedPublish(level, Publish(topic, payload, qos, retain, False, None, props))
    data = prepared.packet(packet_id, dup)
    assert data == encode(Publish(topic, payload, qos, retain, dup, packet_id, props), level)
    assert len(data) == prepared.size
    decoded = decode_packet(data, level)
    assert isinstance(decoded, Publish)
    assert (decoded.packet_id, decoded.dup, decoded.payload) == (packet_id, dup, payload)


@pytest.mark.parametrize("level", [4, 5])
def test_prepared_packet_id_range_and_qos0(level: int) -> None:
    prepared = PreparedPublish(level, Publish("t/x", b"p", 1))
    for bad in (None, 0, -1, 0x10000, 1 << 40, 1.5):
        with pytest.raises(LocalProtocolError, match="packet identifier"):
            prepared.packet(bad)  # type: ignore[arg-type]
    assert prepared.packet(0xFFFF)[7:9] == b"\xff\xff"
    qos0 = PreparedPublish(level, Publish("t/x", b"p", 0))
    assert qos0.packet() == encode(Publish("t/x", b"p"), level)
    for packet_id, dup in ((1, False), (0, False), (None, True), (5, True)):
        with pytest.raises(LocalProtocolError, match="QoS 0"):
            qos0.packet(packet_id, dup)


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_encode_publish_refuses_unknown_levels(qos: int) -> None:
    publish = Publish("t", b"x", qos, packet_id=1 if qos else None)
    encode(publish, 4)  # the topic is now cached: the fast path would accept it
    for level in (0, 2, 6, 7):
        with pytest.raises(LocalProtocolError, match="level"):
            encode(publish, level)
    with pytest.raises(LocalProtocolError, match="level"):
        _write_publish_general(publish, 6)


def test_event_fields_are_the_ones_the_inline_decoder_sets() -> None:
    # fast_decoder.decode_batch fills bare Publish / PubAck instances slot by slot; a new field must
    # be set there too.
    names = [field.name for field in dataclasses.fields(Publish)]
    assert names == ["topic", "payload", "qos", "retain", "dup", "packet_id", "properties"]
    assert [field.name for field in dataclasses.fields(PubAck)] == [
        "packet_id",
        "reason_code",
        "properties",
    ]


@pytest.mark.parametrize("level", [4, 5])
def test_inline_decode_equals_general_decode(level: int) -> None:
    events = [
        Publish("a/b", b"0" * 10),
        Publish("a/b", b"1" * 200, 1, True, False, 7),
        Publish("a/b", b"2", 1, False, True, 8),
        Publish("c", b"3" * 20_000, 1, False, False, 9),
        Publish("c", b"", 0, True),
    ]
    data = b"".join(encode(event, level) for event in events)
    batch = feed(open_connection(level), data)
    general = [decode_packet(encode(event, level), level) for event in events]
    assert batch == general == events
    conn = open_connection(level)
    conn.receive_data(data)
    assert drain_one_by_one(conn) == events


def test_maximum_qos_0_refuses_qos1_after_good_packets_in_one_batch() -> None:
    conn = open_connection(5, connack_properties=Properties(maximum_qos=0))
    data = encode(Publish("t", b"a"), 5) + encode(Publish("t", b"b", 1, packet_id=3), 5)
    assert feed(conn, data) == [Publish("t", b"a")]
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x9B
    assert conn.inbound_qos2_ids() == frozenset()


@pytest.mark.parametrize("qos", [0, 1])
def test_retain_unavailable_refuses_retained_after_good_packets(qos: int) -> None:
    conn = open_connection(5, connack_properties=Properties(retain_available=0))
    retained = Publish("t", b"b", qos, True, False, 4 if qos else None)
    data = encode(Publish("t", b"a", 1, packet_id=3), 5) + encode(retained, 5)
    assert feed(conn, data) == [Publish("t", b"a", 1, packet_id=3)]
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x9A


def test_v5_qos1_with_properties_and_without_property_length() -> None:
    conn = open_connection(5)
    with_props = Publish("t", b"x", 1, packet_id=5, properties=Properties(content_type="c"))
    assert feed(conn, encode(with_props, 5)) == [with_props]
    # Remaining length that ends right after the packet id: no property length byte.
    truncated = b"\x32\x05\x00\x01t\x00\x06" + encode(Publish("t", b"y"), 5)
    with pytest.raises(RemoteProtocolError) as info:
        feed(conn, truncated)
    assert info.value.reason_code == 0x81


def test_qos1_packet_id_zero_is_refused_inline() -> None:
    conn = open_connection(4)
    data = encode(Publish("t", b"a"), 4) + b"\x32\x05\x00\x01t\x00\x00"
    assert feed(conn, data) == [Publish("t", b"a")]
    with pytest.raises(RemoteProtocolError):
        conn.events()


@pytest.mark.parametrize("level", [3, 4, 5])
def test_send_puback_fast_path_equals_writer_and_frees_the_id(level: int) -> None:
    conn = open_connection(level, connack_properties=Properties(receive_maximum=1))
    for packet_id in (1, 0x1234, 0xFFFF):
        feed(conn, encode(Publish("t", b"x", 1, packet_id=packet_id), level))
        assert conn.send(PubAck(packet_id)) == encode(PubAck(packet_id), level)
    # The quota of 1 is free again after each PUBACK; a reason code takes the general path.
    feed(conn, encode(Publish("t", b"x", 1, packet_id=9), level))
    assert conn.send(PubAck(9, 0x10)) == encode(PubAck(9, 0x10), level)
    feed(conn, encode(Publish("t", b"x", 1, packet_id=10), level))


def test_send_puback_fast_path_keeps_the_checks() -> None:
    conn = open_connection(5)
    for bad in (0, -1, 0x10000):
        with pytest.raises(LocalProtocolError):
            conn.send(PubAck(bad))
    with pytest.raises(LocalProtocolError):
        conn.send(PubAck(1, 0x8C))  # not a PUBACK reason code (3.4.2.1)
    tiny = open_connection(5)
    tiny.client_max_packet_size = 3  # as if CONNECT said so (the CONNACK would not fit either)
    with pytest.raises(LocalProtocolError):
        tiny.send(PubAck(1))  # 4 bytes exceed the client's maximum of 3
    before = Connection()
    before.receive_data(connect_packet(4))
    before.events()
    with pytest.raises(LocalProtocolError):
        before.send(PubAck(1))  # before CONNACK
    conn.send(Disconnect())
    with pytest.raises(LocalProtocolError):
        conn.send(PubAck(1))  # after our DISCONNECT


def test_prepared_takes_any_bytes_like_payload_and_caches_packers_by_shape() -> None:
    from gateway.protocol import prepared as prepared_module

    expected = encode(Publish("t/v", b"abc", 1, packet_id=3), 5)
    for payload in (b"abc", bytearray(b"abc"), memoryview(b"xabc")[1:]):
        prepared = PreparedPublish(5, Publish("t/v", payload, 1))  # type: ignore[arg-type]
        assert prepared.packet(3) == expected
    first = PreparedPublish(4, Publish("same/shape", b"1" * 10, 1))
    second = PreparedPublish(4, Publish("same/shape", b"2" * 10, 1))
    assert first._pack is second._pack
    assert second.packet(1) != first.packet(1)
    assert len(prepared_module._PACKERS) <= prepared_module._PACKERS_SIZE
