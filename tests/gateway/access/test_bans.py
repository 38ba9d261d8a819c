"""Bans and flapping end to end: a real `lmqtt serve` process (embedded store), real paho clients
(MQTT 3.1.1 and 5.0), `lmqtt ban` against its admin API, a restart on the same data."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.access.bans import BanError, BanList, parse_duration, parse_target
from gateway.access.flapping import FlappingDetector
from gateway.app import Gateway as GatewayApp
from gateway.cli import main
from gateway.config import SettingsError, load_settings
from gateway.ops.admin_client import AdminClient, AdminClientError
from gateway.protocol import Connect
from tests.gateway.conftest import Client, RawClient, stop_clients, wait_until
from tests.rocketmq.test_gateway_rocketmq import ServeProcess

TOKEN = "ban-test-token"
FLAP_MAX = 4
ADMIN_LINE = re.compile(r"lmqtt admin \(/metrics, /health\) on [^:]+:(\d+)")

# -- the rules, without a gateway --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "value", "expected"),
    [
        ("client_id", "dev-1", "dev-1"),
        ("address", "10.1.2.3/24", "10.1.2.0/24"),
        ("address", "10.1.2.3", "10.1.2.3/32"),
        ("address", "::ffff:10.0.0.0/104", "10.0.0.0/8"),
        ("address", "2001:db8::/32", "2001:db8::/32"),
    ],
)
def test_targets_are_normalised(kind: str, value: str, expected: str) -> None:
    assert parse_target(kind, value) == (kind, expected)


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("client_id", "", "must not be empty"),
        ("username", "", "must not be empty"),
        ("address", "10.0.0.0/33", "malformed address"),
        ("address", "10.0.0.x", "malformed address"),
        ("device", "x", "unknown ban kind"),
    ],
)
def test_bad_targets_are_refused(kind: str, value: str, message: str) -> None:
    with pytest.raises(BanError, match=message):
        parse_target(kind, value)


def test_durations() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("1h30m") == 5400
    assert parse_duration(2.5) == 2.5
    for bad in ("0", 0, "0s", "-5", "5 minutes", "", "m5"):
        with pytest.raises(BanError):
            parse_duration(bad)


def test_address_bans_match_networks_of_either_family() -> None:
    bans = BanList()

    async def add() -> None:
        await bans.add("address", "10.1.0.0/16", reason="site")
        await bans.add("address", "10.1.2.3", reason="one")
        await bans.add("address", "2001:db8::/32")

    asyncio.run(add())
    for host, reason in [
        ("10.1.2.3", "one"),  # the most specific ban answers
        ("10.1.9.9", "site"),
        ("::ffff:10.1.9.9", "site"),  # an IPv4 peer on a dual-stack socket
        ("2001:db8:1::5", ""),
    ]:
        ban = bans.check(None, None, host)
        assert ban is not None and ban.reason == reason, host
    for host in ("10.2.0.1", "2001:db9::1", "::1", "not-an-address"):
        assert bans.check(None, None, host) is None, host


def test_flapping_counts_a_sliding_window() -> None:
    now = [0.0]
    det = FlappingDetector(3, 10.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0):
        now[0] = t
        assert det.connecting("a") == 0
    now[0] = 10.5  # the connect at 0.0 left the window: 3 within it again, not more
    assert det.connecting("a") == 0
    now[0] = 10.9
    assert det.connecting("a") == 4  # 1.0, 2.0, 10.5 and this one: more than 3
    assert det.connecting("b") == 0  # each client id counts alone
    assert det.bans == 1


def test_the_flapping_table_stays_bounded_and_keeps_a_flapping_client() -> None:
    """A fleet of one-off client ids is forgotten oldest first, in steps (gateway/bounded.py),
    never past `max_clients`; a client id seen again and again stays at the recent end and is
    still caught."""
    now = [0.0]
    det = FlappingDetector(3, 1000.0, clock=lambda: now[0], max_clients=64)
    caught = 0
    for i in range(5_000):
        now[0] = i * 0.01
        assert det.connecting(f"dev-{i}") == 0
        assert len(det) <= 64
        if i % 40 == 0:
            caught += det.connecting("twin") != 0
    assert caught == 125 // 4  # every fourth connect of the twin: more than 3 in the window
    assert det.bans == caught
    assert not det.would_ban("dev-0")  # forgotten long ago: counts from one again


@pytest.mark.parametrize("max_connects", [1, 2, 3])
def test_would_ban_tells_what_connecting_would_answer_and_counts_nothing(
    max_connects: int,
) -> None:
    """The read callback's CONNECT asks would_ban first (nothing counted) and takes the
    CONNECT at once only when it says no: it must agree with connecting() at every step."""
    now = [0.0]
    det = FlappingDetector(max_connects, 10.0, clock=lambda: now[0])
    twin = FlappingDetector(max_connects, 10.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0, 2.5, 12.6, 13.0, 30.0, 30.1, 30.2, 30.3):
        now[0] = t
        predicted = det.would_ban("a")
        assert det.would_ban("a") == predicted  # asking twice changes nothing
        count = det.connecting("a")
        assert (count != 0) == predicted, t
        assert count == twin.connecting("a"), t  # the twin was never asked: same counts
    assert not det.would_ban("never-seen")
    assert not FlappingDetector(0, 10.0).would_ban("a")  # off


# -- a gateway process ---------------------------------------------------------------------


class Gateway:
    def __init__(self, proc: ServeProcess) -> None:
        self.proc = proc
        self.start()

    def start(self) -> None:
        self.proc.start()
        wait_until(lambda: self.admin_port, what="the admin listener's log line")

    @property
    def admin_port(self) -> int:
        for line in self.proc.output:
            m = ADMIN_LINE.search(line)
            if m:
                return int(m.group(1))
        return 0

    @property
    def port(self) -> int:
        return self.proc.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def api(self) -> AdminClient:
        return AdminClient(self.url, token=TOKEN)

    def bans(self) -> dict[str, dict[str, object]]:
        return {f"{b['kind']}/{b['value']}": b for b in self.api().get("/api/bans")["bans"]}

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("bans")
    (tmp / "token").write_text(TOKEN)
    (tmp / "lmqtt.toml").write_text(
        f'admin_token_file = "{tmp / "token"}"\n'
        f"flapping_max_connects = {FLAP_MAX}\n"
        "flapping_window = 60\n"
        "flapping_ban = 300\n"
        "admin_port = 0\n"
        "[[bans]]\n"
        'client_id = "static-1"\n'
        'reason = "lab device"\n'
    )
    g = Gateway(ServeProcess(tmp / "data", "--config", str(tmp / "lmqtt.toml")))
    try:
        yield g
    finally:
        g.proc.stop()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def connack(port: int, client_id: str, *, v5: bool, username: str | None = None) -> int:
    """The CONNACK code paho reads for one CONNECT (no retries)."""
    c = Client(port, client_id, v5=v5, connect=False)
    c.c.reconnect_delay_set(60, 60)
    if username is not None:
        c.c.username_pw_set(username)
    try:
        result = c.connect()
        assert result is not None
        return result[1]
    finally:
        c.c.disconnect()
        c.c.loop_stop()


def connack_v311(port: int, client_id: str) -> bytes:
    """The bytes of the CONNACK an MQTT 3.1.1 CONNECT gets."""
    raw = RawClient(port, level=4)
    try:
        raw.send(Connect(4, client_id, True, 60))
        raw.sock.settimeout(10)
        data = b""
        while len(data) < 4 and (chunk := raw.sock.recv(4 - len(data))):
            data += chunk
        return data
    finally:
        raw.close()


def cli(gw: Gateway, *args: str) -> int:
    return main(["ban", *args, "--admin", gw.url, "--token-file", str(_token(gw))])


def _token(gw: Gateway) -> Path:
    return gw.proc.data_dir.parent / "token"


def test_ban_refuses_connects_and_closes_the_connected_client(
    gw: Gateway, clients: list[Client], capsys: pytest.CaptureFixture[str]
) -> None:
    v5 = Client(gw.port, "dev-1", v5=True)
    v3 = Client(gw.port, "dev-1b")
    clients += [v5, v3]
    v5.c.reconnect_delay_set(60, 60)
    assert cli(gw, "add", "--client-id", "dev-1", "--for", "1h", "--reason", "firmware loop") == 0
    assert "banned client_id dev-1" in capsys.readouterr().out
    # The connected MQTT 5 client is told: DISCONNECT 0x98 Administrative action (0x8A Banned
    # is a CONNACK code only).
    v5.wait_for(lambda: v5.disconnected is not None, what="the DISCONNECT")
    assert v5.disconnected == 0x98
    assert connack(gw.port, "dev-1", v5=True) == 0x8A  # Banned
    assert connack_v311(gw.port, "dev-1") == b"\x20\x02\x00\x05"  # 3.1.1: not authorized
    assert connack(gw.port, "dev-1", v5=False) == 0x87  # ... as paho reports it
    assert connack(gw.port, "dev-2", v5=True) == 0  # others are not touched
    assert v3.connack == (False, 0) and v3.disconnected is None

    assert cli(gw, "list") == 0
    listed = capsys.readouterr().out
    assert re.search(r"client_id\s+dev-1\s+admin\s+\S+ \S+ \(in \d+ s\)\s+firmware loop", listed)
    assert re.search(r"client_id\s+static-1\s+config\s+never\s+lab device", listed)

    assert cli(gw, "remove", "--client-id", "dev-1") == 0
    assert connack(gw.port, "dev-1", v5=True) == 0


def test_user_name_and_address_bans(gw: Gateway, clients: list[Client]) -> None:
    api = gw.api()
    api.post("/api/bans", {"username": "mallory", "reason": "stolen credentials"})
    assert connack(gw.port, "m-1", v5=True, username="mallory") == 0x8A
    assert connack(gw.port, "m-1", v5=True, username="alice") == 0
    api.delete("/api/bans/username/mallory")

    held = Client(gw.port, "addr-1", v5=True)
    clients.append(held)
    held.c.reconnect_delay_set(60, 60)
    api.post("/api/bans", {"address": "127.0.0.0/8", "for": 300})
    held.wait_for(lambda: held.disconnected is not None, what="the DISCONNECT")
    assert held.disconnected == 0x98
    assert connack(gw.port, "addr-2", v5=False) == 0x87  # 3.1.1's 5, as paho reports it
    assert "address/127.0.0.0/8" in gw.bans()
    api.delete("/api/bans/address/127.0.0.0%2F8")
    assert connack(gw.port, "addr-2", v5=True) == 0


def test_bad_input_is_refused_and_changes_nothing(
    gw: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    before = gw.bans()
    cases = [
        (("add", "--address", "10.0.0.0/33"), "malformed address"),
        (("add", "--client-id", ""), "must not be empty"),
        (("add", "--client-id", "x", "--for", "0"), "more than 0"),
        (("add", "--client-id", "x", "--for", "soon"), "malformed duration"),
        (("remove", "--client-id", "nobody"), "404"),
        (("remove", "--client-id", "static-1"), "409"),
    ]
    for args, message in cases:
        assert cli(gw, *args) == 1, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
    api = gw.api()
    for body, message in [
        ({"client_id": "a", "username": "b"}, "exactly one"),
        ({"client_id": 7}, "must be a string"),
        ({"client_id": "a", "until": "5m"}, "unknown field"),
        ([], "JSON object"),
    ]:
        with pytest.raises(AdminClientError) as exc:
            api.post("/api/bans", body)
        assert exc.value.status == 400 and message in str(exc.value)
    assert gw.bans() == before
    with pytest.raises(AdminClientError) as exc:
        AdminClient(gw.url).get("/api/bans")
    assert exc.value.status == 401


def test_static_ban_from_the_settings(gw: Gateway) -> None:
    assert connack(gw.port, "static-1", v5=True) == 0x8A
    assert gw.bans()["client_id/static-1"]["source"] == "config"


def test_a_flapping_client_is_banned_once_and_listed(gw: Gateway) -> None:
    for _ in range(FLAP_MAX):
        assert connack(gw.port, "flap-1", v5=True) == 0
    assert connack(gw.port, "flap-1", v5=True) == 0x8A  # one more than allowed
    assert connack_v311(gw.port, "flap-1") == b"\x20\x02\x00\x05"
    ban = gw.bans()["client_id/flap-1"]
    assert ban["reason"] == "flapping" and ban["source"] == "flapping"
    assert 290 < float(str(ban["remaining_s"])) <= 300
    said = [line for line in gw.proc.output if "flapping_max_connects" in line]
    assert len(said) == 1, said
    assert f"connected {FLAP_MAX + 1} times within 60 s" in said[0]
    metrics = gw.metrics()
    assert 'lmqtt_connect_banned_total{cause="flapping"} 2.0' in metrics
    assert "lmqtt_flapping_bans_total 1.0" in metrics
    assert re.search(r"^lmqtt_bans_active [1-9]", metrics, re.M)


def test_a_restart_keeps_bans_until_they_end(gw: Gateway) -> None:
    api = gw.api()
    api.post("/api/bans", {"client_id": "keep-1", "reason": "kept"})
    api.post("/api/bans", {"client_id": "brief-1", "for": "1s"})
    gw.proc.stop()
    gw.start()
    bans = gw.bans()
    assert bans["client_id/keep-1"]["reason"] == "kept"
    assert bans["client_id/static-1"]["source"] == "config"
    assert connack(gw.port, "keep-1", v5=True) == 0x8A
    # The brief one ended (by now, or within its second): gone from the list, connects again.
    wait_until(lambda: "client_id/brief-1" not in gw.bans(), what="the 1 s ban to end")
    assert connack(gw.port, "brief-1", v5=True) == 0
    gw.api().delete("/api/bans/client_id/keep-1")
    after = gw.bans()
    assert "client_id/keep-1" not in after and "client_id/static-1" in after


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[[bans]]\naddress = "10.0.0.0/33"\n', "bans[0]: malformed address"),
        ('[[bans]]\nclient_id = ""\n', "bans[0]: the client_id of a ban must not be empty"),
        ('[[bans]]\nclient_id = "a"\nusername = "b"\n', "exactly one of client_id"),
        ('admin_token_file = "/nonexistent/token"\n', "admin_token_file /nonexistent/token"),
    ],
)
def test_bad_ban_settings_stop_the_gateway_at_start(
    tmp_path: Path, toml: str, message: str
) -> None:
    """Gateway() refuses them before anything is opened (`lmqtt serve` exits 2 with the
    message, as for every SettingsError)."""
    (tmp_path / "bad.toml").write_text(toml)
    with pytest.raises(SettingsError) as err:
        GatewayApp(load_settings(tmp_path / "bad.toml", data_dir=tmp_path / "data"))
    assert message in str(err.value)
    assert not (tmp_path / "data").exists()
