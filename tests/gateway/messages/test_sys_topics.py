"""$SYS publisher: values, change-only rounds, lifecycle; and end to end through a Gateway."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.config import GatewaySettings, load_settings
from gateway.messages.sys_topics import SYS_PREFIX, SysPublisher
from gateway.stats import GatewayStats

TOPICS = {
    "version",
    "uptime",
    "clients/connected",
    "clients/total",
    "messages/received",
    "messages/sent",
    "bytes/received",
    "bytes/sent",
    "subscriptions/count",
    "retained messages/count",
    "store/bytes",
}


@dataclass
class RecordingGateway:
    """The slice of Gateway that SysPublisher uses, recording what it publishes."""

    settings: GatewaySettings
    stats: GatewayStats = field(default_factory=GatewayStats)
    published: list[tuple[str, bytes, bool, int]] = field(default_factory=list)
    retained: list[object] = field(default_factory=list)

    async def publish_internal(
        self, topic: str, payload: bytes, retain: bool = False, qos: int = 0
    ) -> None:
        self.published.append((topic, payload, retain, qos))


def _gateway(tmp_path: Path, **kw: object) -> RecordingGateway:
    data = tmp_path / "data"
    (data / "commitlog").mkdir(parents=True)
    (data / "commitlog" / "00000000000000000000").write_bytes(b"x" * 5000)
    return RecordingGateway(settings=load_settings(None, data_dir=data, **kw))


def _publisher(gw: RecordingGateway) -> SysPublisher:
    s = gw.settings
    return SysPublisher(
        gw.stats,
        gw.publish_internal,
        data_dir=s.data_dir,
        retained=gw.retained,
        interval=s.sys_interval,
    )


async def test_values_reflect_stats(tmp_path: Path) -> None:
    gw = _gateway(tmp_path)
    gw.stats.clients_connected = 3
    gw.stats.clients_total = 5
    gw.stats.messages_received = 10
    gw.stats.messages_sent = 20
    gw.stats.bytes_received = 100
    gw.stats.bytes_sent = 200
    gw.stats.subscriptions = 7
    gw.retained.extend([1, 2])
    values = _publisher(gw).values()
    assert {t.removeprefix(SYS_PREFIX) for t in values} == TOPICS
    v = {t.removeprefix(SYS_PREFIX): x for t, x in values.items()}
    assert v["clients/connected"] == "3" and v["clients/total"] == "5"
    assert v["messages/received"] == "10" and v["messages/sent"] == "20"
    assert v["bytes/received"] == "100" and v["bytes/sent"] == "200"
    assert v["subscriptions/count"] == "7" and v["retained messages/count"] == "2"
    assert v["version"].startswith("lmqtt version ")
    assert v["uptime"].endswith(" seconds")
    assert int(v["store/bytes"]) > 0  # measured from the CommitLog directory
    gw.stats.store_bytes = 12345
    assert _publisher(gw).values()[SYS_PREFIX + "store/bytes"] == "12345"


async def test_rounds_publish_retained_and_only_changes(tmp_path: Path) -> None:
    gw = _gateway(tmp_path)
    pub = _publisher(gw)
    assert await pub.publish_once() == len(TOPICS)
    assert all(retain and qos == 0 for _, _, retain, qos in gw.published)
    assert all(topic.startswith("$SYS/broker/") for topic, *_ in gw.published)
    gw.published.clear()
    gw.stats.clients_connected = 1
    await pub.publish_once()
    changed = {t.removeprefix(SYS_PREFIX) for t, *_ in gw.published}
    assert "clients/connected" in changed
    assert changed <= {"clients/connected", "uptime"}  # unchanged values are not re-sent


async def test_start_stop_and_interval(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, sys_interval=0.01)
    pub = _publisher(gw)
    pub.start()
    for _ in range(500):
        if pub.rounds >= 3:
            break
        await asyncio.sleep(0.01)
    assert pub.rounds >= 3
    await pub.stop()
    rounds = pub.rounds
    await asyncio.sleep(0.05)
    assert pub.rounds == rounds  # really stopped
    await pub.stop()  # idempotent


async def test_disabled_when_interval_is_zero(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, sys_interval=0)
    pub = _publisher(gw)
    pub.start()
    await asyncio.sleep(0.02)
    assert pub.rounds == 0 and gw.published == []
    await pub.stop()


async def test_publish_failure_does_not_kill_the_loop(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, sys_interval=0.01)
    calls = 0

    async def failing(topic: str, payload: bytes, retain: bool = False, qos: int = 0) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("disk full")

    gw.publish_internal = failing  # type: ignore[method-assign]
    pub = _publisher(gw)
    pub.start()
    for _ in range(500):
        if pub.rounds >= 1:
            break
        await asyncio.sleep(0.01)
    await pub.stop()
    assert pub.rounds >= 1 and calls > 1


# ---------------------------------------------------------------- end to end


async def test_sys_topics_reach_a_subscriber(tmp_path: Path) -> None:
    """A real Gateway publishes $SYS retained; a client subscribing to $SYS/# gets them."""
    app = pytest.importorskip("gateway.app")
    import paho.mqtt.client as mqtt

    settings = load_settings(port=0, data_dir=tmp_path / "data", sys_interval=0.05)
    gateway = app.Gateway(settings)
    await gateway.start()
    try:
        got: dict[str, bytes | bytearray] = {}
        loop = asyncio.get_running_loop()
        seen_all = asyncio.Event()

        def on_message(_c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
            got[msg.topic] = msg.payload
            connected = int(got.get(SYS_PREFIX + "clients/connected", b"0"))
            if {t.removeprefix(SYS_PREFIX) for t in got} >= TOPICS and connected >= 1:
                loop.call_soon_threadsafe(seen_all.set)

        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id="sys-watch", protocol=mqtt.MQTTv5
        )
        client.on_message = on_message
        client.connect("127.0.0.1", gateway.port)
        client.loop_start()
        try:
            client.subscribe("$SYS/#", qos=0)
            await asyncio.wait_for(seen_all.wait(), 30)
            assert got[SYS_PREFIX + "version"].startswith(b"lmqtt version ")
            assert got[SYS_PREFIX + "uptime"].endswith(b" seconds")

            # "#" alone must not match $SYS topics: retained ones would arrive with the SUBACK,
            # before the client's own probe message comes back.
            other: list[str] = []
            probe_back = asyncio.Event()

            def on_other(_c: object, _u: object, m: mqtt.MQTTMessage) -> None:
                other.append(m.topic)
                if m.topic == "probe":
                    loop.call_soon_threadsafe(probe_back.set)

            c2 = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2, client_id="hash-watch", protocol=mqtt.MQTTv5
            )
            c2.on_message = on_other
            subscribed = asyncio.Event()

            def on_subscribe(*_a: object) -> None:
                loop.call_soon_threadsafe(subscribed.set)

            c2.on_subscribe = on_subscribe
            c2.connect("127.0.0.1", gateway.port)
            c2.loop_start()
            try:
                c2.subscribe("#", qos=0)
                await asyncio.wait_for(subscribed.wait(), 30)
                c2.publish("probe", b"p", qos=1)
                await asyncio.wait_for(probe_back.wait(), 30)
            finally:
                c2.disconnect()
                c2.loop_stop()
            assert not [t for t in other if t.startswith("$")]
        finally:
            client.disconnect()
            client.loop_stop()
    finally:
        await gateway.stop()
