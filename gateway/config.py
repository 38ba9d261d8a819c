"""Gateway settings: one frozen object resolved once from four layers.

Precedence, highest first::

    CLI overrides (load_settings(**overrides))   --port 1884
    environment variables LMQTT_<FIELD>           LMQTT_PORT=1884
    TOML file (--config FILE or LMQTT_CONFIG)     port = 1884
    defaults declared below

Every `lmqtt` command that reads settings (serve, inspect, replay, report) resolves them here,
once, its flags as the overrides (gateway/cli.py); the fan-out report, which may not import the
gateway, is handed the store's resolved values by `lmqtt report` (analytics/cli.py).

The TOML file is flat: top-level keys are the field names below (``max_packet_size = 65536``).
Unknown keys are rejected by name (with a suggestion), because a typo in a config file that is
silently ignored is the kind of bug an operator finds at 3 a.m.

Every failure (unreadable file, bad TOML, unknown key, invalid value) raises SettingsError whose
text names the setting, where the bad value came from and what is allowed; the CLI prints it and
exits 2. Library code never calls sys.exit.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

__all__ = [
    "DEFAULT_PORT",
    "ENV_PREFIX",
    "GatewaySettings",
    "QuotaRule",
    "SettingsError",
    "StaticBan",
    "load_settings",
]

ENV_PREFIX = "LMQTT_"
CONFIG_ENV = "LMQTT_CONFIG"  # names a TOML file when --config is not given
DEFAULT_PORT = 1883

# MQTT's Remaining Length is at most 4 varint bytes: 268,435,455 + 5 header bytes.
MQTT_MAX_PACKET_SIZE = 268_435_460
U16_MAX = 0xFFFF
U32_MAX = 0xFFFFFFFF
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# The TOML layer of the settings being loaded right now. pydantic-settings builds its sources
# from the class, not the call, so load_settings hands the parsed file over through this.
_TOML_DATA: ContextVar[dict[str, Any] | None] = ContextVar("_TOML_DATA", default=None)


class SettingsError(ValueError):
    """Invalid gateway settings; str() is a complete, operator-readable explanation."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class _TomlSource(PydanticBaseSettingsSource):
    """The TOML layer: already parsed and checked for unknown keys by load_settings."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        data = _TOML_DATA.get() or {}
        return data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_TOML_DATA.get() or {})


class QuotaRule(BaseModel):
    """One [[quotas]] table: the publish quota of the clients it matches. `client_id` is a
    glob pattern (fnmatch: `sensor-*`), `username` a user name or glob; a rule with both
    matches clients matching both. A quota left out is the global one; 0 removes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    client_id: str | None = Field(default=None, min_length=1)
    username: str | None = Field(default=None, min_length=1)
    max_publish_rate: float | None = Field(default=None, ge=0)
    max_publish_bytes_rate: float | None = Field(default=None, ge=0)
    max_publish_burst: float | None = Field(default=None, ge=1)
    max_publish_bytes_burst: float | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _selects(self) -> QuotaRule:
        if self.client_id is None and self.username is None:
            raise ValueError("a [[quotas]] rule needs client_id or username (a glob pattern)")
        return self


