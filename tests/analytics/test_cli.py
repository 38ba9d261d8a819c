"""Bad input to `lmqtt report`: one clear line and exit 2, decided before any JVM starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from analytics.cli import build_parser, main, parse_time
from analytics.errors import AnalyticsError


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "java" not in err.lower()
    return rc, err


@pytest.mark.parametrize("command", ["fanout", "compact"])
def test_missing_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    rc, err = _run([command, "--data-dir", str(tmp_path / "nope"), "--out", str(tmp_path)], capsys)
    assert rc == 2
    assert "does not exist" in err


def test_directory_that_is_not_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(["fanout", "--data-dir", str(tmp_path), "--out", str(tmp_path)], capsys)
    assert (rc, "not an lmqtt store" in err) == (2, True)


def test_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data" / "commitlog").mkdir(parents=True)
    rc, err = _run(["fanout", "--data-dir", str(tmp_path / "data")], capsys)
    assert (rc, "the store is empty" in err) == (2, True)
    # A segment file preallocated but never written is just as empty.
    (tmp_path / "data" / "commitlog" / ("0" * 20)).write_bytes(bytes(4096))
    rc, err = _run(["fanout", "--data-dir", str(tmp_path / "data")], capsys)
    assert (rc, "holds no messages yet" in err) == (2, True)


def test_bad_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(["fanout", "--data-dir", str(tmp_path), "--since", "yesterday"], capsys)
    assert (rc, "cannot read time 'yesterday'" in err) == (2, True)
    rc, err = _run(["fanout", "--since", "2024-01-02", "--until", "2024-01-01"], capsys)
    assert (rc, "--since must be before --until" in err) == (2, True)


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(["explode"], capsys)
    assert rc == 2 and "invalid choice" in err


def test_parse_time_forms() -> None:
    now = 1_700_000_000_000
    assert parse_time("2023-11-14T22:13:20", now) == 1_700_000_000_000
    assert parse_time("2023-11-14T23:13:20+01:00", now) == 1_700_000_000_000
    assert parse_time("2023-11-14T22:13:20Z", now) == 1_700_000_000_000
    assert parse_time("1700000000", now) == 1_700_000_000_000
    assert parse_time("1700000000000", now) == 1_700_000_000_000
    assert parse_time("15m", now) == now - 15 * 60_000
    assert parse_time("2h", now) == now - 7_200_000
    with pytest.raises(AnalyticsError):
        parse_time("soon", now)


@pytest.mark.parametrize("command", ["fanout", "compact"])
def test_relative_paths_are_made_absolute_for_cluster_executors(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Executors on a cluster have another working directory: a relative --data-dir read nothing.
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args([command, "--data-dir", "data", "--out", "out"])
    assert args.data_dir == str(tmp_path / "data")
    assert args.out == str(tmp_path / "out")


@pytest.fixture
def no_lmqtt_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("LMQTT_"):
            monkeypatch.delenv(key)


@pytest.mark.usefixtures("no_lmqtt_env")
@pytest.mark.parametrize("command", ["fanout", "compact"])
def test_lmqtt_report_takes_the_data_dir_from_the_settings(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`lmqtt report` reads the store the gateway's settings name: --config FILE, then LMQTT_*
    over it, then its flags over both."""
    from gateway.cli import main as lmqtt

    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text(f"data_dir = '{tmp_path / 'from-file'}'\n")
    out = ["--out", str(tmp_path / "out")]
    assert lmqtt(["report", command, "--config", str(cfg), *out]) == 2
    assert f"data directory {tmp_path / 'from-file'} does not exist" in capsys.readouterr().err
    monkeypatch.setenv("LMQTT_DATA_DIR", str(tmp_path / "from-env"))
    assert lmqtt(["report", command, "--config", str(cfg), *out]) == 2
    assert f"data directory {tmp_path / 'from-env'} does not exist" in capsys.readouterr().err
    flag = ["--data-dir", str(tmp_path / "from-flag")]
    assert lmqtt(["report", command, "--config", str(cfg), *flag, *out]) == 2
    assert f"data directory {tmp_path / 'from-flag'} does not exist" in capsys.readouterr().err


@pytest.mark.usefixtures("no_lmqtt_env")
def test_lmqtt_report_takes_the_store_from_the_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main as lmqtt

    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text("store = 'rocketmq'\nnamesrv = '127.0.0.1:9'\n")
    rc = lmqtt(["report", "fanout", "--config", str(cfg), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "RocketMQ name server 127.0.0.1:9 unreachable" in err, err


@pytest.mark.usefixtures("no_lmqtt_env")
def test_python_m_analytics_reads_its_flags_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without `lmqtt`, no gateway settings: LMQTT_DATA_DIR is not analytics' to read."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LMQTT_DATA_DIR", str(tmp_path / "from-env"))
    rc, err = _run(["fanout", "--out", str(tmp_path / "out")], capsys)
    assert rc == 2 and f"data directory {tmp_path / 'lmqtt-data'} does not exist" in err
