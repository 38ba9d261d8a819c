"""A remoting command and its frame: the one unit RocketMQ clients and servers exchange.

Frame (``RemotingCommand.encode`` / ``NettyDecoder``, big-endian)::

    +----------------+-----------------+-------------------+----------------+--------------+
    | length (int32) | serialize (8b)  | header len (24b)  | header         | body         |
    +----------------+-----------------+-------------------+----------------+--------------+
      length = 4 + header len + body len (the length field itself is not counted); at most
      16 MiB (``com.rocketmq.remoting.frameMaxLength``). serialize: 0 JSON, 1 ROCKETMQ.

JSON header (what fastjson writes for ``RemotingCommand``: keys sorted, nulls left out)::

    {"code":310,"extFields":{"a":"group",...},"flag":0,"language":"PYTHON","opaque":8,
     "remark":"...","serializeTypeCurrentRPC":"JSON","version":479}

    flag bit 0: response, bit 1: one-way. extFields: string -> string, in the iteration order
    of a java.util.HashMap (emulated below so our bytes equal the Java client's).

ROCKETMQ (binary) header (``RocketMQSerializable``)::

    code int16 | language int8 | version int16 | opaque int32 | flag int32 |
    remark len int32 + UTF-8 | extFields len int32 + (key len int16 + key, value len int32 + value)*

We send JSON here (what every server accepts; send_frames.py sends a producer's messages with the
binary header); we read both, because a server started with ``rocketmq.serialize.type=ROCKETMQ``
answers in binary.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import accelerators
from rocketmq_remoting.codes import (
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    VERSION_5_3_3,
    LanguageCode,
    SerializeType,
)
from rocketmq_remoting.errors import ProtocolError

FRAME_MAX: Final = 16 * 1024 * 1024
_INT: Final = struct.Struct(">i")
_TWO_INTS: Final = struct.Struct(">ii")
_BIN_FIXED: Final = struct.Struct(">hbhii")  # code, language, version, opaque, flag


@dataclass(slots=True)
class RemotingCommand:
    """One request or response; ``ext_fields`` is the typed header flattened to strings."""

    code: int
    opaque: int = 0
    flag: int = 0
    remark: str | None = None
    ext_fields: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    language: str = "PYTHON"
    version: int = VERSION_5_3_3
    serialize_type: SerializeType = SerializeType.JSON

    @property
    def is_response(self) -> bool:
        return bool(self.flag & FLAG_RESPONSE)

    @property
    def is_oneway(self) -> bool:
        return bool(self.flag & FLAG_ONEWAY)

    def encode(self) -> bytes:
        """The whole frame, length prefix included."""
        if self.serialize_type is SerializeType.ROCKETMQ:
            header = _encode_binary_header(self)
        else:
            header = _encode_json_header(self)
        length = 4 + len(header) + len(self.body)
        if length > FRAME_MAX:
            raise ProtocolError(f"frame of {length} bytes exceeds {FRAME_MAX}")
        mark = (int(self.serialize_type) << 24) | len(header)
        return _TWO_INTS.pack(length, mark) + header + self.body


def java_string_hash(s: str) -> int:
    """``String.hashCode()``: over UTF-16 code units, 32-bit wrap-around, signed."""
    h = 0
    data = s.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def java_hashmap_order(keys: list[str]) -> list[str]:
    """The order a ``new HashMap<>()`` filled with ``keys`` (in this order) iterates them.

    Buckets are visited by index ``spread(hash) & (capacity - 1)``; a bucket keeps insertion
    order, and resizing (capacity doubles past 0.75 load) keeps it too. fastjson writes a map
    in this order, so reproducing it makes our frames byte-identical to Java's.
    """
    capacity = 16
    while len(keys) > capacity * 3 // 4:
        capacity *= 2
    position = {}
    for index, key in enumerate(keys):
        h = java_string_hash(key) & 0xFFFFFFFF
        spread = h ^ (h >> 16)
        position[key] = (spread & (capacity - 1), index)
    return sorted(keys, key=position.__getitem__)


@functools.lru_cache(maxsize=256)
def hashmap_order(keys: tuple[str, ...]) -> tuple[str, ...]:
    # A request type sends the same keys each time (a send: the a..n of its V2 header): the
    # order is computed once per key set, not per frame (it was a tenth of a send's CPU).
    return tuple(java_hashmap_order(list(keys)))


def _ordered_items(fields: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(k, fields[k]) for k in hashmap_order(tuple(fields))]


#: A JSON string literal, non-ASCII kept as is: exactly `json.dumps(value, ensure_ascii=False)`
#: (the C function it calls), without building a JSONEncoder per value.
json_string = json.encoder.encode_basestring


def _encode_json_header(cmd: RemotingCommand) -> bytes:
    parts = [f'{{"code":{cmd.code}']
    if cmd.ext_fields:
        items = ",".join(
            f"{json_string(k)}:{json_string(v)}" for k, v in _ordered_items(cmd.ext_fields)
        )
        parts.append(f',"extFields":{{{items}}}')
    parts.append(f',"flag":{cmd.flag},"language":"{cmd.language}","opaque":{cmd.opaque}')
    if cmd.remark is not None:
        parts.append(f',"remark":{json_string(cmd.remark)}')
    parts.append(f',"serializeTypeCurrentRPC":"JSON","version":{cmd.version}}}')
    return "".join(parts).encode()


def _encode_binary_header(cmd: RemotingCommand) -> bytes:
    out = bytearray(
        _BIN_FIXED.pack(cmd.code, LanguageCode[cmd.language], cmd.version, cmd.opaque, cmd.flag)
    )
    remark = (cmd.remark or "").encode()
    out += _INT.pack(len(remark)) + remark
    fields = bytearray()
    for k, v in _ordered_items(cmd.ext_fields):
        kb, vb = k.encode(), v.encode()
        fields += struct.pack(">h", len(kb)) + kb + _INT.pack(len(vb)) + vb
    out += _INT.pack(len(fields)) + fields
    return bytes(out)


def decode_frame(frame: bytes | bytearray | memoryview) -> RemotingCommand:
    """One frame without its length prefix (``mark`` int, header, body) -> command."""
    if len(frame) < 4:
        raise ProtocolError("frame shorter than its header-length field")
    (mark,) = _INT.unpack_from(frame, 0)
    kind = (mark >> 24) & 0xFF
    header_len = mark & 0xFFFFFF
    if 4 + header_len > len(frame):
        raise ProtocolError(f"header length {header_len} exceeds frame of {len(frame)} bytes")
    header = bytes(frame[4 : 4 + header_len])
    body = bytes(frame[4 + header_len :])
    if kind == SerializeType.JSON:
        cmd = _decode_json_header(header)
    elif kind == SerializeType.ROCKETMQ:
        cmd = _decode_binary_header(header)
    else:
        raise ProtocolError(f"unknown serialize type {kind}")
    cmd.body = body
    return cmd


#: json's C scanner: one JSON value from a str at an index (what json.loads runs after
#: detecting the encoding, decoding the bytes and skipping whitespace: three Python-level calls
#: per answer that a broker's compact header never needs).
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _json_object(header: bytes) -> Any:
    """`json.loads(header)`, through the C scanner when the header is one compact value."""
    text = header.decode()
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        return json.loads(text)  # leading whitespace, or not JSON: json.loads says which
    if end != len(text):
        return json.loads(text)  # trailing whitespace is fine, anything else is refused
    return value


#: The JSON header's keys the decoder reads (also handed to the C kernel, below).
_HEADER_KEYS: Final = ("code", "extFields", "flag", "language", "opaque", "remark", "version")


def _decode_json_header(header: bytes) -> RemotingCommand:
    try:
        raw = _json_object(header)
        code, ext_key, flag, language, opaque, remark, version = _HEADER_KEYS
        ext = raw.get(ext_key) or {}
        if not all(type(v) is str for v in ext.values()):  # a Java server writes strings
            ext = {str(k): str(v) for k, v in ext.items()}
        return RemotingCommand(
            code=int(raw[code]),
            opaque=int(raw.get(opaque, 0)),
            flag=int(raw.get(flag, 0)),
            remark=raw.get(remark),
            ext_fields=ext,
            language=str(raw.get(language, "JAVA")),
            version=int(raw.get(version, 0)),
            serialize_type=SerializeType.JSON,
        )
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        # OverflowError: a number JSON reads as infinite (`Infinity`, `1e999`) where an int goes
        raise ProtocolError(f"bad JSON header: {exc}") from exc


def _decode_binary_header(header: bytes) -> RemotingCommand:
    try:
        code, language, version, opaque, flag = _BIN_FIXED.unpack_from(header, 0)
        pos = _BIN_FIXED.size
        (remark_len,) = _INT.unpack_from(header, pos)
        pos += 4
        remark = header[pos : pos + remark_len].decode() if remark_len > 0 else None
        pos += max(remark_len, 0)
        (fields_len,) = _INT.unpack_from(header, pos)
        pos += 4
        end = pos + fields_len
        if end > len(header):
            raise ProtocolError("extFields run past the header")
        ext: dict[str, str] = {}
        while pos < end:
            (klen,) = struct.unpack_from(">h", header, pos)
            pos += 2
            key = header[pos : pos + klen].decode()
            pos += klen
            (vlen,) = _INT.unpack_from(header, pos)
            pos += 4
            ext[key] = header[pos : pos + vlen].decode()
            pos += vlen
        try:
            lang = LanguageCode(language).name
        except ValueError:
            lang = "OTHER"
        return RemotingCommand(
            code=code,
            opaque=opaque,
            flag=flag,
            remark=remark,
            ext_fields=ext,
            language=lang,
            version=version,
            serialize_type=SerializeType.ROCKETMQ,
        )
    except (struct.error, UnicodeDecodeError) as exc:
        raise ProtocolError(f"bad binary header: {exc}") from exc


def decode_frame_at_py(buf: bytes | bytearray, start: int, end: int) -> RemotingCommand:
    """`decode_frame` of the frame buf[start:end] (the reference of the C kernel's `frame`)."""
    return decode_frame(buf[start:end])


#: The C kernel (rocketmq_remoting/_speedups.c `frame`) decodes the frames every broker answer
#: is (a compact JSON header without escapes, and the body) itself and hands any other to
#: `decode_frame`: exactly decode_frame_at_py (tests/rocketmq_remoting/test_frame_speedup.py).
#: LMQTT_PURE_PYTHON(_READ) keeps the reference.
_kernel = accelerators.load("rocketmq_remoting._speedups", "LMQTT_PURE_PYTHON_READ")
if _kernel is not None:
    _kernel.configure_frames(RemotingCommand, SerializeType.JSON, decode_frame, _HEADER_KEYS)
#: A frame at buf[start:end] (without its length prefix) -> its command.
decode_frame_at: Callable[[bytes | bytearray, int, int], RemotingCommand] = (
    decode_frame_at_py if _kernel is None else _kernel.frame
)
