"""The `lmqtt` command as a user runs it: real subprocesses, real sockets, real MQTT clients."""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import main

ROOT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"lmqtt listening on (\S+):(\d+), data in (.+)$")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMQTT_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=cwd or ROOT,
        timeout=timeout,
    )


# ---------------------------------------------------------------- usage and settings errors


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ((), {}, "required: COMMAND"),
        (("serve", "--port", "abc"), {}, "invalid int value"),
        (("serve", "--bogus"), {}, "unrecognized arguments: --bogus"),
        (("serve", "--port", "70000"), {}, "port: must be between 0 and 65535"),
        (("serve", "--flush", "sometimes"), {}, "flush: Input should be 'async' or 'sync'"),
        (("serve",), {"LMQTT_MAX_QOS": "7"}, "environment LMQTT_MAX_QOS"),
        (("serve", "--log-level", "chatty"), {}, "log_level: must be one of"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    args: tuple[str, ...],
    env: dict[str, str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In-process (the same main() the console script calls), to keep the suite fast."""
    for key in list(os.environ):
        if key.upper().startswith("LMQTT_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        rc = main(list(args))
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert rc == 2, err
    assert expected in err
    assert "Traceback" not in err


def test_bad_settings_in_a_real_process() -> None:
    result = _run("serve", "--port", "70000", env={**_env(), "LMQTT_FLUSH": "never"})
    assert result.returncode == 2
    assert "port: must be between 0 and 65535" in result.stderr
    assert "flush:" in result.stderr and "environment LMQTT_FLUSH" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_config_file_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text("hots = '0.0.0.0'\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "unknown setting 'hots' (did you mean 'host'?)" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_inspect_rejects_missing_and_foreign_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", "--data-dir", str(tmp_path / "nope")]) == 1
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "photos").mkdir()
    assert main(["inspect", "--data-dir", str(tmp_path / "photos")]) == 1
    assert "not an lmqtt data directory" in capsys.readouterr().err


def test_subtools_dispatch_or_explain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmqtt report/sim ARGS` call the sub-tool's main(ARGS) untouched, or explain."""
    (tmp_path / "g2_fake_report.py").write_text(
        "def main(argv, **settings):\n    print('report got', argv)\n    return 3\n"
    )
    (tmp_path / "g2_fake_sim.py").write_text("import g2_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gateway.cli as cli

    monkeypatch.setitem(cli.SUBTOOLS, "report", ("g2_fake_report", "install report"))
    assert main(["report", "--since", "1h", "--help"]) == 3
    assert capsys.readouterr().out.strip() == "report got ['--since', '1h', '--help']"

    monkeypatch.setitem(cli.SUBTOOLS, "sim", ("g2_fake_sim", "pip install 'lmqtt[sim]'"))
    assert main(["sim", "run"]) == 1
    err = capsys.readouterr().err
    assert "'lmqtt sim' needs the g2_no_such_dependency package: pip install 'lmqtt[sim]'" in err

    monkeypatch.setitem(cli.SUBTOOLS, "sim", ("g2_absent_tool.cli", "x"))
    assert main(["sim"]) == 1
    assert "'lmqtt sim' is not available in this installation" in capsys.readouterr().err


def test_report_is_handed_the_store_settings_resolved_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmqtt report` resolves --config, LMQTT_* and its store flags as every command does
    (flags > environment > file) and hands analytics the values, without those arguments."""
    for key in list(os.environ):
        if key.upper().startswith("LMQTT_"):
            monkeypatch.delenv(key)
    (tmp_path / "g2_fake_report2.py").write_text(
        "def main(argv, **settings):\n    print(repr((argv, settings)))\n    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import gateway.cli as cli

    monkeypatch.setitem(cli.SUBTOOLS, "report", ("g2_fake_report2", "install report"))
    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text(
        "data_dir = 'from-file'\nstore = 'rocketmq'\nnamesrv = 'file:9876'\n"
        "rocketmq_topic = 'file-topic'\nrocketmq_broker = 'file-broker'\n"
    )
    monkeypatch.setenv("LMQTT_ROCKETMQ_TOPIC", "env-topic")
    monkeypatch.setenv("LMQTT_ROCKETMQ_BROKER", "env-broker")
    argv = ["report", "fanout", "--config", str(cfg), "--since", "1h", "--rocketmq-broker", "b"]
    assert main(argv) == 0
    assert ast.literal_eval(capsys.readouterr().out) == (
        ["fanout", "--since", "1h"],
        {
            "data_dir": "from-file",
            "store": "rocketmq",
            "namesrv": "file:9876",
            "rocketmq_topic": "env-topic",
            "rocketmq_broker": "b",
        },
    )
    # Nothing configured: the defaults, and no data directory (analytics' own default).
    monkeypatch.delenv("LMQTT_ROCKETMQ_TOPIC")
    monkeypatch.delenv("LMQTT_ROCKETMQ_BROKER")
    assert main(["report", "show"]) == 0
    assert ast.literal_eval(capsys.readouterr().out) == (
        ["show"],
        {
            "data_dir": None,
            "store": "embedded",
            "namesrv": None,
            "rocketmq_topic": "lmqtt",
            "rocketmq_broker": None,
        },
    )
    # An invalid combination is the settings' error, exit 2, before analytics runs.
    cfg.write_text("store = 'rocketmq'\n")
    assert main(["report", "fanout", "--config", str(cfg)]) == 2
    assert "store = rocketmq needs namesrv" in capsys.readouterr().err


# ---------------------------------------------------------------- serve


class Server:
    def __init__(self, proc: subprocess.Popen[str], host: str, port: int, data: str) -> None:
        self.proc, self.host, self.port, self.data = proc, host, port, data


def _wait_listening(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[str, int, str]:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = []
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=deadline - time.monotonic()):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = LISTENING.search(line.strip())
            if m:
                return m.group(1), int(m.group(2)), m.group(3)
    finally:
        sel.close()
    stderr = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
    raise AssertionError(f"server did not report listening: stdout={seen!r} stderr={stderr!r}")


@contextlib.contextmanager
def serving(*args: str, cwd: Path | None = None) -> Iterator[Server]:
    pytest.importorskip("gateway.app")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--loop",
            "asyncio",
            "--sys-interval",
            "0",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=cwd or ROOT,
    )
    try:
        host, port, data = _wait_listening(proc)
        yield Server(proc, host, port, data)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


def _stop(server: Server, sig: int = signal.SIGTERM) -> tuple[int, str]:
    server.proc.send_signal(sig)
    try:
        rc = server.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise AssertionError("server did not stop within 15 s of the signal") from None
    assert server.proc.stderr is not None
    return rc, server.proc.stderr.read()


def _roundtrip(port: int) -> bytes:
    import paho.mqtt.client as mqtt

    got: list[bytes] = []
    ready, arrived = threading.Event(), threading.Event()
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id="cli-test", protocol=mqtt.MQTTv311
    )
    client.on_subscribe = lambda *a: ready.set()

    def on_message(_c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        got.append(bytes(msg.payload))
        arrived.set()

    client.on_message = on_message
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    try:
        client.subscribe("cli/#", qos=1)
        assert ready.wait(30), "no SUBACK"
        client.publish("cli/hello", b"world", qos=1)
        assert arrived.wait(30), "message not delivered"
    finally:
        client.disconnect()
        client.loop_stop()
    return got[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_mqtt_and_stops_gracefully(tmp_path: Path, sig: int) -> None:
    data = tmp_path / "data"
    logs = ("--log-format", "json", "--log-level", "INFO") if sig == signal.SIGINT else ()
    with serving("--port", "0", "--data-dir", str(data), *logs) as server:
        assert server.host == "127.0.0.1" and server.port != 0
        assert server.data == str(data)
        assert _roundtrip(server.port) == b"world"
        rc, stderr = _stop(server, sig)
    assert rc == 0, stderr
    assert "Traceback" not in stderr
    if logs:  # structured: every line one JSON object from an lmqtt.* logger
        docs = [json.loads(line) for line in stderr.splitlines() if line.strip()]
        assert docs and all(d["logger"].startswith("lmqtt.") for d in docs)
        assert any(d["msg"] == "SIGINT received: shutting down" for d in docs)
    else:  # quiet by default: the shutdown notice is the only line
        assert stderr.strip().endswith("SIGTERM received: shutting down")
    assert (data / "commitlog").is_dir()
    # After a graceful stop the data directory is inspectable and holds the message.
    result = _run("inspect", "--data-dir", str(data), "--json")
    assert result.returncode == 0, result.stderr


def _bind_1883() -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 1883))
        s.listen(1)
    except OSError as exc:
        s.close()
        if exc.errno == errno.EADDRINUSE:
            return None  # someone already holds it: the fallback is exercised all the same
        raise
    return s


def test_serve_falls_back_to_a_free_port_when_1883_is_taken(tmp_path: Path) -> None:
    blocker = _bind_1883()
    try:
        with serving(cwd=tmp_path) as server:  # no --port, no --data-dir: the defaults
            assert server.port != 1883
            assert server.data == "./lmqtt-data"
            assert _roundtrip(server.port) == b"world"
            rc, stderr = _stop(server)
        assert rc == 0
        assert f"port 1883 is in use; listening on free port {server.port}" in stderr
        assert (tmp_path / "lmqtt-data" / "commitlog").is_dir()
    finally:
        if blocker is not None:
            blocker.close()


def test_explicit_busy_port_is_an_error(tmp_path: Path) -> None:
    pytest.importorskip("gateway.app")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = _run("serve", "--port", str(port), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 1
    assert "address already in use" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- logging


def test_logging_text_json_and_quiet_default() -> None:
    import io
    import json
    import logging

    from gateway.logs import configure_logging, get_logger

    log = get_logger("server")
    assert log.name == "lmqtt.server"
    buf = io.StringIO()
    configure_logging("WARNING", "text", buf)
    log.info("not shown %s", "by default")
    log.warning("client %s gone", "c1", extra={"client": "c1", "reason": 0x8E})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    assert "WARNING lmqtt.server: client c1 gone client=c1 reason=142" in lines[0]

    buf = io.StringIO()
    configure_logging("DEBUG", "json", buf)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed %d times", 2, extra={"client": "c2"})
    doc = json.loads(buf.getvalue())
    assert doc["level"] == "ERROR" and doc["logger"] == "lmqtt.server"
    assert doc["msg"] == "failed 2 times" and doc["client"] == "c2"
    assert "ValueError: boom" in doc["exc"]
    configure_logging()  # back to the quiet default for other tests
    assert logging.getLogger("lmqtt").level == logging.WARNING


def test_second_server_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serving("--port", "0", "--data-dir", str(data)) as first:
        result = _run("serve", "--port", "0", "--data-dir", str(data))
        assert result.returncode == 1
        assert "another 'lmqtt serve'" in result.stderr and "Traceback" not in result.stderr
        # ... while inspect, read-only, still works next to the live server.
        result = _run("inspect", "--data-dir", str(data), "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["data_dir"] == str(data)
        rc, _ = _stop(first)
    assert rc == 0
