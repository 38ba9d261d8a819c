"""The C twin of the fast decoder's inline loop (`scan` in _speedups.c) against the Python
loop, its reference: the same events, the same errors and reason codes, the same state after
every read, for the same bytes cut into reads anywhere (packets split across reads).

Each case runs two connections side by side, one with `fast_decoder.SCAN` as the gateway loads
it, one with `SCAN = None` (the pure-Python loop), and compares everything observable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
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
    readers,
    writers,
)
from gateway.protocol.readers import TOPIC_CACHE
from tests.gateway.protocol.helpers import remaining_length

from .helpers import open_connection

speedups = pytest.importorskip("gateway.protocol._speedups")
PURE = any(
    os.environ.get(name, "") not in ("", "0")
    for name in ("LMQTT_PURE_PYTHON", "LMQTT_PURE_PYTHON_READ")
)
if fast_decoder.SCAN is None:  # pure-Python mode: bind the module here, as the loaders do otherwise
    speedups.configure(Publish, writers._ENCODED_TOPICS, writers._encode_py)
    speedups.configure_scan(
        PubAck, readers.TOPIC_CACHE_KEY_MAX, readers.TOPIC_CACHE_SIZE, readers.TOPIC_NAME_FORBIDDEN
    )
SCAN: fast_decoder.Scan = fast_decoder.SCAN or speedups.scan


@contextmanager
def scan_as(scan: Any) -> Iterator[None]:
    """Run with `scan` as the C loop (None: the Python loop), in both modules that bind it."""
    loaded = fast_decoder.SCAN, connection.SCAN
    fast_decoder.SCAN = connection.SCAN = scan
    try:
        yield
    finally:
        fast_decoder.SCAN, connection.SCAN = loaded


def raw_publish(first: int, topic: bytes, packet_id: bytes, props: bytes, payload: bytes) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic + packet_id + props + payload
    return bytes([first]) + remaining_length(len(body)) + body


TOPICS = [b"site/1/dev/7/temp", b"cmd/3", b"a", b"bad/+", b"bad/#", b"nul\x00", b"\xff\xfe", b""]
packet_ids = st.sampled_from([b"\x00\x01", b"\x00\x02", b"\x12\x34", b"\x00\x00", b"\xff\xff"])

# Valid packets of the shapes the inline loop decodes, mixed with everything it must refuse or
# hand on: QoS 2 and 3, DUP on QoS 0, retain, id 0, wildcard / NUL / bad UTF-8 / empty topics,
# properties, topic lengths past the body, non-minimal and 3-byte remaining lengths, PUBACKs
# with and without reason codes, other packet types, garbage.
publish = st.builds(
    raw_publish,
    first=st.sampled_from([0x30, 0x31, 0x32, 0x33, 0x3A, 0x3B, 0x34, 0x36, 0x38, 0x35]),
    topic=st.sampled_from(TOPICS),
    packet_id=packet_ids,
    props=st.sampled_from([b"", b"", b"\x00", b"\x02\x01\x01", b"\x05"]),
    payload=st.sampled_from([b"", b"x" * 64, b"y" * 130, b"z" * 17_000]),
)
simple_publish = st.builds(  # the common case, by the generator's own logic
    lambda qos, topic, pid, payload: raw_publish(
        0x30 | qos << 1, topic, pid if qos else b"", b"", payload
    ),
    qos=st.integers(0, 1),
    topic=st.sampled_from(TOPICS[:3]),
    pid=packet_ids,
    payload=st.sampled_from([b"", b"x" * 64, b"y" * 200]),
)
other = st.sampled_from(
    [
        b"\x40\x02\x00\x01",  # PUBACK
        b"\x40\x02\x00\x00",  # PUBACK id 0
        b"\x40\x03\x00\x05\x00",  # PUBACK with reason code
        b"\x40\x04\x00\x05\x10\x00",
        b"\xc0\x00",  # PINGREQ
        b"\x30\x80\x00",  # non-minimal remaining length
        b"\x30\x01\x00",  # body shorter than the topic length
        b"\x32\x05\x00\x01a\x00",  # id cut short
        b"\x30\xff\xff\xff\xff\x7f",  # remaining length of 5 bytes
        b"\x20\x02\x00\x00",  # CONNACK from a client
        b"\x00\x00",
        b"\xe0\x00",  # DISCONNECT
    ]
)
stream = st.lists(st.one_of(simple_publish, simple_publish, publish, other), max_size=12)


def next_events(conn: Connection) -> list[Any]:
    """The gateway's way: next_event until NEED_DATA (its own C path for a device read)."""
    out: list[Any] = []
    while (event := conn.next_event()) is not NEED_DATA:
        out.append(event)
    return out


