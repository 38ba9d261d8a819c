"""A device's read in one C call (`Connection.take_plain`, `take_plain` in _speedups.c)
against the Python path, its reference: for the same bytes cut into reads anywhere, the
publishes and PUBACKs it takes, followed by what `next_event` hands out after them, are the
events the pure-Python decoder hands out (same publishes in the same order, same PUBACK ids,
same errors and reason codes), and the connection's state after every read (the inbound QoS 1
ids its PUBACKs discharge, the outbound ids in flight, the buffer) is the same.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol import (
    NEED_DATA,
    Connection,
    Properties,
    PubAck,
    Publish,
    RemoteProtocolError,
    connection,
    encode,
    fast_decoder,
)
from gateway.protocol.readers import TOPIC_CACHE
from tests.gateway.protocol.test_protocol_scan_speedup import (
    PURE,
    TOPICS,
    acked_connection,
    connack_limits,
    raw_publish,
    scan_as,
    stream,
)

from .helpers import open_connection

speedups = pytest.importorskip("gateway.protocol._speedups")
TAKE = fast_decoder.TAKE_PLAIN or speedups.take_plain
SCAN = fast_decoder.SCAN or speedups.scan
PLAIN_TOPIC = TOPICS[0].decode()  # the topic the device published before

# A device's reads: mostly its own topic, in every shape take_plain must take or leave
# (QoS 0-2, RETAIN, DUP, properties, id 0), PUBACKs with and without reason code, and the
# scan test's mix of everything else.
device_publish = st.builds(
    raw_publish,
    first=st.sampled_from([0x30, 0x30, 0x32, 0x32, 0x31, 0x33, 0x34, 0x3A, 0x38]),
    topic=st.sampled_from([TOPICS[0], TOPICS[0], TOPICS[0], TOPICS[1]]),
    packet_id=st.sampled_from([b"\x00\x01", b"\x00\x02", b"\x00\x05", b"\x00\x00"]),
    props=st.sampled_from([b"", b"", b"", b"\x00", b"\x02\x01\x01"]),
    payload=st.sampled_from([b"", b"x" * 64, b"y" * 200]),
)
acks = st.sampled_from([b"\x40\x02\x00\x01", b"\x40\x02\x00\x05", b"\x40\x03\x00\x02\x10"])
device_stream = st.lists(
    st.one_of(device_publish, device_publish, device_publish, acks, stream.map(b"".join)),
    max_size=12,
)


@contextmanager
def take_as(take: Any) -> Iterator[None]:
    """Run with `take` as Connection.take_plain's C call (None: it takes nothing)."""
    loaded = connection.TAKE_PLAIN
    connection.TAKE_PLAIN = take
    try:
        yield
    finally:
        connection.TAKE_PLAIN = loaded


class Owner:
    """Stands for the connection and its property blocks in the batch's lists."""

    blocks = object()


def plain(event: Any) -> bool:
    """What take_plain may take: a plain publish on PLAIN_TOPIC, a PUBACK without reason code."""
    if type(event) is Publish:
        return event.topic == PLAIN_TOPIC and event.qos < 2 and not event.retain
    return type(event) is PubAck and event.reason_code == 0 and event.properties is None


def canonical(pubs: list[Any], acked: list[int], events: list[Any]) -> tuple[Any, ...]:
    """(publishes, PUBACK ids) of the plain run heading the read, then the rest: the order
    between a publish and a PUBACK (opposite directions) is the one thing not compared."""
    head = 0
    while head < len(events) and plain(events[head]):
        head += 1
    pubs = pubs + [e for e in events[:head] if type(e) is Publish]
    acked = acked + [e.packet_id for e in events[:head] if type(e) is PubAck]
    return pubs, acked, events[head:]


