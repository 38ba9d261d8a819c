"""The PUBLISH fast path of the writer: same bytes as the general path, same checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol import LocalProtocolError, Properties, Publish, encode, readers, writers
from gateway.protocol.readers import read_publish

topics = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00+#"), max_size=40
)


def _decode(data: bytes, level: int) -> Publish:
    length, shift, at = 0, 0, 1
    while True:
        byte = data[at]
        length |= (byte & 0x7F) << shift
        shift += 7
        at += 1
        if not byte & 0x80:
            break
    assert at + length == len(data)
    return read_publish(data[0] & 0x0F, data, at, len(data), level)


@given(
    topic=topics,
    size=st.sampled_from(
        [0, 1, 60, 61, 62, 63, 64, 125, 126, 127, 128, 16300, 16340, 16383, 20000]
    ),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    dup=st.booleans(),
    packet_id=st.integers(1, 0xFFFF),
    level=st.sampled_from([3, 4, 5]),
    props=st.sampled_from([None, Properties(), Properties(user_properties=[])]),
)
def test_fast_path_equals_general_path(
    topic: str,
    size: int,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int,
    level: int,
    props: Properties | None,
) -> None:
    # Twice: the first call may miss the topic cache, the second hits it.
    event = Publish(
        topic, bytes(size), qos, retain, dup and qos > 0, packet_id if qos else None, props
    )
    try:
        expected = writers._write_publish_general(event, level)
    except LocalProtocolError:
        for _ in range(2):
            with pytest.raises(LocalProtocolError):
                encode(event, level)
        return
    for _ in range(2):
        assert encode(event, level) == expected
    decoded = _decode(expected, level)
    assert (decoded.topic, decoded.payload, decoded.qos) == (topic, event.payload, qos)
    assert (decoded.retain, decoded.dup, decoded.packet_id) == (retain, event.dup, event.packet_id)


@pytest.mark.parametrize("level", [4, 5])
def test_fast_path_keeps_the_checks_for_cached_topics(level: int) -> None:
    encode(Publish("cached/topic", b"x"), level)  # now in the cache
    for bad in (
        Publish("cached/topic", b"x", 0, packet_id=1),
        Publish("cached/topic", b"x", 0, dup=True),
        Publish("cached/topic", b"x", 1),
        Publish("cached/topic", b"x", 1, packet_id=0),
        Publish("cached/topic", b"x", 1, packet_id=0x10000),
        Publish("cached/topic", b"x", 3, packet_id=1),
    ):
        with pytest.raises(LocalProtocolError):
            encode(bad, level)


def test_empty_topic_is_never_cached() -> None:
    with pytest.raises(LocalProtocolError):
        encode(Publish("", b"x"), 4)
    assert "" not in writers._ENCODED_TOPICS
    assert "" not in writers._ENCODED_TOPICS_NO_PROPS
    # MQTT 5: an empty topic is fine with a topic alias, and still not cached.
    data = encode(Publish("", b"x", properties=Properties(topic_alias=3)), 5)
    assert _decode(data, 5).properties.topic_alias == 3  # type: ignore[union-attr]
    assert "" not in writers._ENCODED_TOPICS


def test_a_fleets_topics_stay_cached() -> None:
    """10,000 devices, each publishing to its own topic: every topic stays in the readers'
    and the writers' caches (a cache cleared when full, smaller than the fleet, would miss on
    nearly every message)."""
    readers.TOPIC_CACHE.clear()
    writers._ENCODED_TOPICS.clear()
    writers._ENCODED_TOPICS_NO_PROPS.clear()
    topics = [f"site/{d % 50}/dev/{d}/temp" for d in range(10_000)]
    for topic in topics:
        assert readers.cache_topic(topic.encode()) == topic
        encode(Publish(topic, b""), 4)
    assert all(readers.TOPIC_CACHE.get(t.encode()) == t for t in topics)
    assert all(t in writers._ENCODED_TOPICS for t in topics)


def test_topic_caches_stay_bounded() -> None:
    for i in range(writers._TOPIC_CACHE_SIZE * 2 + 10):
        encode(Publish(f"bounded/{i}", b""), 5)
    assert len(writers._ENCODED_TOPICS) <= writers._TOPIC_CACHE_SIZE
    assert len(writers._ENCODED_TOPICS_NO_PROPS) <= writers._TOPIC_CACHE_SIZE
    # Long topics are encoded every time rather than cached.
    long_topic = "l" * 300
    encode(Publish(long_topic, b""), 4)
    assert long_topic not in writers._ENCODED_TOPICS


def test_non_empty_properties_take_the_property_encoder() -> None:
    props = Properties(message_expiry_interval=30, user_properties=[("k", "v")])
    data = encode(Publish("p/t", b"body", 1, packet_id=9, properties=props), 5)
    decoded = _decode(data, 5)
    assert decoded.properties is not None
    assert decoded.properties.message_expiry_interval == 30
    assert decoded.properties.user_properties == [("k", "v")]
    with pytest.raises(LocalProtocolError):
        encode(Publish("p/t", b"", properties=Properties(session_expiry_interval=1)), 5)
