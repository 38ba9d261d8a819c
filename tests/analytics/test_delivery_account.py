"""End to end, the issue's scenario: a persistent subscriber on `site/+/dev/#` and a clean one on
`site/1/dev/1/temp` (both online), a persistent `site/#` subscriber offline, and dev-1 publishing
100 QoS 1 messages. Every delivery is counted (200 for dev-1, clean session included), and the
gateway's own $SYS messages are never a device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

pytest.importorskip("gateway.app")

from store import FLAG_CLEAN, FLAG_CLOSED, read_account
from tests.gateway.conftest import Client, GatewayHarness, quick_account, stop_clients, wait_until
from topicmap import queue_name

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

N = 100


def _acked(data: Path, subscriber: str, flt: str) -> int:
    q = queue_name(flt)
    return max(
        (r.acked for r in read_account(data) if r.subscriber == subscriber and r.queue == q),
        default=-1,
    )


def test_every_delivery_counted_clean_sessions_included(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from analytics.fanout import run_fanout

    quick_account(monkeypatch)  # the lag sample waited for below comes every sample_s

    data = tmp_path / "data"
    h = GatewayHarness(data, sys_interval=0.2).start()
    made: list[Client] = []
    try:
        persistent = Client(h.port, "backend-p", clean=False)
        clean = Client(h.port, "backend-c", clean=True)
        archive = Client(h.port, "archive", clean=False)
        ops = Client(h.port, "ops")  # watches the gateway's own $SYS messages at QoS 0
        made += [persistent, clean, archive, ops]
        ops.subscribe("$SYS/#", qos=0)
        ops.wait_messages(1)
        persistent.subscribe("site/+/dev/#", qos=1)
        clean.subscribe("site/1/dev/1/temp", qos=1)
        archive.subscribe("site/#", qos=1)
        archive.disconnect()  # persistent: its share waits in its queue
        dev = Client(h.port, "dev-1")
        made.append(dev)
        for i in range(N):
            dev.publish("site/1/dev/1/temp", f"{i}".encode(), qos=1)
        persistent.wait_messages(N)
        clean.wait_messages(N)
        # The account is written off the hot path (every flush_s): wait for both ranges.
        wait_until(
            lambda: (
                _acked(data, "backend-p", "site/+/dev/#") == N
                and _acked(data, "backend-c", "site/1/dev/1/temp") == N
            ),
            timeout=30,
            what="the delivery account",
        )
        # The offline subscriber's lag is sampled every sample_s.
        wait_until(
            lambda: any(r.subscriber == "archive" and r.queue_end >= N for r in read_account(data)),
            timeout=60,
            what="the offline subscriber's lag sample",
        )
        # Both subscriptions are still open while this report runs.
        out = tmp_path / "open"
        meta = run_fanout(spark, data, out)
        _check(out, meta)
    finally:
        stop_clients(made)
        h.stop()
    # The clean session ended with its connection: its range was closed, nothing lost.
    closed = [
        r
        for r in read_account(data)
        if r.subscriber == "backend-c" and r.flags & FLAG_CLOSED and r.flags & FLAG_CLEAN
    ]
    assert closed and closed[-1].acked == N
    out = tmp_path / "after"
    _check(out, run_fanout(spark, data, out))


def _check(out: Path, meta) -> None:  # type: ignore[no-untyped-def]
    rows = {r["client_id"]: r for r in pq.read_table(out / "report" / "device_fanout").to_pylist()}
    dev = rows["dev-1"]
    assert dev["messages"] == N
    assert dev["deliveries"] == 2 * N  # 100 per online subscriber
    assert dev["deliveries_acked"] == 2 * N and dev["deliveries_qos0"] == 0
    assert dev["eligible"] == 3 * N  # the offline archive is due them too
    assert dev["subscribers_reached"] == 2
    assert dev["messages_unreached"] == 0
    assert "" not in rows and None not in rows  # the gateway is not a device
    assert meta.gateway["messages"] > 0  # ... it has its own line
    assert meta.gateway["deliveries"] > 0  # to ops, whose $SYS/# range is accounted
    subs = {r["subscriber"]: r for r in pq.read_table(out / "report" / "subscribers").to_pylist()}
    assert subs["backend-c"]["kind"] == "clean" and subs["backend-c"]["acked"] == N
    assert subs["archive"]["lag"] >= N and subs["backend-p"]["lag"] == 0
    per_filter = {
        r["filter"]: r for r in pq.read_table(out / "report" / "filter_deliveries").to_pylist()
    }
    assert per_filter["site/+/dev/#"]["deliveries"] == N
    assert per_filter["site/1/dev/1/temp"]["deliveries"] == N
    assert per_filter["site/#"]["deliveries"] == 0
