"""Writers: one event -> the bytes of one packet, at a protocol level. Direction-agnostic.

Writers validate what our code hands them (LocalProtocolError) and map MQTT 5 reason codes to
what levels 3 and 4 can express. Properties are dropped below level 5, where they do not exist.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
from collections.abc import Callable
from typing import Any

import accelerators
from gateway.protocol import packet_types as pt
from gateway.protocol import wire
from gateway.protocol.errors import LocalProtocolError
from gateway.protocol.events import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Event,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)
from gateway.protocol.properties import Properties, write_properties
from gateway.protocol.readers import TOPIC_CACHE_SIZE
from gateway.protocol.reason_codes import (
    ALLOWED_REASON_CODES,
    connack_return_code_v4,
    suback_return_code_v4,
)

varint = wire.varint
PACKET_ID_BYTES = wire.PACKET_ID_BYTES
_LEVELS = frozenset({3, 4, 5})
utf8 = wire.utf8


def frame(first_byte: int, body: bytes) -> bytes:
    return bytes((first_byte,)) + varint(len(body)) + body


def _packet_id(packet_id: int | None) -> bytes:
    if packet_id is None or not 1 <= packet_id <= 0xFFFF:
        raise LocalProtocolError(f"packet identifier must be 1..65535, not {packet_id}")
    return packet_id.to_bytes(2, "big")


def _reason(packet: int, code: int) -> int:
    if code not in ALLOWED_REASON_CODES[packet]:
        raise LocalProtocolError(f"reason code 0x{code:02X} is not valid in {pt.NAMES[packet]}")
    return code


def _qos(qos: int) -> int:
    if qos not in (0, 1, 2):
        raise LocalProtocolError(f"QoS must be 0, 1 or 2, not {qos}")
    return qos


_PROTOCOL_NAMES = {
    3: utf8("MQIsdp") + b"\x03",
    4: utf8("MQTT") + b"\x04",
    5: utf8("MQTT") + b"\x05",
}


def write_connect(ev: Connect, level: int) -> bytes:
    if ev.protocol_level != level:
        raise LocalProtocolError(f"Connect.protocol_level {ev.protocol_level} != level {level}")
    flags = 0x02 if ev.clean_start else 0
    will = ev.will
    if will is not None:
        flags |= 0x04 | (_qos(will.qos) << 3) | (0x20 if will.retain else 0)
    if ev.username is not None:
        flags |= 0x80
    if ev.password is not None:
        if ev.username is None and level < 5:
            raise LocalProtocolError("a password needs a user name before MQTT 5")
        flags |= 0x40
    parts = [_PROTOCOL_NAMES[level], bytes((flags,)), wire.uint16(ev.keep_alive)]
    if level == 5:
        parts.append(write_properties(ev.properties, pt.CONNECT))
    parts.append(utf8(ev.client_id))
    if will is not None:
        if level == 5:
            parts.append(write_properties(will.properties, pt.WILL))
        parts += [utf8(will.topic), wire.binary(will.payload)]
    if ev.username is not None:
        parts.append(utf8(ev.username))
    if ev.password is not None:
        parts.append(wire.binary(ev.password))
    return frame(0x10, b"".join(parts))


def write_connack(ev: ConnAck, level: int) -> bytes:
    code = _reason(pt.CONNACK, ev.reason_code)
    # A refused connection never has a session (MQTT-3.2.2-4 / 3.2.2-6); 3.1 has no flag.
    present = 1 if ev.session_present and code == 0 and level != 3 else 0
    if level < 5:
        return bytes((0x20, 2, present, connack_return_code_v4(code)))
    return frame(0x20, bytes((present, code)) + write_properties(ev.properties, pt.CONNACK))


# The PUBLISH fast path. Fan-out mostly goes through PreparedPublish; this is the path of
# `encode(Publish)` / `Connection.send(Publish)`. It builds no per-field objects: the encoded
# topic comes from a bounded cache, the packet id from a table, the fixed header from a table,
# and one join copies the payload. It lives in `encode` itself (`write_publish` is the same
# function), so encoding a PUBLISH costs one Python call, not a dispatch call plus a writer call.
#
#     +-------+----------+------------------+-----------+--------------+---------+
#     | byte1 | rem. len | topic (cached,   | packet id | properties   | payload |
#     | flags | 1-4 B    | length-prefixed) | QoS > 0   | MQTT 5 only  |         |
#     +-------+----------+------------------+-----------+--------------+---------+

# Encoded topic names (length prefix included), bounded like readers.TOPIC_CACHE, and the
# same followed by an empty MQTT 5 property block (QoS 0 has nothing between the two). Only
# valid, non-empty topic names are cached, so a hit needs no further topic checks.
_ENCODED_TOPICS: dict[str, bytes] = {}
# The same dict, for encoders outside this module that take a hit as "valid, encoded" and
# leave a miss to these writers (gateway/delivery/loop.py's plain run).
ENCODED_TOPICS = _ENCODED_TOPICS
_ENCODED_TOPICS_NO_PROPS: dict[str, bytes] = {}
_TOPIC_CACHE_SIZE = TOPIC_CACHE_SIZE

# Fixed header with a two-byte remaining length (128..16383).
_pack_header3 = struct.Struct(">BBB").pack

# Fixed headers of PUBLISH packets with remaining length < 128: [flags][remaining length].
_SHORT_HEADERS = [[bytes((0x30 | flags, length)) for length in range(128)] for flags in range(16)]


_NO_PROPERTY_BLOCK = b"\x00"
_property_values = operator.attrgetter(*(f.name for f in dataclasses.fields(Properties)))
_ABSENT_PROPERTIES = (None,) * len(dataclasses.fields(Properties))


def remember_topic(topic: str) -> None:
    """Cache the encoded forms of a topic name that PUBLISHes will carry (the publish path
    calls it once per new topic it routes to a subscriber), so that the first delivery of
    the topic hits the cache (the delivery's plain run, a C loop, stops at a miss and leaves
    the message to the general path). The same checks as a miss's: wildcards and invalid
    UTF-8 raise LocalProtocolError."""
    if topic not in _ENCODED_TOPICS:
        _encoded_topic(topic)


def _encoded_topic(topic: str) -> bytes:
    if "+" in topic or "#" in topic:
        raise LocalProtocolError(f"wildcard in PUBLISH topic {topic!r}")
    encoded = utf8(topic)
    if topic and len(encoded) <= 258:
        if len(_ENCODED_TOPICS) >= _TOPIC_CACHE_SIZE:
            _ENCODED_TOPICS.clear()
            _ENCODED_TOPICS_NO_PROPS.clear()
        _ENCODED_TOPICS[topic] = encoded
        _ENCODED_TOPICS_NO_PROPS[topic] = encoded + _NO_PROPERTY_BLOCK
    return encoded


def _encode_py(event: Event, level: int) -> bytes:
    """Encode any event at `level` (3, 4 or 5), regardless of direction: the pure-Python
    `encode` (see the end of this module for the C one).

    PUBLISH in its common shapes (cached topic, no properties, shorter than 16 KiB) is joined
    right here; every other PUBLISH takes `_write_publish_general`, other packets their writer.
    """
    if type(event) is not Publish:
        writer = WRITERS.get(type(event))
        if writer is None:
            raise LocalProtocolError(f"not an MQTT packet event: {event!r}")
        if level not in _LEVELS:
            raise LocalProtocolError(f"unknown protocol level {level}")
        return writer(event, level)
    qos = event.qos
    if qos == 0:
        if level == 4 or level == 3:
            prefix = _ENCODED_TOPICS.get(event.topic)
        elif level == 5 and event.properties is None:
            prefix = _ENCODED_TOPICS_NO_PROPS.get(event.topic)
        else:
            prefix = None
        if prefix is not None and event.packet_id is None and not event.dup:
            payload = event.payload
            length = len(prefix) + len(payload)
            if length < 128:
                header = _SHORT_HEADERS[1 if event.retain else 0][length]
                return b"".join((header, prefix, payload))
            if length < 16384:
                header = _pack_header3(
                    0x31 if event.retain else 0x30, length & 0x7F | 0x80, length >> 7
                )
                return b"".join((header, prefix, payload))
    elif qos == 1 or qos == 2:
        if level == 4 or level == 3:
            encoded = _ENCODED_TOPICS.get(event.topic)
            block = b""
        elif level == 5 and event.properties is None:
            encoded = _ENCODED_TOPICS.get(event.topic)
            block = _NO_PROPERTY_BLOCK
        else:
            encoded = None
        packet_id = event.packet_id
        if encoded is not None and packet_id is not None and 0 < packet_id < 0x10000:
            payload = event.payload
            length = len(encoded) + len(block) + len(payload) + 2
            flags = qos << 1 | (8 if event.dup else 0) | (1 if event.retain else 0)
            if length < 128:
                header = _SHORT_HEADERS[flags][length]
            elif length < 16384:
                header = _pack_header3(0x30 | flags, length & 0x7F | 0x80, length >> 7)
            else:
                return _write_publish_general(event, level)
            return b"".join((header, encoded, PACKET_ID_BYTES[packet_id], block, payload))
    return _write_publish_general(event, level)


def _publish_property_block(props: Properties) -> bytes:
    # All-absent properties (the usual case for a Properties() built by callers) skip the
    # generic per-property encoder; anything else goes through it and its checks.
    if _property_values(props) == _ABSENT_PROPERTIES:
        return _NO_PROPERTY_BLOCK
    return write_properties(props, pt.PUBLISH)


def publish_topic_and_properties(ev: Publish, level: int) -> tuple[bytes, bytes]:
    """The encoded topic name and property block of a PUBLISH (b"" below MQTT 5), with the
    checks of level, topic and properties. QoS, DUP and packet id are the caller's."""
    if level not in _LEVELS:
        raise LocalProtocolError(f"unknown protocol level {level}")
    topic = ev.topic
    encoded = _ENCODED_TOPICS.get(topic) or _encoded_topic(topic)
    if level == 5:
        props = ev.properties
        if props is None:
            block = _NO_PROPERTY_BLOCK
            if not topic:
                raise LocalProtocolError("empty PUBLISH topic without a topic alias")
        else:
            block = _publish_property_block(props)
            if not topic and props.topic_alias is None:
                raise LocalProtocolError("empty PUBLISH topic without a topic alias")
    elif topic:
        block = b""
    else:
        raise LocalProtocolError("empty PUBLISH topic")
    return encoded, block