def observe(conn: Connection, data: bytes, cuts: list[int], taking: bool) -> list[Any]:
    """Per read the events (what was taken first) and any error; then the state."""
    seen: list[Any] = []
    points = sorted({c % (len(data) + 1) for c in cuts} | {len(data)})
    last = 0
    owner = Owner()
    for point in points:
        if point == last:
            continue  # b"" would mean EOF
        chunk = data[last:point]
        pubs: list[Any] = []
        acked: list[int] = []
        events: list[Any] = []
        try:
            if taking:
                owners: list[Any] = []
                blocks: list[Any] = []
                topic = PLAIN_TOPIC if len(data) % 3 else None  # sometimes none: PUBACKs only
                other: list[Any] = []
                left = conn.take_plain(
                    chunk, topic, pubs, owners, owner, blocks, owner.blocks, acked, other
                )
                assert owners == [owner] * len(pubs)
                assert blocks == [owner.blocks] * len(pubs)
                assert 0 <= left <= len(chunk)
                assert all(map(plain, pubs))
                assert topic is not None or not pubs
                assert len(other) <= 1 and all(o.topic != topic for o in other)
                events += other  # handed out before what next_event reads after it
            else:
                conn.receive_data(chunk)
            while (event := conn.next_event()) is not NEED_DATA:
                events.append(event)
        except RemoteProtocolError as err:
            seen.append(canonical(pubs, acked, events))
            seen.append(("error", type(err).__name__, int(err.reason_code), str(err)))
            break
        seen.append(canonical(pubs, acked, events))
        last = point
    ids = conn._ids
    seen.append(
        (
            "state",
            bytes(conn._buf)[conn._off :],
            None if ids is None else (sorted(ids.inbound_qos1), dict(ids.outbound)),
            conn._pending_error and str(conn._pending_error),
        )
    )
    return seen


def same_as_python(make: Any, data: bytes, cuts: list[int], cached: bool) -> None:
    outcomes = []
    for taking, scan in ((True, SCAN), (False, None)):
        TOPIC_CACHE.clear()
        if cached:
            TOPIC_CACHE.update({t: t.decode() for t in TOPICS[:3]})
        with scan_as(scan), take_as(TAKE if taking else None):
            outcomes.append(observe(make(), data, cuts, taking))
    assert outcomes[0] == outcomes[1]


@settings(max_examples=150, deadline=None)
@given(
    level=st.sampled_from([4, 5, 3]),
    packets=device_stream,
    cuts=st.lists(st.integers(0, 40_000), max_size=5),
    cached=st.booleans(),
    connack=connack_limits,
)
def test_take_plain_equals_python_path(
    level: int, packets: list[bytes], cuts: list[int], cached: bool, connack: Properties | None
) -> None:
    props = connack if level == 5 else None
    make = acked_connection(level, connack_properties=props)
    same_as_python(make, b"".join(packets), cuts, cached)


@settings(max_examples=60, deadline=None)
@given(packets=device_stream, cuts=st.lists(st.integers(0, 400), max_size=3))
def test_fresh_connection_and_small_limit(packets: list[bytes], cuts: list[int]) -> None:
    # No packet ids yet, and a limit under 130 bytes (no fast decoding): nothing differs.
    same_as_python(lambda: open_connection(4), b"".join(packets), cuts, True)
    same_as_python(lambda: open_connection(4, max_packet_size=100), b"".join(packets), cuts, True)


@pytest.mark.skipif(PURE, reason="a LMQTT_PURE_PYTHON switch is set: the Python path runs")
def test_a_device_read_is_taken_in_c() -> None:
    assert connection.TAKE_PLAIN is speedups.take_plain
    TOPIC_CACHE[TOPICS[0]] = PLAIN_TOPIC
    conn = open_connection(4)
    conn.receive_data(encode(Publish(PLAIN_TOPIC, b"first", 1, packet_id=1), 4))
    assert isinstance(conn.next_event(), Publish)  # the first one makes the packet ids
    data = b"".join(encode(Publish(PLAIN_TOPIC, b"p", 1, packet_id=i), 4) for i in range(2, 9))
    other = encode(Publish("cmd/3", b"q", 0), 4)
    pubs: list[Any] = []
    owners: list[Any] = []
    blocks: list[Any] = []
    conn.send(Publish("out/t", b"m", 1, packet_id=4))  # in flight to the device
    acks = encode(PubAck(4), 4)
    acked: list[int] = []
    taken: list[Any] = []
    after = encode(Publish(PLAIN_TOPIC, b"r", 1, packet_id=9), 4)
    left = conn.take_plain(
        data + acks + other + after, PLAIN_TOPIC, pubs, owners, "c", blocks, "b", acked, taken
    )
    assert left == len(after)  # another topic ends the run: what follows is next_event's
    assert taken == [Publish("cmd/3", b"q", 0)]  # for the caller to check first
    assert pubs == [Publish(PLAIN_TOPIC, b"p", 1, packet_id=i) for i in range(2, 9)]
    assert owners == ["c"] * 7 and blocks == ["b"] * 7 and acked == [4]
    assert conn._ids is not None and conn._ids.inbound_qos1 == set(range(1, 9))
    assert conn._ids.outbound == {}
    assert conn.next_event() == Publish(PLAIN_TOPIC, b"r", 1, packet_id=9)
    assert conn.next_event() is NEED_DATA


