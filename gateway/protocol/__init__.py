"""Sans-IO MQTT 3.1 / 3.1.1 / 5.0 protocol core: bytes in, events out; events in, bytes out."""

from gateway.protocol.connection import BATCHED, Connection
from gateway.protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from gateway.protocol.events import (
    Auth,
    ConnAck,
    Connect,
    ConnectionClosed,
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
from gateway.protocol.phases import NEED_DATA, Sentinel
from gateway.protocol.prepared import PreparedPublish
from gateway.protocol.properties import Properties
from gateway.protocol.readers import decode_packet
from gateway.protocol.reason_codes import ReasonCode
from gateway.protocol.writers import ENCODED_TOPICS, encode, remember_topic

__all__ = [
    "BATCHED",
    "ENCODED_TOPICS",
    "NEED_DATA",
    "Auth",
    "ConnAck",
    "Connect",
    "Connection",
    "ConnectionClosed",
    "Disconnect",
    "Event",
    "LocalProtocolError",
    "PingReq",
    "PingResp",
    "PreparedPublish",
    "Properties",
    "ProtocolError",
    "PubAck",
    "PubComp",
    "PubRec",
    "PubRel",
    "Publish",
    "ReasonCode",
    "RemoteProtocolError",
    "Sentinel",
    "SubAck",
    "Subscribe",
    "Subscription",
    "UnsubAck",
    "Unsubscribe",
    "Will",
    "decode_packet",
    "encode",
    "remember_topic",
]
