"""Password file and `lmqtt passwd`: real files in tmp_path, the real CLI entry point."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.access.auth import (
    PasswordFile,
    PasswordFileError,
    SecurityError,
    hash_password,
    verify_password,
)
from gateway.app import Gateway
from gateway.cli import main
from gateway.config import load_settings
from gateway.protocol import Connect, encode
from tests.gateway.conftest import TIMEOUT, Client, GatewayHarness, RawClient, wait_until

FAST_N = 1 << 4  # tests of the encoding itself need not be slow


def test_hash_roundtrip_and_salt() -> None:
    a = hash_password("s3cret", n=FAST_N)
    b = hash_password("s3cret", n=FAST_N)
    assert a != b  # random salt
    assert verify_password(a, "s3cret") and verify_password(b, b"s3cret")
    assert not verify_password(a, "s3cret ")
    assert not verify_password(a, "")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "plain",
        "$7$101$abc$def",  # mosquitto's PBKDF2 scheme: not read
        "$scrypt$16384$8$1$!!$!!",
        "$scrypt$3$8$1$c2FsdHNhbHQ=$aGFzaGhhc2hoYXNoaGFzaA==",  # N not a power of two
        "$scrypt$1073741824$8$1$c2FsdA==$aGFzaGhhc2hoYXNoaGFzaA==",  # N too large
        "$scrypt$16384$8$1",
    ],
)
def test_malformed_hash_never_verifies(bad: str) -> None:
    assert not verify_password(bad, "x")


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=80))
def test_arbitrary_hash_text_never_raises(text: str) -> None:
    assert verify_password("$scrypt$" + text, "pw") is False


def test_file_set_verify_delete_reload(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    pf = PasswordFile(path=path)
    pf.set("alice", "wonderland")
    pf.set("bob", "builder")
    pf.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = PasswordFile.load(path)
    assert loaded.verify("alice", b"wonderland")
    assert not loaded.verify("alice", b"builder")
    assert not loaded.verify("carol", b"wonderland")
    assert loaded.delete("bob") and not loaded.delete("bob")
    loaded.save()
    assert set(PasswordFile.load(path).users) == {"alice"}


def test_file_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    with pytest.raises(PasswordFileError, match="no such file"):
        PasswordFile.load(path)
    good = hash_password("x", n=FAST_N)
    path.write_text(f"# users\n\nalice:{good}\nbob-without-hash\n")
    with pytest.raises(PasswordFileError, match="line 4"):
        PasswordFile.load(path)
    path.write_text(f"alice:{good}\nbob:$7$101$x$y\n")
    with pytest.raises(PasswordFileError, match=r"line 2.*scheme"):
        PasswordFile.load(path)


@pytest.mark.parametrize("user", ["", "a:b", " lead", "new\nline"])
def test_invalid_user_names_refused(user: str) -> None:
    with pytest.raises(ValueError):
        PasswordFile().set(user, "pw")


def test_passwd_cli_add_change_delete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sub" / "passwd"
    path.parent.mkdir()
    assert main(["passwd", str(path), "alice", "-b", "one"]) == 0
    assert main(["passwd", str(path), "bob", "-b", "two"]) == 0
    assert PasswordFile.load(path).verify("alice", "one")
    assert main(["passwd", str(path), "alice", "-b", "three"]) == 0
    pf = PasswordFile.load(path)
    assert pf.verify("alice", "three") and not pf.verify("alice", "one")
    assert pf.verify("bob", "two")
    assert main(["passwd", str(path), "bob", "-D"]) == 0
    assert set(PasswordFile.load(path).users) == {"alice"}
    assert main(["passwd", str(path), "bob", "-D"]) == 1
    assert "not in" in capsys.readouterr().err
    assert main(["passwd", str(path), "bad:name", "-b", "x"]) == 2
    assert main(["passwd", str(path), "carol", "-b", ""]) == 2
    assert main(["passwd", str(path), "carol", "-D", "-b", "x"]) == 2


def test_passwd_cli_prompts_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "passwd"
    answers = iter(["pw1", "pw1", "a", "b"])
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    assert main(["passwd", str(path), "dora"]) == 0
    assert PasswordFile.load(path).verify("dora", "pw1")
    assert main(["passwd", str(path), "dora"]) == 2  # mismatch: file unchanged
    assert PasswordFile.load(path).verify("dora", "pw1")


def test_passwd_cli_refuses_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    path.write_text("garbage\n")
    assert main(["passwd", str(path), "x", "-b", "y"]) == 1
    assert path.read_text() == "garbage\n"


# ---------------------------------------------------------------- against a running gateway


def _raw_connack_v4(port: int, username: str | None, password: bytes | None) -> int:
    """The 3.1.1 CONNACK return code exactly as sent on the wire."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        sock.sendall(encode(Connect(4, "raw", True, 30, username=username, password=password), 4))
        data = b""
        while len(data) < 4:
            chunk = sock.recv(4 - len(data))
            assert chunk, "closed before CONNACK"
            data += chunk
        assert data[:2] == b"\x20\x02"
        return data[3]
    finally:
        sock.close()


def _paho(port: int, user: str | None, password: str | None, *, v5: bool) -> Client:
    c = Client(port, v5=v5, connect=False)
    if user is not None:
        c.c.username_pw_set(user, password)
    # paho's network thread retries a refused CONNECT after 1 s: on a slow host that retry
    # came within a test and counted as one more refusal. One CONNECT per client here.
    c.c.reconnect_delay_set(min_delay=600, max_delay=600)
    c.connect()
    return c


@pytest.fixture
def passwd_file(tmp_path: Path) -> Path:
    path = tmp_path / "passwd"
    assert main(["passwd", str(path), "alice", "-b", "wonderland"]) == 0
    return path


