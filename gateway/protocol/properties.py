"""MQTT 5 properties (section 2.2.2): the table, the `Properties` value, reading and writing.

    Properties = Property Length (variable byte integer) + properties
    property   = identifier (variable byte integer; all defined ids fit one byte) + value

Rules enforced on read: unknown identifier or one not allowed on the packet -> 0x81 Malformed;
a property other than User Property (and Subscription Identifier on PUBLISH) present twice ->
0x82 Protocol Error; out-of-range values (0/1 flags, zero Receive Maximum, ...) -> 0x82, except
Topic Alias 0 -> 0x94 Topic Alias invalid (as for an alias above the maximum; Mosquitto and the
Paho interoperability tests expect it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from gateway.protocol import packet_types as pt
from gateway.protocol import wire
from gateway.protocol.errors import LocalProtocolError, RemoteProtocolError

# Value types.
BYTE, UINT16, UINT32, VARINT, UTF8, BINARY, PAIR = range(7)


@dataclass(slots=True, repr=False)
class Properties:
    """Every MQTT 5 property; None means absent. Lists hold repeatable properties."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: list[int] | None = None
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: list[tuple[str, str]] | None = None
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None

    def __repr__(self) -> str:
        present = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)]
        return f"Properties({', '.join(p for p in present if not p.endswith('=None'))})"

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) in (None, []) for f in fields(self))


class PropertySpec(NamedTuple):
    identifier: int
    field: str
    kind: int
    packets: frozenset[int]
    # Values outside this range are a Protocol Error (None: whole range of the type allowed).
    valid: tuple[int, int] | None = None
    # The reason code for a value outside `valid`, when not Protocol Error.
    invalid_code: int = wire.PROTOCOL_ERROR


_P = pt
_WILL_PUB = frozenset({_P.PUBLISH, _P.WILL})
_REASON_STRING_PACKETS = frozenset(
    {_P.CONNACK, _P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP}
    | {_P.SUBACK, _P.UNSUBACK, _P.DISCONNECT, _P.AUTH}
)
_ALL_PACKETS = frozenset(
    {_P.CONNECT, _P.CONNACK, _P.PUBLISH, _P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP}
    | {_P.SUBSCRIBE, _P.SUBACK, _P.UNSUBSCRIBE, _P.UNSUBACK, _P.DISCONNECT, _P.AUTH, _P.WILL}
)

