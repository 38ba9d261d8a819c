"""Smoke test of the benchmark harness: real broker process, real load-generator processes.

Not a timed test: it only checks that messages flow end to end and that the codec frames
packets correctly however the bytes are split.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import wire
from bench.brokers import BrokerOptions, BrokerProcess
from bench.realtime import is_realtime, make_realtime
from bench.scenarios import RunSettings, fanout


def test_split_packets_reassembles_any_fragmentation() -> None:
    template = wire.PublishTemplate("a/b", 1, 64)
    stream = b"".join(template.encode(seq, 7, seq + 1) for seq in range(20))

    @given(st.lists(st.integers(min_value=1, max_value=len(stream)), max_size=30))
    def check(cuts: list[int]) -> None:
        pending = b""
        seen: list[int] = []
        edges = [0, *sorted(set(cuts)), len(stream)]
        for start, end in itertools.pairwise(edges):
            pending += stream[start:end]
            packets, consumed = wire.split_packets(pending)
            for first, body in packets:
                qos, packet_id, payload = wire.publish_fields(first, body)
                seq, sent = wire.PAYLOAD_HEADER.unpack_from(payload)
                assert (qos, packet_id, sent, len(payload)) == (1, seq + 1, 7, 64)
                seen.append(seq)
            pending = pending[consumed:]
        assert seen == list(range(20))
        assert pending == b""

    check()


def test_remaining_length_varint_boundaries() -> None:
    for value, encoded in [(0, b"\x00"), (127, b"\x7f"), (128, b"\x80\x01"), (16383, b"\xff\x7f")]:
        assert wire.encode_varint(value) == encoded


async def _smoke_run(name: str, tmp_path: Path, *, latency: bool) -> dict[str, Any]:
    """One second of paced QoS 1 through broker `name`: one publisher, one subscriber.

    The drain waits for every delivery; only a stall of ten seconds ends it early, so a loaded
    host that pauses the broker for a moment (CI runs JVMs beside it) is not counted as loss.
    What the broker logged goes with the metrics, for the assertion's message.
    """
    broker = BrokerProcess(name, tmp_path, BrokerOptions())
    await broker.start()
    try:
        metrics = await fanout(
            broker,
            RunSettings(duration=1.0, drain_idle=10.0),
            qos=1,
            connections=[{"id": "smoke-sub", "filters": ["smoke/t"]}],
            topics=["smoke/t"],
            per_message=1,
            rate=500.0,
            latency=latency,
        )
        metrics["broker_log"] = broker.log_tail(20)
        return metrics
    finally:
        await broker.stop()


async def test_load_generator_moves_messages_through_amqtt(tmp_path: Path) -> None:
    metrics = await _smoke_run("amqtt", tmp_path, latency=True)
    assert metrics["published"] > 100
    assert metrics["delivered"] == metrics["published"], (metrics["acked"], metrics["broker_log"])
    assert metrics["loss_pct"] == 0.0
    assert metrics["p50_ms"] > 0
    # Self-check of the paced publisher: PUBACK round trips and send lag were measured (the lag
    # may be 0 if the generator was punctual).
    assert metrics["puback_p50_ms"] > 0
    assert metrics["send_lag_p99_ms"] >= metrics["send_lag_p50_ms"] >= 0


def test_make_realtime_applies_to_every_thread_or_reports_refusal() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start();"
            " print('up', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        applied = make_realtime(child.pid)
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 2
        if applied:
            assert all(is_realtime(tid) for tid in tids)
        else:
            # "Refused" must be the kernel's answer, not the helper's: ask it directly.
            assert not any(is_realtime(tid) for tid in tids)
            with pytest.raises((PermissionError, AttributeError)):
                os.sched_setscheduler(child.pid, os.SCHED_FIFO, os.sched_param(1))
    finally:
        child.kill()
        child.wait()


async def test_fleet_moves_every_device_message_to_every_backend(tmp_path: Path) -> None:
    """The fleet scenario end to end on a small fleet: every device connects, each message
    reaches 2 or 3 backends, and the figures the report needs are there (no timing checked)."""
    from bench.fleet import fleet

    broker = BrokerProcess("amqtt", tmp_path, BrokerOptions())
    await broker.start()
    try:
        metrics = await fleet(broker, devices=60, rate=120.0, duration=1.0, qos=1, capacity=False)
    finally:
        await broker.stop()
    assert metrics["connected"] == 60 and metrics["connect_failures"] == 0
    assert metrics["published"] == 120
    # Devices 0..59 in turn, two rounds: sites 0..4 and 50..54 have a third backend.
    assert metrics["expected"] == 2 * (60 * 2 + 10)
    assert metrics["delivered"] == metrics["expected"]
    assert metrics["loss_pct"] == 0.0
    for key in ("p50_ms", "p99_ms", "p999_ms", "us_cpu_per_publish", "kib_per_device"):
        assert key in metrics
    # The broker's CPU per publish, split into its own code and the kernel's work for it.
    split = metrics["us_user_cpu_per_publish"] + metrics["us_system_cpu_per_publish"]
    assert metrics["us_user_cpu_per_publish"] > 0
    assert split == pytest.approx(metrics["us_cpu_per_publish"], abs=0.02)


@pytest.mark.parametrize("name", ["lmqtt", "lmqtt-noaccount"])
async def test_lmqtt_without_its_delivery_account_keeps_none(tmp_path: Path, name: str) -> None:
    """bench --account-cost runs lmqtt-noaccount beside lmqtt: the same gateway, messages flow,
    but it writes no delivery account (lmqtt writes one by the time it stops)."""
    metrics = await _smoke_run(name, tmp_path, latency=False)
    assert metrics["published"] > 100
    assert metrics["delivered"] == metrics["published"]
    assert (tmp_path / "data" / "account").exists() == (name == "lmqtt")


def test_account_cost_is_the_paired_difference_per_delivery() -> None:
    from bench.report import account_cost

    def runs(*us: float) -> dict[str, object]:
        return {"runs": [{"us_cpu_per_delivery": u} for u in us]}

    cost = account_cost({"lmqtt": runs(10.0, 12.0, 11.0), "lmqtt-noaccount": runs(9.0, 11.5, 9.0)})
    assert cost is not None
    assert cost["paired_diffs"] == [1.0, 0.5, 2.0]
    assert cost["us_cpu_per_delivery_account"] == 1.0
    assert cost["share_pct"] == round(100 * 1.0 / 11.0, 1)
    assert account_cost({"lmqtt": runs(10.0)}) is None
