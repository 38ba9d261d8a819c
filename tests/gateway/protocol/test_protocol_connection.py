"""The server state machine: CONNECT first, packet ids both ways, aliases, sending rules,
and framing that does not care how the bytes are split."""

from __future__ import annotations

import pytest

from gateway.protocol import (
    NEED_DATA,
    Auth,
    ConnAck,
    Connect,
    Connection,
    ConnectionClosed,
    Disconnect,
    Event,
    LocalProtocolError,
    PingReq,
    PingResp,
    PreparedPublish,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    RemoteProtocolError,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
    encode,
)

from .helpers import drain_one_by_one, open_connection


def client_stream(level: int) -> list[Event]:
    """Everything a client may send, in a valid order, CONNECT first."""
    v5 = level == 5
    props = Properties(user_properties=[("k", "v")]) if v5 else None
    events: list[Event] = [
        Connect(
            level,
            "dev-1",
            False,
            45,
            "user",
            b"secret",
            Will(
                "dev/1/status",
                b"offline",
                1,
                True,
                Properties(will_delay_interval=5) if v5 else Properties(),
            ),
            Properties(session_expiry_interval=300, authentication_method="PLAIN")
            if v5
            else Properties(),
        ),
        Publish("dev/1/temp", b"21.5", 0),
        Publish("dev/1/temp", b"x" * 200, 1, True, False, 1, props),
        Publish("dev/1/temp", b"y" * 300, 2, False, False, 2),
        PubRel(2),
        PubAck(100),
        PubRec(101),
        PubComp(101),
        Subscribe(3, [Subscription("cmd/#", 1), Subscription("cfg/+", 2)]),
        Unsubscribe(4, ["cmd/#"]),
        PingReq(),
    ]
    if v5:
        events.append(Auth(0x19, Properties(authentication_method="PLAIN")))
    events.append(Disconnect())
    return events


@pytest.mark.parametrize("level", [3, 4, 5])
def test_split_at_every_byte_boundary(level: int) -> None:
    expected = client_stream(level)
    data = b"".join(encode(e, level) for e in expected)
    for cut in range(len(data) + 1):
        conn = Connection()
        got: list[Event] = []
        for part in (data[:cut], data[cut:]):
            if part:
                conn.receive_data(part)
            got += conn.events()
        assert got == expected, cut


@pytest.mark.parametrize("level", [3, 4, 5])
def test_byte_by_byte_with_next_event(level: int) -> None:
    expected = client_stream(level)
    data = b"".join(encode(e, level) for e in expected)
    conn = Connection()
    got: list[Event] = []
    for i in range(len(data)):
        conn.receive_data(data[i : i + 1])
        got += drain_one_by_one(conn)
    assert got == expected
    conn.receive_data(b"")
    assert conn.next_event() == ConnectionClosed()


@pytest.mark.parametrize("level", [4, 5])
def test_truncated_packet_at_eof(level: int) -> None:
    packets = [encode(e, level) for e in client_stream(level)[:4]]
    data = b"".join(packets)
    boundaries = {sum(len(p) for p in packets[:i]) for i in range(len(packets) + 1)}
    for cut in range(1, len(data)):
        conn = Connection()
        conn.receive_data(data[:cut])
        conn.receive_data(b"")
        if cut in boundaries:
            assert isinstance(conn.events()[-1], ConnectionClosed)
            continue
        with pytest.raises(RemoteProtocolError) as info:
            while conn.events():
                pass
        assert info.value.reason_code == 0x81
        assert conn.error_packet(info.value) in (b"", b"\x20\x03\x00\x81\x00")


def test_eof_on_boundary_is_connection_closed() -> None:
    conn = open_connection(4)
    conn.receive_data(b"\xc0\x00")
    conn.receive_data(b"")
    assert conn.events() == [PingReq(), ConnectionClosed()]
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"more")