#   id    field                               type    allowed in
PROPERTY_SPECS: tuple[PropertySpec, ...] = (
    PropertySpec(0x01, "payload_format_indicator", BYTE, _WILL_PUB, (0, 1)),
    PropertySpec(0x02, "message_expiry_interval", UINT32, _WILL_PUB),
    PropertySpec(0x03, "content_type", UTF8, _WILL_PUB),
    PropertySpec(0x08, "response_topic", UTF8, _WILL_PUB),
    PropertySpec(0x09, "correlation_data", BINARY, _WILL_PUB),
    PropertySpec(
        0x0B,
        "subscription_identifiers",
        VARINT,
        frozenset({_P.PUBLISH, _P.SUBSCRIBE}),
        (1, wire.MAX_VARINT),
    ),
    PropertySpec(
        0x11,
        "session_expiry_interval",
        UINT32,
        frozenset({_P.CONNECT, _P.CONNACK, _P.DISCONNECT}),
    ),
    PropertySpec(0x12, "assigned_client_identifier", UTF8, frozenset({_P.CONNACK})),
    PropertySpec(0x13, "server_keep_alive", UINT16, frozenset({_P.CONNACK})),
    PropertySpec(0x15, "authentication_method", UTF8, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    PropertySpec(0x16, "authentication_data", BINARY, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    PropertySpec(0x17, "request_problem_information", BYTE, frozenset({_P.CONNECT}), (0, 1)),
    PropertySpec(0x18, "will_delay_interval", UINT32, frozenset({_P.WILL})),
    PropertySpec(0x19, "request_response_information", BYTE, frozenset({_P.CONNECT}), (0, 1)),
    PropertySpec(0x1A, "response_information", UTF8, frozenset({_P.CONNACK})),
    PropertySpec(0x1C, "server_reference", UTF8, frozenset({_P.CONNACK, _P.DISCONNECT})),
    PropertySpec(0x1F, "reason_string", UTF8, _REASON_STRING_PACKETS),
    PropertySpec(0x21, "receive_maximum", UINT16, frozenset({_P.CONNECT, _P.CONNACK}), (1, 0xFFFF)),
    PropertySpec(0x22, "topic_alias_maximum", UINT16, frozenset({_P.CONNECT, _P.CONNACK})),
    PropertySpec(0x23, "topic_alias", UINT16, frozenset({_P.PUBLISH}), (1, 0xFFFF), 0x94),
    PropertySpec(0x24, "maximum_qos", BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertySpec(0x25, "retain_available", BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertySpec(0x26, "user_properties", PAIR, _ALL_PACKETS),
    PropertySpec(
        0x27,
        "maximum_packet_size",
        UINT32,
        frozenset({_P.CONNECT, _P.CONNACK}),
        (1, 0xFFFFFFFF),
    ),
    PropertySpec(0x28, "wildcard_subscription_available", BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertySpec(0x29, "subscription_identifier_available", BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertySpec(0x2A, "shared_subscription_available", BYTE, frozenset({_P.CONNACK}), (0, 1)),
)

SPEC_BY_ID: dict[int, PropertySpec] = {s.identifier: s for s in PROPERTY_SPECS}
SPEC_BY_FIELD: dict[str, PropertySpec] = {s.field: s for s in PROPERTY_SPECS}
_USER_PROPERTY = 0x26
_SUBSCRIPTION_IDENTIFIER = 0x0B


def read_properties(data: bytes, pos: int, packet: int) -> tuple[Properties, int]:
    """Read a property block at `pos` for `packet` (a packet type or `WILL`)."""
    length, pos = wire.read_varint(data, pos)
    end = pos + length
    if end > len(data):
        raise wire.malformed("property length runs past the end of the packet")
    props = Properties()
    seen: set[int] = set()
    name = pt.NAMES[packet]
    while pos < end:
        ident = data[pos]
        pos += 1
        spec = SPEC_BY_ID.get(ident)
        if spec is None:
            raise wire.malformed(f"unknown property identifier 0x{ident:02X} in {name}")
        if packet not in spec.packets:
            raise wire.malformed(f"property {spec.field} is not allowed in {name}")
        kind = spec.kind
        value: Any
        if kind == BYTE:
            if pos >= end:
                raise wire.malformed("property block ends inside a value")
            value = data[pos]
            pos += 1
        elif kind == UINT16:
            value, pos = wire.read_uint16(data, pos)
        elif kind == UINT32:
            value, pos = wire.read_uint32(data, pos)
        elif kind == VARINT:
            value, pos = wire.read_varint(data, pos)
        elif kind == UTF8:
            value, pos = wire.read_str(data, pos)
        elif kind == BINARY:
            value, pos = wire.read_binary(data, pos)
        else:
            key, pos = wire.read_str(data, pos)
            val, pos = wire.read_str(data, pos)
            value = (key, val)
        if pos > end:
            raise wire.malformed("property value runs past the property length")
        if spec.valid is not None and not spec.valid[0] <= value <= spec.valid[1]:
            raise RemoteProtocolError(
                spec.invalid_code, f"property {spec.field} has invalid value {value}"
            )
        if ident == _USER_PROPERTY:
            if props.user_properties is None:
                props.user_properties = []
            props.user_properties.append(value)
        elif ident == _SUBSCRIPTION_IDENTIFIER:
            if props.subscription_identifiers is None:
                props.subscription_identifiers = [value]
            elif packet == pt.PUBLISH:
                props.subscription_identifiers.append(value)
            else:
                raise wire.protocol_error(f"subscription identifier twice in {name}")
        else:
            if ident in seen:
                raise wire.protocol_error(f"property {spec.field} twice in {name}")
            seen.add(ident)
            setattr(props, spec.field, value)
    return props, end


def _write_value(kind: int, value: Any) -> bytes:
    if kind == BYTE:
        if not 0 <= value <= 0xFF:
            raise LocalProtocolError(f"{value} does not fit a byte property")
        return bytes((value,))
    if kind == UINT16:
        return wire.uint16(value)
    if kind == UINT32:
        return wire.uint32(value)
    if kind == VARINT:
        return wire.varint(value)
    if kind == UTF8:
        return wire.utf8(value)
    if kind == BINARY:
        return wire.binary(value)
    return wire.utf8(value[0]) + wire.utf8(value[1])


_EMPTY_BLOCK = b"\x00"


def write_properties(props: Properties | None, packet: int) -> bytes:
    """Encode a property block (length prefix included) for `packet`."""
    if props is None:
        return _EMPTY_BLOCK
    parts: list[bytes] = []
    name = pt.NAMES[packet]
    for spec in PROPERTY_SPECS:
        value = getattr(props, spec.field)
        if value is None:
            continue
        if packet not in spec.packets:
            raise LocalProtocolError(f"property {spec.field} is not allowed in {name}")
        ident = bytes((spec.identifier,))
        if spec.kind == PAIR or spec.identifier == _SUBSCRIPTION_IDENTIFIER:
            if (
                spec.identifier == _SUBSCRIPTION_IDENTIFIER
                and len(value) > 1
                and packet != pt.PUBLISH
            ):
                raise LocalProtocolError(f"only one subscription identifier in {name}")
            for item in value:
                if spec.valid is not None and not spec.valid[0] <= item <= spec.valid[1]:
                    raise LocalProtocolError(f"invalid {spec.field} value {item}")
                parts.append(ident + _write_value(spec.kind, item))
            continue
        if spec.valid is not None and not spec.valid[0] <= value <= spec.valid[1]:
            raise LocalProtocolError(f"invalid {spec.field} value {value}")
        parts.append(ident + _write_value(spec.kind, value))
    if not parts:
        return _EMPTY_BLOCK
    body = b"".join(parts)
    return wire.varint(len(body)) + body
