"""End to end: devices publish through the real gateway (paho-mqtt), subscribers receive, and
the fan-out report's per-device deliveries equal what the subscribers actually got."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("gateway.app")

from tests.gateway.conftest import Client, GatewayHarness, stop_clients, wait_until
from topicmap import queue_name

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

TRAFFIC = {  # device -> [(topic, count)]
    "dev-1": [("plant/1/temp", 10), ("plant/1/hum", 5)],
    "dev-2": [("plant/2/temp", 8)],
    "dev-3": [("office/9/door", 4)],  # nobody subscribes
}


def drive_traffic(port: int, made: list[Client]) -> tuple[Client, Client, Client, Client]:
    """The report tests' fleet on the gateway at `port`: a persistent `plant/#` subscriber, an
    offline one on `plant/+/temp` (its queue keeps everything), a shared group of two
    persistent MQTT 5 members, then TRAFFIC published at QoS 1. Every client goes to `made`."""
    everything = Client(port, "sub-all", clean=False)
    offline = Client(port, "sub-temp", clean=False)
    g1 = Client(port, "g1", v5=True, clean=False, session_expiry=3600)
    g2 = Client(port, "g2", v5=True, clean=False, session_expiry=3600)
    made += [everything, offline, g1, g2]
    everything.subscribe("plant/#", qos=1)
    offline.subscribe("plant/+/temp", qos=1)
    offline.disconnect()  # keeps its session: everything for it waits in its queue
    g1.subscribe("$share/grp/plant/1/#", qos=1)
    g2.subscribe("$share/grp/plant/1/#", qos=1)
    for device, topics in TRAFFIC.items():
        pub = Client(port, device)
        made.append(pub)
        for topic, count in topics:
            for i in range(count):
                pub.publish(topic, f"{device}:{i}".encode(), qos=1)
    return everything, offline, g1, g2


def test_report_matches_what_subscribers_received(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from analytics.fanout import run_fanout

    h = GatewayHarness(tmp_path / "data").start()
    made: list[Client] = []
    try:
        everything, offline, g1, g2 = drive_traffic(h.port, made)
        plant = sum(n for d, ts in TRAFFIC.items() for t, n in ts if t.startswith("plant/"))
        plant1 = sum(n for t, n in TRAFFIC["dev-1"])
        everything.wait_messages(plant)
        wait_until(lambda: len(g1.messages) + len(g2.messages) >= plant1, what="shared")
        offsets = h.gw.store.offsets  # type: ignore[union-attr]
        wait_until(
            lambda: (
                offsets.get("sub-all", queue_name("plant/#")) == plant
                and offsets.get("$share/grp", queue_name("plant/1/#")) == plant1
            ),
            what="PUBACKs committed",
        )
    finally:
        stop_clients(made)
        h.stop()

    received: Counter[str] = Counter()
    for c in (everything, g1, g2, offline):
        for m in c.messages:
            received[m.payload.decode().split(":")[0]] += 1
    out = tmp_path / "reports"
    meta = run_fanout(spark, tmp_path / "data", out)
    rows = {r["client_id"]: r for r in pq.read_table(out / "report" / "device_fanout").to_pylist()}
    for device, topics in TRAFFIC.items():
        row = rows[device]
        assert row["messages"] == sum(n for _, n in topics)
        assert row["deliveries"] == received[device], device
    # Due but not delivered: the offline subscriber's temperature readings.
    assert rows["dev-1"]["eligible"] - rows["dev-1"]["deliveries"] == 10
    assert rows["dev-2"]["eligible"] - rows["dev-2"]["deliveries"] == 8
    assert (rows["dev-1"]["subscribers_reached"], rows["dev-3"]["subscribers_reached"]) == (2, 0)
    assert rows["dev-1"]["fanout_max"] == 3  # plant/#, plant/+/temp, plant/1/#
    backlog = {r["filter"]: r for r in pq.read_table(out / "report" / "queue_backlog").to_pylist()}
    assert backlog["plant/+/temp"]["backlog_messages"] == 18
    assert backlog["plant/#"]["backlog_messages"] == 0
    assert meta.devices >= len(TRAFFIC)
