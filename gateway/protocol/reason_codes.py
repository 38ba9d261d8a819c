"""MQTT 5 reason codes, which packets may carry which, and the 3.1.1 mapping.

The protocol core speaks MQTT 5 reason codes everywhere; when the connection runs 3.1.1 (or
3.1) the writers map them to the few return codes those versions have.
"""

from __future__ import annotations

from enum import IntEnum

from gateway.protocol import packet_types as pt


class ReasonCode(IntEnum):
    """MQTT 5.0 reason codes (section 2.4). 0x00-0x02 have several names by packet."""

    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL_MESSAGE = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


# Which reason codes each packet type may carry (MQTT 5 sections 3.2.2.2 ... 3.15.2.1).
ALLOWED_REASON_CODES: dict[int, frozenset[int]] = {
    pt.CONNACK: frozenset(
        {0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C}
        | {0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}
    ),
    pt.PUBACK: frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    pt.PUBREC: frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    pt.PUBREL: frozenset({0x00, 0x92}),
    pt.PUBCOMP: frozenset({0x00, 0x92}),
    pt.SUBACK: frozenset({0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}),
    pt.UNSUBACK: frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91}),
    pt.DISCONNECT: frozenset(
        {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90}
        | {0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F}
        | {0xA0, 0xA1, 0xA2}
    ),
    pt.AUTH: frozenset({0x00, 0x18, 0x19}),
}

# MQTT 3.1.1 CONNACK return codes (section 3.2.2.3):
#   0 accepted  1 unacceptable protocol version  2 identifier rejected
#   3 server unavailable  4 bad user name or password  5 not authorized
_CONNACK_V4: dict[int, int] = {
    0x00: 0,
    0x84: 1,
    0x85: 2,
    0x88: 3,
    0x89: 3,
    0x86: 4,
    0x8C: 4,  # bad authentication method: closest is bad credentials
    0x87: 5,
    0x8A: 5,  # banned: closest is not authorized
}


def connack_return_code_v4(reason_code: int) -> int:
    """Map an MQTT 5 CONNACK reason code to the 3.1.1 return code closest in meaning."""
    return _CONNACK_V4.get(reason_code, 3)  # anything else: "server unavailable"


def suback_return_code_v4(reason_code: int) -> int:
    """3.1.1 SUBACK knows only granted QoS 0-2 and 0x80 failure."""
    return reason_code if reason_code <= 2 else 0x80