def observe(conn: Connection, data: bytes, cuts: list[int], one_by_one: bool) -> list[Any]:
    """What a gateway sees: per read the events (or the error), then the state."""
    seen: list[Any] = []
    points = sorted({c % (len(data) + 1) for c in cuts} | {len(data)})
    last = 0
    for point in points:
        if point == last:
            continue  # b"" would mean EOF
        try:
            conn.receive_data(data[last:point])
            seen.append(("events", next_events(conn) if one_by_one else conn.events()))
        except RemoteProtocolError as err:
            seen.append(("error", type(err).__name__, int(err.reason_code), str(err)))
            break
        last = point
    ids = conn._ids
    seen.append(
        (
            "state",
            conn._off,
            bytes(conn._buf),
            None if ids is None else (sorted(ids.inbound_qos1), dict(ids.outbound)),
            conn._pending_error and str(conn._pending_error),
        )
    )
    return seen


def both(make: Any, data: bytes, cuts: list[int], cached: bool) -> None:
    for one_by_one in (True, False):
        same_in_c_and_python(make, data, cuts, cached, one_by_one)


def same_in_c_and_python(
    make: Any, data: bytes, cuts: list[int], cached: bool, one_by_one: bool
) -> None:
    outcomes = []
    for scan in (SCAN, None):
        TOPIC_CACHE.clear()
        if cached:
            TOPIC_CACHE.update({t: t.decode() for t in TOPICS[:3]})
        with scan_as(scan):
            outcomes.append(observe(make(), data, cuts, one_by_one))
    assert outcomes[0] == outcomes[1]


def acked_connection(level: int, **kwargs: Any) -> Any:
    """A connection with outbound QoS 1 in flight (ids 1, 2, 5), so PUBACKs change state."""

    def make() -> Connection:
        conn = open_connection(level, **kwargs)
        for pid in (1, 2, 5):
            conn.send(Publish("out/t", b"m", 1, packet_id=pid))
        return conn

    return make


