"""Events: one dataclass per MQTT control packet (plus `ConnectionClosed` for EOF).

Events are plain `slots` dataclasses, not frozen: `Publish` is created once per message on the
hot path and frozen dataclasses pay for `object.__setattr__` on every field. Treat them as
values anyway. Reason codes are MQTT 5 codes at every protocol level; the writers map them to
3.1.1 return codes. `properties` is None when a packet carried no properties (always at levels
3 and 4), except `Connect.properties`, which is always a `Properties`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.protocol.properties import Properties


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Subscription:
    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Connect:
    protocol_level: int
    client_id: str
    clean_start: bool = True
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class ConnAck:
    session_present: bool = False
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties | None = None


@dataclass(slots=True)
class PubAck:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class PubRec:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class PubRel:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class PubComp:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Subscribe:
    packet_id: int
    subscriptions: list[Subscription]
    properties: Properties | None = None


@dataclass(slots=True)
class SubAck:
    packet_id: int
    reason_codes: list[int]
    properties: Properties | None = None


@dataclass(slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: list[str]
    properties: Properties | None = None


@dataclass(slots=True)
class UnsubAck:
    """At levels 3 and 4 UNSUBACK carries no reason codes; `reason_codes` is then ignored."""

    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class PingReq:
    pass


@dataclass(slots=True)
class PingResp:
    pass


@dataclass(slots=True)
class Disconnect:
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Auth:
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class ConnectionClosed:
    """The peer closed its side (`receive_data(b"")`) on a packet boundary."""


Event = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | PubRec
    | PubRel
    | PubComp
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
    | ConnectionClosed
)
