"""Hostile-client soak (bounded: ~12 s of attack): a real `lmqtt serve` process under
slow-loris sockets, half-open and never-reading subscribers, oversized and malformed packets,
connection floods and subscription storms, while well-behaved paho clients publish and
subscribe at QoS 1. They must lose nothing, every hostile socket must be gone afterwards, and
the server's resident memory must stay bounded."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from gateway.protocol import Connect, Subscribe, Subscription, Unsubscribe, encode
from tests.gateway.conftest import wait_until

ATTACK_S = 10.0
MESSAGES_PER_PUBLISHER = 400
PAYLOAD = b"p" * 512
ATTACKER = "127.0.0.2"  # floods come from their own loopback address (own rate bucket)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _health(admin: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/health", timeout=10) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


def _attacker_socket(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(ATTACKER, 0))


def _connect_bytes(cid: str, keep_alive: int = 0, level: int = 4) -> bytes:
    return encode(Connect(level, cid, True, keep_alive), level)


class Good:
    """A well-behaved paho client: QoS 1 subscriber recording payloads, or publisher."""

    def __init__(self, port: int, cid: str, v5: bool) -> None:
        proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        kw: dict[str, Any] = {} if v5 else {"clean_session": True}
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, cid, protocol=proto, **kw)
        self.c.max_inflight_messages_set(50)
        self.c.max_queued_messages_set(0)
        self.got: set[bytes] = set()
        self.subscribed = threading.Event()
        self.connected = threading.Event()
        self.c.on_connect = lambda *a: self.connected.set()
        self.c.on_message = lambda _c, _u, m: self.got.add(bytes(m.payload[:32]))
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self.c.connect("127.0.0.1", port, keepalive=30)
        self.c.loop_start()
        assert self.connected.wait(10)


RUNS: dict[str, int] = {}


def _loop(stop: threading.Event, body: Callable[[], None]) -> None:
    while not stop.is_set():
        try:
            body()
        except OSError:
            pass  # the server closing an attacker's socket is the point
        RUNS[body.__name__] = RUNS.get(body.__name__, 0) + 1


@pytest.mark.slow
def test_hostile_clients_do_not_hurt_good_ones(tmp_path: Path) -> None:
    port, admin = _free_port(), _free_port()
    env = {
        **os.environ,
        "LMQTT_CONNECT_TIMEOUT": "1.5",
        "LMQTT_MAX_PACKET_SIZE": "65536",
        "LMQTT_MAX_SUBSCRIPTIONS": "50",
        "LMQTT_MAX_CONNECTIONS": "400",
        "LMQTT_CONNECT_RATE": "200",
        "LMQTT_CONNECT_BURST": "100",
        "LMQTT_CONNECT_RATE_LOOPBACK": "true",
        "LMQTT_ADMIN_PORT": str(admin),
    }
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
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    stop = threading.Event()
    threads: list[threading.Thread] = []
    held: list[socket.socket] = []
    goods: list[Good] = []
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
        subs = [Good(port, "good-sub-5", True), Good(port, "good-sub-4", False)]
        pubs = [Good(port, "good-pub-5", True), Good(port, "good-pub-4", False)]
        goods += subs + pubs
        for s in subs:
            s.c.subscribe("good/#", 1)
            assert s.subscribed.wait(10)
        baseline = _rss_kib(proc.pid)
        rng = random.Random(7)

        # --- the attackers ---------------------------------------------------------------
        def slow_loris() -> None:
            sock = _attacker_socket(port)
            for b in _connect_bytes("loris"):
                if stop.is_set():
                    break
                sock.sendall(bytes([b]))
                time.sleep(0.3)  # one byte at a time: closed by the CONNECT timeout
            sock.close()

        def never_reading_subscriber() -> None:
            # Subscribes to the busy topic, then neither reads nor sends: the server must
            # pause its delivery at the write-buffer mark instead of buffering without end.
            sock = _attacker_socket(port)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(_connect_bytes(f"deaf-{rng.random()}"))
            sock.sendall(encode(Subscribe(1, [Subscription("good/#", 0)]), 4))
            held.append(sock)
            stop.wait()

        def half_open() -> None:
            sock = _attacker_socket(port)
            sock.sendall(_connect_bytes(f"half-{rng.random()}", keep_alive=1))
            held.append(sock)  # keep-alive 1 s, then silence: dropped at 1.5 s
            stop.wait(0.2)

        def oversized() -> None:
            sock = _attacker_socket(port)
            sock.sendall(_connect_bytes(f"big-{rng.random()}", level=5))
            # Remaining length 16 MiB announced: refused from the header alone.
            sock.sendall(b"\x30\x80\x80\x80\x08" + b"x" * 4096)
            sock.settimeout(5)
            while sock.recv(4096):
                pass
            sock.close()

        def malformed() -> None:
            sock = _attacker_socket(port)
            if rng.random() < 0.5:
                sock.sendall(_connect_bytes(f"junk-{rng.random()}"))
            sock.sendall(rng.randbytes(rng.randint(1, 300)))
            sock.settimeout(5)
            try:
                while sock.recv(4096):
                    pass
            except TimeoutError:
                pass  # a prefix of a valid packet: the CONNECT timeout closes it later
            sock.close()

        def flood() -> None:
            for _ in range(20):
                sock = _attacker_socket(port)
                sock.close()
            time.sleep(0.05)

        def subscription_storm() -> None:
            sock = _attacker_socket(port)
            sock.sendall(_connect_bytes(f"storm-{rng.random()}", keep_alive=30))
            pid = 1
            for _ in range(20):
                filters = [Subscription(f"storm/{rng.randint(0, 10**6)}/+/#", 0) for _ in range(30)]
                sock.sendall(encode(Subscribe(pid, filters), 4))
                sock.sendall(encode(Unsubscribe(pid + 1, [f.topic_filter for f in filters]), 4))
                pid += 2
            sock.close()

        attacks = [slow_loris] * 8 + [never_reading_subscriber] * 10 + [half_open] * 4
        attacks += [oversized, malformed, malformed, flood, subscription_storm]
        for attack in attacks:
            t = threading.Thread(target=_loop, args=(stop, attack), daemon=True)
            t.start()
            threads.append(t)

        # --- the well-behaved traffic -----------------------------------------------------
        peak = baseline
        deadline = time.monotonic() + ATTACK_S
        sent = 0
        infos = []
        while sent < MESSAGES_PER_PUBLISHER or time.monotonic() < deadline:
            for i, p in enumerate(pubs):
                body = f"{i}:{sent:06d}".encode().ljust(32, b".") + PAYLOAD
                infos.append(p.c.publish(f"good/{i}/{sent % 10}", body, 1))
            sent += 1
            if sent % 20 == 0:
                peak = max(peak, _rss_kib(proc.pid))
                time.sleep(0.05)
            if sent >= MESSAGES_PER_PUBLISHER * 8:
                break
        for info in infos:
            info.wait_for_publish(30)
            assert info.is_published()
        expected = {
            f"{i}:{n:06d}".encode().ljust(32, b".") for i in range(len(pubs)) for n in range(sent)
        }
        for s in subs:
            wait_until(lambda s=s: len(s.got) >= len(expected), 30, "every good message")  # type: ignore[misc]
            assert s.got == expected  # nothing lost (QoS 1 duplicates collapse in the set)
        peak = max(peak, _rss_kib(proc.pid))
        stop.set()
        for t in threads:
            t.join(10)
        for sock in held:
            sock.close()
        # Every hostile socket is gone: only the four good clients remain.
        wait_until(lambda: _health(admin)["connections"] == 4, 15, "only good clients left")
        assert _health(admin)["status"] == "ok"
        assert {name: RUNS.get(name, 0) > 0 for name in {a.__name__ for a in attacks}} == {
            a.__name__: True for a in attacks
        }
        grown_mib = (peak - baseline) / 1024
        print(f"soak: {sent * 2} good messages, RSS {baseline // 1024} MiB -> peak "
              f"{peak // 1024} MiB")  # fmt: skip
        assert grown_mib < 150, f"server RSS grew by {grown_mib:.0f} MiB"
    finally:
        stop.set()
        for sock in held:
            sock.close()
        for g in goods:
            g.c.disconnect()
            g.c.loop_stop()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
