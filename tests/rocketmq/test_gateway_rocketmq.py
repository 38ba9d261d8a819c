"""`lmqtt serve --store rocketmq` end to end: real MQTT clients (paho), a real gateway process,
the real RocketMQ 5.3.3 cluster of the session (conftest.py).

Each test gets its own parent topic (`rocketmq_topic`), which is also the namespace of its light
queues (gateway/storage/rocketmq/adapter.py), so the tests share the cluster without seeing each
other's messages or retained state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.protocol import PubAck, Publish
from rocketmq_remoting import RemotingClient, TopicNotExistError
from rocketmq_remoting.admin import create_topic, update_broker_config
from tests.gateway.conftest import Client, RawClient, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from topicmap.rocketmq import encode_lmq

ROOT = Path(__file__).resolve().parents[2]

# The first test also waits for the cluster to start.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class ServeProcess:
    """`python -m gateway serve` in a subprocess; its port read from its first line."""

    def __init__(
        self,
        data_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        wrap: tuple[str, ...] = (),
    ) -> None:
        """`wrap`: a command the gateway is started through (e.g. ``ip netns exec NS``)."""
        self.data_dir = data_dir
        self.args = args
        self.env = env or {}
        self.wrap = wrap
        self.proc: subprocess.Popen[str] | None = None
        self._found: list[int] = []
        self.port = 0
        self.output: list[str] = []

    def start(self, timeout: float = 60.0) -> ServeProcess:
        return self.launch().wait_listening(timeout)

    def launch(self) -> ServeProcess:
        """Start the process; its output is read from then on (wait_listening)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        self.output = []
        self.proc = subprocess.Popen(
            [*self.wrap, sys.executable, "-m", "gateway", "serve", "--port", "0",
             "--sys-interval", "0", "--data-dir", str(self.data_dir), "--log-level", "INFO",
             *self.args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        found: list[int] = []
        self._found = found
        proc = self.proc

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.output.append(line)
                m = re.match(r"lmqtt listening on [^:]+:(\d+)", line)
                if m and not found:
                    found.append(int(m.group(1)))

        threading.Thread(target=read, daemon=True).start()
        return self

    def wait_listening(self, timeout: float = 60.0) -> ServeProcess:
        found = self._found
        wait_until(
            lambda: found or self.proc is None or self.proc.poll() is not None,
            timeout,
            "the gateway's listening line",
        )
        assert found, "gateway did not start:\n" + "".join(self.output)
        self.port = found[0]
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(30)
        finally:
            self.proc = None
            print("".join(self.output))  # shown by pytest when the test fails

    def restart(self) -> ServeProcess:
        self.stop()
        return self.start()


@pytest.fixture
def serve(rocketmq: RocketMQCluster, tmp_path: Path) -> Iterator[ServeProcess]:
    """A gateway on broker-a (async flush) with its own namespace; stopped afterwards."""
    topic = f"t{uuid.uuid4().hex[:12]}"
    g = ServeProcess(
        tmp_path / "data",
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
        env={"LMQTT_ROCKETMQ_TOPIC": topic, "LMQTT_ROCKETMQ_BROKER": "broker-a"},
    )  # fmt: skip
    try:
        yield g.start()
    finally:
        g.stop()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_wildcard_fanout_qos0_qos1_through_light_queues(
    serve: ServeProcess, clients: list[Client]
) -> None:
    plus = Client(serve.port, "plus")
    hashed = Client(serve.port, "hash", v5=True)
    exact = Client(serve.port, "exact")
    both = Client(serve.port, "both")
    clients += [plus, hashed, exact, both]
    assert plus.subscribe("s/+/t", 1) == [1]
    assert hashed.subscribe("s/#", 1) == [1]
    assert exact.subscribe("s/1/t", 0) == [0]
    # Two overlapping filters in one session: each message once (docs/storage.md).
    assert both.subscribe([("s/+/t", 1), ("s/#", 1)]) == [1, 1]
    pub = Client(serve.port, "pub")
    clients.append(pub)
    sent = [("s/1/t", 1), ("s/2/t", 1), ("s/x", 0), ("s/1/t", 0), ("other/1", 1)]
    for i, (topic, qos) in enumerate(sent):
        pub.publish(topic, f"m{i}", qos)

    def got(c: Client, n: int) -> list[tuple[str, bytes]]:
        return [(m.topic, bytes(m.payload)) for m in c.wait_messages(n)]

    assert got(plus, 3) == [("s/1/t", b"m0"), ("s/2/t", b"m1"), ("s/1/t", b"m3")]
    assert got(hashed, 4) == [("s/1/t", b"m0"), ("s/2/t", b"m1"), ("s/x", b"m2"), ("s/1/t", b"m3")]
    assert got(exact, 2) == [("s/1/t", b"m0"), ("s/1/t", b"m3")]
    assert got(both, 4) == got(hashed, 4)
    # QoS is the minimum of publish and subscription.
    assert [m.qos for m in plus.messages] == [1, 1, 0]
    assert [m.qos for m in exact.messages] == [0, 0]
    # Nothing more arrives (the exact counts): a marker published last comes alone.
    pub.publish("s/1/t", "end", 1)
    assert got(exact, 3)[-1] == ("s/1/t", b"end")
    assert got(plus, 4)[-1] == ("s/1/t", b"end")
    assert len(exact.messages) == 3 and len(plus.messages) == 4


def test_messages_are_stored_in_light_queues_on_the_broker(
    serve: ServeProcess, rocketmq: RocketMQCluster, clients: list[Client]
) -> None:
    """What the gateway acknowledged is in the broker's light queue of the filter, and the
    subscriber's committed offset is the broker's consumer offset of its %LMQ% group."""
    sub = Client(serve.port, "sub", clean=False)
    pub = Client(serve.port, "pub")
    clients += [sub, pub]
    sub.subscribe("lq/#", 1)
    for i in range(5):
        pub.publish("lq/a", f"x{i}", 1)
    sub.wait_messages(5)
    topic = serve.env["LMQTT_ROCKETMQ_TOPIC"]
    lmq = encode_lmq("%LMQ%lq.%23", topic)

    group = encode_lmq("sub", topic)  # the subscriber's consumer group on the broker
    broker = rocketmq.brokers["broker-a"]

    async def read() -> tuple[list[bytes], int | None]:
        async with RemotingClient([rocketmq.namesrv_addr]) as client:
            res = await client.pull(broker, lmq, 0, consumer_group="%LMQ%test", max_messages=32)
            # The committed offset reaches the broker within the gateway's 1 s flush.
            deadline = time.monotonic() + 10
            committed = None
            while committed != 5 and time.monotonic() < deadline:
                committed = await client.query_consumer_offset(broker, group, lmq)
                await asyncio.sleep(0.1)
            return [m.body for m in res.messages], committed

    bodies, committed = asyncio.run(read())
    assert bodies == [f"x{i}".encode() for i in range(5)]
    assert committed == 5


def test_persistent_session_gets_its_backlog_after_reconnect_and_gateway_restart(
    serve: ServeProcess, clients: list[Client]
) -> None:
    keeper = Client(serve.port, "keeper", clean=False)
    clients.append(keeper)
    assert keeper.subscribe("b/#", 1) == [1]
    keeper.disconnect()
    pub = Client(serve.port, "pub")
    clients.append(pub)
    for i in range(40):
        pub.publish(f"b/{i % 3}", f"first {i}", 1)
    # Reconnect to the same process: the backlog is read back from the broker.
    keeper.connect()
    assert keeper.connack == (True, 0)
    msgs = keeper.wait_messages(40)
    assert [bytes(m.payload) for m in msgs] == [f"first {i}".encode() for i in range(40)]
    keeper.disconnect()
    for i in range(60):
        pub.publish("b/x", f"second {i}", 1)
    pub.disconnect()
    # A new gateway process knows nothing of the messages but the broker's light queue.
    serve.restart()
    pub2 = Client(serve.port, "pub2")
    clients.append(pub2)
    keeper.port = serve.port
    keeper.messages.clear()
    keeper.connect()
    assert keeper.connack == (True, 0)
    msgs = keeper.wait_messages(60)
    assert [bytes(m.payload) for m in msgs] == [f"second {i}".encode() for i in range(60)]
    pub2.publish("b/live", "live", 1)
    assert bytes(keeper.wait_messages(61)[-1].payload) == b"live"


def test_qos2_and_retained_messages(serve: ServeProcess, clients: list[Client]) -> None:
    sub = Client(serve.port, "q2", v5=True)
    pub = Client(serve.port, "q2pub", v5=True)
    clients += [sub, pub]
    sub.subscribe("q2/#", 2)
    for i in range(3):
        pub.publish("q2/x", f"exactly once {i}", 2)
    msgs = sub.wait_messages(3)
    assert [(bytes(m.payload), m.qos) for m in msgs] == [
        (f"exactly once {i}".encode(), 2) for i in range(3)
    ]
    pub.publish("r/1", "kept", 1, retain=True)
    pub.publish("r/2", "kept too", 1, retain=True)
    pub.publish("r/2", "", 1, retain=True)  # deletes r/2's
    late = Client(serve.port, "late")
    clients.append(late)
    late.subscribe("r/#", 1)
    got = late.wait_messages(1)
    assert [(m.topic, bytes(m.payload), m.retain) for m in got] == [("r/1", b"kept", True)]
    # A new process with an empty data directory rebuilds retained state from the broker's
    # %RETAIN% light queue.
    serve.stop()
    import shutil

    shutil.rmtree(serve.data_dir)
    serve.start()
    fresh = Client(serve.port, "fresh")
    clients.append(fresh)
    fresh.subscribe("r/#", 1)
    got = fresh.wait_messages(1)
    assert [(m.topic, bytes(m.payload), m.retain) for m in got] == [("r/1", b"kept", True)]


def test_sync_mode_on_a_sync_flush_broker_sigkill_loses_no_acknowledged_message(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """broker-b flushes synchronously (SYNC_FLUSH) and does not auto-create topics: the
    gateway creates its topic, acknowledges each PUBLISH after SEND_OK, and a SIGKILL of the
    gateway right after the acknowledgements loses none of them."""
    g = ServeProcess(
        tmp_path / "data",
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, "--flush", "sync",
        env={
            "LMQTT_ROCKETMQ_TOPIC": f"t{uuid.uuid4().hex[:12]}",
            "LMQTT_ROCKETMQ_BROKER": "broker-b",
        },
    )  # fmt: skip
    try:
        g.start()
        assert any("broker broker-b" in line for line in g.output)
        assert not any("readUnCommitted" in line for line in g.output), g.output
        keeper = Client(g.port, "keeper", clean=False)
        clients.append(keeper)
        keeper.subscribe("k/#", 1)
        keeper.disconnect()
        pub = Client(g.port, "writer")
        clients.append(pub)
        infos = [pub.c.publish("k/1", f"acked {i}", 1) for i in range(50)]
        for info in infos:
            info.wait_for_publish(10)
        assert all(info.is_published() for info in infos)
        assert g.stop(signal.SIGKILL) == -signal.SIGKILL
        g.start()
        keeper.port = g.port
        keeper.connect()
        msgs = keeper.wait_messages(50)
        assert [bytes(m.payload) for m in msgs] == [f"acked {i}".encode() for i in range(50)]
    finally:
        g.stop()


def test_name_server_unreachable_is_one_clear_line_and_exit_code_1(tmp_path: Path) -> None:
    """Once `rocketmq_start_timeout` (2 s here) is over; the wait is logged meanwhile."""
    port = _free_port()  # nothing listens there
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--port", "0", "--data-dir",
         str(tmp_path / "d"), "--store", "rocketmq", "--namesrv", f"127.0.0.1:{port}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LMQTT_ROCKETMQ_START_TIMEOUT": "2"},
    )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot start: RocketMQ name server 127.0.0.1:{port} unreachable" in done.stderr
    assert "waiting for RocketMQ" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert time.monotonic() - started < 30


def test_store_rocketmq_without_namesrv_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--data-dir", str(tmp_path / "d"),
         "--store", "rocketmq"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "namesrv" in done.stderr
    assert "Traceback" not in done.stderr


def test_broker_without_light_queues_is_refused_with_what_to_fix(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    rocketmq.start_extra_broker("broker-nolmq", lmq=False)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--port", "0", "--data-dir",
             str(tmp_path / "d"), "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT), "LMQTT_ROCKETMQ_BROKER": "broker-nolmq"},
        )  # fmt: skip
    finally:
        rocketmq.stop_broker("broker-nolmq", signal.SIGKILL)  # done with: no graceful stop
    assert done.returncode == 1, done.stderr
    assert "broker broker-nolmq" in done.stderr
    assert "enableLmq=true" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_broker_restart_loses_no_acknowledged_message(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """Sync mode on a SYNC_FLUSH broker that is restarted under the running gateway: every
    PUBLISH acknowledged with reason 0 (before, and after it is back) reaches the persistent
    subscriber; while it is down, PUBLISHes are refused (PUBACK 0x80), never acknowledged."""
    rocketmq.start_extra_broker("broker-r", flush="SYNC_FLUSH")
    g = ServeProcess(
        tmp_path / "data",
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, "--flush", "sync",
        env={"LMQTT_ROCKETMQ_BROKER": "broker-r"},
    )  # fmt: skip
    try:
        g.start()
        keeper = Client(g.port, "keeper", clean=False)
        clients.append(keeper)
        keeper.subscribe("rs/#", 1)
        keeper.disconnect()
        pub = RawClient(g.port, level=5)
        pub.connect("writer")
        acked: list[bytes] = []
        pid = 0

        def publish_until_acked(payload: bytes, timeout: float) -> None:
            nonlocal pid
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                pid = pid % 65535 + 1
                pub.send(Publish("rs/1", payload, qos=1, packet_id=pid))
                ack = pub.recv_until(PubAck)
                assert isinstance(ack, PubAck) and ack.packet_id == pid
                if ack.reason_code == 0:
                    acked.append(payload)
                    return
                time.sleep(0.2)  # refused (broker away): not stored as far as we know; again
            raise AssertionError(f"{payload!r} never acknowledged")

        for i in range(20):
            publish_until_acked(f"before {i}".encode(), 10)
        rocketmq.restart_broker("broker-r")
        for i in range(20):
            publish_until_acked(f"after {i}".encode(), 60)
        keeper.connect()
        wait_until(lambda: set(acked) <= set(keeper.payloads()), 60, "every acknowledged message")
        got = keeper.payloads()
        firsts = sorted(set(got), key=got.index)  # a refused send may still have been stored
        assert [p for p in firsts if p in acked] == acked
    finally:
        g.stop()
        rocketmq.stop_broker("broker-r", signal.SIGKILL)  # done with: no graceful stop


def test_sync_mode_on_an_async_flush_broker_warns(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    g = ServeProcess(
        tmp_path / "data",
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, "--flush", "sync",
        env={"LMQTT_ROCKETMQ_TOPIC": f"t{uuid.uuid4().hex[:8]}"},
    )  # fmt: skip
    try:
        g.start()
        assert any("flushDiskType=ASYNC_FLUSH" in line for line in g.output), g.output
    finally:
        g.stop()


def test_sync_flush_broker_that_dispatches_only_flushed_messages_is_warned_about(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    """broker-b (SYNC_FLUSH) runs with readUnCommitted=true (a gateway on it says nothing:
    the SIGKILL test above); switched to the broker's default (false) at run time, a gateway
    started on it warns (deliveries would wait for the flush, its reput thread spins between
    flushes)."""

    async def set_read_uncommitted(value: str) -> None:
        async with rocketmq.client() as client:
            await update_broker_config(
                client, rocketmq.brokers["broker-b"], {"readUnCommitted": value}
            )

    def start() -> ServeProcess:
        return ServeProcess(
            tmp_path / uuid.uuid4().hex[:8],
            "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, "--flush", "sync",
            env={
                "LMQTT_ROCKETMQ_TOPIC": f"t{uuid.uuid4().hex[:8]}",
                "LMQTT_ROCKETMQ_BROKER": "broker-b",
            },
        ).start()  # fmt: skip

    asyncio.run(set_read_uncommitted("false"))
    try:
        g = start()
        try:
            assert any(
                "flushDiskType=SYNC_FLUSH and readUnCommitted=false" in line for line in g.output
            ), g.output
        finally:
            g.stop()
    finally:
        asyncio.run(set_read_uncommitted("true"))


def test_sessions_live_in_rocketmq_a_gateway_with_a_wiped_data_dir_resumes_them(
    serve: ServeProcess, clients: list[Client]
) -> None:
    """The session state log is the %STATE% light queue: a gateway started with an empty data
    directory knows the persistent session, its subscription and its position."""
    import shutil

    keeper = Client(serve.port, "keeper", v5=True, clean=False, session_expiry=3600)
    clients.append(keeper)
    keeper.subscribe("w/+/t", 1)
    keeper.disconnect()
    pub = Client(serve.port, "pub")
    clients.append(pub)
    for i in range(10):
        pub.publish("w/1/t", f"before {i}", 1)
    pub.disconnect()
    serve.stop()
    shutil.rmtree(serve.data_dir)
    serve.start()
    assert any("state:" in line and "live" in line for line in serve.output), serve.output
    pub = Client(serve.port, "pub")
    clients.append(pub)
    for i in range(10):
        pub.publish("w/2/t", f"after {i}", 1)  # routed: the filter registry came back too
    keeper.port = serve.port
    keeper.connect()
    assert keeper.connack == (True, 0)
    msgs = keeper.wait_messages(20)
    assert [bytes(m.payload) for m in msgs] == [f"before {i}".encode() for i in range(10)] + [
        f"after {i}".encode() for i in range(10)
    ]


def test_state_compaction_bounds_the_replay_and_keeps_every_session(
    rocketmq: RocketMQCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from gateway.storage.rocketmq import state as rocketmq_state
    from gateway.storage.rocketmq.adapter import RocketMqStorage
    from tests.gateway.conftest import GatewayHarness

    # No compaction by the gateway's own housekeeping (every second) while the history grows:
    # on a slow host one could run before `before` is read. The test compacts below.
    monkeypatch.setattr(rocketmq_state, "STATE_COMPACT_SLACK", 10**9)
    h = GatewayHarness(
        tmp_path / "data",
        store="rocketmq",
        namesrv=rocketmq.namesrv_addr,
        rocketmq_topic=f"t{uuid.uuid4().hex[:12]}",
    ).start()
    try:
        for i in range(5):
            c = Client(h.port, f"dev-{i}", clean=False)
            c.subscribe(f"cmp/{i}", 1)
            for j in range(3):  # each SUBSCRIBE saves the session record again
                c.subscribe(f"cmp/{i}/{j}", 1)
            c.disconnect()

        def history() -> int:
            store = h.gw.store if h.gw is not None else None
            assert isinstance(store, RocketMqStorage)
            return store._state_log.history

        def live() -> int:
            assert h.gw is not None
            return len(list(h.gw.store.state_records()))

        before = h.call(history)
        assert before > 2 * h.call(live)
        assert h.gw is not None
        monkeypatch.setattr(rocketmq_state, "STATE_COMPACT_SLACK", 0)
        h.run(h.gw.store.compact_state())
        assert h.call(history) == h.call(live)
        h.stop()
        shutil.rmtree(h.data_dir)
        h.start()
        # The replay read the snapshot (and at most what the queue's end lagged behind).
        assert h.call(history) < before
        for i in range(5):
            c = Client(h.port, f"dev-{i}", clean=False)
            assert c.connack == (True, 0)
            pub = Client(h.port, "pub")
            pub.publish(f"cmp/{i}/2", b"x", 1)
            assert [m.topic for m in c.wait_messages(1)] == [f"cmp/{i}/2"]
            c.disconnect()
            pub.disconnect()
    finally:
        h.stop()


def test_shared_group_resumes_at_its_position_after_a_restart(
    serve: ServeProcess, clients: list[Client]
) -> None:
    """A shared group's position survives a gateway restart: nothing it already delivered
    comes again, what was published while the gateway was away does."""
    member = Client(serve.port, "member", v5=True, clean=False, session_expiry=3600)
    clients.append(member)
    member.subscribe("$share/g/sh/#", 1)
    pub = Client(serve.port, "pub")
    clients.append(pub)
    for i in range(5):
        pub.publish("sh/1", f"old {i}", 1)
    assert [bytes(m.payload) for m in member.wait_messages(5)] == [
        f"old {i}".encode() for i in range(5)
    ]
    member.disconnect()
    pub.disconnect()
    serve.restart()
    pub = Client(serve.port, "pub")
    clients.append(pub)
    pub.publish("sh/1", "new", 1)
    member.port = serve.port
    member.messages.clear()
    member.connect()
    assert [bytes(m.payload) for m in member.wait_messages(1)] == [b"new"]
    pub.publish("sh/1", "marker", 1)
    assert [bytes(m.payload) for m in member.wait_messages(2)] == [b"new", b"marker"]


def test_a_deployment_stays_on_the_broker_that_holds_its_topic(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """Without `rocketmq_broker`, a gateway picks the broker the deployment's parent topic is
    already on (its route), not the first registered by name: a deployment started on
    broker-b (named then) is found there again once the setting is gone, as after a broker
    whose name sorts first joined the cluster; its session and backlog resume."""
    topic = f"t{uuid.uuid4().hex[:12]}"
    data = tmp_path / "data"
    first = ServeProcess(
        data, "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
        env={"LMQTT_ROCKETMQ_TOPIC": topic, "LMQTT_ROCKETMQ_BROKER": "broker-b"},
    )  # fmt: skip
    first.start()
    try:
        keeper = Client(first.port, "keeper", v5=True, clean=False, session_expiry=3600)
        clients.append(keeper)
        keeper.subscribe("h/#", 1)
        keeper.disconnect()
        pub = Client(first.port, "pub")
        clients.append(pub)
        for i in range(5):
            pub.publish("h/1", f"m{i}", 1)
        pub.disconnect()
    finally:
        first.stop()

    async def route_brokers() -> list[str]:
        async with RemotingClient([rocketmq.namesrv_addr]) as c:
            return (await c.get_route(topic)).readable_brokers()

    assert asyncio.run(route_brokers()) == ["broker-b"]
    again = ServeProcess(
        data, "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
        env={"LMQTT_ROCKETMQ_TOPIC": topic},
    )  # fmt: skip
    again.start()
    try:
        assert any("broker-b" in line and "storage:" in line for line in again.output), again.output
        keeper.port = again.port
        keeper.connect()
        assert keeper.connack == (True, 0)
        msgs = keeper.wait_messages(5)
        assert [bytes(m.payload) for m in msgs] == [f"m{i}".encode() for i in range(5)]
    finally:
        again.stop()
    assert asyncio.run(route_brokers()) == ["broker-b"]  # nothing created on broker-a


def test_a_topic_on_several_brokers_is_served_from_the_first_with_a_warning(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """A parent topic already on both brokers (e.g. runs with different `rocketmq_broker`s):
    the gateway stores on the first by name and says that the other's data is not read."""
    topic = f"t{uuid.uuid4().hex[:12]}"

    async def create_on_both() -> list[str]:
        async with RemotingClient([rocketmq.namesrv_addr]) as c:
            for addr in rocketmq.brokers.values():
                await create_topic(c, addr, topic, queues=1)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with contextlib.suppress(TopicNotExistError):
                    found = (await c.get_route(topic)).readable_brokers()
                    if len(found) == 2:
                        return found
                await asyncio.sleep(0.1)
            raise AssertionError("the route never listed both brokers")

    assert asyncio.run(create_on_both()) == ["broker-a", "broker-b"]
    g = ServeProcess(
        tmp_path / "data", "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
        env={"LMQTT_ROCKETMQ_TOPIC": topic},
    )  # fmt: skip
    g.start()
    try:
        warned = [line for line in g.output if "also on broker(s) broker-b" in line]
        assert warned and "stores on and reads broker-a only" in warned[0], g.output
        assert any("storage: RocketMQ broker broker-a" in line for line in g.output), g.output
        sub = Client(g.port, "sub")
        clients.append(sub)
        sub.subscribe("s/#", 1)
        pub = Client(g.port, "pub")
        clients.append(pub)
        pub.publish("s/1", "x", 1)
        assert [bytes(m.payload) for m in sub.wait_messages(1)] == [b"x"]
    finally:
        g.stop()