def test_large_packet_trickled_in_small_chunks() -> None:
    conn = open_connection(5)
    payload = bytes(range(256)) * 2000
    data = encode(Publish("big/one", payload, 1, packet_id=7), 5) + b"\xc0\x00"
    got: list[Event] = []
    for i in range(0, len(data), 1000):
        conn.receive_data(data[i : i + 1000])
        got += conn.events()
        # The buffer never holds much more than the unconsumed bytes.
        assert len(conn._buf) - conn._off <= len(data)
    assert got == [Publish("big/one", payload, 1, False, False, 7), PingReq()]


def test_many_tiny_packets_in_one_read() -> None:
    conn = open_connection(4)
    conn.receive_data(b"\xc0\x00" * 10000 + b"\x30\x03\x00\x01a")
    events = conn.events()
    assert len(events) == 10001
    assert events[-1] == Publish("a", b"")


def test_connect_sets_level_and_client_limits() -> None:
    conn = Connection()
    assert conn.protocol_level is None
    props = Properties(receive_maximum=3, maximum_packet_size=200, topic_alias_maximum=4)
    conn.receive_data(encode(Connect(5, "c", True, 10, properties=props), 5))
    event = conn.next_event()
    assert isinstance(event, Connect) and event.client_id == "c"
    assert conn.protocol_level == 5
    assert conn.keep_alive == 10 and conn.keep_alive_timeout == 15.0
    assert conn.client_receive_maximum == 3
    assert conn.client_max_packet_size == 200
    assert conn.client_topic_alias_maximum == 4
    conn.send(ConnAck(False, 0, Properties(server_keep_alive=5)))
    assert conn.keep_alive == 5


def test_v4_defaults() -> None:
    conn = open_connection(4)
    assert conn.client_receive_maximum == 65535
    assert conn.client_max_packet_size is None
    assert conn.client_topic_alias_maximum == 0
    assert conn.keep_alive == 30


def test_sending_rules() -> None:
    conn = Connection()
    with pytest.raises(LocalProtocolError):
        conn.send(ConnAck())  # nothing received yet
    conn.receive_data(encode(Connect(4, "c"), 4))
    conn.events()
    with pytest.raises(LocalProtocolError):
        conn.send(PingResp())  # before CONNACK
    with pytest.raises(LocalProtocolError):
        conn.send(PingReq())  # a server never sends PINGREQ
    with pytest.raises(LocalProtocolError):
        conn.send(ConnAck(False, 0x10))  # not a CONNACK reason code
    assert conn.send(ConnAck()) == b"\x20\x02\x00\x00"
    with pytest.raises(LocalProtocolError):
        conn.send(ConnAck())  # only once
    assert conn.send(PingResp()) == b"\xd0\x00"
    assert conn.send(SubAck(1, [0, 1, 0x80])) == b"\x90\x05\x00\x01\x00\x01\x80"
    assert conn.send(UnsubAck(2, [0])) == b"\xb0\x02\x00\x02"
    with pytest.raises(LocalProtocolError):
        conn.send(Auth())  # MQTT 5 only
    assert conn.send(Disconnect(0x8B)) == b""  # 3.1.1 has no server DISCONNECT: just close
    with pytest.raises(LocalProtocolError):
        conn.send(PingResp())


def test_refused_connack_closes() -> None:
    conn = Connection()
    conn.receive_data(encode(Connect(5, "c"), 5))
    conn.events()
    assert conn.send(ConnAck(True, 0x86)) == b"\x20\x03\x00\x86\x00"
    with pytest.raises(LocalProtocolError):
        conn.send(PingResp())


