"""The JSON form of an MQTT message in the gateway's state records: one codec for all of them.

Three records hold a message as JSON: a session's in-flight copy (RecordedPublish, in the
session record), a session's will (in the session record) and a retained message (its snapshot
record). They share this codec, so a message is written and read one way; their shapes are
the head below followed by each one's own fields, in this order (the records' bytes depend on
it: existing data directories load unchanged)::

    in-flight copy   {"topic", "payload", "qos", "retain", "client_id", "expiry",
                      "stored_at_ms", "props": {record property: value}}
    will             {"topic", "payload", "qos", "retain", "properties": {MQTT 5 property: value}}
    retained         {"topic", "payload", "qos", "properties": {record property: value},
                      "stored_at_ms", "expiry", "offset"}

"payload" is base64. Record properties are the store record's string properties (keys:
topicmap/record.py). A will's properties are the MQTT 5 properties publishing it later needs,
by their Properties attribute names, correlation data in hex and user properties as a list of
[key, value].
"""

from __future__ import annotations

import base64
from typing import Any

from gateway.protocol import Properties, Will

__all__ = [
    "message_from_json",
    "message_to_json",
    "optional_int",
    "record_properties_from_json",
    "will_from_json",
    "will_to_json",
]

# The will's MQTT 5 properties kept as they are (the ones that matter for publishing it later;
# correlation data and user properties are converted).
_WILL_PROPERTIES = (
    "will_delay_interval",
    "message_expiry_interval",
    "payload_format_indicator",
    "content_type",
    "response_topic",
)


def message_to_json(topic: str, payload: bytes, qos: int, **fields: Any) -> dict[str, Any]:
    """{"topic", "payload" (base64), "qos"} followed by `fields`, in their order."""
    return {
        "topic": topic,
        "payload": base64.b64encode(payload).decode("ascii"),
        "qos": qos,
        **fields,
    }


def message_from_json(
    d: dict[str, Any], *, default_qos: int | None = None, validate: bool = False
) -> tuple[str, bytes, int]:
    """(topic, payload, QoS) of a message's JSON. `default_qos`: the QoS when the document has
    none (None: it must have one, KeyError otherwise). `validate`: a payload with characters
    outside the base64 alphabet raises binascii.Error (a ValueError) instead of having them
    skipped."""
    qos = d["qos"] if default_qos is None else d.get("qos", default_qos)
    return str(d["topic"]), base64.b64decode(d["payload"], validate=validate), int(qos)


def record_properties_from_json(value: Any) -> dict[str, str]:
    """Record properties (absent or null: none) as strings; ValueError or TypeError when the
    value is not a mapping (or a list of pairs)."""
    return {str(k): str(v) for k, v in dict(value or {}).items()}


def optional_int(value: Any) -> int | None:
    """An integer field that may be null."""
    return None if value is None else int(value)


def will_to_json(will: Will) -> dict[str, Any]:
    """A will's JSON: {"topic", "payload", "qos", "retain", "properties"}."""
    p = will.properties
    props: dict[str, Any] = {}
    if p is not None:
        for name in _WILL_PROPERTIES:
            value = getattr(p, name)
            if value is not None:
                props[name] = value
        if p.correlation_data is not None:
            props["correlation_data"] = bytes(p.correlation_data).hex()
        if p.user_properties:
            props["user_properties"] = [[k, v] for k, v in p.user_properties]
    return message_to_json(will.topic, will.payload, will.qos, retain=will.retain, properties=props)


def will_from_json(d: dict[str, Any]) -> Will:
    """The will of `will_to_json`'s JSON (a missing QoS is 0, a missing retain flag false)."""
    topic, payload, qos = message_from_json(d, default_qos=0)
    props = Properties()
    raw = d.get("properties") or {}
    for name in _WILL_PROPERTIES:
        if name in raw:
            setattr(props, name, raw[name])
    if "correlation_data" in raw:
        props.correlation_data = bytes.fromhex(raw["correlation_data"])
    if "user_properties" in raw:
        props.user_properties = [(str(k), str(v)) for k, v in raw["user_properties"]]
    return Will(
        topic=topic,
        payload=payload,
        qos=qos,
        retain=bool(d.get("retain", False)),
        properties=props,
    )
