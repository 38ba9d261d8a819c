"""`lmqtt replay`: the offline export, run as a real process on a data directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.session.replay import iso_ms
from tests.gateway.conftest import Client, GatewayHarness, wait_until


def _lmqtt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture
def history(tmp_path: Path, clients: list[Client]) -> tuple[Path, int, int]:
    """A data directory with site/a (0..9), other/x, then site/b (10..19) after `mid`, and
    site/a (20..29) after `end`; the gateway is stopped."""
    h = GatewayHarness(tmp_path / "data").start()
    try:
        pub = Client(h.port, "pub")
        clients.append(pub)
        marks = []
        for first, topic in ((0, "site/a"), (10, "site/b"), (20, "site/a")):
            for i in range(first, first + 10):
                pub.publish(topic, f"{topic}:{i}".encode(), 1)
            pub.publish("other/x", b"\xff\xfe", 1)
            t = int(time.time() * 1000)

            def moved(t: int = t) -> bool:
                return int(time.time() * 1000) > t + 1

            wait_until(moved, what="the clock")
            marks.append(t + 1)
        pub.disconnect()
    finally:
        h.stop()
    return tmp_path / "data", marks[0], marks[1]


def test_jsonl_export_since_until(history: tuple[Path, int, int]) -> None:
    data, mid, end = history
    r = _lmqtt("replay", "--data-dir", str(data), "--filter", "site/#", "--since", "earliest")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["payload"] for row in rows] == [
        f"site/{'b' if 10 <= i < 20 else 'a'}:{i}" for i in range(30)
    ]
    assert all(row["qos"] == 1 and row["parent"] == "site" for row in rows)
    assert [row["physical_offset"] for row in rows] == sorted(r["physical_offset"] for r in rows)
    assert "30 messages exported" in r.stderr

    r = _lmqtt(
        "replay", "--data-dir", str(data), "--filter", "+/b", "--since", iso_ms(mid),
        "--until", str(end),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["payload"] for row in rows] == [f"site/b:{i}" for i in range(10, 20)]

    r = _lmqtt("replay", "--data-dir", str(data), "--filter", "other/x", "--since", "0")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 3
    assert rows[0]["payload"] is None and rows[0]["payload_base64"] == "//4="


def test_parquet_export(history: tuple[Path, int, int], tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    data, mid, _end = history
    out = tmp_path / "out.parquet"
    r = _lmqtt(
        "replay", "--data-dir", str(data), "--filter", "site/a", "--since", iso_ms(mid),
        "--format", "parquet", "--output", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    table = pq.read_table(out)
    assert table.column("payload").to_pylist() == [f"site/a:{i}" for i in range(20, 30)]
    assert set(table.column("topic").to_pylist()) == {"site/a"}


def test_bad_arguments_are_one_clear_line(history: tuple[Path, int, int], tmp_path: Path) -> None:
    data, _mid, _end = history
    for args, code, text in [
        (["--filter", "site/#", "--since", "noon"], 2, "replay start 'noon' is invalid"),
        (["--filter", "site/#/x", "--since", "0"], 2, "topic filter"),
        (["--filter", "a", "--since", "0", "--format", "parquet"], 2, "needs --output"),
    ]:
        r = _lmqtt("replay", "--data-dir", str(data), *args)
        assert r.returncode == code, r.stderr
        assert text in r.stderr and "Traceback" not in r.stderr
    r = _lmqtt("replay", "--data-dir", str(tmp_path / "none"), "--filter", "a", "--since", "0")
    assert r.returncode == 1 and "not an lmqtt data directory" in r.stderr


def test_settings_from_the_config_file_environment_and_flags(
    history: tuple[Path, int, int], tmp_path: Path
) -> None:
    """The store is the settings' (gateway/config.py): --config FILE, LMQTT_* over it, the
    command's flags over both, as `lmqtt serve` and `lmqtt inspect` resolve them."""
    data, _mid, _end = history
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMQTT_")}
    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text(f"data_dir = '{data}'\n")
    query = ("--filter", "site/#", "--since", "earliest")
    r = _lmqtt("replay", "--config", str(cfg), *query, env=env)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 30 and "30 messages exported" in r.stderr

    elsewhere = tmp_path / "elsewhere"
    r = _lmqtt(
        "replay", "--config", str(cfg), *query, env={**env, "LMQTT_DATA_DIR": str(elsewhere)}
    )
    assert r.returncode == 1 and f"{elsewhere} is not an lmqtt data directory" in r.stderr
    r = _lmqtt(
        "replay", "--config", str(cfg), "--data-dir", str(data), *query,
        env={**env, "LMQTT_DATA_DIR": str(elsewhere)},
    )  # fmt: skip
    assert r.returncode == 0 and "30 messages exported" in r.stderr, r.stderr

    # The store kind too, checked with the other settings: rocketmq without its name server.
    cfg.write_text(f"data_dir = '{data}'\nstore = 'rocketmq'\n")
    r = _lmqtt("replay", "--config", str(cfg), *query, env=env)
    assert r.returncode == 2 and "store = rocketmq needs namesrv" in r.stderr, r.stderr
    r = _lmqtt("replay", "--config", str(cfg), "--store", "embedded", *query, env=env)
    assert r.returncode == 0 and "30 messages exported" in r.stderr, r.stderr
