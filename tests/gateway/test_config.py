"""GatewaySettings: layer precedence, validation messages, TOML strictness."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest

from gateway.config import DEFAULT_PORT, GatewaySettings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own LMQTT_* variables must not leak into these tests."""
    for key in list(os.environ):
        if key.upper().startswith("LMQTT_"):
            monkeypatch.delenv(key)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lmqtt.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults() -> None:
    s = load_settings()
    assert s.host == "127.0.0.1"
    assert s.port is None and not s.port_explicit and s.default_port == DEFAULT_PORT
    assert s.data_dir == Path("lmqtt-data")
    assert s.flush == "async" and s.log_level == "WARNING" and s.log_format == "text"


def test_precedence_cli_over_env_over_toml_over_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _toml(
        tmp_path,
        'port = 2001\nflush = "sync"\nmax_qos = 1\nlog_level = "info"\n',
    )
    monkeypatch.setenv("LMQTT_PORT", "2002")
    monkeypatch.setenv("LMQTT_FLUSH", "async")
    s = load_settings(cfg, port=2003)
    assert s.port == 2003  # CLI beats env and TOML
    assert s.flush == "async"  # env beats TOML
    assert s.max_qos == 1  # TOML beats default
    assert s.log_level == "INFO"  # normalised
    assert s.receive_maximum == GatewaySettings.model_fields["receive_maximum"].default


def test_none_override_means_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMQTT_PORT", "2002")
    assert load_settings(port=None, host=None).port == 2002


def test_config_file_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _toml(tmp_path, "sys_interval = 0\n")
    monkeypatch.setenv("LMQTT_CONFIG", str(cfg))
    assert load_settings().sys_interval == 0


def test_frozen() -> None:
    s = load_settings()
    with pytest.raises(pydantic.ValidationError):
        s.port = 1


def test_unknown_toml_key_named_with_suggestion(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, "prot = 1884\nhost = 'x'\n")
    with pytest.raises(SettingsError) as info:
        load_settings(cfg)
    assert "unknown setting 'prot'" in str(info.value)
    assert "did you mean 'port'" in str(info.value)
    assert str(cfg) in str(info.value)


def test_unknown_override_rejected() -> None:
    with pytest.raises(SettingsError, match="bogus"):
        load_settings(bogus=1)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no such file"):
        load_settings(tmp_path / "absent.toml")
    with pytest.raises(SettingsError, match="invalid TOML"):
        load_settings(_toml(tmp_path, "port = = 3\n"))
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path)  # a directory


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"port": 70000}, "port: must be between 0 and 65535"),
        ({"port": -1}, "port: must be between 0 and 65535"),
        ({"flush": "sometimes"}, "flush: Input should be 'async' or 'sync'"),
        ({"max_packet_size": 10}, "max_packet_size: Input should be greater than or equal to 64"),
        ({"max_packet_size": 1 << 30}, "max_packet_size: Input should be less than or equal"),
        ({"receive_maximum": 0}, "receive_maximum: Input should be greater than or equal to 1"),
        ({"max_qos": 3}, "max_qos: Input should be less than or equal to 2"),
        ({"log_level": "loud"}, "log_level: must be one of DEBUG, INFO, WARNING"),
        ({"log_format": "xml"}, "log_format: Input should be 'text' or 'json'"),
        ({"host": "  "}, "host: must be a host name or IP address"),
        ({"data_dir": "."}, "data_dir: must name a directory of its own"),
        ({"sys_interval": -1}, "sys_interval: Input should be greater than or equal to 0"),
        (
            {"server_keep_alive": 100, "max_keep_alive": 10},
            "server_keep_alive (100) must not exceed max_keep_alive (10)",
        ),
        (
            {"default_session_expiry": 100, "max_session_expiry": 10},
            "default_session_expiry (100) must not exceed max_session_expiry (10)",
        ),
        ({"cluster": True}, "cluster = true needs store = rocketmq"),
        (
            {"cluster": True, "store": "rocketmq", "namesrv": "h:9876", "cluster_lease": 1.0},
            "cluster_heartbeat must be under half of cluster_lease",
        ),
        ({"node_id": "a/b"}, "node_id: String should match pattern"),
    ],
)
def test_validation_messages(overrides: dict[str, object], expected: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(None, **overrides)
    assert expected in str(info.value)


def test_error_names_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMQTT_PORT", "abc")
    cfg = _toml(tmp_path, "max_inflight = 0\n")
    with pytest.raises(SettingsError) as info:
        load_settings(cfg, max_qos=5)
    text = str(info.value)
    assert "port:" in text and "environment LMQTT_PORT" in text and "'abc'" in text
    assert "max_inflight:" in text and f"config file {cfg}" in text
    assert "max_qos:" in text and "command line --max-qos" in text
    assert len(info.value.problems) == 3


def test_env_values_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMQTT_OUTBOUND_TOPIC_ALIASES", "false")
    monkeypatch.setenv("LMQTT_SERVER_KEEP_ALIVE", "30")
    monkeypatch.setenv("LMQTT_DATA_DIR", "/tmp/x")
    monkeypatch.setenv("lmqtt_log_format", "json")
    s = load_settings()
    assert s.outbound_topic_aliases is False
    assert s.server_keep_alive == 30
    assert s.data_dir == Path("/tmp/x")
    assert s.log_format == "json"
