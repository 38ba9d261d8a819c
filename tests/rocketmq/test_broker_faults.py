"""RocketMQ as an operator's bad day has it: a gateway started before its name server and
broker (they usually start together), and a broker restarted under a gateway whose subscriber
is idle. Real `lmqtt serve` processes and in-process gateways, real brokers, paho clients."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster, namesrv_port
from tests.rocketmq.conftest import start_gateway
from tests.rocketmq.test_gateway_rocketmq import ROOT, ServeProcess
from topicmap import queue_name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def _said(g: ServeProcess, *parts: str) -> bool:
    return any(all(p in line for p in parts) for line in list(g.output))


def test_serve_waits_for_the_name_server_and_a_broker_and_gives_up_after_its_timeout(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """`lmqtt serve` started before the name server listens, then before any broker registers,
    says what it waits for and comes up once a broker is registered, then serves a publish and
    a subscribe; one with a 1 s `rocketmq_start_timeout` and no broker stops with the clear
    message and exit code 1. (A cluster of its own: a name server, then one broker.)"""
    late = RocketMQCluster(tmp_path / "late")
    addr = f"127.0.0.1:{namesrv_port()}"
    g = ServeProcess(
        tmp_path / "data",
        "--store", "rocketmq", "--namesrv", addr,
        env={"LMQTT_ROCKETMQ_TOPIC": f"t{uuid.uuid4().hex[:12]}"},
    )  # fmt: skip
    try:
        g.launch()
        wait_until(
            lambda: _said(g, "waiting for RocketMQ", f"name server {addr} unreachable"),
            30,
            "the gateway waiting for the name server",
        )
        assert g.proc is not None and g.proc.poll() is None
        late.start_namesrv(int(addr.rsplit(":", 1)[1]))
        wait_until(
            lambda: _said(g, "waiting for RocketMQ", "no RocketMQ broker is registered"),
            30,
            "the gateway waiting for a broker",
        )

        # Meanwhile, a gateway that waits 1 s gives up with the message of a start without one.
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--port", "0", "--data-dir",
             str(tmp_path / "impatient"), "--store", "rocketmq", "--namesrv", addr],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT), "LMQTT_ROCKETMQ_START_TIMEOUT": "1"},
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert f"cannot start: no RocketMQ broker is registered at name server {addr}" in (
            done.stderr
        )
        assert "Traceback" not in done.stderr + done.stdout

        assert g.proc.poll() is None, "".join(g.output)
        late.start_extra_broker("broker-late")
        g.wait_listening(60)
        sub = Client(g.port, "sub")
        pub = Client(g.port, "pub")
        clients.extend([sub, pub])
        sub.subscribe("late/#", 1)
        pub.publish("late/1", b"served", 1)
        assert [bytes(m.payload) for m in sub.wait_messages(1)] == [b"served"]
    finally:
        stop_clients(clients)
        g.stop()
        late.stop(signal.SIGKILL)


def test_an_idle_subscribers_held_pull_never_times_out_across_a_broker_restart(
    rocketmq: RocketMQCluster,
    tmp_path: Path,
    clients: list[Client],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subscriber idle while its broker (broker-b of the session) restarts: the light queue's
    held pull, taken up again once the broker is back, ends with PULL_NOT_FOUND after the
    broker's hold (no client timeout: "no answer to request code 11" is never logged), and a
    message published then reaches the subscriber woken by its arrival: within 1 s, where the
    broker's next hold check, the only other way the held pull could end, is ~5 s away. With a
    held pull per mirror (`rocketmq_notify_pulls` off): the parent topic's tail is not idle (the
    gateway's own writes reach it every ~10 s), an idle light queue is; the client's hold
    timing checked here is the same for both."""
    caplog.set_level(logging.DEBUG, logger="lmqtt.rocketmq")
    h = start_gateway(rocketmq, tmp_path, rocketmq_broker="broker-b", rocketmq_notify_pulls=False)
    queue = queue_name("idle/#")

    def ended_empty(since: int) -> int:
        return sum(
            r.getMessage().startswith(f"queue {queue}: held pull ended empty")
            for r in list(caplog.records)[since:]
        )

    try:
        sub = Client(h.port, "idle")
        warm = Client(h.port, "warm")
        pub = Client(h.port, "pub")
        clients.extend([sub, warm, pub])
        sub.subscribe("idle/#", 1)
        warm.subscribe("warm/#", 1)
        pub.publish("idle/1", b"before", 1)
        sub.wait_messages(1)
        rocketmq.restart_broker("broker-b", sig=signal.SIGKILL)  # a crash: no 10 s graceful stop
        back = len(caplog.records)
        # The gateway's send connection is made again and the restarted broker's JVM runs its
        # send, dispatch and wake-up paths once, through another subscriber's queue, so the
        # message timed below measures the idle queue's held pull, not a reconnect or a cold JVM.
        pub.publish("warm/1", b"warm up", 1)
        warm.wait_messages(1, 60)
        # The mirror's pull comes back within its backoff (at most 5 s), then is held 15 s
        # and answered at the broker's next hold check (up to 5 s later). The second one is
        # sent just after a hold check, so it is answered ~20 s later: the longest hold, which
        # a client waiting suspend + request timeout (20 s) raced.
        wait_until(
            lambda: ended_empty(back) >= 2, 80, "two idle held pulls ending empty after the restart"
        )
        timeouts = [
            r.getMessage() for r in caplog.records if "no answer to request" in r.getMessage()
        ]
        assert not timeouts, timeouts
        sent = time.monotonic()
        pub.publish("idle/1", b"after", 1)
        sub.wait_for(lambda: b"after" in sub.payloads(), 30, "the message published after")
        # QoS 1 is at least once: "before" may be stored twice when the broker is killed
        # after its pull answer but before its send answer (two broker threads write them
        # onto the one connection; sender.py "away" sends it again), as in the test below.
        assert sub.payloads() in ([b"before", b"after"], [b"before", b"before", b"after"])
        latency = sub.messages[-1].timestamp - sent
        print(f"delivered {latency * 1000:.1f} ms after the publish")
        # The pull was sent again right after the hold check that ended the second one, so the
        # next check is ~5 s away: within 1 s only the arrival wake-up can have answered it (a
        # loaded CI host took 172 ms, so a tighter bound measured the host, not the wake-up).
        assert latency < 1.0, f"delivered {latency * 1000:.0f} ms after the publish"
    finally:
        stop_clients(clients)
        h.stop()


