"""Control packet type numbers (high nibble of the first byte) and fixed-header flag rules.

bit    7   6   5   4 | 3     2   1    0
byte1  packet type   | flags (PUBLISH: DUP, QoS, QoS, RETAIN; PUBREL/SUBSCRIBE/
                     |        UNSUBSCRIBE: 0010; everything else 0000)
byte2.. remaining length, variable byte integer of 1-4 bytes
"""

from __future__ import annotations

CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14
AUTH = 15
# Not a packet: the will properties of a CONNECT have their own allowed-property set.
WILL = 16

NAMES: dict[int, str] = {
    CONNECT: "CONNECT",
    CONNACK: "CONNACK",
    PUBLISH: "PUBLISH",
    PUBACK: "PUBACK",
    PUBREC: "PUBREC",
    PUBREL: "PUBREL",
    PUBCOMP: "PUBCOMP",
    SUBSCRIBE: "SUBSCRIBE",
    SUBACK: "SUBACK",
    UNSUBSCRIBE: "UNSUBSCRIBE",
    UNSUBACK: "UNSUBACK",
    PINGREQ: "PINGREQ",
    PINGRESP: "PINGRESP",
    DISCONNECT: "DISCONNECT",
    AUTH: "AUTH",
    WILL: "Will",
}

# Required fixed-header flags for every type except PUBLISH.
FIXED_FLAGS: dict[int, int] = {
    CONNECT: 0,
    CONNACK: 0,
    PUBACK: 0,
    PUBREC: 0,
    PUBREL: 0b0010,
    PUBCOMP: 0,
    SUBSCRIBE: 0b0010,
    SUBACK: 0,
    UNSUBSCRIBE: 0b0010,
    UNSUBACK: 0,
    PINGREQ: 0,
    PINGRESP: 0,
    DISCONNECT: 0,
    AUTH: 0,
}
