"""Bans: client ids, user names and source addresses the gateway refuses.

A ban names one target and is checked at every CONNECT (AccessControl.check_connect): a banned
client is refused with CONNACK 0x8A Banned (MQTT 3.1.1: 0x05 Not authorized), and a ban made
while a matching client is connected closes that connection at once. MQTT 5 allows 0x8A in a
CONNACK only (section 3.14.2.1 lists the DISCONNECT codes), so that client gets DISCONNECT 0x98
Administrative action first, the code the specification gives for a connection closed by an
operator; its will is published, as for any connection the server ends.

    kind       value                               matches
    ---------  ----------------------------------  --------------------------------------
    client_id  the client identifier, non-empty    CONNECT's client id
    username   the user name, non-empty            CONNECT's user name (or the TLS CN)
    address    an address or CIDR, normalised      the source address (IPv4-mapped IPv6
               ("10.1.2.0/24", "2001:db8::/32")    addresses as IPv4)

Where bans come from: the settings (`bans`, static: they hold while configured, on every node
from its own settings, and cannot be removed at run time), the admin API (`lmqtt ban add`,
durable) and flapping detection (gateway/access/flapping.py, durable, reason "flapping").

Durable bans are state records (gateway/storage/port.py; the embedded state log, RocketMQ's
%STATE% queue), so a restart keeps them and, in cluster mode, every node applies a ban any
node made as it tails the state log (`observe`):

    key    "ban/<kind>/<value>"                      e.g. "ban/address/10.1.2.0/24"
    value  {"kind": "...", "value": "...", "reason": "...", "source": "admin" | "flapping",
            "created_ms": T, "until_ms": T | null}   UTF-8 JSON; DELETE = removed

A ban with `until_ms` ends then, on every node by its own clock. An ended ban is forgotten in
memory; on a single node (the only writer) its record is deleted too. In cluster mode an ended
ban's record stays in the state log, ignored when read, until a new ban of the same target
replaces it (a node deleting it could race another node banning the same target again, and
the delete would win); such records are small and few (one per target ever banned).

The CONNECT check costs two dict lookups while there are bans of client ids or user names only;
the source address is parsed, and the networks walked, only while an address ban exists.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

from gateway.clock import now_ms
from gateway.config import SettingsError, StaticBan
from gateway.protocol import ReasonCode
from gateway.storage.port import StateRecord, StoreError

__all__ = [
    "BAN_KEY_PREFIX",
    "Ban",
    "BanError",
    "BanList",
    "UnknownBan",
    "parse_duration",
    "parse_target",
]

log = logging.getLogger("lmqtt.access")

BAN_KEY_PREFIX = "ban/"
KINDS = ("client_id", "username", "address")
Kind = Literal["client_id", "username", "address"]
MAX_VALUE = 65_535  # bytes: MQTT's longest string
MAX_REASON = 1024
MAX_DURATION_S = 100 * 365 * 86_400
SWEEP_S = 10.0  # how often ended bans are forgotten
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


class BanError(ValueError):
    """Bad input for a ban (names what is wrong); nothing was changed."""


class UnknownBan(BanError):
    """No such ban."""


class StaticBanError(BanError):
    """A ban from the settings: it is removed by editing them."""


def parse_target(kind: str, value: str) -> tuple[Kind, str]:
    """(kind, normalised value); BanError when either is not acceptable."""
    if kind not in KINDS:
        raise BanError(f"unknown ban kind {kind!r}: use one of {', '.join(KINDS)}")
    if not isinstance(value, str) or not value:
        raise BanError(f"the {kind} of a ban must not be empty")
    if len(value.encode("utf-8")) > MAX_VALUE or "\x00" in value:
        raise BanError(f"the {kind} is longer than MQTT allows or holds a NUL character")
    if kind == "address":
        try:
            net = ipaddress.ip_network(value.strip(), strict=False)
        except ValueError:
            raise BanError(
                f"malformed address {value!r}: give an IP address or a CIDR such as "
                "10.1.2.0/24 or 2001:db8::/32"
            ) from None
        if isinstance(net, ipaddress.IPv6Network) and net.network_address.ipv4_mapped:
            mapped = net.network_address.ipv4_mapped
            net = ipaddress.ip_network(f"{mapped}/{max(0, net.prefixlen - 96)}")
        return "address", str(net)
    return ("client_id" if kind == "client_id" else "username"), value


def parse_duration(text: str | float | int) -> float:
    """Seconds of "90", "90s", "5m", "2h", "1d", "1h30m" (or a number); BanError unless > 0."""
    if isinstance(text, bool):
        raise BanError("a duration is a number of seconds or a text such as 5m, 2h, 1d")
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        t = text.strip().lower()
        try:
            seconds = float(t)
        except ValueError:
            parts = _DURATION.findall(t)
            if not parts or "".join(n + u for n, u in parts) != t:
                raise BanError(
                    f"malformed duration {text!r}: give seconds or e.g. 90s, 5m, 2h, 1d, 1h30m"
                ) from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not seconds > 0:
        raise BanError("a ban's duration must be more than 0 (leave it out for no end)")
    if seconds > MAX_DURATION_S:
        raise BanError("a ban's duration must be under 100 years (leave it out for no end)")
    return seconds


@dataclass(frozen=True, slots=True)
class Ban:
    kind: Kind
    value: str  # normalised (parse_target)
    reason: str = ""
    source: str = "admin"  # admin | flapping | config
    created_ms: int = 0
    until_ms: int | None = None  # None: no end

    @property
    def key(self) -> str:
        return f"{BAN_KEY_PREFIX}{self.kind}/{self.value}"

    def active(self, now: int) -> bool:
        return self.until_ms is None or now < self.until_ms

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, value: bytes) -> Ban:
        d = json.loads(value)
        kind, target = parse_target(str(d["kind"]), str(d["value"]))
        until = d.get("until_ms")
        return cls(
            kind,
            target,
            str(d.get("reason", "")),
            str(d.get("source", "admin")),
            int(d.get("created_ms", 0)),
            None if until is None else int(until),
        )

    def view(self, now: int) -> dict[str, object]:
        """As the admin API shows it."""
        remaining = None if self.until_ms is None else max(0.0, (self.until_ms - now) / 1000)
        return {
            "kind": self.kind,
            "value": self.value,
            "reason": self.reason,
            "source": self.source,
            "created_ms": self.created_ms,
            "until_ms": self.until_ms,
            "remaining_s": remaining,
        }

    def describe(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"{self.kind} {self.value!r} banned{why}"


class StateWriter(Protocol):
    """What bans need of storage (gateway/storage/port.py Storage)."""

    def append_state(self, records: Iterable[StateRecord]) -> int: ...

    async def wait_state_durable(self, position: int) -> None: ...


class Kickable(Protocol):
    """A connection a ban may close (gateway/connection/client.py ClientConnection)."""

    @property
    def client_id(self) -> str: ...

    @property
    def username(self) -> str | None: ...

    @property
    def transport(self) -> asyncio.BaseTransport: ...

    @property
    def session(self) -> object | None:
        """None until the CONNECT is answered (its check decides about those)."""
        ...

    def close(self, reason: int | None = None) -> None: ...


def peer_host(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


#: An address as (IP version, its value as an integer); a network as (version, network
#: value, mask): an address is in it when (value & mask) == network value.
Address = tuple[int, int]
Network = tuple[int, int, int]
_V4_MAPPED = 0xFFFF << 32  # ::ffff:a.b.c.d, an IPv4 peer on a dual-stack socket


def _address(host: str) -> Address | None:
    """A source address (as the transport names it) as (4 | 6, integer); IPv4-mapped IPv6
    as IPv4. socket.inet_pton, not ipaddress: a CONNECT pays this while address bans exist."""
    try:
        return 4, int.from_bytes(socket.inet_pton(socket.AF_INET, host))
    except OSError:
        pass
    try:
        value = int.from_bytes(socket.inet_pton(socket.AF_INET6, host.split("%")[0]))
    except OSError:
        return None
    if value & ~0xFFFFFFFF == _V4_MAPPED:
        return 4, value & 0xFFFFFFFF
    return 6, value


def _network(cidr: str) -> Network:
    """A normalised ban value (parse_target) as (version, network value, mask)."""
    net = ipaddress.ip_network(cidr)
    return net.version, int(net.network_address), int(net.netmask)


class BanList:
    """Every ban in force on this node (see the module docstring)."""

    def __init__(self, static: Sequence[StaticBan] = ()) -> None:
        """`static`: the settings' bans; SettingsError names the first bad one."""
        self._by_kind: dict[str, dict[str, Ban]] = {kind: {} for kind in KINDS}
        self._by_client = self._by_kind["client_id"]
        self._by_user = self._by_kind["username"]
        self._by_address = self._by_kind["address"]
        # address bans as networks, walked only while there is one
        self._networks: list[tuple[Network, Ban]] = []
        self._static: set[str] = set()
        self._store: StateWriter | None = None
        self._purge = False
        self._connections: Callable[[], Iterable[Kickable]] = tuple
        self.refused = 0  # CONNECTs refused by a ban, flapping ones included
        self.refused_flapping = 0  # ... by a ban for flapping
        self.kicked = 0  # connected clients closed by a new ban
        for i, spec in enumerate(static):
            kind, value = (
                ("client_id", spec.client_id)
                if spec.client_id is not None
                else ("username", spec.username)
                if spec.username is not None
                else ("address", spec.address or "")
            )
            try:
                k, v = parse_target(kind, value)
            except BanError as exc:
                raise SettingsError(f"bans[{i}]: {exc}") from None
            ban = Ban(k, v, spec.reason, "config")
            self._put(ban)
            self._static.add(ban.key)

    # -- start ---------------------------------------------------------------------------

    def open(
        self,
        store: StateWriter,
        records: Mapping[str, bytes],
        connections: Callable[[], Iterable[Kickable]],
        *,
        single_writer: bool,
    ) -> None:
        """Take up the durable bans of `records` (the state read at start); new ones are
        appended to `store`; `connections`: the open ones, closed when a ban matches.
        `single_writer`: no other node writes bans (ended ones are then deleted)."""
        self._store = store
        self._connections = connections
        self._purge = single_writer
        now = now_ms()
        ended: list[StateRecord] = []
        for key, value in records.items():
            if not key.startswith(BAN_KEY_PREFIX) or key in self._static:
                continue  # the settings' ban of a target wins over a record of it
            ban = self._decode(key, value)
            if ban is None:
                continue
            if ban.active(now):
                self._put(ban)
            else:
                ended.append((key, None))
        if ended and single_writer:
            store.append_state(ended)
        if records:
            log.info("%d ban(s) in force", len(self))

    def _decode(self, key: str, value: bytes) -> Ban | None:
        try:
            ban = Ban.from_json(value)
        except (ValueError, KeyError, TypeError, BanError) as exc:
            log.error("state record %r is not a ban (skipped): %s", key, exc)
            return None
        return ban if ban.key == key else None

    # -- CONNECT ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_client) + len(self._by_user) + len(self._by_address)

    def check(self, client_id: str | None, username: str | None, host: str | None) -> Ban | None:
        """The ban in force on a client connecting as `client_id` and `username` from
        `host`, or None."""
        ban = None
        if client_id is not None and self._by_client:
            ban = self._by_client.get(client_id)
        if ban is None and username is not None and self._by_user:
            ban = self._by_user.get(username)
        if ban is None and host is not None and self._by_address:
            ban = self._address_ban(host)
        if ban is None:
            return None
        if ban.until_ms is not None and not ban.active(now_ms()):
            self._forget(ban)
            return self.check(client_id, username, host)
        return ban

    def _address_ban(self, host: str) -> Ban | None:
        ip = _address(host)
        if ip is None:
            return None
        version, value = ip
        for (v, net, mask), ban in self._networks:
            if v == version and value & mask == net:
                return ban
        return None

    def refused_by(self, ban: Ban) -> None:
        """Count a CONNECT `ban` refused."""
        self.refused += 1
        if ban.source == "flapping":
            self.refused_flapping += 1

    # -- changes ---------------------------------------------------------------------------

    def in_force(self) -> list[Ban]:
        """The bans in force, static ones first, then by kind and value."""
        now = now_ms()
        out = [b for table in self._by_kind.values() for b in table.values() if b.active(now)]
        return sorted(out, key=lambda b: (b.source != "config", b.kind, b.value))

    def active_count(self) -> int:
        now = now_ms()
        return sum(1 for t in self._by_kind.values() for b in t.values() if b.active(now))

    async def add(
        self, kind: str, value: str, *, reason: str = "",
        duration_s: str | float | None = None, source: str = "admin",
    ) -> Ban:  # fmt: skip
        """Ban a target (replacing a durable ban of the same target), durably; connected
        clients it matches are closed. BanError on bad input (nothing changed)."""
        k, v = parse_target(kind, value)
        if len(reason) > MAX_REASON:
            raise BanError(f"the reason is longer than {MAX_REASON} characters")
        seconds = None if duration_s is None else parse_duration(duration_s)
        now = now_ms()
        until = None if seconds is None else now + int(seconds * 1000)
        ban = Ban(k, v, reason, source, now, until)
        if ban.key in self._static:
            raise StaticBanError(f"{k} {v!r} is banned by the settings already")
        self._put(ban)
        await self._write([(ban.key, ban.to_json())])
        self._kick(ban)
        return ban

    async def remove(self, kind: str, value: str) -> Ban:
        """Lift a durable ban; UnknownBan when there is none, StaticBanError for one of the
        settings."""
        k, v = parse_target(kind, value)
        key = f"{BAN_KEY_PREFIX}{k}/{v}"
        if key in self._static:
            raise StaticBanError(
                f"{k} {v!r} is banned by the gateway's settings (bans): remove it there"
            )
        ban = self._by_kind[k].get(v)
        if ban is None:
            raise UnknownBan(f"no ban of {k} {v!r}")
        self._forget(ban)
        await self._write([(key, None)])
        return ban

    async def _write(self, records: list[StateRecord]) -> None:
        store = self._store
        if store is None:
            return
        try:
            await store.wait_state_durable(store.append_state(records))
        except StoreError as exc:
            # In force here; other nodes and a restart may not know it.
            log.error("ban not saved (in force on this node only): %s", exc)

    def observe(self, node: str, records: Sequence[StateRecord]) -> None:
        """Cluster mode: state records another node wrote; its bans apply here as well."""
        for key, value in records:
            if not key.startswith(BAN_KEY_PREFIX) or key in self._static:
                continue
            if value is None:
                kind, _, target = key[len(BAN_KEY_PREFIX) :].partition("/")
                old = self._by_kind.get(kind, {}).get(target)
                if old is not None:
                    self._forget(old)
                    log.warning("ban lifted by node %s: %s %r", node, old.kind, old.value)
                continue
            ban = self._decode(key, value)
            if ban is None or not ban.active(now_ms()):
                continue
            self._put(ban)
            log.warning("%s (by node %s)", ban.describe(), node)
            self._kick(ban)

    def _put(self, ban: Ban) -> None:
        old = self._by_kind[ban.kind].get(ban.value)
        if old is not None:
            self._forget(old)
        self._by_kind[ban.kind][ban.value] = ban
        if ban.kind == "address":
            self._networks.append((_network(ban.value), ban))
            # Most specific first (the longest mask): it answers for an address in several.
            self._networks.sort(key=lambda nb: -nb[0][2])

    def _forget(self, ban: Ban) -> None:
        table = self._by_kind[ban.kind]
        if table.get(ban.value) is ban:
            del table[ban.value]
            if ban.kind == "address":
                self._networks = [(n, b) for n, b in self._networks if b is not ban]

    def _kick(self, ban: Ban) -> None:
        """Close the connections `ban` matches."""
        for client in list(self._connections()):
            if client.session is None:
                continue
            host = peer_host(client.transport) if ban.kind == "address" else None
            hit = (
                (ban.kind == "client_id" and client.client_id == ban.value)
                or (ban.kind == "username" and client.username == ban.value)
                or (host is not None and self._matches_address(ban, host))
            )
            if hit:
                self.kicked += 1
                log.warning("%r disconnected: %s", client.client_id, ban.describe())
                client.close(ReasonCode.ADMINISTRATIVE_ACTION)

    @staticmethod
    def _matches_address(ban: Ban, host: str) -> bool:
        ip = _address(host)
        version, net, mask = _network(ban.value)
        return ip is not None and ip[0] == version and ip[1] & mask == net

    # -- ended bans --------------------------------------------------------------------------

    def sweep(self) -> None:
        """Forget the bans that ended (and, as the only writer, delete their records)."""
        now = now_ms()
        ended = [b for t in self._by_kind.values() for b in t.values() if not b.active(now)]
        for ban in ended:
            self._forget(ban)
        if ended and self._purge and self._store is not None:
            try:
                self._store.append_state([(b.key, None) for b in ended])
            except StoreError as exc:
                log.warning("ended bans not deleted from the state log: %s", exc)

    async def run(self) -> None:
        """Sweep every SWEEP_S (a task of the gateway while it runs)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep()