def publish_fixed_header(flags: int, length: int) -> bytes:
    """Fixed header of a PUBLISH with these flags (DUP, QoS, RETAIN) and remaining length."""
    if length < 128:
        return _SHORT_HEADERS[flags][length]
    if length < 16384:
        return _pack_header3(0x30 | flags, (length & 0x7F) | 0x80, length >> 7)
    return bytes((0x30 | flags,)) + varint(length)


def _write_publish_general(ev: Publish, level: int) -> bytes:
    """Every PUBLISH shape, with every check (level, topic, QoS, packet id, properties)."""
    encoded, block = publish_topic_and_properties(ev, level)
    qos = ev.qos
    if qos == 0:
        if ev.dup or ev.packet_id is not None:
            raise LocalProtocolError("a QoS 0 PUBLISH has no packet identifier and no DUP")
        flags = 1 if ev.retain else 0
        middle = block
    elif qos == 1 or qos == 2:
        packet_id = ev.packet_id
        if packet_id is None or not 0 < packet_id < 0x10000:
            raise LocalProtocolError(f"packet identifier must be 1..65535, not {packet_id}")
        flags = qos << 1 | (8 if ev.dup else 0) | (1 if ev.retain else 0)
        middle = PACKET_ID_BYTES[packet_id] + block
    else:
        raise LocalProtocolError(f"QoS must be 0, 1 or 2, not {qos}")
    payload = ev.payload
    header = publish_fixed_header(flags, len(encoded) + len(middle) + len(payload))
    return b"".join((header, encoded, middle, payload))


