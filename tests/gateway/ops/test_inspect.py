"""`lmqtt inspect` over a store with known content: numbers, names, and strictly read-only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.messages.retained import RetainedIndex
from gateway.ops.inspection import inspect_data_dir
from store import MessageStore, StoreConfig
from topicmap import queue_name

ROOT = Path(__file__).resolve().parents[3]
HOT = "site/+/temp"
ALL = "site/#"
Q_HOT, Q_ALL = queue_name(HOT), queue_name(ALL)


def _build(data: Path) -> MessageStore:
    """10 messages on site/<i>/temp (both filters), 3 on site/x/hum (site/# only), 2 retained
    topics set and one of them deleted; two sessions, one with a shared subscription."""
    store = MessageStore.open(StoreConfig(data_dir=data))
    for i in range(10):
        store.put(
            topic="site",
            body=b"t%d" % i,
            queues=[Q_HOT, Q_ALL],
            properties={"mqtt.topic": f"site/{i}/temp"},
        )
    for _ in range(3):
        store.put(topic="site", body=b"h", queues=[Q_ALL], properties={"mqtt.topic": "site/x/hum"})
    for topic, body in (("site/a/cfg", b"on"), ("site/b/cfg", b"off"), ("site/b/cfg", b"")):
        store.put(
            topic="site",
            body=body,
            queues=[RetainedIndex.QUEUE],
            properties={"mqtt.topic": topic, "mqtt.qos": "1", "mqtt.retain": "1"},
        )
    sessions = {
        "version": 1,
        "sessions": {
            "dev-1": {
                "protocol_level": 5,
                "expiry_interval": 3600,
                "disconnected_at_ms": 1700000000000,
                "subscriptions": [
                    {
                        "filter": HOT,
                        "queue": Q_HOT,
                        "share_group": None,
                        "qos": 1,
                        "no_local": False,
                        "retain_as_published": False,
                        "retain_handling": 0,
                        "subscription_identifier": None,
                        "start_offset": 2,
                    },
                ],
                "qos2_inbound": [7],
                "inflight": [
                    {"packet_id": 1, "queue": Q_HOT, "offset": 6, "qos": 1, "pubrel": False}
                ],
            },
            "dev-2": {
                "protocol_level": 4,
                "expiry_interval": 604800,
                "disconnected_at_ms": None,
                "subscriptions": [
                    {
                        "filter": f"$share/g/{ALL}",
                        "queue": Q_ALL,
                        "share_group": "g",
                        "qos": 0,
                        "no_local": False,
                        "retain_as_published": False,
                        "retain_handling": 0,
                        "subscription_identifier": None,
                        "start_offset": 0,
                    },
                    {
                        "filter": HOT,
                        "queue": Q_HOT,
                        "share_group": None,
                        "qos": 2,
                        "no_local": False,
                        "retain_as_published": False,
                        "retain_handling": 0,
                        "subscription_identifier": None,
                        "start_offset": 4,
                    },
                ],
                "qos2_inbound": [],
                "inflight": [],
            },
        },
    }
    store.write_config("sessions.json", json.dumps(sessions).encode())
    store.offsets.commit("dev-1", Q_HOT, 6)
    store.offsets.commit("$share/g", Q_ALL, 5)
    # dev-2's HOT subscription has no committed offset yet: backlog counts from start_offset.
    return store


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "data"
    _build(path).close()
    return path


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
    }


def test_report_numbers(data: Path) -> None:
    report = inspect_data_dir(data)
    queues = {q.name: q for q in report.queues}
    assert queues["site"].kind == "parent" and queues["site"].max_offset == 16
    assert (queues[Q_HOT].kind, queues[Q_HOT].filter, queues[Q_HOT].max_offset) == (
        "light",
        HOT,
        10,
    )
    assert (queues[Q_ALL].filter, queues[Q_ALL].messages) == (ALL, 13)
    assert queues[RetainedIndex.QUEUE].kind == "retained"
    assert report.retained_count == 1

    sessions = {s.client_id: s for s in report.sessions}
    assert sessions["dev-1"].inflight == 1 and sessions["dev-1"].qos2_inbound == 1
    assert sessions["dev-2"].disconnected_at_ms is None and sessions["dev-2"].subscriptions == 2

    subs = {(s.client_id, s.filter): s for s in report.subscriptions}
    one = subs[("dev-1", HOT)]
    assert (one.group, one.committed, one.backlog) == ("dev-1", 6, 4)
    shared = subs[("dev-2", f"$share/g/{ALL}")]
    assert (shared.group, shared.committed, shared.backlog) == ("$share/g", 5, 8)
    fresh = subs[("dev-2", HOT)]
    assert (fresh.committed, fresh.start_offset, fresh.backlog) == (None, 4, 6)
    assert {(o["group"], o["offset"], o["lag"]) for o in report.offsets} == {
        ("dev-1", 6, 4),
        ("$share/g", 5, 8),
    }


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQTT_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "gateway", "inspect", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_cli_json_and_text_are_read_only(data: Path) -> None:
    before = _tree(data)
    result = _cli("--data-dir", str(data), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["retained_count"] == 1
    assert {q["name"]: q["messages"] for q in doc["queues"]}[Q_ALL] == 13
    assert {s["client_id"] for s in doc["sessions"]} == {"dev-1", "dev-2"}

    result = _cli("--data-dir", str(data))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for needle in (
        "Queues (4)",
        "Sessions (2)",
        "Subscriptions (3)",
        HOT,
        ALL,
        "$share/g",
        "Retained messages: 1",
        "offline since 2023-11-14 22:13:20Z",
    ):
        assert needle in out, needle
    assert _tree(data) == before  # not a byte, not a timestamp changed


def test_inspect_next_to_a_running_writer(tmp_path: Path) -> None:
    """The writer holds the lock; inspect still reads (read-only open takes no lock)."""
    store = _build(tmp_path / "live")
    try:
        store.flush()
        report = inspect_data_dir(tmp_path / "live")
        assert {q.name: q.max_offset for q in report.queues}[Q_HOT] == 10
    finally:
        store.close()


def test_damaged_sessions_file_is_a_warning(tmp_path: Path) -> None:
    store = MessageStore.open(StoreConfig(data_dir=tmp_path / "d"))
    store.put(topic="a", body=b"x", queues=[], properties={})
    store.write_config("sessions.json", b"{not json")
    store.close()
    report = inspect_data_dir(tmp_path / "d")
    assert report.sessions == [] and "sessions.json" in report.warnings[0]
    assert [q.name for q in report.queues] == ["a"]


async def test_backlog_of_an_offline_persistent_session(tmp_path: Path) -> None:
    """Through a real Gateway: a persistent subscriber goes away, 3 messages arrive for it;
    after the gateway stops, inspect shows the session offline with a backlog of 3."""
    import asyncio
    import threading

    import paho.mqtt.client as mqtt

    app = pytest.importorskip("gateway.app")
    from gateway.config import load_settings

    data = tmp_path / "data"
    gateway = app.Gateway(load_settings(port=0, data_dir=data, sys_interval=0))
    await gateway.start()
    try:
        subscribed, gone = threading.Event(), threading.Event()
        sub = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id="field-7",
            clean_session=False,
            protocol=mqtt.MQTTv311,
        )
        sub.on_subscribe = lambda *a: subscribed.set()
        sub.on_disconnect = lambda *a: gone.set()
        sub.connect("127.0.0.1", gateway.port)
        sub.loop_start()
        sub.subscribe("plant/+/alarm", qos=1)
        assert await asyncio.to_thread(subscribed.wait, 30)
        sub.disconnect()
        assert await asyncio.to_thread(gone.wait, 30)
        sub.loop_stop()

        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="plc", protocol=mqtt.MQTTv311)
        pub.connect("127.0.0.1", gateway.port)
        pub.loop_start()
        infos = [pub.publish(f"plant/{i}/alarm", b"!", qos=1) for i in range(3)]
        for info in infos:
            await asyncio.to_thread(info.wait_for_publish, 30)  # PUBACK: stored
            assert info.is_published()
        pub.disconnect()
        pub.loop_stop()
    finally:
        await gateway.stop()

    report = inspect_data_dir(data)
    [session] = [s for s in report.sessions if s.client_id == "field-7"]
    assert session.disconnected_at_ms is not None and session.subscriptions == 1
    [subscription] = [s for s in report.subscriptions if s.client_id == "field-7"]
    assert subscription.filter == "plant/+/alarm" and subscription.qos == 1
    assert subscription.backlog == 3
    queue = {q.name: q for q in report.queues}[subscription.queue]
    assert queue.filter == "plant/+/alarm" and queue.kind == "light"


def test_text_output_is_bounded_unless_all(tmp_path: Path) -> None:
    """Millions of light queues must not become millions of lines by default."""
    import io

    from rich.console import Console

    from gateway.ops.inspection import render_text

    store = MessageStore.open(StoreConfig(data_dir=tmp_path / "d"))
    for i in range(8):
        for _ in range(i + 1):  # queue i holds i + 1 messages
            store.put(topic="big", body=b"x", queues=[queue_name(f"big/{i}")], properties={})
    store.close()
    report = inspect_data_dir(tmp_path / "d")

    def text(limit: int | None) -> str:
        buf = io.StringIO()
        render_text(report, Console(file=buf, width=200), limit=limit)
        return buf.getvalue()

    short = text(3)
    assert "3 of 9 shown (most messages); --all shows every row" in short
    assert "big/7" in short and "big/6" in short and "big/0" not in short
    assert "│ 36 │" in short.replace(" ", "").replace("│36│", "│ 36 │")  # parent: 36 messages
    full = text(None)
    assert all(f"big/{i}" in full for i in range(8)) and "shown" not in full
