"""The fast decoder: the events of every complete packet in a connection's buffer.

`decode_batch` is the receiving hot path of `Connection.events` and `Connection.next_event`.
It decodes ordinary PUBLISH packets (QoS 0 and 1, no properties, a valid topic) and PUBACK
packets without a reason code inline: no per-field objects, no calls per packet. Anything else,
or anything unusual about such a packet, goes through the connection's general path
(`Connection._next_one`), which applies every rule of the state machine and raises the precise
error. The inline path changes only what the general path would change for the same packet:
the read offset and the QoS 1 packet ids; it never moves the phase.

`SCAN` is the inline loop in C (`scan` in _speedups.c) over a `bytes` buffer, or None. It
decodes the same packets, stops at the first one it does not, and the Python loop here (its
reference) goes on from there; tests/gateway/protocol/test_protocol_scan_speedup.py holds the
two together. connection.py binds `SCAN` by name too (next_event's one-call path for a device
read), so a test that swaps it swaps both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import accelerators
from gateway.protocol import writers
from gateway.protocol.errors import RemoteProtocolError
from gateway.protocol.events import Connect, ConnectionClosed, Event, PubAck, Publish
from gateway.protocol.packet_ids import PacketIds
from gateway.protocol.phases import CONNECTED, NEED_DATA, Phase, Sentinel
from gateway.protocol.readers import (
    TOPIC_CACHE,
    TOPIC_CACHE_KEY_MAX,
    TOPIC_CACHE_SIZE,
    TOPIC_NAME_FORBIDDEN,
    cache_topic,
)


class Connection(Protocol):
    """What the decoder reads and moves of the connection (gateway/protocol/connection.py):
    its receive buffer and the state its fast path checks. It is the connection's receive loop,
    so it works on the connection's own fields rather than on copies handed to it."""

    _buf: bytes | bytearray
    _off: int
    _eof: bool
    _phase: Phase
    _pending_error: RemoteProtocolError | None
    _ids: PacketIds | None
    max_packet_size: int
    protocol_level: int | None
    receive_maximum: int
    maximum_qos: int
    retain_available: bool

    def _packet_ids(self) -> PacketIds: ...

    def kernel_ids(self) -> tuple[set[int] | None, dict[int, int] | None, int]: ...

    def _next_one(self) -> Event | Literal[Sentinel.NEED_DATA]: ...


# scan(buf, off, table, limit, v5, topics, in_qos1, out_flight, receive_maximum,
#      in_flight_others, out) -> the offset of the first packet it did not decode.
Scan = Callable[
    [bytes, int, list[int | None], int, bool, dict[bytes, str], "set[int] | None",
     "dict[int, int] | None", int, int, list[Event]],
    int,
]  # fmt: skip


def _load_scan() -> Scan | None:
    """The C `scan`, or None: not built, or LMQTT_PURE_PYTHON (every accelerator) or
    LMQTT_PURE_PYTHON_READ (this one, for A/B runs) keeps the Python loop."""
    speedups = accelerators.load("gateway.protocol._speedups", "LMQTT_PURE_PYTHON_READ")
    if speedups is None or not writers.SPEEDUPS:
        return None  # scan builds Publish instances, which the writers' configure() binds
    speedups.configure_scan(PubAck, TOPIC_CACHE_KEY_MAX, TOPIC_CACHE_SIZE, TOPIC_NAME_FORBIDDEN)
    scan: Scan = speedups.scan
    return scan


SCAN = _load_scan()

# take_plain(buf, table, limit, v5, topics, in_qos1, out_flight, receive_maximum,
#            in_flight_others, topic, pubs, owners, owner, blocks, owner_blocks, acked, other)
# -> the offset of the first packet it did not take (Connection.take_plain).
TakePlain = Callable[
    [bytes, list[int | None], int, bool, dict[bytes, str], "set[int] | None",
     "dict[int, int] | None", int, int,
     "str | None", list[Publish], list[Any], object, list[Any], object, list[int],
     list[Publish]],
    int,
]  # fmt: skip


def _load_take_plain() -> TakePlain | None:
    """The C `take_plain` (a device's read of plain publishes, a subscriber's of PUBACKs, in
    one call), or None when `scan` is not loaded: then Connection.take_plain takes nothing
    and the Python path (its reference) reads everything."""
    if SCAN is None:
        return None
    speedups = accelerators.load("gateway.protocol._speedups", "LMQTT_PURE_PYTHON_READ")
    if speedups is None:
        return None
    take: TakePlain = speedups.take_plain
    return take


TAKE_PLAIN = _load_take_plain()