def test_inbound_qos2_duplicate_before_pubrel() -> None:
    conn = open_connection(4)
    packet = encode(Publish("t", b"m", 2, packet_id=5), 4)
    conn.receive_data(packet)
    (first,) = conn.events()
    assert isinstance(first, Publish) and not first.dup
    assert conn.inbound_qos2_ids() == {5}
    conn.send(PubRec(5))
    conn.receive_data(packet)  # resent (PUBREC lost): flagged, not a new message
    (again,) = conn.events()
    assert isinstance(again, Publish) and again.dup
    conn.receive_data(b"\x62\x02\x00\x05")
    assert conn.events() == [PubRel(5)]
    assert conn.inbound_qos2_ids() == frozenset()
    conn.send(PubComp(5))
    conn.receive_data(packet)  # after PUBREL the id is free: a new message
    (new,) = conn.events()
    assert isinstance(new, Publish) and not new.dup


def test_restored_inbound_qos2() -> None:
    conn = open_connection(5)
    conn.restore_inbound_qos2([9])
    conn.receive_data(encode(Publish("t", b"m", 2, True, True, 9), 5))
    (event,) = conn.events()
    assert isinstance(event, Publish) and event.dup


def test_outbound_packet_ids() -> None:
    conn = open_connection(5, connect_properties=Properties(receive_maximum=2))
    conn.send(Publish("t", b"1", 1, packet_id=1))
    with pytest.raises(LocalProtocolError) as info:
        conn.send(Publish("t", b"1", 1, packet_id=1))
    assert info.value.reason_code == 0x91
    conn.send(Publish("t", b"1", 1, dup=True, packet_id=1))  # retransmission is fine
    conn.send(Publish("t", b"2", 2, packet_id=2))
    assert conn.outbound_quota == 0
    with pytest.raises(LocalProtocolError):
        conn.send(Publish("t", b"3", 1, packet_id=3))  # client Receive Maximum
    conn.send(Publish("t", b"0", 0))  # QoS 0 is not limited
    conn.receive_data(b"\x40\x02\x00\x01" + b"\x50\x02\x00\x02")
    assert conn.events() == [PubAck(1), PubRec(2)]
    assert conn.outbound_packet_ids() == {2}
    conn.send(PubRel(2))
    conn.receive_data(b"\x70\x02\x00\x02")
    assert conn.events() == [PubComp(2)]
    assert conn.outbound_in_flight == 0
    # An error PUBREC ends the flow.
    conn.send(Publish("t", b"4", 2, packet_id=4))
    conn.receive_data(b"\x50\x03\x00\x04\x80")
    assert conn.events() == [PubRec(4, 0x80)]
    assert conn.outbound_in_flight == 0


def test_restored_outbound() -> None:
    conn = open_connection(4)
    conn.restore_outbound(unacknowledged=[1, 2], released=[3])
    assert conn.outbound_packet_ids() == {1, 2, 3}
    conn.send(Publish("t", b"", 1, dup=True, packet_id=1))
    conn.receive_data(b"\x40\x02\x00\x01\x50\x02\x00\x02\x70\x02\x00\x03")
    assert len(conn.events()) == 3
    assert conn.outbound_packet_ids() == {2}


def test_send_prepared_tracks_ids_and_patches() -> None:
    conn = open_connection(5)
    prepared = PreparedPublish(
        5, Publish("a/b", b"hello", 1, properties=Properties(content_type="t"))
    )
    data = conn.send_prepared(prepared, 300)
    assert data == encode(
        Publish("a/b", b"hello", 1, False, False, 300, Properties(content_type="t")), 5
    )
    assert prepared.packet(301, True) == encode(
        Publish("a/b", b"hello", 1, False, True, 301, Properties(content_type="t")), 5
    )
    assert conn.outbound_packet_ids() == {300}
    with pytest.raises(LocalProtocolError):
        conn.send_prepared(prepared, 300)
    with pytest.raises(LocalProtocolError):
        conn.send_prepared(PreparedPublish(4, Publish("a", b"", 0)))  # wrong level
    qos0 = PreparedPublish(5, Publish("a", b"z", 0, retain=True))
    assert conn.send_prepared(qos0) == encode(Publish("a", b"z", 0, True), 5)
    with pytest.raises(LocalProtocolError):
        qos0.packet(1)
    with pytest.raises(LocalProtocolError):
        prepared.packet(0)


