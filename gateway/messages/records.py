"""How an MQTT PUBLISH is recorded in the store, and read back for delivery.

The store knows nothing of MQTT: the MQTT facts travel as string properties of the record, under
the keys of the record schema (topicmap/record.py, which draws the table of keys and values).
The store adds its dispatch properties (the light queues the record was dispatched to and its
offset in each).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.messages.message_json import (
    message_from_json,
    message_to_json,
    optional_int,
    record_properties_from_json,
)
from gateway.protocol import Properties, Publish
from topicmap.record import (
    CLIENT,
    CONTENT_TYPE,
    CORRELATION_DATA,
    EXPIRY,
    PAYLOAD_FORMAT,
    PID,
    QOS,
    RESPONSE_TOPIC,
    RETAIN,
    TOPIC,
    USER_PROPERTIES,
)

log = logging.getLogger("lmqtt.gateway")

# Property values must not contain the store's pair separators.
_SEPARATORS = ("\x01", "\x02")


def _safe(value: str) -> bool:
    return _SEPARATORS[0] not in value and _SEPARATORS[1] not in value


def _base_properties(topic: str, qos: int, retain: bool, client_id: str) -> dict[str, str]:
    return {
        TOPIC: topic,
        QOS: str(qos),
        RETAIN: "1" if retain else "0",
        CLIENT: client_id,
    }


def message_properties(publish: Publish, client_id: str) -> dict[str, str]:
    """The MQTT facts of an inbound PUBLISH as store properties."""
    props = _base_properties(publish.topic, publish.qos, publish.retain, client_id)
    if publish.qos > 0 and publish.packet_id is not None:
        props[PID] = str(publish.packet_id)
    p = publish.properties
    if p is None:
        return props
    if p.message_expiry_interval is not None:
        props[EXPIRY] = str(p.message_expiry_interval)
    if p.payload_format_indicator is not None:
        props[PAYLOAD_FORMAT] = str(p.payload_format_indicator)
    if p.content_type is not None and _safe(p.content_type):
        props[CONTENT_TYPE] = p.content_type
    if p.response_topic is not None and _safe(p.response_topic):
        props[RESPONSE_TOPIC] = p.response_topic
    if p.correlation_data is not None:
        props[CORRELATION_DATA] = bytes(p.correlation_data).hex()
    if p.user_properties:
        # json.dumps escapes control characters, so the separators cannot leak through.
        props[USER_PROPERTIES] = json.dumps([[k, v] for k, v in p.user_properties])
    return props


#: The per-message part of a property block: PID \x01 <decimal packet id> \x02 (`PID_BLOCK %
#: packet_id`; the publish batch's C loop is handed its head and tail). Digits cannot contain
#: the store's separators, so it needs no validation beyond the key's (done once here).
PID_HEAD = PID.encode() + b"\x01"
PID_TAIL = b"\x02"
PID_BLOCK = PID_HEAD + b"%d" + PID_TAIL
#: The head of a block's first pair, TOPIC \x01 <topic name> \x02: a new topic's block is this
#: pair then the store-encoded rest of its (QoS, retain) block, cached per publisher.
TOPIC_HEAD = TOPIC.encode() + b"\x01"
#: (QoS, retain) -> QOS \x01 <qos> \x02 RETAIN \x01 <0|1> \x02 CLIENT \x01: a base block
#: between its topic name and its client id, cut from the first block of the kind the store
#: encoded (every storage encodes properties in the store's record format). The publish
#: batch's C loop is handed this dict and reads it the same way (`KIND_MIDDLES`).
_KIND_MIDDLES: dict[tuple[int, bool], bytes] = {}
# Distinct (topic, QoS, retain) blocks one publisher keeps (cleared when full).
PROPERTY_BLOCKS_SIZE = 4096
KIND_MIDDLES = _KIND_MIDDLES


class PublishProperties:
    """The store property blocks of one client's PUBLISHes, encoded once per kind.

    A PUBLISH without MQTT 5 properties differs from the previous one to the same topic only
    in its packet id: its block is the cached, store-validated block of (topic, QoS, retain)
    plus the packet id pair, in the order message_properties() writes them. The dict that
    goes with it (for RecentMessages / delivery) is shared by those messages and has no
    PID (delivery never reads it; a record read back from the store has it). Neither
    may be mutated. A PUBLISH with properties is encoded in full every time.
    """

    __slots__ = ("_client_id", "_client_raw", "_encode", "blocks")

    def __init__(self, client_id: str, encode: Callable[[dict[str, str]], bytes]) -> None:
        self._client_id = client_id
        self._encode = encode
        # (topic, QoS, retain) -> (block, properties); read by PublishPath's batch loop too
        # (gateway/messages/publishing.py encode_publishes_py and its C twin), which make a
        # new one with new_plain() and leave the rest to of().
        self.blocks: dict[tuple[str, int, bool], tuple[bytes, dict[str, str]]] = {}
        # The client id's value and pair end; None when it holds a separator (or cannot be
        # encoded): then the store encodes (and refuses) each new block.
        self._client_raw: bytes | None = None
        if _safe(client_id):
            try:
                self._client_raw = client_id.encode() + b"\x02"
            except UnicodeEncodeError:
                pass

    def of(self, pub: Publish) -> tuple[bytes, dict[str, str]]:
        """(encoded block, properties) of `pub`; InvalidPropertyError (a StoreError) if the
        store refuses them."""
        if pub.properties is not None:
            props = message_properties(pub, self._client_id)
            return self._encode(props), props
        key = (pub.topic, pub.qos, pub.retain)
        hit = self.blocks.get(key)
        if hit is None:
            hit = self.new_plain(pub.topic, pub.qos, pub.retain)
            if hit is None:
                props = _base_properties(pub.topic, pub.qos, pub.retain, self._client_id)
                hit = (self._encoded(props, pub.qos, pub.retain), props)
                self._keep(key, hit)
        if pub.qos and pub.packet_id is not None:
            return hit[0] + PID_BLOCK % pub.packet_id, hit[1]
        return hit

    def new_plain(self, topic: str, qos: int, retain: bool) -> tuple[bytes, dict[str, str]] | None:
        """The (block, properties) of a (topic, QoS, retain) this publisher has no block for,
        made without the store and kept; None (nothing kept) when the store must encode it:
        its kind's middle unknown yet (the first block of a kind in the process is the
        store's), or the name or the client id holding a separator or unencodable.

        Byte for byte what the store encodes: TOPIC_HEAD, the name, the kind's middle, the
        client id. Blocks concatenate (the store's encode_properties), so a name and a client
        id without the store's separators need no other check: the keys are the kind's, which
        the store validated. The publish batch's loop makes a device's first block here
        (encode_publishes_py), and its C twin (gateway/messages/_batch.c) does exactly this."""
        middle = _KIND_MIDDLES.get((qos, retain))
        client = self._client_raw
        if middle is None or client is None or not _safe(topic):
            return None
        try:
            name = topic.encode()
        except UnicodeEncodeError:
            return None
        hit = (
            TOPIC_HEAD + name + b"\x02" + middle + client,
            _base_properties(topic, qos, retain, self._client_id),
        )
        self._keep((topic, qos, retain), hit)
        return hit

    def _keep(self, key: tuple[str, int, bool], hit: tuple[bytes, dict[str, str]]) -> None:
        blocks = self.blocks
        if len(blocks) >= PROPERTY_BLOCKS_SIZE:
            blocks.clear()
        blocks[key] = hit

    def _encoded(self, props: dict[str, str], qos: int, retain: bool) -> bytes:
        """The store's block of `props` (_base_properties): validates all, refuses a name or
        an id with a separator. With a client id free of them, it also teaches the kind's
        middle (what lies between the name's pair and the client id) to new_plain()."""
        block = self._encode(props)
        client = self._client_raw
        if client is not None and (qos, retain) not in _KIND_MIDDLES:
            start = block.index(b"\x02") + 1  # after the topic's pair
            _KIND_MIDDLES[(qos, retain)] = block[start : len(block) - len(client)]
        return block


@dataclass(slots=True)
class RecordedPublish:
    """The MQTT view of one stored record."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    client_id: str
    expiry: int | None
    stored_at_ms: int
    props: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """The JSON of an in-flight copy held by a session (gateway/messages/message_json.py)."""
        return message_to_json(
            self.topic,
            self.payload,
            self.qos,
            retain=self.retain,
            client_id=self.client_id,
            expiry=self.expiry,
            stored_at_ms=self.stored_at_ms,
            props=self.props,
        )

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RecordedPublish:
        topic, payload, qos = message_from_json(d)
        return cls(
            topic=topic,
            payload=payload,
            qos=qos,
            retain=bool(d.get("retain", False)),
            client_id=str(d.get("client_id", "")),
            expiry=optional_int(d.get("expiry")),
            stored_at_ms=int(d["stored_at_ms"]),
            props=record_properties_from_json(d.get("props")),
        )

    def remaining_expiry(self, now_ms: int | None = None) -> int | None:
        """Seconds left of the message expiry interval; <= 0 means expired; None = never."""
        if self.expiry is None:
            return None
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return self.expiry - (now - self.stored_at_ms) // 1000

    def mqtt5_properties(
        self, subscription_ids: list[int], expiry_left: int | None
    ) -> Properties | None:
        """Outbound MQTT 5 properties (None when there are none)."""
        p = self.props
        props = Properties()
        empty = True
        if PAYLOAD_FORMAT in p:
            props.payload_format_indicator = int(p[PAYLOAD_FORMAT])
            empty = False
        if expiry_left is not None:
            props.message_expiry_interval = max(expiry_left, 1)
            empty = False
        if CONTENT_TYPE in p:
            props.content_type = p[CONTENT_TYPE]
            empty = False
        if RESPONSE_TOPIC in p:
            props.response_topic = p[RESPONSE_TOPIC]
            empty = False
        if CORRELATION_DATA in p:
            props.correlation_data = bytes.fromhex(p[CORRELATION_DATA])
            empty = False
        if USER_PROPERTIES in p:
            props.user_properties = [(k, v) for k, v in json.loads(p[USER_PROPERTIES])]
            empty = False
        if subscription_ids:
            props.subscription_identifiers = list(subscription_ids)
            empty = False
        return None if empty else props


def read_record(
    topic: str, body: bytes, props: dict[str, str], store_timestamp: int
) -> RecordedPublish | None:
    """Decode the MQTT facts of a record; None if it was not written by an MQTT publish."""
    try:
        expiry_s = props.get(EXPIRY)
        # Positional: runs once per message delivered, and keyword arguments cost more per call.
        return RecordedPublish(
            props.get(TOPIC, topic),
            body,
            int(props.get(QOS, "0")),
            props.get(RETAIN) == "1",
            props.get(CLIENT, ""),
            int(expiry_s) if expiry_s is not None else None,
            store_timestamp,
            props,
        )
    except ValueError:
        log.warning("record with unreadable mqtt properties on topic %r skipped", topic)
        return None
