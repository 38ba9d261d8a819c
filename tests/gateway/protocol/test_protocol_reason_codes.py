"""The reason-code-per-packet table, pinned to the MQTT 5.0 specification (OASIS Standard,
7 March 2019, https://docs.oasis-open.org/mqtt/mqtt/v5.0/os/mqtt-v5.0-os.html).

Each packet's allowed codes come from that packet's own section. The spec's summary table in
section 2.4 (Table 2-6) disagrees with two of them, and paho-mqtt's ReasonCode table follows
Table 2-6; `test_differences_from_table_2_6_are_the_known_ones` pins those two so a change in
either source is noticed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode

from gateway.protocol import (
    Auth,
    ConnAck,
    Disconnect,
    Event,
    LocalProtocolError,
    PubAck,
    PubComp,
    PubRec,
    PubRel,
    ReasonCode,
    RemoteProtocolError,
    SubAck,
    UnsubAck,
    encode,
)
from gateway.protocol import packet_types as pt
from gateway.protocol.readers import decode_packet
from gateway.protocol.reason_codes import ALLOWED_REASON_CODES

# section -> (packet type, codes listed in that section's table)
SPEC: dict[str, tuple[int, set[int]]] = {
    # 3.2.2.2 Connect Reason Code, Table 3-1
    "3.2.2.2": (
        pt.CONNACK,
        {0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C}
        | {0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F},
    ),
    # 3.4.2.1 PUBACK Reason Code
    "3.4.2.1": (pt.PUBACK, {0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    # 3.5.2.1 PUBREC Reason Code
    "3.5.2.1": (pt.PUBREC, {0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    # 3.6.2.1 PUBREL Reason Code
    "3.6.2.1": (pt.PUBREL, {0x00, 0x92}),
    # 3.7.2.1 PUBCOMP Reason Code
    "3.7.2.1": (pt.PUBCOMP, {0x00, 0x92}),
    # 3.9.3 SUBACK Payload (Subscribe Reason Codes)
    "3.9.3": (
        pt.SUBACK,
        {0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2},
    ),
    # 3.11.3 UNSUBACK Payload (Unsubscribe Reason Codes)
    "3.11.3": (pt.UNSUBACK, {0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91}),
    # 3.14.2.1 Disconnect Reason Code
    "3.14.2.1": (
        pt.DISCONNECT,
        {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90}
        | {0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F}
        | {0xA0, 0xA1, 0xA2},
    ),
    # 3.15.2.1 Authenticate Reason Code
    "3.15.2.1": (pt.AUTH, {0x00, 0x18, 0x19}),
}


@pytest.mark.parametrize("section", sorted(SPEC))
def test_table_matches_the_packet_sections(section: str) -> None:
    packet, codes = SPEC[section]
    assert ALLOWED_REASON_CODES[packet] == frozenset(codes), f"MQTT 5.0 section {section}"


def test_table_covers_exactly_the_packets_with_reason_codes() -> None:
    assert set(ALLOWED_REASON_CODES) == {packet for packet, _ in SPEC.values()}
    every_code = {int(code) for code in ReasonCode}
    for packet, codes in ALLOWED_REASON_CODES.items():
        assert codes <= every_code, pt.NAMES[packet]


def test_differences_from_table_2_6_are_the_known_ones() -> None:
    """paho-mqtt's per-code packet lists transcribe Table 2-6 of section 2.4."""
    paho: dict[int, set[int]] = {}
    for code, names in PahoReasonCode(PacketTypes.CONNACK).names.items():
        for packets in names.values():
            for packet in packets:
                paho.setdefault(packet, set()).add(code)
    ours_to_paho = {
        pt.CONNACK: PacketTypes.CONNACK,
        pt.PUBACK: PacketTypes.PUBACK,
        pt.PUBREC: PacketTypes.PUBREC,
        pt.PUBREL: PacketTypes.PUBREL,
        pt.PUBCOMP: PacketTypes.PUBCOMP,
        pt.SUBACK: PacketTypes.SUBACK,
        pt.UNSUBACK: PacketTypes.UNSUBACK,
        pt.DISCONNECT: PacketTypes.DISCONNECT,
        pt.AUTH: PacketTypes.AUTH,
    }
    differences = {
        pt.NAMES[ours]: (
            sorted(ALLOWED_REASON_CODES[ours] - paho[theirs]),
            sorted(paho[theirs] - ALLOWED_REASON_CODES[ours]),
        )
        for ours, theirs in ours_to_paho.items()
        if ALLOWED_REASON_CODES[ours] != paho[theirs]
    }
    # 3.2.2.2 lists 0x99 (Will Payload does not match its Payload Format Indicator), Table 2-6
    # does not; Table 2-6 lists 0x8C for DISCONNECT, 3.14.2.1 does not.
    assert differences == {"CONNACK": ([0x99], []), "DISCONNECT": ([], [0x8C])}


# One event per packet type with a reason code, at MQTT 5, built around `code`.
EVENTS: dict[int, Callable[[int], Event]] = {
    pt.CONNACK: lambda code: ConnAck(False, code),
    pt.PUBACK: lambda code: PubAck(1, code),
    pt.PUBREC: lambda code: PubRec(1, code),
    pt.PUBREL: lambda code: PubRel(1, code),
    pt.PUBCOMP: lambda code: PubComp(1, code),
    pt.SUBACK: lambda code: SubAck(1, [code]),
    pt.UNSUBACK: lambda code: UnsubAck(1, [code]),
    pt.DISCONNECT: lambda code: Disconnect(code),
    pt.AUTH: lambda code: Auth(code),
}


@pytest.mark.parametrize("packet", sorted(EVENTS), ids=lambda packet: pt.NAMES[packet])
def test_writers_and_readers_enforce_the_table(packet: int) -> None:
    make = EVENTS[packet]
    for code in range(256):
        if code in ALLOWED_REASON_CODES[packet]:
            data = encode(make(code), 5)
            event = decode_packet(data, 5)
            got = event.reason_codes[0] if packet in (pt.SUBACK, pt.UNSUBACK) else event.reason_code  # type: ignore[union-attr]
            assert got == code
        else:
            with pytest.raises(LocalProtocolError):
                encode(make(code), 5)


@pytest.mark.parametrize("packet", sorted(EVENTS), ids=lambda packet: pt.NAMES[packet])
def test_readers_refuse_codes_outside_the_table(packet: int) -> None:
    valid = encode(EVENTS[packet](0x00), 5)
    # Where the reason code byte sits in the minimal encoding of each packet.
    at = {pt.CONNACK: 3, pt.SUBACK: 5, pt.UNSUBACK: 5, pt.DISCONNECT: 2, pt.AUTH: 2}.get(packet, 4)
    if len(valid) <= at:  # code 0 with no properties is left out: write one explicitly
        valid = valid[:1] + bytes((valid[1] + 2,)) + valid[2:] + b"\x00\x00"
    for code in range(256):
        if code in ALLOWED_REASON_CODES[packet]:
            continue
        data = valid[:at] + bytes((code,)) + valid[at + 1 :]
        with pytest.raises(RemoteProtocolError) as info:
            decode_packet(data, 5)
        assert info.value.reason_code == 0x81