def test_prepared_large_payload_uses_multibyte_length() -> None:
    payload = b"p" * 70000
    prepared = PreparedPublish(4, Publish("t/x", payload, 2, True))
    assert prepared.packet(65535) == encode(Publish("t/x", payload, 2, True, False, 65535), 4)
    assert prepared.size == len(prepared.packet(1))


def test_inbound_topic_alias() -> None:
    conn = open_connection(5, connack_properties=Properties(topic_alias_maximum=2))
    conn.receive_data(encode(Publish("long/topic", b"1", properties=Properties(topic_alias=2)), 5))
    conn.receive_data(encode(Publish("", b"2", properties=Properties(topic_alias=2)), 5))
    conn.receive_data(encode(Publish("other", b"3", properties=Properties(topic_alias=2)), 5))
    conn.receive_data(encode(Publish("", b"4", properties=Properties(topic_alias=2)), 5))
    topics = [(e.topic, e.payload) for e in conn.events() if isinstance(e, Publish)]
    assert topics == [("long/topic", b"1"), ("long/topic", b"2"), ("other", b"3"), ("other", b"4")]
    conn.receive_data(encode(Publish("", b"5", properties=Properties(topic_alias=1)), 5))
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0x82  # alias 1 never set


def test_outbound_limits_of_the_client() -> None:
    conn = open_connection(
        5, connect_properties=Properties(maximum_packet_size=50, topic_alias_maximum=1)
    )
    conn.send(Publish("t", b"x" * 10, properties=Properties(topic_alias=1)))
    with pytest.raises(LocalProtocolError):
        conn.send(Publish("t", b"x", properties=Properties(topic_alias=2)))
    with pytest.raises(LocalProtocolError) as info:
        conn.send(Publish("t", b"x" * 100))
    assert info.value.reason_code == 0x95
    with pytest.raises(LocalProtocolError):
        conn.send_prepared(PreparedPublish(5, Publish("t", b"x" * 100)))


def test_auth_exchange() -> None:
    conn = Connection()
    props = Properties(authentication_method="SCRAM-SHA-1", authentication_data=b"first")
    conn.receive_data(encode(Connect(5, "c", properties=props), 5))
    conn.events()
    challenge = Auth(
        0x18, Properties(authentication_method="SCRAM-SHA-1", authentication_data=b"c")
    )
    assert conn.send(challenge) == encode(challenge, 5)  # AUTH may precede CONNACK
    conn.receive_data(encode(Auth(0x18, Properties(authentication_method="SCRAM-SHA-1")), 5))
    assert len(conn.events()) == 1
    conn.send(ConnAck())


def test_disconnect_v5_session_expiry_rule() -> None:
    conn = open_connection(5, connect_properties=Properties(session_expiry_interval=10))
    conn.receive_data(encode(Disconnect(0x04, Properties(session_expiry_interval=0xFFFFFFFF)), 5))
    assert conn.events() == [Disconnect(0x04, Properties(session_expiry_interval=0xFFFFFFFF))]


def test_subscribe_v5_options_decode() -> None:
    conn = open_connection(5)
    options = bytes((0b0010_1110,))  # retain handling 2, RAP, no local, QoS 2
    body = b"\x00\x07\x02\x0b\x05" + b"\x00\x03a/b" + options
    conn.receive_data(bytes((0x82, len(body))) + body)
    assert conn.events() == [
        Subscribe(
            7, [Subscription("a/b", 2, True, True, 2)], Properties(subscription_identifiers=[5])
        )
    ]


def test_level_3_quirks() -> None:
    conn = open_connection(3)
    conn.receive_data(b"\x8a\x06\x00\x01\x00\x01t\x01")  # 3.1 SUBSCRIBE with DUP set
    assert conn.events() == [Subscribe(1, [Subscription("t", 1)])]


