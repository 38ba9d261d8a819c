"""PublishPath (gateway/messages/publishing.py): the first-time work of a new topic, on a real
embedded store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import GatewaySettings
from gateway.messages.publishing import PublishPath
from gateway.messages.recent import RecentMessages
from gateway.messages.records import PublishProperties
from gateway.protocol import ENCODED_TOPICS, Publish, encode
from gateway.stats import GatewayStats
from gateway.storage.embedded import open_storage


@pytest.fixture
def path(tmp_path: Path) -> Iterator[PublishPath]:
    store = open_storage(GatewaySettings(data_dir=tmp_path / "data"))
    path = PublishPath(store, RecentMessages(), GatewayStats())
    path.add_filter("fp/+/dev/+/temp")
    yield path
    store.close()


def _publish(path: PublishPath, topic: str) -> None:
    block = PublishProperties("dev-1", path.store.encode_properties)
    path.append_publishes([Publish(topic=topic, payload=b"x", qos=1, packet_id=7)], [block])


def test_a_new_topic_with_a_subscriber_is_encoded_for_delivery_when_first_routed(
    path: PublishPath,
) -> None:
    # The delivery's plain run (a C loop) takes a message only when its topic is in the
    # writers' cache; filled here, a new topic's first delivery is no general-path send.
    topic = "fp/3/dev/41/temp"
    assert topic not in ENCODED_TOPICS
    _publish(path, topic)
    assert ENCODED_TOPICS[topic] == len(topic).to_bytes(2, "big") + topic.encode()
    # Byte for byte what the encoder writes for it.
    packet = encode(Publish(topic=topic, payload=b"x", qos=1, packet_id=9), 4)
    assert (
        packet == b"\x32" + bytes([2 + len(topic) + 2 + 1]) + ENCODED_TOPICS[topic] + b"\x00\x09x"
    )


def test_a_topic_no_filter_matches_is_not_encoded(path: PublishPath) -> None:
    topic = "fp/3/dev/42/humidity"
    _publish(path, topic)
    assert path.publish_route(topic)[1] == ()
    assert topic not in ENCODED_TOPICS
