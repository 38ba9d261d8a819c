"""Our own mistakes are LocalProtocolError, never bytes on the wire."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.protocol import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    LocalProtocolError,
    PreparedPublish,
    Properties,
    PubAck,
    Publish,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
    encode,
)
from gateway.protocol.properties import PROPERTY_SPECS

BAD: list[tuple[str, Any, int]] = [
    ("QoS 3", Publish("t", b"", 3, packet_id=1), 4),
    ("QoS 0 with packet id", Publish("t", b"", 0, packet_id=1), 4),
    ("QoS 0 with DUP", Publish("t", b"", 0, dup=True), 5),
    ("QoS 1 without packet id", Publish("t", b"", 1), 4),
    ("packet id 0", Publish("t", b"", 1, packet_id=0), 5),
    ("packet id 65536", PubAck(65536), 4),
    ("wildcard topic", Publish("a/#", b""), 4),
    ("U+0000 topic", Publish("a\x00", b""), 4),
    ("lone surrogate", Publish("a\ud800", b""), 4),
    ("empty topic 3.1.1", Publish("", b""), 4),
    ("empty topic without alias", Publish("", b""), 5),
    ("topic alias in PUBACK", PubAck(1, 0, Properties(topic_alias=1)), 5),
    (
        "session expiry in PUBLISH",
        Publish("t", b"", properties=Properties(session_expiry_interval=1)),
        5,
    ),
    ("topic alias 0", Publish("t", b"", properties=Properties(topic_alias=0)), 5),
    ("byte property out of range", ConnAck(False, 0, Properties(maximum_qos=2)), 5),
    (
        "two subscription ids in SUBSCRIBE",
        Subscribe(1, [Subscription("a")], Properties(subscription_identifiers=[1, 2])),
        5,
    ),
    (
        "subscription id 0",
        Publish("t", b"", properties=Properties(subscription_identifiers=[0])),
        5,
    ),
    ("reason code not for PUBACK", PubAck(1, 0x8F), 5),
    ("reason code not for CONNACK", ConnAck(False, 0x04), 4),
    ("SUBACK without codes", SubAck(1, []), 4),
    ("SUBSCRIBE without filters", Subscribe(1, []), 4),
    ("UNSUBSCRIBE without filters", Unsubscribe(1, []), 5),
    ("UNSUBACK 5.0 without codes", UnsubAck(1, []), 5),
    ("retain handling 3", Subscribe(1, [Subscription("a", 0, retain_handling=3)]), 5),
    ("AUTH in 3.1.1", Auth(), 4),
    ("string longer than 65535", Connect(4, "x" * 70000), 4),
    ("password without user name 3.1.1", Connect(4, "c", password=b"p"), 4),
    ("level mismatch", Connect(5, "c"), 4),
    ("will QoS 3", Connect(4, "c", will=Will("w", b"", 3)), 4),
    ("unknown level", PubAck(1), 6),
    ("not an event", object(), 4),
]


@pytest.mark.parametrize(("event", "level"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_local_errors(event: Any, level: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode(event, level)


def test_prepared_publish_validates_like_encode() -> None:
    with pytest.raises(LocalProtocolError):
        PreparedPublish(4, Publish("a/+", b""))
    with pytest.raises(LocalProtocolError):
        PreparedPublish(7, Publish("a", b""))


def test_every_property_has_a_field_and_round_trips_in_some_packet() -> None:
    fields = set(Properties.__dataclass_fields__)
    assert {spec.field for spec in PROPERTY_SPECS} == fields
    assert len({spec.identifier for spec in PROPERTY_SPECS}) == len(PROPERTY_SPECS) == 27


def test_properties_repr_and_emptiness() -> None:
    assert repr(Properties()) == "Properties()"
    assert repr(Properties(topic_alias=3)) == "Properties(topic_alias=3)"
    assert Properties().is_empty()
    assert Properties(user_properties=[]).is_empty()
    assert not Properties(reason_string="").is_empty()


def test_reason_code_names() -> None:
    assert ReasonCode(0x81).name == "MALFORMED_PACKET"
    assert ReasonCode.PACKET_TOO_LARGE == 0x95
    assert ReasonCode.NORMAL_DISCONNECTION == ReasonCode.SUCCESS == 0
    assert encode(Disconnect(ReasonCode.SESSION_TAKEN_OVER), 5) == b"\xe0\x01\x8e"


def test_long_remaining_lengths() -> None:
    for size in (127 - 5, 128, 16383, 16384, 2_097_152):
        data = encode(Publish("t", b"x" * size), 4)
        from gateway.protocol import decode_packet

        assert decode_packet(data, 4) == Publish("t", b"x" * size)