def _write_ack(
    packet: int, first: int, ev: PubAck | PubRec | PubRel | PubComp, level: int
) -> bytes:
    pid = _packet_id(ev.packet_id)
    if level < 5:
        return bytes((first, 2)) + pid
    code = _reason(packet, ev.reason_code)
    if ev.properties is None or ev.properties.is_empty():
        if code == 0:
            return bytes((first, 2)) + pid
        return bytes((first, 3)) + pid + bytes((code,))
    return frame(first, pid + bytes((code,)) + write_properties(ev.properties, packet))


def write_puback(ev: PubAck, level: int) -> bytes:
    return _write_ack(pt.PUBACK, 0x40, ev, level)


def write_pubrec(ev: PubRec, level: int) -> bytes:
    return _write_ack(pt.PUBREC, 0x50, ev, level)


def write_pubrel(ev: PubRel, level: int) -> bytes:
    return _write_ack(pt.PUBREL, 0x62, ev, level)


def write_pubcomp(ev: PubComp, level: int) -> bytes:
    return _write_ack(pt.PUBCOMP, 0x70, ev, level)


def write_subscribe(ev: Subscribe, level: int) -> bytes:
    if not ev.subscriptions:
        raise LocalProtocolError("SUBSCRIBE needs at least one subscription")
    parts = [_packet_id(ev.packet_id)]
    if level == 5:
        parts.append(write_properties(ev.properties, pt.SUBSCRIBE))
    for sub in ev.subscriptions:
        options = _qos(sub.qos)
        if level == 5:
            if sub.retain_handling not in (0, 1, 2):
                raise LocalProtocolError(f"retain handling must be 0..2: {sub.retain_handling}")
            options |= (
                (4 if sub.no_local else 0)
                | (8 if sub.retain_as_published else 0)
                | (sub.retain_handling << 4)
            )
        parts += [utf8(sub.topic_filter), bytes((options,))]
    return frame(0x82, b"".join(parts))