def test_messages_acknowledged_while_the_broker_is_away_are_stored_in_order_once_it_is_back(
    rocketmq: RocketMQCluster,
    tmp_path: Path,
    clients: list[Client],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--flush async` acknowledges a QoS 1 PUBLISH before the broker answers. Messages
    published while the gateway's broker is down (killed, then started again on its store)
    are sent again until it is back (sender.py "away"), not logged as lost: the subscriber
    gets them in order, then one published after the restart. (`rocketmq_send_retry` is set
    well over a broker's restart on a loaded host: the bound is not what is tested.)"""
    caplog.set_level(logging.DEBUG, logger="lmqtt.rocketmq")
    h = start_gateway(rocketmq, tmp_path, rocketmq_broker="broker-b", rocketmq_send_retry=180.0)
    try:
        sub = Client(h.port, "sub")
        pub = Client(h.port, "pub")
        clients.extend([sub, pub])
        sub.subscribe("away/#", 1)
        pub.publish("away/0", b"before", 1)
        sub.wait_messages(1)
        addr = rocketmq.stop_broker("broker-b", signal.SIGKILL)
        away = [f"away {i}".encode() for i in range(1, 6)]
        for i, payload in enumerate(away, 1):
            pub.publish(f"away/{i}", payload, 1)  # PUBACKed (async mode), the broker down
        # A send has found the broker away before it is back (sent again; before the resends:
        # given up as lost at once).
        wait_until(
            lambda: any(
                "sending again" in m or "messages not stored" in m
                for m in (r.getMessage() for r in list(caplog.records))
            ),
            30,
            "a send finding the broker away",
        )
        rocketmq.start_broker_again("broker-b", addr)
        pub.publish("away/6", b"after", 1)
        sub.wait_for(lambda: b"after" in sub.payloads(), 120, "the message published after")
        got = sub.payloads()
        # QoS 1 is at least once, and "before" may be stored twice: the broker writes the
        # tail's pull answer and the send's answer from two threads onto the one connection,
        # so "before" can be delivered while its send is still unanswered; killed then, the
        # broker never answers it, and the sender sends it again (sender.py "away": a
        # batch's publish may be stored twice). Seen once in a full suite on a loaded host.
        # Every message published while the broker was away is stored once, in order.
        if got[:2] == [b"before", b"before"]:
            got = got[1:]
        assert got == [b"before", *away, b"after"]
        lost = [r.getMessage() for r in caplog.records if "messages not stored" in r.getMessage()]
        assert not lost, lost
    finally:
        stop_clients(clients)
        h.stop()