@pytest.mark.parametrize("v5", [True, False])
def test_connect_auth_matrix(
    tmp_path: Path, passwd_file: Path, clients: list[Client], v5: bool
) -> None:
    h = GatewayHarness(tmp_path / "data", password_file=passwd_file).start()
    try:
        cases = [
            ("alice", "wonderland", 0),
            ("alice", "wrong", 0x86),
            ("mallory", "wonderland", 0x86),
            (None, None, 0x87),  # anonymous: a password file turns it off by default
        ]
        for user, pw, expected in cases:
            c = _paho(h.port, user, pw, v5=v5)
            clients.append(c)
            assert c.connack is not None and c.connack[1] == expected, (user, pw, c.connack)
        if not v5:  # 3.1.1 return codes on the wire: 4 bad credentials, 5 not authorized
            assert _raw_connack_v4(h.port, "alice", b"wonderland") == 0
            assert _raw_connack_v4(h.port, "alice", b"nope") == 4
            assert _raw_connack_v4(h.port, None, None) == 5
        # A refused client got nothing: the accepted one still works end to end.
        ok = clients[0]
        ok.subscribe("t/#", 1)
        ok.publish("t/1", b"hello", 1)
        assert ok.wait_messages(1)[0].payload == b"hello"
        expected_refusals = 3 if v5 else 5
        assert h.call(lambda: h.gw.access.refused_connects) == expected_refusals  # type: ignore[union-attr]
    finally:
        h.stop()


def test_refused_credentials_do_not_count_as_flapping(tmp_path: Path, passwd_file: Path) -> None:
    """Connects with a wrong password under a device's client id do not get that id banned
    for flapping (anyone reaching the port could do it); the device's own connects count."""
    h = GatewayHarness(tmp_path / "data", password_file=passwd_file, flapping_max_connects=3)
    h.start()

    def connack(password: bytes) -> int:
        c = RawClient(h.port, level=5)
        try:
            return int(c.connect("dev-1", username="alice", password=password).reason_code)
        finally:
            c.close()

    try:
        assert [connack(b"guess") for _ in range(5)] == [0x86] * 5
        assert [connack(b"wonderland") for _ in range(3)] == [0] * 3
        assert connack(b"wonderland") == 0x8A  # its fourth: flapping
    finally:
        h.stop()


def test_anonymous_allowed_explicitly_with_password_file(
    tmp_path: Path, passwd_file: Path, clients: list[Client]
) -> None:
    h = GatewayHarness(tmp_path / "data", password_file=passwd_file, allow_anonymous=True).start()
    try:
        anon = _paho(h.port, None, None, v5=True)
        clients.append(anon)
        assert anon.connack == (False, 0)
        bad = _paho(h.port, "alice", "wrong", v5=True)  # credentials given are still checked
        clients.append(bad)
        assert bad.connack is not None and bad.connack[1] == 0x86
    finally:
        h.stop()


def test_loopback_default_allows_anonymous(gateway: GatewayHarness, clients: list[Client]) -> None:
    c = _paho(gateway.port, None, None, v5=False)
    clients.append(c)
    assert c.connack == (False, 0)


def test_non_loopback_without_auth_refuses_to_start(tmp_path: Path, passwd_file: Path) -> None:
    data = tmp_path / "data"
    with pytest.raises(SecurityError, match=r"refusing to listen on 0\.0\.0\.0"):
        Gateway(load_settings(host="0.0.0.0", port=0, data_dir=data))
    assert not data.exists()  # refused before anything was opened
    # Either a password file or an explicit allow_anonymous makes it start.
    Gateway(load_settings(host="0.0.0.0", port=0, data_dir=data, password_file=passwd_file))
    Gateway(load_settings(host="0.0.0.0", port=0, data_dir=data, allow_anonymous=True))


def test_serve_refuses_non_loopback_without_auth(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--host", "0.0.0.0", "--port", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LMQTT_DATA_DIR": str(tmp_path / "d")},
    )
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0 without authentication" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sighup_reloads_passwords_without_dropping(tmp_path: Path, passwd_file: Path) -> None:
    """A real `lmqtt serve` process: change the password file, SIGHUP, old sessions live on."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "d"),
            "--sys-interval",
            "0",
            "--password-file",
            str(passwd_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    made: list[Client] = []
    try:
        assert proc.stdout is not None
        assert "listening" in proc.stdout.readline()
        alice = _paho(port, "alice", "wonderland", v5=True)
        made.append(alice)
        assert alice.connack == (False, 0)
        alice.subscribe("news", 1)
        assert main(["passwd", str(passwd_file), "bob", "-b", "builder"]) == 0
        assert main(["passwd", str(passwd_file), "alice", "-D"]) == 0
        before = _paho(port, "bob", "builder", v5=True)
        made.append(before)
        assert before.connack is not None and before.connack[1] == 0x86  # not reloaded yet
        proc.send_signal(signal.SIGHUP)

        def bob_gets_in() -> bool:
            c = _paho(port, "bob", "builder", v5=True)
            made.append(c)
            return c.connack == (False, 0)

        wait_until(bob_gets_in, what="bob accepted after SIGHUP")
        late = _paho(port, "alice", "wonderland", v5=True)
        made.append(late)
        assert late.connack is not None and late.connack[1] == 0x86
        # alice's existing connection was not dropped and still receives.
        made[-2].publish("news", b"still here", 1)
        assert alice.wait_messages(1)[0].payload == b"still here"
        assert alice.disconnected is None
    finally:
        for c in made:
            c.c.disconnect()
            c.c.loop_stop()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
