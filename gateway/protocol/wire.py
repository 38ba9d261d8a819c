"""Primitive data representations of MQTT (section 1.5) and their malformed-input rules.

    Two Byte Integer     big-endian uint16
    Four Byte Integer    big-endian uint32
    Variable Byte Int.   7 bits per byte, low group first, bit 7 = "more"; 1-4 bytes,
                         minimal encoding, max 268,435,455
    UTF-8 String         uint16 length + UTF-8 bytes; no U+0000, no surrogates
    Binary Data          uint16 length + bytes
    String Pair          two UTF-8 strings

Readers take `(data, pos)` and return `(value, new_pos)`; every violation raises
`RemoteProtocolError` with 0x81 Malformed Packet. Readers are used on complete packets, so
running past the end means the remaining length lied, which is also malformed.
"""

from __future__ import annotations

import struct

from gateway.protocol.errors import LocalProtocolError, RemoteProtocolError

MALFORMED = 0x81
PROTOCOL_ERROR = 0x82
MAX_VARINT = 268_435_455


def malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(MALFORMED, message)


def protocol_error(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(PROTOCOL_ERROR, message)


def read_uint16(data: bytes, pos: int) -> tuple[int, int]:
    end = pos + 2
    if end > len(data):
        raise malformed("packet ends inside a two byte integer")
    return (data[pos] << 8) | data[pos + 1], end


def read_uint32(data: bytes, pos: int) -> tuple[int, int]:
    end = pos + 4
    if end > len(data):
        raise malformed("packet ends inside a four byte integer")
    return int.from_bytes(data[pos:end], "big"), end


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    for i in range(4):
        if pos + i >= len(data):
            raise malformed("packet ends inside a variable byte integer")
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise malformed("variable byte integer is not minimally encoded")
            return value, pos + i + 1
        shift += 7
    raise malformed("variable byte integer longer than 4 bytes")


def read_remaining_length(buf: bytes | bytearray, off: int) -> tuple[int, int]:
    """The fixed header's Remaining Length at `buf[off + 1:]` when it takes 2-4 bytes (a
    Variable Byte Integer) -> (length, header size), or (0, 0) while `buf` ends inside it."""
    value = 0
    for i in range(4):
        at = off + 1 + i
        if at >= len(buf):
            return 0, 0
        byte = buf[at]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if byte == 0:
                raise malformed("remaining length is not minimally encoded")
            return value, i + 2
    raise malformed("remaining length longer than 4 bytes")


def read_str(data: bytes, pos: int) -> tuple[str, int]:
    if pos + 2 > len(data):
        raise malformed("packet ends inside a string length")
    start = pos + 2
    end = start + ((data[pos] << 8) | data[pos + 1])
    if end > len(data):
        raise malformed("string runs past the end of the packet")
    try:
        text = data[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise malformed(f"invalid UTF-8 in string: {exc.reason}") from None
    if "\x00" in text:
        raise malformed("U+0000 in UTF-8 string")
    return text, end


def read_binary(data: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 2 > len(data):
        raise malformed("packet ends inside a binary data length")
    start = pos + 2
    end = start + ((data[pos] << 8) | data[pos + 1])
    if end > len(data):
        raise malformed("binary data runs past the end of the packet")
    return bytes(data[start:end]), end


# Writers. They validate what our own code hands them and raise LocalProtocolError.

_VARINT_CACHE = [bytes((i,)) for i in range(128)]

# The two bytes of every packet identifier, index = id (index 0 is never used: ids are 1..65535).
# A list index instead of a struct pack call per QoS 1/2 PUBLISH, for 65,536 two-byte bytes
# objects held once per process and built at import (one C-level map).
PACKET_ID_BYTES: list[bytes] = list(map(struct.Struct(">H").pack, range(0x10000)))


def varint(value: int) -> bytes:
    if value < 128:
        if value < 0:
            raise LocalProtocolError(f"negative variable byte integer {value}")
        return _VARINT_CACHE[value]
    if value > MAX_VARINT:
        raise LocalProtocolError(f"variable byte integer {value} exceeds {MAX_VARINT}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def uint16(value: int) -> bytes:
    if not 0 <= value <= 0xFFFF:
        raise LocalProtocolError(f"{value} does not fit a two byte integer")
    return value.to_bytes(2, "big")


def uint32(value: int) -> bytes:
    if not 0 <= value <= 0xFFFFFFFF:
        raise LocalProtocolError(f"{value} does not fit a four byte integer")
    return value.to_bytes(4, "big")


def utf8(text: str) -> bytes:
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"string is not encodable as UTF-8: {exc.reason}") from None
    if len(raw) > 0xFFFF:
        raise LocalProtocolError("UTF-8 string longer than 65535 bytes")
    if "\x00" in text:
        raise LocalProtocolError("U+0000 is not allowed in MQTT strings")
    return len(raw).to_bytes(2, "big") + raw


def binary(value: bytes) -> bytes:
    if len(value) > 0xFFFF:
        raise LocalProtocolError("binary data longer than 65535 bytes")
    return len(value).to_bytes(2, "big") + bytes(value)