def _load_pubacks() -> Callable[[list[int], set[int] | None], bytes] | None:
    """The C `pubacks` (Connection.pubacks' loop: PUBACKs of stored publishes), or None:
    Connection.pubacks builds them in Python (its reference)."""
    if SCAN is None:
        return None
    speedups = accelerators.load("gateway.protocol._speedups", "LMQTT_PURE_PYTHON_READ")
    if speedups is None:
        return None
    build: Callable[[list[int], set[int] | None], bytes] = speedups.pubacks
    return build


PUBACKS = _load_pubacks()


class _Slow(Exception):
    """Internal: leave the inline PUBLISH path for the general one."""


# First bytes of PUBLISH packets the inline path decodes -> QoS. QoS 2 (duplicate detection),
# QoS 3 and DUP on QoS 0 always take the general path. One table per (QoS 1 allowed, retain
# available): what we announced in CONNACK is folded into the table, so a packet that breaks it
# (0x9B / 0x9A) falls to the general path without per-packet checks in the inline one.
def _fast_publish_table(qos1_allowed: bool, retain_allowed: bool) -> list[int | None]:
    table: list[int | None] = [None] * 256
    for first, qos in {0x30: 0, 0x31: 0, 0x32: 1, 0x33: 1, 0x3A: 1, 0x3B: 1}.items():
        if (not qos or qos1_allowed) and (not first & 1 or retain_allowed):
            table[first] = qos
    return table


FAST_PUBLISH_QOS = {
    (qos1, retain): _fast_publish_table(qos1, retain)
    for qos1 in (False, True)
    for retain in (False, True)
}
_NO_FAST_PUBLISH: list[int | None] = [None] * 256


