"""InboundPublisher (gateway/messages/inbound.py): a RocketMQ application's message as an MQTT
publish, checked and stored through the real publish path on a real embedded store. The
RocketMQ end (consumer group, dead letters, Java producers) is tests/rocketmq/test_inbound.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import GatewaySettings
from gateway.messages.inbound import InboundPublisher, publisher_of
from gateway.messages.publishing import PublishPath
from gateway.messages.recent import RecentMessages
from gateway.messages.records import read_record
from gateway.stats import GatewayStats
from gateway.storage.embedded import open_storage
from gateway.storage.inbound import InboundMessage, Rejected
from gateway.storage.port import Storage


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Storage]:
    s = open_storage(GatewaySettings(data_dir=tmp_path / "data"))
    yield s
    s.close()


def _publisher(store: Storage, **kw: object) -> tuple[InboundPublisher, PublishPath, GatewayStats]:
    stats = GatewayStats()
    path = PublishPath(store, RecentMessages(), stats)
    options: dict = {"max_topic_length": 64, "retain_available": True, **kw}
    return InboundPublisher(path, stats, **options), path, stats


def msg(body: bytes = b"on", **props: str) -> InboundMessage:
    return InboundMessage(body, props, "", "10.0.0.5", "ID1")


@pytest.mark.parametrize(
    ("props", "reason"),
    [
        ({}, "no mqttTopic property"),
        ({"mqttTopic": "a/+/b"}, "wildcard '+'"),
        ({"mqttTopic": "a/#"}, "wildcard '#'"),
        ({"mqttTopic": "$SYS/x"}, "is a $-topic"),
        ({"mqttTopic": ""}, "mqttTopic:"),
        ({"mqttTopic": "a/\udcff"}, "not valid UTF-8"),
        ({"mqttTopic": "x" * 65}, "65 bytes, over 64"),
        ({"mqttTopic": "a", "mqttQos": "3"}, "mqttQos '3'"),
        ({"mqttTopic": "a", "mqttRetain": "yes"}, "mqttRetain 'yes'"),
        ({"mqttTopic": "a", "k": "\udcff"}, "user property 'k'"),
    ],
)
def test_a_message_that_is_no_publish_is_rejected_with_the_reason(
    store: Storage, props: dict[str, str], reason: str
) -> None:
    inbound, _, _ = _publisher(store)
    with pytest.raises(Rejected) as info:
        inbound.publish_of(msg(b"on", **props))
    assert reason in info.value.reason


def test_properties_become_qos_retain_and_user_properties(store: Storage) -> None:
    inbound, _, _ = _publisher(store)
    pub = inbound.publish_of(
        msg(mqttTopic="cmd/7/valve", mqttQos="2", mqttRetain="TRUE", mqttPublisher="svc", a="1")
    )
    assert (pub.topic, pub.qos, pub.retain, pub.payload) == ("cmd/7/valve", 2, True, b"on")
    assert pub.properties is not None and pub.properties.user_properties == [("a", "1")]
    assert inbound.publish_of(msg(mqttTopic="t")).properties is None
    no_retain, _, _ = _publisher(store, retain_available=False)
    assert not no_retain.publish_of(msg(mqttTopic="t", mqttRetain="1")).retain


def test_the_publisher_is_the_producer_group_else_mqtt_publisher_else_the_host() -> None:
    assert publisher_of(InboundMessage(b"", {"mqttPublisher": "svc"}, "grp", "h", "i")) == (
        "rocketmq:grp"
    )
    assert publisher_of(InboundMessage(b"", {"mqttPublisher": "svc"}, "", "h", "i")) == (
        "rocketmq:svc"
    )
    assert publisher_of(InboundMessage(b"", {}, "", "10.0.0.5", "i")) == "rocketmq:10.0.0.5"


def test_handle_stores_it_like_a_device_publish_routed_to_matching_filters(
    store: Storage,
) -> None:
    inbound, path, stats = _publisher(store)
    plus = path.add_filter("cmd/+/valve")
    path.add_filter("other/#")
    asyncio.run(
        inbound.handle(msg(b"open", mqttTopic="cmd/7/valve", mqttQos="1", mqttPublisher="svc"))
    )
    assert stats.inbound_consumed == 1 and stats.messages_received == 1
    got = store.get(plus, 0)
    (stored,) = got.messages
    rec = read_record(stored.topic, stored.body, stored.properties, stored.store_timestamp)
    assert rec is not None
    assert (rec.topic, rec.payload, rec.qos, rec.client_id) == (
        "cmd/7/valve",
        b"open",
        1,
        "rocketmq:svc",
    )
    inbound.dead_lettered(msg(), "why")
    assert stats.inbound_dead_lettered == 1