def test_request_problem_information_zero_strips_reason_strings() -> None:
    conn = open_connection(5, connect_properties=Properties(request_problem_information=0))
    props = Properties(reason_string="quota", user_properties=[("a", "b")])
    assert conn.send(PubAck(1, 0x97, props)) == b"\x40\x03\x00\x01\x97"
    # CONNACK / DISCONNECT / PUBLISH may still carry them
    assert conn.send(Disconnect(0x8B, props)) == encode(Disconnect(0x8B, props), 5)


def test_subscription_identifiers_not_available() -> None:
    conn = open_connection(5, connack_properties=Properties(subscription_identifier_available=0))
    conn.receive_data(
        encode(Subscribe(1, [Subscription("a", 0)], Properties(subscription_identifiers=[3])), 5)
    )
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert info.value.reason_code == 0xA1
    assert conn.error_packet(info.value) == b"\xe0\x01\xa1"


def test_authentication_data_without_method() -> None:
    conn = Connection()
    conn.receive_data(encode(Connect(5, "c", properties=Properties(authentication_data=b"x")), 5))
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert conn.error_packet(info.value) == b"\x20\x03\x00\x82\x00"


def test_error_packet_is_sent_once() -> None:
    conn = open_connection(5)
    conn.receive_data(b"\x00\x00")
    with pytest.raises(RemoteProtocolError) as info:
        conn.events()
    assert conn.error_packet(info.value) == b"\xe0\x01\x81"
    assert conn.error_packet(info.value) == b""
    with pytest.raises(LocalProtocolError):
        conn.send(PingResp())


def test_puback_fast_path_matches_general_path() -> None:
    conn = open_connection(4)
    conn.send(Publish("t", b"", 1, packet_id=1))
    conn.send(Publish("t", b"", 1, packet_id=2))
    conn.receive_data(b"\x40\x02\x00\x01\x40\x02\x00\x02\x40\x02\x00\x00")
    assert conn.events() == [PubAck(1), PubAck(2)]
    assert conn.outbound_in_flight == 0
    with pytest.raises(RemoteProtocolError):
        conn.events()  # packet id 0 falls through to the general path and is refused


def test_take_pubacks_hands_out_the_queued_run_next_event_would() -> None:
    """take_pubacks moves the PUBACKs heading the decoded queue, no more than its limit, and
    stops at another packet: next_event then goes on exactly where one-by-one calls would."""
    conn = open_connection(4)
    for pid in range(1, 6):
        conn.send(Publish("t", b"", 1, packet_id=pid))
    acks = b"".join(b"\x40\x02\x00" + bytes([pid]) for pid in range(1, 5))
    publish = encode(Publish("t", b"x", 0), 4)
    conn.receive_data(acks + publish + b"\x40\x02\x00\x05")
    assert conn.next_event() == PubAck(1)
    out: list[int] = []
    assert conn.take_pubacks(out, 2) == 2
    assert conn.take_pubacks(out, 10) == 1
    assert out == [2, 3, 4]
    assert conn.take_pubacks(out, 10) == 0
    assert conn.next_event() == Publish("t", b"x", 0)
    assert conn.next_event() == PubAck(5)
    assert conn.take_pubacks(out, 10) == 0 and out == [2, 3, 4]
    assert conn.next_event() is NEED_DATA
    assert conn.outbound_in_flight == 0


def test_allocate_packet_id_skips_ids_in_flight() -> None:
    conn = open_connection(4)
    conn.restore_outbound(unacknowledged=[1, 2, 4])
    assert conn.allocate_packet_id() == 3
    conn.send(Publish("t", b"", 1, packet_id=3))
    assert conn.allocate_packet_id() == 5
    conn.restore_outbound(unacknowledged=range(1, 65536))
    with pytest.raises(LocalProtocolError):
        conn.allocate_packet_id()
    conn.receive_data(b"\x40\x02\xff\xff")
    conn.events()
    assert conn.allocate_packet_id() == 65535