def decode_batch(conn: Connection, stop_after_connect: bool = False) -> list[Event]:
    """The events of every complete packet in `conn`'s buffer (up to a CONNECT when
    `stop_after_connect`). An error after some events is kept for the next call.

    The loop decodes ordinary PUBLISH (and plain PUBACK) packets inline, the hot path: no
    per-field objects, no calls. Anything else, or anything unusual about a PUBLISH, goes
    through `conn._next_one`, which applies every rule and raises the precise error.
    """
    if conn._phase != CONNECTED or conn._pending_error is not None:
        return _decode_general(conn, stop_after_connect)
    out: list[Event] = []
    append = out.append
    buf = conn._buf
    off = conn._off
    n = len(buf)
    is_bytes = type(buf) is bytes
    v5 = conn.protocol_level == 5
    # A limit below 130 bytes could refuse even a short PUBLISH: leave that to the
    # general path, so that the inline path checks the limit only for long packets.
    fast = conn.max_packet_size >= 130
    limit = conn.max_packet_size
    topics = TOPIC_CACHE
    # QoS 2 and PUBREL take the general path, so only QoS 1 ids change inside the loop.
    # No packet ids yet (an idle or QoS 0 connection): the first QoS 1 PUBLISH makes them.
    in_qos1, out_flight, in_flight_others = conn.kernel_ids()
    receive_maximum = conn.receive_maximum
    # With the default 65535 only a reused id could exceed the quota: no check per packet.
    limited = receive_maximum < 0xFFFF
    # Bytes after the topic that a QoS 1 PUBLISH must have: the packet id and, in MQTT 5,
    # a property length the inline path accepts only as 0 (no properties).
    id_size = 3 if v5 else 2
    new_publish = object.__new__  # see the Publish built at the end of the inline path
    fast_qos = (
        FAST_PUBLISH_QOS[conn.maximum_qos >= 1, conn.retain_available] if fast else _NO_FAST_PUBLISH
    )
    # The C twin of this loop (`scan` in _speedups.c) decodes the same packets of a bytes
    # buffer and stops at the first one it does not, which the loop below handles.
    scan = SCAN if is_bytes and fast else None
    while n - off >= 2:
        if scan is not None:
            off = scan(
                buf, off, fast_qos, limit, v5, topics, in_qos1, out_flight,  # type: ignore[arg-type]
                receive_maximum, in_flight_others, out,
            )  # fmt: skip
            if n - off < 2:
                break
        first = buf[off]
        qos = fast_qos[first]
        if qos is None:
            if first == 0x40 and fast and buf[off + 1] == 2 and n - off >= 4:
                # PUBACK without reason code: every QoS 1 delivery brings one back.
                acked = (buf[off + 2] << 8) | buf[off + 3]
                if acked:
                    if out_flight is not None:
                        out_flight.pop(acked, None)
                    ack = new_publish(PubAck)  # a bare instance, as for PUBLISH below
                    ack.packet_id = acked
                    ack.reason_code = 0
                    ack.properties = None
                    append(ack)
                    off += 4
                    continue
        else:
            try:
                length = buf[off + 1]
                if length < 128:
                    start = off + 2
                else:
                    if n - off < 3:
                        break
                    second = buf[off + 2]
                    if second > 127 or not second:
                        raise _Slow
                    length = (length & 0x7F) | (second << 7)
                    start = off + 3
                    if length + 3 > limit:
                        raise _Slow
                end = start + length
                if end > n:
                    break
                # A body shorter than 2 bytes makes pos > end (or IndexError at the end).
                pos = start + 2 + ((buf[start] << 8) | buf[start + 1])
                if pos > end:
                    raise _Slow
                if is_bytes:
                    raw = buf[start + 2 : pos]
                    topic = topics.get(raw) or cache_topic(raw)  # type: ignore[arg-type]
                    if topic is None:
                        raise _Slow
                else:
                    topic = buf[start + 2 : pos].decode("utf-8")
                    if not topic or "\x00" in topic or "+" in topic or "#" in topic:
                        raise _Slow
                if qos:
                    # Read first, check once: bytes past `end` belong to the next packet
                    # (or raise IndexError), and nothing is used before the check.
                    packet_id: int | None = (buf[pos] << 8) | buf[pos + 1]
                    pos += id_size
                    if pos > end or not packet_id or (v5 and buf[pos - 1]):
                        raise _Slow  # MQTT 5 properties need the full reader
                    if in_qos1 is None:
                        ids = conn._packet_ids()
                        in_qos1 = ids.inbound_qos1
                        out_flight = ids.outbound
                    if not limited:
                        in_qos1.add(packet_id)
                    elif packet_id not in in_qos1:
                        if len(in_qos1) + in_flight_others >= receive_maximum:
                            raise _Slow
                        in_qos1.add(packet_id)
                else:
                    packet_id = None
                    if v5:
                        if pos >= end or buf[pos]:
                            raise _Slow  # properties need the full reader
                        pos += 1
                # Publish(...) runs the dataclass __init__, a Python call; filling the
                # slots of a bare instance here is cheaper. Every field is set (a test pins
                # the field list).
                pub = new_publish(Publish)
                pub.topic = topic
                pub.payload = buf[pos:end] if is_bytes else bytes(buf[pos:end])  # type: ignore[assignment]
                pub.qos = qos
                pub.retain = first & 1 == 1
                pub.dup = first & 8 == 8
                pub.packet_id = packet_id
                pub.properties = None
                append(pub)
                off = end
                continue
            except (_Slow, UnicodeDecodeError, IndexError):
                pass
        # The general path, one packet at a time.
        conn._off = off
        try:
            event = conn._next_one()
        except RemoteProtocolError as err:
            if not out:
                raise
            conn._pending_error = err
            return out
        if event is NEED_DATA:
            return out
        append(event)
        if type(event) is ConnectionClosed:
            return out
        buf = conn._buf
        off = conn._off
        n = len(buf)
        fast = (
            conn._phase == CONNECTED and conn._pending_error is None and conn.max_packet_size >= 130
        )
        fast_qos = (
            FAST_PUBLISH_QOS[conn.maximum_qos >= 1, conn.retain_available]
            if fast
            else _NO_FAST_PUBLISH
        )
        scan = SCAN if is_bytes and fast else None
        v5 = conn.protocol_level == 5
        id_size = 3 if v5 else 2
        if conn._ids is not None:
            in_qos1, out_flight, in_flight_others = conn.kernel_ids()
        receive_maximum = conn.receive_maximum
        limited = receive_maximum < 0xFFFF
    if off == n:
        # Everything consumed: drop the caller's chunk now rather than holding it (up to a
        # whole socket read) while the connection idles.
        conn._buf = b""
        off = n = 0
    conn._off = off
    if conn._eof and off == n:
        # Let the general path report EOF (ConnectionClosed or a truncated packet).
        try:
            event = conn._next_one()
        except RemoteProtocolError as err:
            if not out:
                raise
            conn._pending_error = err
            return out
        if event is not NEED_DATA:
            append(event)
    elif conn._eof:
        return out + _decode_general(conn, False)
    return out


def _decode_general(conn: Connection, stop_after_connect: bool) -> list[Event]:
    """Packet by packet through the general path: while the inline one may not run (before
    CONNECT, after DISCONNECT or an error) and after EOF."""
    out: list[Event] = []
    while True:
        try:
            event = conn._next_one()
        except RemoteProtocolError as err:
            if not out:
                raise
            conn._pending_error = err
            return out
        if event is NEED_DATA or type(event) is Connect:
            if conn._off == len(conn._buf):
                conn._buf = b""  # as in decode_batch: an idle connection keeps no old chunk
                conn._off = 0
            if event is NEED_DATA:
                return out
        out.append(event)
        if type(event) is ConnectionClosed or (stop_after_connect and type(event) is Connect):
            return out
