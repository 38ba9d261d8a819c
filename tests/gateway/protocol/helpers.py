"""Shared helpers for the protocol tests: open a server connection at a level."""

from __future__ import annotations

from gateway.protocol import (
    NEED_DATA,
    ConnAck,
    Connect,
    Connection,
    Event,
    Properties,
    encode,
)


def connect_packet(level: int, client_id: str = "c1", **kwargs: object) -> bytes:
    return encode(Connect(level, client_id, **kwargs), level)  # type: ignore[arg-type]


def open_connection(
    level: int,
    connack_properties: Properties | None = None,
    connect_properties: Properties | None = None,
    max_packet_size: int = 1_048_576,
) -> Connection:
    """A server Connection that has received CONNECT and sent a successful CONNACK."""
    conn = Connection(max_packet_size=max_packet_size)
    props = connect_properties if connect_properties is not None else Properties()
    conn.receive_data(encode(Connect(level, "c1", True, 30, properties=props), level))
    event = conn.next_event()
    assert isinstance(event, Connect)
    conn.send(ConnAck(False, 0, connack_properties))
    return conn


def feed(conn: Connection, data: bytes) -> list[Event]:
    conn.receive_data(data)
    return conn.events()


def drain_one_by_one(conn: Connection) -> list[Event]:
    out: list[Event] = []
    while True:
        event = conn.next_event()
        if event is NEED_DATA:
            return out
        out.append(event)


def remaining_length(n: int) -> bytes:
    """MQTT's Variable Byte Integer (spec 1.5.5), written here rather than taken from
    gateway.protocol.wire, so the tests that build raw packets do not trust the code they test."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
