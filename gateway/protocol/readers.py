"""Readers: the body of one complete packet -> one event. Direction-agnostic.

Every reader gets the fixed-header flags (already checked against `FIXED_FLAGS` for every type
but PUBLISH), the body bytes (exactly the remaining length) and the protocol level, and raises
`RemoteProtocolError` for anything malformed. Which packets a server may receive, and rules that
need connection state (topic aliases, packet id reuse, CONNECT first), live in `connection.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.protocol import packet_types as pt
from gateway.protocol import wire
from gateway.protocol.errors import RemoteProtocolError
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
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from gateway.protocol.properties import Properties, read_properties
from gateway.protocol.reason_codes import ALLOWED_REASON_CODES

malformed = wire.malformed
read_str = wire.read_str
read_uint16 = wire.read_uint16

UNSUPPORTED_PROTOCOL_VERSION = 0x84
CLIENT_IDENTIFIER_NOT_VALID = 0x85
TOPIC_NAME_INVALID = 0x90
PAYLOAD_FORMAT_INVALID = 0x99

# Protocol name + level pairs we speak. A known name with another level gets CONNACK 0x84.
PROTOCOLS: dict[str, tuple[int, ...]] = {"MQTT": (4, 5), "MQIsdp": (3,)}


def connect_level(body: bytes) -> int | None:
    """The protocol level a CONNECT body claims, or None if it is too short to tell.

    Used before full parsing so that even a malformed CONNECT is answered in its own version.
    """
    try:
        _, pos = read_str(body, 0)
    except RemoteProtocolError:
        return None
    return body[pos] if pos < len(body) else None


def read_connect(flags: int, body: bytes, level: int) -> Connect:
    name, pos = read_str(body, 0)
    if pos >= len(body):
        raise malformed("CONNECT ends after the protocol name")
    level = body[pos]
    pos += 1
    if name not in PROTOCOLS:
        raise malformed(f"unknown protocol name {name!r}")
    if level not in PROTOCOLS[name]:
        raise RemoteProtocolError(
            UNSUPPORTED_PROTOCOL_VERSION, f"unsupported protocol {name!r} level {level}"
        )
    if pos >= len(body):
        raise malformed("CONNECT ends before the connect flags")
    cflags = body[pos]
    pos += 1
    if cflags & 0x01:
        raise malformed("reserved connect flag is set")
    will_flag = cflags & 0x04
    will_qos = (cflags >> 3) & 0x03
    will_retain = bool(cflags & 0x20)
    has_password = cflags & 0x40
    has_username = cflags & 0x80
    if not will_flag and (will_qos or will_retain):
        raise malformed("will QoS or will retain set without the will flag")
    if will_qos == 3:
        raise malformed("will QoS 3")
    if has_password and not has_username and level < 5:
        raise malformed("password flag without user name flag")
    keep_alive, pos = read_uint16(body, pos)
    props = Properties()
    if level == 5:
        props, pos = read_properties(body, pos, pt.CONNECT)
        if props.authentication_data is not None and props.authentication_method is None:
            raise wire.protocol_error("authentication data without an authentication method")
    client_id, pos = read_str(body, pos)
    will = None
    if will_flag:
        will_props = Properties()
        if level == 5:
            will_props, pos = read_properties(body, pos, pt.WILL)
        will_topic, pos = read_str(body, pos)
        if not will_topic or "+" in will_topic or "#" in will_topic:
            raise RemoteProtocolError(TOPIC_NAME_INVALID, f"invalid will topic {will_topic!r}")
        will_payload, pos = wire.read_binary(body, pos)
        check_message_properties(will_props, will_payload)
        will = Will(will_topic, will_payload, will_qos, will_retain, will_props)
    username = password = None
    if has_username:
        username, pos = read_str(body, pos)
    if has_password:
        password, pos = wire.read_binary(body, pos)
    if pos != len(body):
        raise malformed("bytes after the end of the CONNECT payload")
    clean = bool(cflags & 0x02)
    if not client_id and (level == 3 or (level == 4 and not clean)):
        # 3.1 requires 1-23 characters; 3.1.1 allows empty only with a clean session.
        raise RemoteProtocolError(CLIENT_IDENTIFIER_NOT_VALID, "empty client identifier")
    return Connect(level, client_id, clean, keep_alive, username, password, will, props)


# 3.1.1 CONNACK return code -> MQTT 5 reason code.
_CONNACK_FROM_V4 = {0: 0x00, 1: 0x84, 2: 0x85, 3: 0x88, 4: 0x86, 5: 0x87}


def _reason(packet: int, code: int) -> int:
    if code not in ALLOWED_REASON_CODES[packet]:
        raise malformed(f"reason code 0x{code:02X} is not valid in {pt.NAMES[packet]}")
    return code


def read_connack(flags: int, body: bytes, level: int) -> ConnAck:
    if len(body) < 2:
        raise malformed("CONNACK shorter than 2 bytes")
    if body[0] & 0xFE:
        raise malformed("reserved CONNACK acknowledge flags are set")
    session_present = bool(body[0] & 1)
    if level < 5:
        if len(body) != 2:
            raise malformed("3.1.1 CONNACK must be 2 bytes")
        if body[1] not in _CONNACK_FROM_V4:
            raise malformed(f"unknown CONNACK return code {body[1]}")
        return ConnAck(session_present, _CONNACK_FROM_V4[body[1]])
    code = _reason(pt.CONNACK, body[1])
    props = None
    if len(body) > 2:
        props, pos = read_properties(body, 2, pt.CONNACK)
        if pos != len(body):
            raise malformed("bytes after the CONNACK properties")
        if pos == 3:
            props = None
    return ConnAck(session_present, code, props)


# Topic names repeat (a sensor publishes to the same few topics for days), so the hot path
# keeps a bounded map from raw topic bytes to the validated name: one dict probe replaces
# UTF-8 decoding and the U+0000 / wildcard scans. Only valid, non-empty names are stored.
# Full, it is cleared, so it must hold every topic a fleet publishes to (a device publishes to
# its own): with more topics than entries nearly every probe misses, and each miss costs the
# C reader's fast path (the packet goes to the Python decoder) and a decode. The same size
# bounds the writers' encoded-topic cache, whose misses cost the delivery's plain run.
TOPIC_CACHE: dict[bytes, str] = {}
TOPIC_CACHE_SIZE = 65_536
TOPIC_CACHE_KEY_MAX = 256  # bytes; at most 65,536 x 256 B (16 MiB) of keys pinned
# What a topic name (a PUBLISH's, not a filter) must not contain: U+0000 (MQTT 3.1.1 1.5.3,
# 5.0 1.5.4) and the wildcards (4.7.1). The C scan (gateway/protocol/_speedups.c) takes them
# from here (fast_decoder.configure_scan).
TOPIC_NAME_FORBIDDEN = "\x00+#"


def cache_topic(raw: bytes) -> str | None:
    """The topic name for `raw` if it is valid for a PUBLISH (and remember it), else None."""
    try:
        topic = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not topic or any(ch in topic for ch in TOPIC_NAME_FORBIDDEN):
        return None
    if len(raw) <= TOPIC_CACHE_KEY_MAX:  # bound the memory a hostile client can pin
        if len(TOPIC_CACHE) >= TOPIC_CACHE_SIZE:
            TOPIC_CACHE.clear()
        TOPIC_CACHE[raw] = topic
    return topic


def check_message_properties(props: Properties, payload: bytes) -> None:
    """Rules on PUBLISH and Will properties that need the payload or a topic check."""
    if props.payload_format_indicator == 1:
        # "UTF-8 Encoded Character Data": the receiver MAY check it (MQTT 5, 3.3.2.3.2).
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError(PAYLOAD_FORMAT_INVALID, "payload is not UTF-8") from None
    topic = props.response_topic
    if topic is not None and (not topic or "+" in topic or "#" in topic):
        raise wire.protocol_error(f"invalid response topic {topic!r}")


def read_publish(flags: int, data: bytes | bytearray, start: int, end: int, level: int) -> Publish:
    """PUBLISH from `data[start:end]`; the hot path, so fields are sliced directly."""
    qos = (flags >> 1) & 3
    if qos == 3:
        raise malformed("PUBLISH with QoS 3")
    dup = bool(flags & 8)
    if dup and not qos:
        raise malformed("DUP set on a QoS 0 PUBLISH")
    pos = start + 2
    if pos > end:
        raise malformed("PUBLISH ends inside the topic length")
    pos += (data[start] << 8) | data[start + 1]
    if pos > end:
        raise malformed("PUBLISH topic runs past the end of the packet")
    try:
        topic = data[start + 2 : pos].decode("utf-8")
    except UnicodeDecodeError:
        raise malformed("invalid UTF-8 in PUBLISH topic") from None
    if "\x00" in topic:
        raise malformed("U+0000 in PUBLISH topic")
    if "+" in topic or "#" in topic:
        raise RemoteProtocolError(TOPIC_NAME_INVALID, f"wildcard in PUBLISH topic {topic!r}")
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise malformed("PUBLISH ends inside the packet identifier")
        packet_id = (data[pos] << 8) | data[pos + 1]
        if not packet_id:
            raise malformed("PUBLISH with packet identifier 0")
        pos += 2
    props = None
    if level == 5:
        if pos >= end:
            raise malformed("PUBLISH ends before the properties")
        if data[pos]:
            body = bytes(data[pos:end])
            props, used = read_properties(body, 0, pt.PUBLISH)
            pos += used
        else:
            pos += 1
    elif not topic:
        raise wire.protocol_error("empty PUBLISH topic")
    return Publish(topic, bytes(data[pos:end]), qos, bool(flags & 1), dup, packet_id, props)


def _read_packet_id(body: bytes) -> int:
    packet_id, _ = read_uint16(body, 0)
    if not packet_id:
        raise malformed("packet identifier 0")
    return packet_id


def _read_ack(packet: int, body: bytes, level: int) -> tuple[int, int, Properties | None]:
    packet_id = _read_packet_id(body)
    if level < 5 or len(body) == 2:
        if len(body) != 2:
            raise malformed(f"{pt.NAMES[packet]} must be 2 bytes before MQTT 5")
        return packet_id, 0, None
    code = _reason(packet, body[2])
    props = None
    if len(body) > 3:
        props, pos = read_properties(body, 3, packet)
        if pos != len(body):
            raise malformed(f"bytes after the {pt.NAMES[packet]} properties")
        if pos == 4:
            props = None  # an empty property block
    return packet_id, code, props


def read_puback(flags: int, body: bytes, level: int) -> PubAck:
    return PubAck(*_read_ack(pt.PUBACK, body, level))


def read_pubrec(flags: int, body: bytes, level: int) -> PubRec:
    return PubRec(*_read_ack(pt.PUBREC, body, level))


def read_pubrel(flags: int, body: bytes, level: int) -> PubRel:
    return PubRel(*_read_ack(pt.PUBREL, body, level))


def read_pubcomp(flags: int, body: bytes, level: int) -> PubComp:
    return PubComp(*_read_ack(pt.PUBCOMP, body, level))


def _id_and_props(packet: int, body: bytes, level: int) -> tuple[int, Properties | None, int]:
    packet_id = _read_packet_id(body)
    if level < 5:
        return packet_id, None, 2
    props, pos = read_properties(body, 2, packet)
    return packet_id, (None if pos == 3 else props), pos


def read_subscribe(flags: int, body: bytes, level: int) -> Subscribe:
    packet_id, props, pos = _id_and_props(pt.SUBSCRIBE, body, level)
    subscriptions: list[Subscription] = []
    while pos < len(body):
        topic_filter, pos = read_str(body, pos)
        if pos >= len(body):
            raise malformed("SUBSCRIBE ends before the subscription options")
        options = body[pos]
        pos += 1
        qos = options & 0x03
        if qos == 3:
            raise malformed("subscription with QoS 3")
        if level < 5:
            if options & 0xFC:
                raise malformed("reserved subscription option bits are set")
            subscriptions.append(Subscription(topic_filter, qos))
            continue
        if options & 0xC0:
            raise malformed("reserved subscription option bits are set")
        retain_handling = (options >> 4) & 0x03
        if retain_handling == 3:
            raise wire.protocol_error("retain handling 3")
        no_local = bool(options & 0x04)
        if no_local and topic_filter.startswith("$share/"):
            raise wire.protocol_error("no local on a shared subscription")
        subscriptions.append(
            Subscription(topic_filter, qos, no_local, bool(options & 0x08), retain_handling)
        )
    if not subscriptions:
        raise wire.protocol_error("SUBSCRIBE without any subscription")
    return Subscribe(packet_id, subscriptions, props)


_SUBACK_V4 = frozenset({0, 1, 2, 0x80})


def read_suback(flags: int, body: bytes, level: int) -> SubAck:
    packet_id, props, pos = _id_and_props(pt.SUBACK, body, level)
    codes = list(body[pos:])
    if not codes:
        raise malformed("SUBACK without return codes")
    allowed = ALLOWED_REASON_CODES[pt.SUBACK] if level == 5 else _SUBACK_V4
    for code in codes:
        if code not in allowed:
            raise malformed(f"invalid SUBACK return code 0x{code:02X}")
    return SubAck(packet_id, codes, props)


def read_unsubscribe(flags: int, body: bytes, level: int) -> Unsubscribe:
    packet_id, props, pos = _id_and_props(pt.UNSUBSCRIBE, body, level)
    topic_filters: list[str] = []
    while pos < len(body):
        topic_filter, pos = read_str(body, pos)
        topic_filters.append(topic_filter)
    if not topic_filters:
        raise wire.protocol_error("UNSUBSCRIBE without any topic filter")
    return Unsubscribe(packet_id, topic_filters, props)


def read_unsuback(flags: int, body: bytes, level: int) -> UnsubAck:
    if level < 5:
        if len(body) != 2:
            raise malformed("3.1.1 UNSUBACK must be 2 bytes")
        return UnsubAck(_read_packet_id(body))
    packet_id, props, pos = _id_and_props(pt.UNSUBACK, body, level)
    codes = [_reason(pt.UNSUBACK, code) for code in body[pos:]]
    if not codes:
        raise malformed("UNSUBACK without reason codes")
    return UnsubAck(packet_id, codes, props)


def read_pingreq(flags: int, body: bytes, level: int) -> PingReq:
    if body:
        raise malformed("PINGREQ with a body")
    return PingReq()


def read_pingresp(flags: int, body: bytes, level: int) -> PingResp:
    if body:
        raise malformed("PINGRESP with a body")
    return PingResp()


def _code_and_props(packet: int, body: bytes) -> tuple[int, Properties | None]:
    if not body:
        return 0, None
    code = _reason(packet, body[0])
    if len(body) == 1:
        return code, None
    props, pos = read_properties(body, 1, packet)
    if pos != len(body):
        raise malformed(f"bytes after the {pt.NAMES[packet]} properties")
    return code, (None if pos == 2 else props)


def read_disconnect(flags: int, body: bytes, level: int) -> Disconnect:
    if level < 5:
        if body:
            raise malformed("DISCONNECT with a body before MQTT 5")
        return Disconnect()
    return Disconnect(*_code_and_props(pt.DISCONNECT, body))


def read_auth(flags: int, body: bytes, level: int) -> Auth:
    if level < 5:
        raise malformed("AUTH (packet type 15) is reserved before MQTT 5")
    return Auth(*_code_and_props(pt.AUTH, body))


Reader = Callable[[int, bytes, int], Event]

READERS: dict[int, Reader] = {
    pt.CONNECT: read_connect,
    pt.CONNACK: read_connack,
    pt.PUBACK: read_puback,
    pt.PUBREC: read_pubrec,
    pt.PUBREL: read_pubrel,
    pt.PUBCOMP: read_pubcomp,
    pt.SUBSCRIBE: read_subscribe,
    pt.SUBACK: read_suback,
    pt.UNSUBSCRIBE: read_unsubscribe,
    pt.UNSUBACK: read_unsuback,
    pt.PINGREQ: read_pingreq,
    pt.PINGRESP: read_pingresp,
    pt.DISCONNECT: read_disconnect,
    pt.AUTH: read_auth,
}


def check_fixed_flags(ptype: int, flags: int, level: int) -> None:
    """Reserved fixed-header flag bits must match the table (3.1 also allowed DUP on some)."""
    if ptype == pt.PUBLISH:
        return
    expected = pt.FIXED_FLAGS.get(ptype)
    if expected is None:
        raise malformed(f"reserved packet type {ptype}")
    if flags == expected:
        return
    if level == 3 and expected == 0b0010 and flags == 0b1010:
        return  # MQTT 3.1 set DUP on retransmitted PUBREL / SUBSCRIBE / UNSUBSCRIBE
    raise malformed(f"invalid fixed header flags 0x{flags:X} for {pt.NAMES[ptype]}")


def decode_packet(data: bytes, level: int) -> Event:
    """Decode exactly one complete packet (fixed header included), for any direction."""
    if len(data) < 2:
        raise malformed("packet shorter than a fixed header")
    length, pos = wire.read_varint(data, 1)
    if pos + length != len(data):
        raise malformed("remaining length does not match the packet size")
    ptype, flags = data[0] >> 4, data[0] & 0x0F
    if ptype == pt.PUBLISH:
        return read_publish(flags, data, pos, len(data), level)
    check_fixed_flags(ptype, flags, level)
    return READERS[ptype](flags, bytes(data[pos:]), level)