def write_suback(ev: SubAck, level: int) -> bytes:
    if not ev.reason_codes:
        raise LocalProtocolError("SUBACK needs at least one reason code")
    if level < 5:
        codes = bytes(map(suback_return_code_v4, ev.reason_codes))  # no generator's frame
        return frame(0x90, _packet_id(ev.packet_id) + codes)
    codes = bytes(_reason(pt.SUBACK, code) for code in ev.reason_codes)
    props = write_properties(ev.properties, pt.SUBACK)
    return frame(0x90, _packet_id(ev.packet_id) + props + codes)


def write_unsubscribe(ev: Unsubscribe, level: int) -> bytes:
    if not ev.topic_filters:
        raise LocalProtocolError("UNSUBSCRIBE needs at least one topic filter")
    parts = [_packet_id(ev.packet_id)]
    if level == 5:
        parts.append(write_properties(ev.properties, pt.UNSUBSCRIBE))
    parts += [utf8(topic_filter) for topic_filter in ev.topic_filters]
    return frame(0xA2, b"".join(parts))


def write_unsuback(ev: UnsubAck, level: int) -> bytes:
    if level < 5:
        return b"\xb0\x02" + _packet_id(ev.packet_id)
    if not ev.reason_codes:
        raise LocalProtocolError("MQTT 5 UNSUBACK needs one reason code per topic filter")
    codes = bytes(_reason(pt.UNSUBACK, code) for code in ev.reason_codes)
    props = write_properties(ev.properties, pt.UNSUBACK)
    return frame(0xB0, _packet_id(ev.packet_id) + props + codes)


def write_pingreq(ev: PingReq, level: int) -> bytes:
    return b"\xc0\x00"


def write_pingresp(ev: PingResp, level: int) -> bytes:
    return b"\xd0\x00"


def _write_code_and_props(packet: int, first: int, ev: Disconnect | Auth) -> bytes:
    code = _reason(packet, ev.reason_code)
    if ev.properties is None or ev.properties.is_empty():
        return bytes((first, 0)) if code == 0 else bytes((first, 1, code))
    return frame(first, bytes((code,)) + write_properties(ev.properties, packet))


def write_disconnect(ev: Disconnect, level: int) -> bytes:
    if level < 5:
        return b"\xe0\x00"
    return _write_code_and_props(pt.DISCONNECT, 0xE0, ev)


def write_auth(ev: Auth, level: int) -> bytes:
    if level < 5:
        raise LocalProtocolError("AUTH exists only in MQTT 5")
    return _write_code_and_props(pt.AUTH, 0xF0, ev)


WRITERS: dict[type, Callable[[Any, int], bytes]] = {
    Connect: write_connect,
    ConnAck: write_connack,
    Publish: _encode_py,
    PubAck: write_puback,
    PubRec: write_pubrec,
    PubRel: write_pubrel,
    PubComp: write_pubcomp,
    Subscribe: write_subscribe,
    SubAck: write_suback,
    Unsubscribe: write_unsubscribe,
    UnsubAck: write_unsuback,
    PingReq: write_pingreq,
    PingResp: write_pingresp,
    Disconnect: write_disconnect,
    Auth: write_auth,
}


def _load_speedups() -> Callable[[Event, int], bytes]:
    """The C `encode` of _speedups.c when it was built and LMQTT_PURE_PYTHON is not set.

    It encodes the fast-path PUBLISH shapes of `_encode_py` byte for byte the same and hands
    every other call to `_encode_py`, so errors and rare shapes behave as in pure Python.
    """
    speedups = accelerators.load("gateway.protocol._speedups")
    if speedups is None:
        return _encode_py
    speedups.configure(Publish, _ENCODED_TOPICS, _encode_py)
    c_encode: Callable[[Event, int], bytes] = speedups.encode
    return c_encode


encode: Callable[[Event, int], bytes] = _load_speedups()
# PUBLISH bytes at a level: `encode` itself, which takes the PUBLISH path first.
write_publish: Callable[[Publish, int], bytes] = encode
SPEEDUPS = encode is not _encode_py
WRITERS[Publish] = write_publish
