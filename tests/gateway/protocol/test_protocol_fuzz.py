"""Hypothesis fuzzing: hostile bytes only ever raise RemoteProtocolError, never hang or hoard.

Three inputs: random bytes (before and after CONNECT, at every level), valid client streams
with random mutations, and the single-packet decoder. Round-trip properties check that what
we encode decodes back to the same event.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.protocol import (
    ConnAck,
    Connection,
    Event,
    Properties,
    Publish,
    RemoteProtocolError,
    Subscribe,
    Subscription,
    decode_packet,
    encode,
)
from tests.gateway.protocol.helpers import remaining_length

from .helpers import connect_packet
from .test_protocol_connection import client_stream

FUZZ = settings(max_examples=250, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
LEVELS = st.sampled_from([3, 4, 5])


def feed_all(conn: Connection, chunks: list[bytes]) -> list[Event]:
    """Feed chunks; stop at the first protocol error, as a server would."""
    fed = 0
    events: list[Event] = []
    try:
        for chunk in chunks:
            if not chunk:
                continue
            conn.receive_data(chunk)
            fed += len(chunk)
            events += conn.events()
            # The buffer holds at most what was fed (nothing is duplicated or retained).
            assert len(conn._buf) - conn._off <= fed
        conn.receive_data(b"")
        events += conn.events()
    except RemoteProtocolError as err:
        assert 0x80 <= err.reason_code <= 0xA2
        answer = conn.error_packet(err)
        assert len(answer) <= 5
    return events


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for point in [*points, len(data)]:
        out.append(data[last:point])
        last = point
    return out


@FUZZ
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_random_bytes_before_connect(data: bytes, cuts: list[int]) -> None:
    feed_all(Connection(max_packet_size=4096), split(data, cuts))


@FUZZ
@given(
    level=LEVELS,
    data=st.binary(max_size=400),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_random_bytes_after_connect(level: int, data: bytes, cuts: list[int]) -> None:
    conn = Connection(max_packet_size=4096)
    conn.receive_data(connect_packet(level))
    conn.events()
    conn.send(ConnAck(False, 0, Properties(topic_alias_maximum=5) if level == 5 else None))
    feed_all(conn, split(data, cuts))


MUTATION = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete"]),
    st.integers(0, 10_000),
    st.integers(0, 255),
)


@FUZZ
@given(
    level=LEVELS,
    mutations=st.lists(MUTATION, min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 2000), max_size=4),
)
def test_mutated_valid_streams(
    level: int, mutations: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    data = bytearray(b"".join(encode(e, level) for e in client_stream(level)))
    for kind, where, value in mutations:
        at = where % (len(data) + 1)
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << (value % 8)
        elif kind == "set" and at < len(data):
            data[at] = value
        elif kind == "insert":
            data[at:at] = bytes((value,))
        elif kind == "delete" and at < len(data):
            del data[at]
    feed_all(Connection(), split(bytes(data), cuts))


@FUZZ
@given(level=LEVELS, data=st.binary(min_size=0, max_size=300))
def test_decode_packet_random(level: int, data: bytes) -> None:
    try:
        decode_packet(data, level)
    except RemoteProtocolError:
        pass


@FUZZ
@given(level=LEVELS, first=st.integers(0, 255), body=st.binary(max_size=200))
def test_decode_packet_framed_random_body(level: int, first: int, body: bytes) -> None:
    data = bytes((first,)) + remaining_length(len(body)) + body
    try:
        decode_packet(data, level)
    except RemoteProtocolError:
        pass


TOPIC = st.text(
    st.characters(blacklist_characters="+#\x00", blacklist_categories=["Cs"]),
    min_size=1,
    max_size=40,
)


@FUZZ
@given(
    level=LEVELS,
    topic=TOPIC,
    payload=st.binary(max_size=300),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    dup=st.booleans(),
    packet_id=st.integers(1, 65535),
    expiry=st.none() | st.integers(0, 2**32 - 1),
    user=st.lists(st.tuples(TOPIC, TOPIC), max_size=3),
)
def test_publish_round_trip_through_connection(
    level: int,
    topic: str,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int,
    expiry: int | None,
    user: list[tuple[str, str]],
) -> None:
    props = None
    if level == 5 and (expiry is not None or user):
        props = Properties(message_expiry_interval=expiry, user_properties=user or None)
    event = Publish(topic, payload, qos, retain, dup and qos > 0, packet_id if qos else None, props)
    conn = Connection()
    conn.receive_data(connect_packet(level))
    conn.events()
    conn.send(ConnAck())
    conn.receive_data(encode(event, level))
    assert conn.events() == [event]
    assert decode_packet(encode(event, level), level) == event


@FUZZ
@given(
    filters=st.lists(
        st.tuples(TOPIC, st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2)),
        min_size=1,
        max_size=5,
    ),
    packet_id=st.integers(1, 65535),
)
def test_subscribe_round_trip_v5(
    filters: list[tuple[str, int, bool, bool, int]], packet_id: int
) -> None:
    subs = [
        Subscription(f, q, nl and not f.startswith("$share/"), rap, rh)
        for f, q, nl, rap, rh in filters
    ]
    event = Subscribe(packet_id, subs)
    assert decode_packet(encode(event, 5), 5) == event