# The CONNACK's limits a session may run under (5.0): none, a receive maximum, a QoS ceiling,
# retain refused.
connack_limits = st.sampled_from(
    [
        None,
        Properties(receive_maximum=2),
        Properties(maximum_qos=0),
        Properties(retain_available=0),
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    level=st.sampled_from([4, 5, 3]),
    packets=stream,
    cuts=st.lists(st.integers(0, 40_000), max_size=5),
    cached=st.booleans(),
    connack=connack_limits,
)
def test_c_scan_equals_python_loop(
    level: int,
    packets: list[bytes],
    cuts: list[int],
    cached: bool,
    connack: Properties | None,
) -> None:
    props = connack if level == 5 else None
    both(acked_connection(level, connack_properties=props), b"".join(packets), cuts, cached)


@settings(max_examples=60, deadline=None)
@given(packets=stream, cuts=st.lists(st.integers(0, 400), max_size=3))
def test_small_packet_limit_and_fresh_connection(packets: list[bytes], cuts: list[int]) -> None:
    # No packet ids yet (the first QoS 1 PUBLISH makes them), and a limit under 130 bytes
    # (the inline loop is off): both must still agree.
    both(lambda: open_connection(4), b"".join(packets), cuts, True)
    both(lambda: open_connection(4, max_packet_size=100), b"".join(packets), cuts, True)


def test_malformed_after_good_packets_same_error() -> None:
    good = b"".join(encode(Publish("site/1/dev/7/temp", b"x", 1, packet_id=i), 4) for i in (1, 2))
    for bad in (b"\x36\x02\x00\x00", b"\x32\x07\x00\x05bad/+\x00\x01", b"\x30\x80\x00"):
        both(acked_connection(4), good + bad, [len(good) + 1], True)
        both(acked_connection(4), good + bad, [], True)


@pytest.mark.skipif(PURE, reason="a LMQTT_PURE_PYTHON switch is set: the Python loop runs")
def test_the_gateway_loop_uses_c() -> None:
    assert fast_decoder.SCAN is connection.SCAN is speedups.scan
    conn = open_connection(4)
    data = b"".join(encode(Publish("cmd/3", b"p", 1, packet_id=i), 4) for i in range(1, 50))
    TOPIC_CACHE[b"cmd/3"] = "cmd/3"
    out: list[Any] = []
    ids = conn._packet_ids()
    off = SCAN(  # speedups.scan, as asserted above
        data, 0, fast_decoder.FAST_PUBLISH_QOS[True, True], 1 << 20, False, TOPIC_CACHE,
        ids.inbound_qos1, ids.outbound, 65535, 0, out,
    )  # fmt: skip
    assert off == len(data)
    assert out == [Publish("cmd/3", b"p", 1, packet_id=i) for i in range(1, 50)]
    assert ids.inbound_qos1 == set(range(1, 50))


def test_no_reference_or_memory_leak() -> None:
    topic = b"site/1/dev/7/temp"
    TOPIC_CACHE[topic] = topic.decode()
    data = (
        raw_publish(0x32, topic, b"\x00\x07", b"", b"x" * 64)
        + raw_publish(0x30, topic, b"", b"", b"y" * 64)
        + b"\x40\x02\x00\x07"
        + b"\x32\x05\x00\x01a\x00"  # cut short: scan stops here
    )
    table = fast_decoder.FAST_PUBLISH_QOS[True, True]

    def run() -> int:
        out: list[Any] = []
        in_qos1: set[int] = set()
        off: int = SCAN(data, 0, table, 1 << 20, False, TOPIC_CACHE, in_qos1, {7: 1}, 1024, 0, out)
        return off

    assert run() == len(data) - 6
    cached = TOPIC_CACHE[topic]
    counts = [sys.getrefcount(o) for o in (data, table, cached)]
    for _ in range(20_000):
        run()
    assert [sys.getrefcount(o) for o in (data, table, cached)] == counts
    tracemalloc.start()
    try:
        run()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(50_000):
            run()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 50,000 scans"


def test_scan_refuses_wrong_arguments() -> None:
    with pytest.raises(TypeError):
        # A bytearray buffer: the C loop takes bytes only.
        SCAN(bytearray(b"\x30\x00"), 0, [None] * 256, 1, False, {}, None, None, 1, 0, [])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SCAN(b"\x30\x00", 5, [None] * 256, 1, False, {}, None, None, 1, 0, [])
    with pytest.raises(TypeError):
        SCAN(b"", 0)  # type: ignore[call-arg]


@pytest.mark.parametrize("name", ["LMQTT_PURE_PYTHON", "LMQTT_PURE_PYTHON_READ"])
def test_pure_python_switch_keeps_the_python_loop(name: str) -> None:
    code = (
        "from gateway.protocol import connection, fast_decoder as f; print(f.SCAN, connection.SCAN)"
    )
    env = {**os.environ, name: "1"}
    env.pop("LMQTT_PURE_PYTHON" if name != "LMQTT_PURE_PYTHON" else "LMQTT_PURE_PYTHON_READ", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "None None"
