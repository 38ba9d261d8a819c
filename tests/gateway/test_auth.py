"""Password file and `lmqtt passwd`: real files in tmp_path, the real CLI entry point."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.auth import PasswordFile, PasswordFileError, hash_password, verify_password
from gateway.cli import main

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
