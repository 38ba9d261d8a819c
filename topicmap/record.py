"""The MQTT record schema: how an MQTT PUBLISH is recorded as properties of a store record.

Every `mqtt.*` key is spelled here and nowhere else: the gateway writes and reads records with
these names (gateway/messages/records.py, whose C kernels are handed them at start), and the
fan-out report reads them from the store's files (analytics/segments.py). Standard library only,
like the rest of topicmap, so both sides may import it.

    key            value
    -------------  ---------------------------------------------------------------
    mqtt.topic     original topic name (the record's store topic is the parent topic)
    mqtt.qos       "0" | "1" | "2"          publish QoS (absent: 0)
    mqtt.retain    "1" | "0"
    mqtt.client    publishing client id ("" for gateway-internal publishes)
    mqtt.pid       publisher packet id (QoS > 0 only)
    mqtt.expiry    MQTT 5 message expiry interval, seconds (absent = never)
    mqtt.pfi       payload format indicator
    mqtt.ct        content type
    mqtt.rt        response topic
    mqtt.cd        correlation data, hex
    mqtt.up        user properties, JSON list of [key, value]
    mqtt.will      a will's id (its client id @ its due time, ms): set on the wills the gateway
                   publishes (gateway/messages/will_log.py), never sent to subscribers

The store adds its dispatch properties (the light queues the record was dispatched to and its
offset in each); their names belong to the store's format, not to this schema.
"""

from __future__ import annotations

from typing import Final

TOPIC: Final = "mqtt.topic"
QOS: Final = "mqtt.qos"
RETAIN: Final = "mqtt.retain"
CLIENT: Final = "mqtt.client"
PID: Final = "mqtt.pid"
EXPIRY: Final = "mqtt.expiry"
PAYLOAD_FORMAT: Final = "mqtt.pfi"
CONTENT_TYPE: Final = "mqtt.ct"
RESPONSE_TOPIC: Final = "mqtt.rt"
CORRELATION_DATA: Final = "mqtt.cd"
USER_PROPERTIES: Final = "mqtt.up"
WILL_ID: Final = "mqtt.will"

#: The keys only an MQTT 5 PUBLISH with properties writes (besides EXPIRY), in this order.
V5_KEYS: Final = (PAYLOAD_FORMAT, CONTENT_TYPE, RESPONSE_TOPIC, CORRELATION_DATA, USER_PROPERTIES)
