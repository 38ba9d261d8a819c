"""The live view (gateway/ops/live_view.py) and `lmqtt top` (gateway/ops/top.py) against real
`lmqtt serve` processes: paho and raw MQTT clients, the admin API over HTTP, top in tmux."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from gateway.ops.admin_client import AdminClient, AdminClientError
from gateway.protocol import Disconnect, ReasonCode
from tests.gateway.conftest import GatewayHarness, RawClient, wait_until
from tests.gateway.served import ServedGateway

TOKEN = "live-view-token"
THRESHOLD_S = 0.3


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    tmp = tmp_path_factory.mktemp("live")
    (tmp / "token").write_text(TOKEN + "\n")
    toml = f'admin_token_file = "{tmp / "token"}"\nslow_subscription_threshold = {THRESHOLD_S}\n'
    with ServedGateway(tmp, toml) as gw:
        yield gw


@pytest.fixture(scope="module")
def api(served: ServedGateway) -> AdminClient:
    return AdminClient(served.admin_url, token=TOKEN)


def _paho(port: int, client_id: str, *, auto_ack: bool = True) -> mqtt.Client:
    c = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv5,
        reconnect_on_failure=False,
    )
    c.manual_ack_set(not auto_ack)
    connected = threading.Event()
    c.on_connect = lambda *a: connected.set()
    c.connect("127.0.0.1", port)
    c.loop_start()
    assert connected.wait(10)
    return c


def _stop(*clients: mqtt.Client) -> None:
    for c in clients:
        c.disconnect()
        c.loop_stop()


def _row(api: AdminClient, client_id: str, **query: str) -> dict[str, Any] | None:
    rows = api.get("/api/clients", {"limit": "1000", **query})["clients"]
    return next((r for r in rows if r["client_id"] == client_id), None)


def test_the_api_wants_credentials_and_refuses_bad_input(
    served: ServedGateway, api: AdminClient
) -> None:
    for path in ("/api/clients", "/api/clients/x", "/api/slow-subscriptions"):
        with pytest.raises(AdminClientError) as err:
            AdminClient(served.admin_url).get(path)
        assert err.value.status == 401
    with pytest.raises(AdminClientError, match=r"400.*cannot sort by 'nope'"):
        api.get("/api/clients", {"sort": "nope"})
    for limit in ("0", "ten", "100000"):
        with pytest.raises(AdminClientError, match=r"400.*limit"):
            api.get("/api/clients", {"limit": limit})
    with pytest.raises(AdminClientError, match=r"404.*no client 'ghost'"):
        api.get("/api/clients/ghost")
    with pytest.raises(AdminClientError, match="404"):
        api.delete("/api/clients/ghost")


def test_clients_shows_a_publishing_clients_rate(served: ServedGateway, api: AdminClient) -> None:
    pub = _paho(served.port, "rate-pub")
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            pub.publish("rate/t", b"x" * 100, qos=1)
            time.sleep(0.02)  # about 50 a second

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        wait_until(
            lambda: (
                (r := _row(api, "rate-pub", sort="msgs_in_rate")) is not None
                and r["msgs_in_rate"] > 10
            ),
            15,
            "rate-pub's rate in /api/clients",
        )
        row = _row(api, "rate-pub")
        assert row is not None
        assert row["protocol"] == "5.0" and row["address"].startswith("127.0.0.1:")
        assert row["msgs_in"] > 0 and row["bytes_in"] > row["msgs_in"] * 100
        assert row["bytes_in_rate"] > row["msgs_in_rate"] * 100
        assert row["connected_s"] > 0 and row["subscriptions"] == 0
        one = api.get("/api/clients/rate-pub")
        assert one["client_id"] == "rate-pub" and one["subscriptions_detail"] == []
    finally:
        stop.set()
        thread.join()
        _stop(pub)


def test_slow_subscriptions_list_a_subscriber_that_does_not_acknowledge(
    served: ServedGateway, api: AdminClient
) -> None:
    sub = _paho(served.port, "mute-sub", auto_ack=False)  # receives, never acknowledges
    subscribed = threading.Event()
    sub.on_subscribe = lambda *a: subscribed.set()
    sub.subscribe("mute/#", 1)
    assert subscribed.wait(10)
    pub = _paho(served.port, "mute-pub")
    try:
        for i in range(5):
            pub.publish("mute/t", b"%d" % i, qos=1).wait_for_publish(10)

        def listed() -> bool:
            slow = api.get("/api/slow-subscriptions")
            return any(
                s["client_id"] == "mute-sub" and s["ack_lag_s"] > THRESHOLD_S
                for s in slow["by_ack_lag"]
            )

        wait_until(listed, 15, "mute-sub among the slow subscriptions")
        slow = api.get("/api/slow-subscriptions")
        assert slow["threshold_s"] == THRESHOLD_S and slow["over_threshold"] >= 1
        entry = next(s for s in slow["by_ack_lag"] if s["client_id"] == "mute-sub")
        assert entry["topic_filter"] == "mute/#"
        row = _row(api, "mute-sub")
        assert row is not None and row["inflight"] == 5 and row["oldest_unacked_s"] > THRESHOLD_S
        assert row["msgs_out"] == 5
        with urllib.request.urlopen(f"{served.admin_url}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        gauge = next(
            ln for ln in metrics.splitlines() if ln.startswith("lmqtt_slow_subscriptions ")
        )
        assert float(gauge.split()[1]) >= 1
    finally:
        _stop(pub, sub)


def test_kick_closes_a_client(served: ServedGateway, api: AdminClient) -> None:
    raw = RawClient(served.port, level=5)
    try:
        assert raw.connect("kick-me").reason_code == 0
        wait_until(lambda: _row(api, "kick-me") is not None, 10, "kick-me listed")
        answer = api.delete("/api/clients/kick-me")
        assert answer["kicked"] == "kick-me"
        ev = raw.recv()
        assert isinstance(ev, Disconnect) and ev.reason_code == ReasonCode.ADMINISTRATIVE_ACTION
        assert raw.is_closed()
        assert _row(api, "kick-me") is None
    finally:
        raw.close()


# -- lmqtt top ---------------------------------------------------------------------------------


def test_top_once_merges_nodes(served: ServedGateway, tmp_path: Path) -> None:
    """Two nodes, each answering for its own clients: `lmqtt top --once` shows both. The
    second node runs in this process (GatewayHarness): a second `lmqtt serve` would add seconds
    and show nothing more."""
    (tmp_path / "token").write_text(TOKEN)
    other = GatewayHarness(
        tmp_path / "data", admin_port=0, admin_token_file=tmp_path / "token"
    ).start()
    assert other.gw is not None
    other_url = f"http://127.0.0.1:{other.gw.listeners.port('admin')}"
    a = _paho(served.port, "node-a-client")
    b = _paho(other.port, "node-b-client")
    try:
        command = [sys.executable, "-m", "gateway", "top", "--once", "--sort", "client_id"]
        command += ["--admin", served.admin_url, "--admin", other_url]
        command += ["--token-file", str(tmp_path / "token")]
        out = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
    finally:
        _stop(a, b)
        other.stop()
    assert out.returncode == 0, out.stderr
    assert "on 2 node(s)" in out.stdout and "NODE" in out.stdout
    assert "node-a-client" in out.stdout and "node-b-client" in out.stdout
    assert f"127.0.0.1:{served.admin_port}" in out.stdout
    assert other_url.removeprefix("http://") in out.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (make test-tools)")
def test_top_in_a_terminal_shows_clients_and_sorts_by_key(
    served: ServedGateway, tmp_path: Path
) -> None:
    """`lmqtt top` in a tmux pane: the screen read back shows the columns and the clients, and
    pressing c (client id) then i (messages in per second) reorders the rows."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    busy = _paho(served.port, "zz-busy")  # last by name, first by its rate
    idle = _paho(served.port, "aa-idle")
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            busy.publish("top/t", b"x", qos=0)
            time.sleep(0.01)

    thread = threading.Thread(target=publish)
    thread.start()
    sock = f"lmqtt-top-{os.getpid()}"
    tmux = ["tmux", "-L", sock]
    command = f"{sys.executable} -m gateway top --admin {served.admin_url} --token-file {token}"
    # The pane's size, not the one inherited: under pytest-xdist COLUMNS (80) is set, and rich
    # would draw the table that narrow, the client ids cut.
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "200", "LINES": "40"}
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "top", "-x", "200", "-y", "40", command],
        check=True,
        env=env,
    )

    def screen() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True
        ).stdout

    def order() -> list[str]:
        return [
            name
            for line in screen().splitlines()
            for name in ("zz-busy", "aa-idle")
            if line.lstrip().startswith(name)
        ]

    try:
        # Deadlines, not pauses: a loaded host takes seconds to start `lmqtt top` (Python, rich).
        try:
            wait_until(lambda: "zz-busy" in screen() and "aa-idle" in screen(), 90, "top's rows")
        except AssertionError:
            raise AssertionError(f"top's rows never showed:\n{screen()}") from None
        text = screen()
        for header in ("CLIENT", "ADDRESS", "IN/s", "OUT/s", "BACKLOG", "UNACK s"):
            assert header in text, text
        assert "sorted by msgs_in_rate" in text
        wait_until(lambda: order() == ["zz-busy", "aa-idle"], 60, "the busy client first")
        subprocess.run([*tmux, "send-keys", "-t", "top", "c"], check=True)
        wait_until(lambda: "sorted by client_id" in screen(), 30, "sorted by client id")
        assert order() == ["aa-idle", "zz-busy"], screen()
        subprocess.run([*tmux, "send-keys", "-t", "top", "i"], check=True)
        wait_until(lambda: order() == ["zz-busy", "aa-idle"], 30, "sorted by rate again")
        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)
        wait_until(
            lambda: subprocess.run([*tmux, "has-session", "-t", "top"]).returncode != 0,
            30,
            "top quits on q",
        )
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        stop.set()
        thread.join()
        _stop(busy, idle)


# -- the rate window (pure: a connection's counters as plain attributes) -----------------------


class _Counters:
    """What the sampler reads of a connection: its counters and when it was accepted."""

    def __init__(self, opened: float) -> None:
        self.opened = opened
        self.msgs_in = self.bytes_in = self.messages_sent = self.bytes_out = 0


def test_rings_keep_changes_only_and_rates_cover_the_last_ten_seconds() -> None:
    from gateway.ops.live_view import WINDOW_S, _record

    rings: dict[Any, list[Any]] = {}
    busy, idle, old = _Counters(100.0), _Counters(100.0), _Counters(0.0)
    for t in range(101, 131):  # 30 s of ticks; busy sends 10 a second, idle nothing
        busy.msgs_in += 10
        for c in (busy, idle, old):
            _record(rings, c, float(t))  # type: ignore[arg-type]  # the counters it reads only
    assert len(rings[idle]) == 1  # nothing changed: the connect seed alone
    assert len(rings[busy]) <= WINDOW_S + 2
    start = rings[busy][0]
    assert start[0] <= 130 - WINDOW_S and (busy.msgs_in - start[1]) / WINDOW_S == 10
    # First seen long after it connected: counted from then, not from its connect.
    assert rings[old][0][0] == 101.0
