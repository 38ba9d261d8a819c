"""The admin HTTP listener: Prometheus /metrics and /health, read with real HTTP requests."""

from __future__ import annotations

import gc
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.protocol import PubAck, Publish, encode
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until


@pytest.fixture
def admin_gateway(tmp_path: Path) -> Iterator[GatewayHarness]:
    h = GatewayHarness(tmp_path / "data", admin_port=0, flush="sync").start()
    try:
        yield h
    finally:
        h.stop()


def _admin_url(h: GatewayHarness, path: str) -> str:
    assert h.gw is not None
    return f"http://127.0.0.1:{h.gw.listeners.port('admin')}{path}"


def scrape(h: GatewayHarness) -> dict[str, float]:
    with urllib.request.urlopen(_admin_url(h, "/metrics"), timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_follow_traffic(admin_gateway: GatewayHarness, clients: list[Client]) -> None:
    before = scrape(admin_gateway)
    assert before["lmqtt_clients_connected"] == 0
    sub = Client(admin_gateway.port, "m-sub")
    pub = Client(admin_gateway.port, "m-pub", v5=True)
    clients += [sub, pub]
    sub.subscribe("m/#", 1)
    for i in range(10):
        pub.publish(f"m/{i}", b"x" * 100, 1)
    sub.wait_messages(10)
    wait_until(lambda: scrape(admin_gateway)["lmqtt_messages_sent_total"] >= 10, what="sent")
    m = scrape(admin_gateway)
    assert m["lmqtt_clients_connected"] == 2
    assert m["lmqtt_connections"] == 2
    assert m["lmqtt_messages_received_total"] == 10
    assert m["lmqtt_bytes_received_total"] > 1000
    assert m["lmqtt_bytes_sent_total"] > 1000
    assert m["lmqtt_subscriptions"] == 1
    assert m["lmqtt_sessions"] == 2
    assert m["lmqtt_light_queues"] >= 1
    assert m["lmqtt_store_bytes"] > 1000
    assert m["lmqtt_store_appended_messages_total"] == 10
    assert 1 <= m["lmqtt_store_append_seconds_count"] <= 10
    # paho sends each PUBLISH as it is made: the acks of batched runs waited for the fsync.
    assert m["lmqtt_store_durable_wait_seconds_count"] >= 1
    assert m["lmqtt_store_fsync_seconds_count"] >= 1  # flush = sync
    assert m["lmqtt_backlog_messages"] == 0
    sub.disconnect()  # clean session: gone; pub's messages have no subscriber now
    wait_until(lambda: scrape(admin_gateway)["lmqtt_clients_connected"] == 1, what="1 client")


def test_burst_is_stored_in_batches_with_metrics_on(admin_gateway: GatewayHarness) -> None:
    """The admin endpoint does not switch the batched ingest off: a burst of QoS 1 PUBLISHes
    written at once is appended in fewer store calls than messages, and every one is counted,
    acknowledged in order and durable (flush = sync)."""
    raw = RawClient(admin_gateway.port, level=5)
    try:
        raw.connect("burst")
        before = scrape(admin_gateway)
        burst = b"".join(
            encode(Publish(f"burst/{i}", b"p" * 32, 1, packet_id=i + 1), 5) for i in range(50)
        )
        raw.send_bytes(burst)
        acks = [raw.recv_until(PubAck).packet_id for _ in range(50)]
        assert acks == list(range(1, 51))
        m = scrape(admin_gateway)
        appended = m["lmqtt_store_appended_messages_total"] - before.get(
            "lmqtt_store_appended_messages_total", 0.0
        )
        calls = m["lmqtt_store_append_seconds_count"] - before.get(
            "lmqtt_store_append_seconds_count", 0.0
        )
        assert appended == 50
        assert 1 <= calls < 50
    finally:
        raw.close()


def test_backlog_of_offline_session(admin_gateway: GatewayHarness, clients: list[Client]) -> None:
    sub = Client(admin_gateway.port, "offline", clean=False)
    clients.append(sub)
    sub.subscribe("b/#", 1)
    sub.disconnect()
    pub = Client(admin_gateway.port)
    clients.append(pub)
    for i in range(7):
        pub.publish(f"b/{i}", b"queued", 1)
    wait_until(lambda: scrape(admin_gateway)["lmqtt_backlog_messages"] == 7, what="backlog 7")


def test_health_and_errors(admin_gateway: GatewayHarness) -> None:
    with urllib.request.urlopen(_admin_url(admin_gateway, "/health"), timeout=10) as resp:
        assert resp.status == 200
        body = json.loads(resp.read())
    assert body["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(_admin_url(admin_gateway, "/nope"), timeout=10)
    assert err.value.code == 404
    req = urllib.request.Request(_admin_url(admin_gateway, "/metrics"), method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 405
    # A client that never finishes its request does not block the others.
    assert admin_gateway.gw is not None
    port = admin_gateway.gw.listeners.port("admin")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        slow.sendall(b"GET /metr")
        with urllib.request.urlopen(_admin_url(admin_gateway, "/health"), timeout=10) as resp:
            assert resp.status == 200
        huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000
        with socket.create_connection(("127.0.0.1", port), timeout=10) as big:
            try:
                big.sendall(huge)
                assert big.recv(100) == b""  # over the 8 KiB head limit: closed
            except ConnectionResetError:
                pass


def test_admin_listener_off_by_default(gateway: GatewayHarness) -> None:
    assert gateway.gw is not None
    assert gateway.gw.listeners.admin is None
    assert gateway.settings.admin_port is None
    assert gateway.settings.admin_host == "127.0.0.1"


def test_gc_pauses_are_exposed(admin_gateway: GatewayHarness) -> None:
    # The gateway runs in this process (a thread of the harness): a collection here is one of
    # its pauses too.
    before = scrape(admin_gateway)
    gc.collect()
    after = scrape(admin_gateway)
    assert after["lmqtt_gc_pause_seconds_count"] >= before["lmqtt_gc_pause_seconds_count"] + 1
    assert after["lmqtt_gc_collections_total"] == after["lmqtt_gc_pause_seconds_count"]
    assert after["lmqtt_gc_pause_seconds_sum"] > 0
    assert after["lmqtt_gc_pause_max_seconds"] >= after["lmqtt_gc_pause_p50_seconds"] > 0


def test_a_stall_of_the_event_loop_is_counted(admin_gateway: GatewayHarness) -> None:
    """The loop held 200 ms (a blocking call on it, as a compaction holding the GIL would):
    lmqtt_event_loop_stalls_total counts it and the largest lag is at least that long."""
    before = scrape(admin_gateway)
    assert before["lmqtt_event_loop_lag_seconds"] >= 0
    admin_gateway.call(lambda: time.sleep(0.2))  # blocks the gateway's loop: the stall itself
    m = scrape(admin_gateway)
    assert m["lmqtt_event_loop_stalls_total"] >= before["lmqtt_event_loop_stalls_total"] + 1
    assert m["lmqtt_event_loop_lag_max_seconds"] >= 0.15


def test_a_scrape_does_not_walk_the_frozen_objects(admin_gateway: GatewayHarness) -> None:
    """A scrape runs on the event loop: its cost must not grow with what gc.freeze() moved out
    of the collector's way (the whole fleet's objects), or every scrape stalls the loop. The
    gateway runs in this process: objects frozen here are the gateway's too."""
    gw = admin_gateway.gw
    assert gw is not None
    metrics = gw.listeners.metrics
    assert metrics is not None  # the admin listener serves /metrics

    def render_cpu() -> float:
        started = time.thread_time()
        metrics.render()
        return time.thread_time() - started

    lean = min(admin_gateway.call(render_cpu) for _ in range(3))
    ballast = [[i] for i in range(1_500_000)]  # tracked containers, as a fleet's objects are
    gc.freeze()
    try:
        heavy = min(admin_gateway.call(render_cpu) for _ in range(3))
    finally:
        gc.unfreeze()
        del ballast
    assert heavy < lean + 0.02, f"scrape {heavy * 1e3:.1f} ms with the ballast frozen"