class StaticBan(BaseModel):
    """One static ban of the settings (`bans`): exactly one of client_id, username, address
    (a CIDR or an address; checked by gateway/access/bans.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    client_id: str | None = None
    username: str | None = None
    address: str | None = None
    reason: str = "configured"

    @model_validator(mode="after")
    def _one_target(self) -> StaticBan:
        given = [x for x in (self.client_id, self.username, self.address) if x is not None]
        if len(given) != 1:
            raise ValueError("a ban names exactly one of client_id, username, address")
        return self


class GatewaySettings(BaseSettings):
    """Everything the gateway can be told. Frozen: resolved once, passed around read-only."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        case_sensitive=False,
        env_parse_none_str="none",
        validate_default=True,
    )

    # --- listener
    host: str = "127.0.0.1"  # like Mosquitto 2: loopback unless configured
    # None = 1883, or a free port if 1883 is taken (logged loudly); 0 = any free port.
    port: int | None = None
    max_connections: int = Field(default=100_000, ge=1)
    # Connections the kernel completes and holds until the gateway accepts them, per listener
    # (listen(2)'s backlog; Linux caps it at net.core.somaxconn). A fleet reconnecting at once
    # outruns the accept loop: past the backlog the kernel drops the SYNs and each of those
    # devices waits a retransmission (1 s, then 3 s, ...). asyncio's default is 100.
    listen_backlog: int = Field(default=4096, ge=1, le=U16_MAX)

    # --- store
    data_dir: Path = Path("lmqtt-data")
    flush: Literal["async", "sync"] = "async"
    flush_interval_ms: int = Field(default=200, ge=1, le=60_000)
    # Async flush: how long the plain publishes read in a turn of the event loop wait for more
    # before the ingest batch stores them, while the arrival rate says that pays
    # (gateway/connection/ingest.py Linger: not when idle; a batch that holds GATHERS_AT_MOST
    # is stored at once). 0: always at the end of that turn. Whole milliseconds: the event
    # loop's timers have no finer grain. More per batch costs less CPU per message and adds up
    # to about this much to the latency of the messages it holds.
    ingest_linger_ms: int = Field(default=1, ge=0, le=100)
    segment_size: int = Field(default=1 << 30, ge=4096, le=(1 << 31) - 1)
    retention_hours: float | None = Field(default=None, gt=0)
    retention_bytes: int | None = Field(default=None, gt=0)
    # embedded: the CommitLog under data_dir (one machine). rocketmq: messages on an Apache
    # RocketMQ 5 broker with light queues (gateway/storage/rocketmq/adapter.py, docs/rocketmq.md);
    # the session state stays under data_dir for now.
    store: Literal["embedded", "rocketmq"] = "embedded"
    namesrv: str | None = None  # RocketMQ name server, host:port
    # Broker name; default: the one holding rocketmq_topic, else the first registered by name.
    rocketmq_broker: str | None = None
    rocketmq_topic: str = Field(default="lmqtt", pattern=r"^[%|a-zA-Z0-9_-]{1,127}$")
    # Spread the messages over every registered broker by MQTT topic (state, retained and
    # the cluster bus stay on the home broker): gateway/storage/rocketmq/spread.py.
    rocketmq_spread: bool = False
    # Seconds between a spread deployment's looks at the name server: brokers that joined, left
    # or came back (a broker lost takes its topics' new messages to the live brokers).
    rocketmq_route_poll: float = Field(default=30.0, gt=0)
    # Seconds a starting gateway waits for the name server and its brokers to be registered
    # (logging what it waits for) before it gives up: they usually start together.
    rocketmq_start_timeout: float = Field(default=120.0, ge=0)
    # Seconds a message send the broker did not take because it was away (connection refused
    # or lost, no answer, service not available: a broker restarting) is sent again, in order,
    # before it fails (async mode: an error line, the message lost); 0: it fails at once.
    rocketmq_send_retry: float = Field(default=30.0, ge=0)
    # The inbound topic (gateway/storage/rocketmq/inbound.py): RocketMQ producers' messages
    # for MQTT subscribers, consumed by the deployment's consumer group (default names:
    # `<rocketmq_topic>-in`, `<rocketmq_topic>-dlq` for the messages that are no publish,
    # group `<rocketmq_topic>-gateway`). False: no consumer, no topics created.
    rocketmq_inbound: bool = True
    rocketmq_inbound_topic: str | None = Field(default=None, pattern=r"^[%|a-zA-Z0-9_-]{1,127}$")
    # Each MQTT message stored also carries its topic as the property `mqttTopic`, which
    # SQL92 filters of native consumers can name (docs/rocketmq-apps.md); off: no extra bytes.
    rocketmq_topic_property: bool = False
    rocketmq_dead_letter_topic: str | None = Field(
        default=None, pattern=r"^[%|a-zA-Z0-9_-]{1,127}$"
    )
    # Held pulls per node, not per subscribed light queue: one tail of the parent topic per
    # broker tells the mirrors what arrived (gateway/storage/rocketmq/tail.py). False: each
    # mirror holds its own pull at its light queue's end (docs/rocketmq.md).
    rocketmq_notify_pulls: bool = True
    # Cluster mode (store = rocketmq): several gateway nodes on one rocketmq_topic, each with
    # `cluster = true` (gateway/cluster/node.py). A node fenced by its lease stops; a lost node's
    # wills are out within the lease (keep it under 1.5 x the clients' keep-alive).
    cluster: bool = False
    cluster_lease: float = Field(default=5.0, gt=0.2, le=300)  # seconds
    cluster_heartbeat: float = Field(default=1.0, gt=0.05, le=60)  # seconds, < lease / 2
    node_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")  # default: random

    # --- MQTT limits
    max_packet_size: int = Field(default=1_048_576, ge=64, le=MQTT_MAX_PACKET_SIZE)
    receive_maximum: int = Field(default=1024, ge=1, le=U16_MAX)
    max_inflight: int = Field(default=100, ge=1, le=U16_MAX)
    topic_alias_maximum: int = Field(default=64, ge=0, le=U16_MAX)
    outbound_topic_aliases: bool = True
    server_keep_alive: int | None = Field(default=None, ge=0, le=U16_MAX)
    max_keep_alive: int = Field(default=U16_MAX, ge=0, le=U16_MAX)
    default_session_expiry: int = Field(default=7 * 24 * 3600, ge=0, le=U32_MAX)
    max_session_expiry: int = Field(default=U32_MAX, ge=0, le=U32_MAX)
    retain_available: bool = True
    max_qos: int = Field(default=2, ge=0, le=2)
    # Outbound messages a session may have read ahead of its acknowledgements (memory bound).
    max_queued_messages: int = Field(default=1000, ge=1)

    # --- delayed publish ($delayed/{seconds}/{topic}: gateway/messages/delayed.py)
    # The longest delay accepted, seconds (a RocketMQ broker also needs timerMaxDelaySec >= it).
    max_delay: int = Field(default=7 * 24 * 3600, ge=1, le=U32_MAX)

    # --- security (gateway/access/auth.py, gateway/access/acl.py, gateway/access/control.py)
    password_file: Path | None = None  # `lmqtt passwd FILE USER` writes it
    acl_file: Path | None = None  # Mosquitto ACL syntax; none = every client may do anything
    # None = anonymous clients allowed only when there is no password file and every listener
    # is on a loopback address; a non-loopback listener without a password file refuses to
    # start unless this is explicitly true.
    allow_anonymous: bool | None = None

    # --- extra listeners (same host as the MQTT listener; None = off, 0 = any free port)
    tls_port: int | None = Field(default=None, ge=0, le=U16_MAX)
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    tls_cafile: Path | None = None  # CA bundle for client certificates
    tls_require_certificate: bool = False  # clients must present a certificate from tls_cafile
    tls_use_identity_as_username: bool = False  # the client certificate's CN is the user name
    ws_port: int | None = Field(default=None, ge=0, le=U16_MAX)  # MQTT over WebSocket
    wss_port: int | None = Field(default=None, ge=0, le=U16_MAX)  # ... over TLS (tls_* files)
    admin_host: str = "127.0.0.1"  # /metrics and /health
    admin_port: int | None = Field(default=None, ge=0, le=U16_MAX)

    # --- hostile-client limits (gateway/access/limits.py)
    connect_timeout: float = Field(default=10.0, gt=0)  # s for a new socket to send CONNECT
    max_topic_length: int = Field(default=65535, ge=1, le=U16_MAX)  # bytes
    max_topic_levels: int = Field(default=128, ge=1)
    max_subscriptions: int = Field(default=10_000, ge=1)  # per client
    # New connections per second per source address (token bucket), 0 = unlimited.
    connect_rate: float = Field(default=20.0, ge=0)
    connect_burst: int = Field(default=100, ge=1)
    connect_rate_loopback: bool = False  # also limit 127.0.0.1/::1 (tests, local tools)

    # --- per-client publish quotas (gateway/access/quotas.py); unset = no quota, no cost
    max_publish_rate: float | None = Field(default=None, gt=0)  # PUBLISH packets/s per client
    max_publish_bytes_rate: float | None = Field(default=None, gt=0)  # payload bytes/s
    # Token-bucket depth: what a client may send at once (default: one second of its rate).
    max_publish_burst: float | None = Field(default=None, ge=1)
    max_publish_bytes_burst: float | None = Field(default=None, ge=1)
    # pause: stop reading the client until its bucket refills (nothing is dropped). reject:
    # MQTT 5 QoS 1/2 get PUBACK/PUBREC 0x97 and are not stored, QoS 0 is dropped (3.1.1 QoS 1/2,
    # which has no negative acknowledgement, is paused).
    quota_action: Literal["pause", "reject"] = "pause"
    # [[quotas]] tables, the first matching wins: per user name / client-id glob pattern.
    quotas: tuple[QuotaRule, ...] = ()
    # Live view (/api/slow-subscriptions, metrics): a subscription whose oldest unsent or
    # unacknowledged message is older than this (seconds) is slow.
    slow_subscription_threshold: float = Field(default=0.5, gt=0)

    # --- services
    sys_interval: float = Field(default=10.0, ge=0)  # $SYS publish period in s, 0 = off
    retained_snapshot_interval: float = Field(default=60.0, gt=0)  # s between retained snapshots
    # The delivery account (gateway/delivery/account.py): what every subscription was sent and
    # acknowledged, for the fan-out report. Off: no account files, and reports count the
    # deliveries of persistent sessions only (their committed offsets).
    delivery_account: bool = True
    # Event loop for `lmqtt serve`: auto = uvloop when installed, else asyncio's own.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    log_level: str = "WARNING"
    log_format: Literal["text", "json"] = "text"

    # --- operator controls (gateway/ops/admin_api.py, gateway/access/bans.py, flapping.py)
    # The admin API (/api on admin_port) accepts Authorization: Bearer <the token in this
    # file>, or HTTP Basic with a user of password_file (only those in admin_users, if set).
    # Neither a token file nor a password file: /api refuses every request (403).
    admin_token_file: Path | None = None
    admin_users: list[str] | None = None
    # Static bans, as TOML tables: [[bans]] client_id = "..." (or username, or address = a
    # CIDR), reason = "...". They hold while configured; `lmqtt ban` adds runtime ones.
    bans: list[StaticBan] = Field(default_factory=list)
    # A client id connecting more than flapping_max_connects times within flapping_window
    # seconds is banned for flapping_ban seconds (0 connects = off).
    flapping_max_connects: int = Field(default=15, ge=0)
    flapping_window: float = Field(default=60.0, gt=0)
    flapping_ban: float = Field(default=300.0, gt=0)

    # --- diagnostics (gateway/ops/stall_watch.py); off by default, no cost when off
    # Log every event-loop stall longer than this (ms) with what the loop was running; 0 = off.
    stall_watch_ms: float = Field(default=0.0, ge=0)
    stall_watch_file: Path | None = None  # also append each stall here, one JSON line each

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # No .env or secrets directory: the four documented layers only.
        return (init_settings, env_settings, _TomlSource(settings_cls))

    @field_validator("host")
    @classmethod
    def _host_not_blank(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("must be a host name or IP address to listen on, e.g. 127.0.0.1")
        return value

    @field_validator("port")
    @classmethod
    def _port_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= U16_MAX:
            raise ValueError("must be between 0 and 65535 (0 = any free port)")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_name(cls, value: object) -> object:
        if isinstance(value, str):
            name = value.strip().upper()
            if name not in LOG_LEVELS:
                raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
            return name
        return value

    @field_validator("data_dir")
    @classmethod
    def _data_dir_not_blank(cls, value: Path) -> Path:
        if str(value).strip() in ("", "."):
            # "." would scatter commitlog/, consumequeue/, lock ... over the working directory.
            raise ValueError("must name a directory of its own, e.g. ./lmqtt-data")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> GatewaySettings:
        if self.server_keep_alive is not None and self.server_keep_alive > self.max_keep_alive:
            raise ValueError(
                f"server_keep_alive ({self.server_keep_alive}) must not exceed "
                f"max_keep_alive ({self.max_keep_alive})"
            )
        needs_tls = self.tls_port is not None or self.wss_port is not None
        if needs_tls and (self.tls_certfile is None or self.tls_keyfile is None):
            raise ValueError("tls_port and wss_port need tls_certfile and tls_keyfile")
        if self.tls_require_certificate and self.tls_cafile is None:
            raise ValueError("tls_require_certificate needs tls_cafile (the CA of the clients)")
        if self.cluster and self.store != "rocketmq":
            raise ValueError("cluster = true needs store = rocketmq (the nodes share its broker)")
        if self.cluster and self.cluster_heartbeat * 2 >= self.cluster_lease:
            raise ValueError("cluster_heartbeat must be under half of cluster_lease")
        if self.store == "rocketmq" and not self.namesrv:
            raise ValueError("store = rocketmq needs namesrv (the name server's host:port)")
        if self.namesrv is not None and not re.fullmatch(r"[^\s:;]+:\d{1,5}", self.namesrv):
            raise ValueError(f"namesrv must be host:port, not {self.namesrv!r}")
        if self.default_session_expiry > self.max_session_expiry:
            raise ValueError(
                f"default_session_expiry ({self.default_session_expiry}) must not exceed "
                f"max_session_expiry ({self.max_session_expiry})"
            )
        return self

    @property
    def port_explicit(self) -> bool:
        """True when the operator chose the port (so a busy port is an error, not a fallback)."""
        return self.port is not None

    @property
    def default_port(self) -> int:
        """The port to try first: the configured one, else MQTT's 1883."""
        return DEFAULT_PORT if self.port is None else self.port


def _field_names() -> list[str]:
    return list(GatewaySettings.model_fields)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SettingsError(f"config file {path}: no such file") from None
    except OSError as exc:
        raise SettingsError(f"config file {path}: cannot read it ({exc.strerror})") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise SettingsError(f"config file {path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: invalid TOML: {exc}") from None
    names = _field_names()
    unknown = [key for key in data if key not in names]
    if unknown:
        problems = []
        for key in unknown:
            hint = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
            problems.append(
                f"config file {path}: unknown setting {key!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
            )
        raise SettingsError("\n".join(problems), problems)
    return data


# Settings whose command-line flag is not simply the field name.
_CLI_FLAGS = {"event_loop": "loop"}


def _origin(
    name: str, overrides: dict[str, Any], toml: dict[str, Any], toml_path: Path | None
) -> str:
    """Where the value of setting `name` came from, for error messages."""
    if name in overrides:
        return "command line --" + _CLI_FLAGS.get(name, name).replace("_", "-")
    env_name = (ENV_PREFIX + name).upper()
    if any(key.upper() == env_name for key in os.environ):
        return f"environment {env_name}"
    if name in toml:
        return f"config file {toml_path}"
    return "default"


def _describe(
    exc: ValidationError, overrides: dict[str, Any], toml: dict[str, Any], toml_path: Path | None
) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = [str(part) for part in err.get("loc", ())]
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if not loc:  # a cross-field (model) check: the message names the settings itself
            problems.append(msg)
            continue
        name = loc[0]
        if err.get("type") == "extra_forbidden":
            hint = difflib.get_close_matches(name, _field_names(), n=1)
            problems.append(
                f"unknown setting {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            )
            continue
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        problems.append(f"{name}: {msg}{shown} [from {_origin(name, overrides, toml, toml_path)}]")
    return problems


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> GatewaySettings:
    """Resolve the settings: overrides > LMQTT_* environment > TOML file > defaults.

    Overrides whose value is None are ignored ("not given on the command line"). When
    `config_file` is None the file named by $LMQTT_CONFIG, if any, is read.
    Raises SettingsError with one line per problem.
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    unknown = [key for key in given if key not in GatewaySettings.model_fields]
    if unknown:
        raise SettingsError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    if config_file is None and os.environ.get(CONFIG_ENV):
        config_file = os.environ[CONFIG_ENV]
    toml_path = Path(config_file) if config_file is not None else None
    toml = _read_toml(toml_path) if toml_path is not None else {}
    token = _TOML_DATA.set(toml)
    try:
        return GatewaySettings(**given)
    except ValidationError as exc:
        problems = _describe(exc, given, toml, toml_path)
        raise SettingsError("invalid settings:\n  " + "\n  ".join(problems), problems) from None
    finally:
        _TOML_DATA.reset(token)