@pytest.mark.skipif(PURE, reason="a LMQTT_PURE_PYTHON switch is set: the Python path runs")
def test_a_device_first_publish_is_taken_in_c() -> None:
    """A new device's first PUBLISH (no topic yet, no packet ids, a name never read before):
    decoded in the same C call into `other`, its name checked and cached, its id in flight."""
    TOPIC_CACHE.clear()
    conn = open_connection(4)
    taken: list[Any] = []
    first = Publish("site/3/dev/77/temp", b"t", 1, packet_id=1)
    left = conn.take_plain(encode(first, 4), None, [], [], "c", [], None, [], taken)
    assert (left, taken) == (0, [first])
    assert TOPIC_CACHE == {b"site/3/dev/77/temp": "site/3/dev/77/temp"}
    assert conn._ids is not None and conn._ids.inbound_qos1 == {1}
    assert conn.next_event() is NEED_DATA
    for bad in (b"a/+", b"a/#", b"a/\x00", b"\xff", b""):  # the Python decoder's to refuse
        conn = open_connection(4)
        data = raw_publish(0x32, bad, b"\x00\x01", b"", b"x")
        taken = []
        assert conn.take_plain(data, None, [], [], "c", [], None, [], taken) == len(data)
        assert taken == [] and bad not in TOPIC_CACHE


def test_no_reference_leak() -> None:
    TOPIC_CACHE[TOPICS[0]] = PLAIN_TOPIC
    data = (
        raw_publish(0x32, TOPICS[0], b"\x00\x07", b"", b"x" * 64)
        + raw_publish(0x30, TOPICS[0], b"", b"", b"y" * 64)
        + b"\x40\x02\x00\x07"
    )
    table = fast_decoder.FAST_PUBLISH_QOS[True, True]
    owner, owner_blocks = object(), object()

    def run() -> int:
        pubs: list[Any] = []
        off: int = TAKE(
            data, table, 1 << 20, False, TOPIC_CACHE, set(), {7: 1}, 65535, 0, PLAIN_TOPIC,
            pubs, [], owner, [], owner_blocks, [], [],
        )  # fmt: skip
        return off

    assert run() == len(data)
    watched = (data, table, owner, owner_blocks, TOPIC_CACHE[TOPICS[0]])
    counts = [sys.getrefcount(o) for o in watched]
    for _ in range(20_000):
        run()
    assert [sys.getrefcount(o) for o in watched] == counts


@settings(max_examples=200, deadline=None)
@given(
    acked=st.lists(st.integers(1, 0xFFFF), max_size=20),
    in_flight=st.sets(st.integers(1, 0xFFFF), max_size=20),
)
def test_c_pubacks_equal_python(acked: list[int], in_flight: set[int]) -> None:
    """The PUBACKs of stored publishes (Connection.pubacks), built in C and in Python: the same
    bytes, the same inbound ids left in flight."""
    outcomes = []
    for build in (speedups.pubacks, None):
        conn = open_connection(4)
        conn._packet_ids().inbound_qos1.update(in_flight | set(acked[:1]))
        loaded = connection.PUBACKS
        connection.PUBACKS = build
        try:
            data = conn.pubacks(list(acked))
        finally:
            connection.PUBACKS = loaded
        assert conn._ids is not None
        outcomes.append((data, sorted(conn._ids.inbound_qos1)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == b"".join(encode(PubAck(i), 4) for i in acked)


def test_c_pubacks_refuse_what_is_no_packet_id() -> None:
    for bad in ([0], [0x10000], [-1], ["1"]):
        with pytest.raises((ValueError, TypeError)):
            speedups.pubacks(bad, set())


def test_a_first_publish_leaks_no_reference() -> None:
    """`other` and the topic cached in C: every reference taken is let go."""
    raw = b"site/9/dev/1/temp"
    data = raw_publish(0x30, raw, b"", b"", b"x" * 8)
    table = fast_decoder.FAST_PUBLISH_QOS[True, True]

    def run() -> tuple[int, str]:
        TOPIC_CACHE.pop(raw, None)  # cached anew each time
        other: list[Any] = []
        off = TAKE(
            data, table, 1 << 20, False, TOPIC_CACHE, None, None, 65535, 0, None,
            [], [], None, [], None, [], other,
        )  # fmt: skip
        return off, other[0].topic

    assert run() == (len(data), raw.decode())
    counts = [sys.getrefcount(o) for o in (data, table)]
    for _ in range(20_000):
        run()
    assert [sys.getrefcount(o) for o in (data, table)] == counts
    held = sys.getrefcount(TOPIC_CACHE[raw])  # outside the assert: pytest's would hold one
    assert held == 2  # the cache's and the call's only
