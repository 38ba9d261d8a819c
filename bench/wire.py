"""Minimal MQTT 3.1.1 codec for the load generator: only the packets a benchmark client needs.

Hand-written on purpose: the generator must cost far less CPU than the broker it measures, so it
never goes through a full client library (paho, amqtt) on the hot path.

Fixed header (every packet)::

    +--------+-----------------------------+
    | byte 0 | type << 4 | flags           |
    +--------+-----------------------------+
    | 1..4   | remaining length (varint,   |
    |        | 7 bits per byte, LSB first) |
    +--------+-----------------------------+

Benchmark payload (first 16 bytes, the rest is padding up to the payload size)::

    +---------------+------------------------------+----------+
    | seq u64 (BE)  | sent_at monotonic_ns u64 (BE)| padding  |
    +---------------+------------------------------+----------+
"""

from __future__ import annotations

import struct

CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
SUBSCRIBE = 8
SUBACK = 9
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14

PAYLOAD_HEADER = struct.Struct(">QQ")
PACKET_ID = struct.Struct(">H")
DISCONNECT_PACKET = b"\xe0\x00"


class WireError(Exception):
    """A packet the benchmark client cannot make sense of (the broker broke the protocol)."""


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _string(text: str) -> bytes:
    raw = text.encode()
    return PACKET_ID.pack(len(raw)) + raw


def _packet(first_byte: int, body: bytes) -> bytes:
    return bytes([first_byte]) + encode_varint(len(body)) + body


def connect(client_id: str, clean_session: bool = True, keep_alive: int = 0) -> bytes:
    flags = 0x02 if clean_session else 0x00
    body = _string("MQTT") + bytes([4, flags]) + PACKET_ID.pack(keep_alive) + _string(client_id)
    return _packet(CONNECT << 4, body)


def subscribe(packet_id: int, filters: list[str], qos: int) -> bytes:
    body = PACKET_ID.pack(packet_id) + b"".join(_string(f) + bytes([qos]) for f in filters)
    return _packet((SUBSCRIBE << 4) | 0x02, body)


def puback(packet_id: int) -> bytes:
    return b"\x40\x02" + PACKET_ID.pack(packet_id)


class PublishTemplate:
    """Pre-encodes everything of a PUBLISH except packet id and the 16-byte payload header.

    With a fixed topic and payload size the remaining length never changes, so one packet costs
    a struct pack and two concatenations.
    """

    __slots__ = ("_padding", "_prefix", "qos")

    def __init__(self, topic: str, qos: int, payload_size: int) -> None:
        if payload_size < PAYLOAD_HEADER.size:
            raise ValueError(f"payload must be at least {PAYLOAD_HEADER.size} bytes")
        self.qos = qos
        topic_raw = _string(topic)
        remaining = len(topic_raw) + (2 if qos else 0) + payload_size
        self._prefix = bytes([(PUBLISH << 4) | (qos << 1)]) + encode_varint(remaining) + topic_raw
        self._padding = b"\x00" * (payload_size - PAYLOAD_HEADER.size)

    def encode(self, seq: int, sent_at_ns: int, packet_id: int = 0) -> bytes:
        pid = PACKET_ID.pack(packet_id) if self.qos else b""
        return self._prefix + pid + PAYLOAD_HEADER.pack(seq, sent_at_ns) + self._padding


def split_packets(buffer: bytes) -> tuple[list[tuple[int, memoryview]], int]:
    """Split complete packets off the front of ``buffer``.

    Returns ``(packets, consumed)`` where each packet is ``(first byte, body view)``; the caller
    keeps ``buffer[consumed:]`` for the next read.
    """
    packets: list[tuple[int, memoryview]] = []
    view = memoryview(buffer)
    size = len(buffer)
    pos = 0
    while pos + 2 <= size:
        first = buffer[pos]
        length = 0
        shift = 0
        cursor = pos + 1
        while True:
            if cursor >= size:
                return packets, pos
            byte = buffer[cursor]
            cursor += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 21:
                raise WireError("remaining length longer than 4 bytes")
        end = cursor + length
        if end > size:
            break
        packets.append((first, view[cursor:end]))
        pos = end
    return packets, pos


def publish_fields(first: int, body: memoryview) -> tuple[int, int, memoryview]:
    """``(qos, packet id, payload)`` of a PUBLISH body."""
    qos = (first >> 1) & 0x03
    topic_len = (body[0] << 8) | body[1]
    pos = 2 + topic_len
    packet_id = 0
    if qos:
        packet_id = (body[pos] << 8) | body[pos + 1]
        pos += 2
    return qos, packet_id, body[pos:]