def test_next_event_applies_connect_handling_to_pipelined_packets() -> None:
    conn = Connection()
    resent = encode(Publish("t", b"m", 2, False, True, 7), 4)
    conn.receive_data(encode(Connect(4, "c", False), 4) + resent + b"\xc0\x00")
    assert isinstance(conn.next_event(), Connect)
    conn.restore_inbound_qos2([7])  # what the gateway does while handling CONNECT
    conn.send(ConnAck(True))
    event = conn.next_event()
    assert isinstance(event, Publish) and event.dup
    assert conn.events() == [PingReq()]
    assert conn.next_event() is NEED_DATA


def test_next_event_and_events_interleave_in_order() -> None:
    conn = open_connection(5)
    packets = [Publish("a", bytes([i]), 1, packet_id=i + 1) for i in range(5)]
    conn.receive_data(b"".join(encode(p, 5) for p in packets) + b"\x00\x00")
    assert conn.next_event() == packets[0]
    assert conn.next_event() == packets[1]
    assert conn.events() == packets[2:]
    with pytest.raises(RemoteProtocolError):
        conn.next_event()


@pytest.mark.parametrize("level", [3, 4, 5])
def test_idle_connection_allocates_no_containers(level: int) -> None:
    """Gateways hold many idle connections: after CONNECT, CONNACK and a PINGREQ a Connection
    is its slots plus the client id, with no queue, id sets or alias map made up front."""
    import gc
    import tracemalloc

    def idle(i: int) -> Connection:
        conn = Connection()
        conn.receive_data(encode(Connect(level, f"idle-{i:06d}", True, 30), level))
        assert isinstance(conn.next_event(), Connect)
        conn.send(ConnAck())
        conn.receive_data(b"\xc0\x00")
        assert conn.events() == [PingReq()]
        return conn

    idle(0)  # warm caches (topic/varint tables) before measuring
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        conns = [idle(i) for i in range(300)]
        gc.collect()
        per_connection = (tracemalloc.get_traced_memory()[0] - before) / len(conns)
    finally:
        tracemalloc.stop()
    assert per_connection < 600, per_connection
    # The lazily made containers still work once needed.
    conn = conns[0]
    assert conn.outbound_in_flight == 0 and conn.outbound_packet_ids() == frozenset()
    assert conn.inbound_qos2_ids() == frozenset()
    pid = conn.allocate_packet_id()
    conn.send(Publish("t", b"x", 1, packet_id=pid))
    assert conn.outbound_packet_ids() == {pid}


def test_send_publish_fast_path_keeps_every_check() -> None:
    conn = open_connection(
        5,
        connect_properties=Properties(
            maximum_packet_size=100, receive_maximum=1, topic_alias_maximum=2
        ),
    )
    with pytest.raises(LocalProtocolError) as too_large:
        conn.send(Publish("t", bytes(200)))
    assert too_large.value.reason_code == 0x95
    with pytest.raises(LocalProtocolError):
        conn.send(Publish("t", b"x", 0, packet_id=1))
    # A refused topic alias leaves no packet id in flight.
    with pytest.raises(LocalProtocolError):
        conn.send(Publish("t", b"x", 1, packet_id=5, properties=Properties(topic_alias=3)))
    assert conn.outbound_packet_ids() == frozenset()
    conn.send(Publish("t", b"x", 1, packet_id=5, properties=Properties(topic_alias=2)))
    with pytest.raises(LocalProtocolError) as in_use:
        conn.send(Publish("t", b"x", 1, packet_id=5))
    assert in_use.value.reason_code == 0x91
    assert conn.send(Publish("t", b"x", 1, dup=True, packet_id=5))  # a retransmission
    with pytest.raises(LocalProtocolError) as quota:
        conn.send(Publish("t", b"x", 1, packet_id=6))  # client Receive Maximum is 1
    assert quota.value.reason_code == 0x93
    conn.send(Disconnect())
    with pytest.raises(LocalProtocolError):
        conn.send(Publish("t", b"x"))
