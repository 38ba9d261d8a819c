"""Replay on the RocketMQ backend beyond the shared suite (tests/gateway/session/test_replay.py runs
there too, see test_gateway_suites.py): `lmqtt replay --store rocketmq`, the offline export
pulled from the broker, with a real gateway process and paho publishers on the real cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.session.replay import iso_ms
from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ROOT, ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def _lmqtt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_export_of_a_rocketmq_deployment(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    topic = f"x{uuid.uuid4().hex[:12]}"
    g = ServeProcess(
        tmp_path / "data",
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, "--flush", "sync",
        env={"LMQTT_ROCKETMQ_TOPIC": topic, "LMQTT_ROCKETMQ_BROKER": "broker-b"},
    ).start()  # fmt: skip
    marks = []
    try:
        pub = Client(g.port, "pub")
        clients.append(pub)
        # Sync mode: a PUBACK comes after SEND_OK, so a time taken after it is after the
        # message's store time.
        for first, t in ((0, "site/a"), (10, "site/b"), (20, "site/a")):
            for i in range(first, first + 10):
                pub.publish(t, f"{t}:{i}".encode(), 1)
            pub.publish("other/x", b"\xff\xfe", 1)
            now = int(time.time() * 1000)

            def moved(now: int = now) -> bool:
                return int(time.time() * 1000) > now + 1

            wait_until(moved, what="the clock")
            marks.append(now + 1)
    finally:
        stop_clients(clients)
        g.stop()
    where = ["--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr]
    where += ["--rocketmq-topic", topic, "--rocketmq-broker", "broker-b"]

    r = _lmqtt("replay", *where, "--filter", "site/#", "--since", "earliest")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["payload"] for row in rows] == [
        f"site/{'b' if 10 <= i < 20 else 'a'}:{i}" for i in range(30)
    ]
    assert all(row["qos"] == 1 and row["parent"] == topic for row in rows)
    assert [row["physical_offset"] for row in rows] == sorted(r["physical_offset"] for r in rows)
    assert "30 messages exported" in r.stderr

    r = _lmqtt(
        "replay", *where, "--filter", "+/b", "--since", iso_ms(marks[0]), "--until", str(marks[1])
    )
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["payload"] for line in r.stdout.splitlines()] == [
        f"site/b:{i}" for i in range(10, 20)
    ]
    r = _lmqtt("replay", *where, "--filter", "other/x", "--since", iso_ms(marks[2]))
    assert r.returncode == 0 and r.stdout == "", r.stderr  # nothing stored after the last mark

    down = _lmqtt("replay", "--store", "rocketmq", "--namesrv", "127.0.0.1:9", "--filter", "a",
                  "--since", "earliest")  # fmt: skip
    assert down.returncode != 0 and "127.0.0.1:9" in down.stderr
    assert "Traceback" not in down.stderr
