"""A deployment's messages spread over both brokers of the test cluster (`rocketmq_spread`,
gateway/storage/rocketmq/spread.py): real `lmqtt serve --store rocketmq` processes, paho clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from analytics.rocketmq import Deployment, read_deployment
from gateway.protocol import PubAck, Publish
from rocketmq_remoting import RemotingClient
from rocketmq_remoting.route import broker_for
from tests.gateway.conftest import Client, RawClient, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ROOT, ServeProcess
from tests.rocketmq.test_report_brokers import _rows
from topicmap import queue_name
from topicmap.rocketmq import encode_lmq

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BROKERS = ["broker-a", "broker-b"]


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def spread_gateway(
    rocketmq: RocketMQCluster, data_dir: Path, topic: str, *args: str, **env: str
) -> ServeProcess:
    """A gateway whose home broker is broker-a, spreading messages over both brokers."""
    return ServeProcess(
        data_dir,
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr, *args,
        env={
            "LMQTT_ROCKETMQ_TOPIC": topic,
            "LMQTT_ROCKETMQ_BROKER": "broker-a",
            "LMQTT_ROCKETMQ_SPREAD": "1",
            **env,
        },
    )  # fmt: skip


def leave_after_acks(c: Client, g: ServeProcess, client_id: str) -> None:
    """`c` (client id `client_id`) disconnects after the PUBACKs it queued, and the gateway
    has read them: DISCONNECT follows them on the connection, and paho writes its queued
    packets from its network thread, so the thread is stopped only once the DISCONNECT is
    out.

    The caller first waits for everything the gateway will send `c` (a window it refilled):
    a socket closed with unread data sends RST, not FIN, and an RST makes the gateway's
    kernel drop what it had received and the gateway not yet read, PUBACKs and DISCONNECT
    included (on a loaded host the test then saw no DISCONNECT, and the acknowledged
    messages came again: a client's race, not the gateway's)."""
    c.c.disconnect()
    wait_until(lambda: c.disconnected is not None, what="paho's DISCONNECT")
    c.c.loop_stop()
    wait_until(
        lambda: any(f"'{client_id}' disconnected" in line for line in g.output),
        30,
        "the gateway to read the PUBACKs and the DISCONNECT",
    )


def broker_ends(rocketmq: RocketMQCluster, topic: str, tf: str) -> dict[str, int]:
    """GET_MAX_OFFSET of the light queue of filter `tf` on each broker."""
    lmq = encode_lmq(queue_name(tf), topic)

    async def read() -> dict[str, int]:
        async with RemotingClient([rocketmq.namesrv_addr]) as client:
            return {
                name: await client.get_max_offset(rocketmq.brokers[name], lmq) for name in BROKERS
            }

    return asyncio.run(read())


def topics_by_broker(topics: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name in BROKERS}
    for t in topics:
        out[broker_for(t.encode(), BROKERS)].append(t)
    return out


def received(c: Client) -> list[tuple[str, bytes]]:
    with c.lock:
        return [(m.topic, bytes(m.payload)) for m in c.messages]


def missing(c: Client, want: set[tuple[str, bytes]]) -> str:
    got = received(c)
    return f"{len(got)} received, missing {sorted(want - set(got))[:10]}"


def test_many_topics_land_on_both_brokers_each_delivered_once_in_topic_order_and_a_session_resumes_exactly(  # noqa: E501
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """40 topics, 5 messages each, QoS 1 and 2: both brokers hold a share (their copies of
    the wildcard's light queue add up to all of them); two wildcard subscribers get each
    message once, each topic's in publish order. A persistent session that acknowledged
    only some of them and went offline resumes after a gateway restart on a wiped data
    directory with exactly the rest: its in-flight messages of both brokers again, nothing
    it acknowledged, nothing lost, and what was published after the restart."""
    topic = f"t{uuid.uuid4().hex[:12]}"
    data = tmp_path / "data"
    g = spread_gateway(rocketmq, data, topic)
    try:
        g.start()
        assert any("spread over brokers broker-a, broker-b" in line for line in g.output)
        w1 = Client(g.port, "w1", clean=False)
        w2 = Client(g.port, "w2", v5=True)
        slow = Client(g.port, "slow", clean=False, auto_ack=False)
        clients.extend([w1, w2, slow])
        w1.subscribe("s/#", 1)
        w2.subscribe("s/+/x", 2)
        slow.subscribe("s/#", 1)
        names = [f"s/{i}/x" for i in range(40)]
        by_broker = topics_by_broker(names)
        assert all(by_broker.values()), by_broker  # the hash gives both brokers topics
        pub = Client(g.port, "pub")
        clients.append(pub)
        sent = [(t, f"{t} #{n}".encode()) for n in range(5) for t in names]
        infos = [pub.c.publish(t, p, 1 + (i & 1)) for i, (t, p) in enumerate(sent)]
        for info in infos:
            info.wait_for_publish(30)
        for c in (w1, w2):
            c.wait_messages(len(sent), 60)
            got = received(c)
            assert sorted(got) == sorted(sent)  # each once
            for t in names:
                assert [p for tt, p in got if tt == t] == [p for tt, p in sent if tt == t]
        ends = broker_ends(rocketmq, topic, "s/#")
        assert ends["broker-a"] > 0 and ends["broker-b"] > 0, ends
        assert sum(ends.values()) == len(sent), ends

        # `slow` has 100 in flight (the window); it acknowledges the first 60 and leaves.
        slow.wait_messages(100, 60)
        with slow.lock:
            first = list(slow.messages)
        for m in first[:60]:
            slow.c.ack(m.mid, m.qos)
        # The gateway reads the 60 PUBACKs and fills the window again: 60 more come, and
        # then nothing until `slow` acknowledges (see leave_after_acks). 100 stay in flight.
        first = slow.wait_messages(160, 60)
        acked = {(m.topic, bytes(m.payload)) for m in first[:60]}
        unacked = {(m.topic, bytes(m.payload)) for m in first[60:]}
        assert len(unacked) == 100
        assert {broker_for(t.encode(), BROKERS) for t, _ in unacked} == set(BROKERS)
        leave_after_acks(slow, g, "slow")
        g.stop()
        shutil.rmtree(data)
        g.start()
        slow2 = Client(g.port, "slow", clean=False, connect=False)
        clients.append(slow2)
        slow2.connect()
        pub2 = Client(g.port, "pub2")
        clients.append(pub2)
        later = [(t, f"{t} later".encode()) for t in names[:10]]
        for t, p in later:
            pub2.publish(t, p, 1)
        want = (set(sent) - acked) | set(later)
        try:
            wait_until(lambda: len(received(slow2)) >= len(want), 60)
        except AssertionError:
            raise AssertionError(missing(slow2, want)) from None
        got2 = received(slow2)
        again = [m for m in got2 if m in acked]
        twice = [m for m in set(got2) if got2.count(m) > 1]
        assert not again, f"{len(again)} acknowledged again, {len(got2)} received: {again[:5]}"
        assert not twice, f"{len(twice)} received twice: {twice[:5]}, {got2.index(twice[0])}"
        assert len(got2) == len(want) and set(got2) == want
        assert unacked <= set(got2[: len(unacked)])  # the in-flight ones first, again
        for t in names:
            mine = [p for tt, p in got2 if tt == t]
            assert mine == sorted(mine, key=lambda p: (p.endswith(b"later"), p))
    finally:
        g.stop()


def test_sync_mode_replay_retained_export_and_sigkill_over_both_brokers(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """`--flush sync` with history on both brokers: `$replay/earliest/h/#` hands over every
    message in store-time order (one history queue per broker, merged), then the live ones,
    each once; retained messages of topics on both brokers reach a new subscriber; a SIGKILL
    of the gateway right after the last PUBACK loses none of the acknowledged messages of
    either broker (an offline persistent session gets them all from the next gateway, each
    topic in order); `lmqtt replay` exports the history in the same order."""
    topic = f"t{uuid.uuid4().hex[:12]}"
    g = spread_gateway(rocketmq, tmp_path / "data", topic, "--flush", "sync")
    try:
        g.start()
        keeper = Client(g.port, "keeper", clean=False)
        clients.append(keeper)
        keeper.subscribe("h/#", 1)
        keeper.disconnect()
        pub = Client(g.port, "pub")
        clients.append(pub)
        names = [f"h/{i}" for i in range(10)]
        assert all(topics_by_broker(names).values())
        history: list[tuple[str, bytes]] = []
        for n in range(4):
            for t in names:
                history.append((t, f"{t} {n}".encode()))
                # Sync mode: the PUBACK follows SEND_OK; a tick of the clock between two
                # publishes orders their store times.
                pub.publish(t, history[-1][1], 1, retain=n == 3)
                now = time.time()
                wait_until(lambda now=now: time.time() > now + 0.002, what="the clock")  # type: ignore[misc]
        replayer = Client(g.port, "replayer", v5=True)
        clients.append(replayer)
        replayer.subscribe("$replay/earliest/h/#", 1)
        live = [(t, f"{t} live".encode()) for t in names]
        for t, p in live:
            pub.publish(t, p, 1)
        replayer.wait_messages(len(history) + len(live), 60)
        got = received(replayer)
        assert got[: len(history)] == history
        assert sorted(got[len(history) :]) == sorted(live)

        fresh = Client(g.port, "fresh")
        clients.append(fresh)
        fresh.subscribe("h/#", 1)
        fresh.wait_messages(len(names))
        with fresh.lock:
            kept = sorted((m.topic, bytes(m.payload)) for m in fresh.messages if m.retain)
        assert kept == sorted((t, f"{t} 3".encode()) for t in names)

        assert g.stop(signal.SIGKILL) == -signal.SIGKILL
        g.start()
        keeper.port = g.port
        keeper.connect()
        sent = history + live
        keeper.wait_messages(len(sent), 60)
        got = received(keeper)
        assert sorted(got) == sorted(sent)
        for t in names:
            assert [p for tt, p in got if tt == t] == [p for tt, p in sent if tt == t]
    finally:
        stop_clients(clients)
        g.stop()
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", "--store", "rocketmq", "--namesrv",
         rocketmq.namesrv_addr, "--rocketmq-topic", topic, "--filter", "h/#", "--since",
         "earliest"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(row["topic"], row["payload"].encode()) for row in rows[: len(history)]] == history
    assert len(rows) == len(history) + len(live)


def test_two_cluster_nodes_with_spread(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """Cluster mode with spread on: a persistent wildcard subscriber on node 0 gets what a
    publisher on node 1 sends to topics on both brokers, each once and in topic order; it
    moves to node 1 with messages waiting and gets exactly the rest there."""
    topic = f"c{uuid.uuid4().hex[:12]}"
    env = {"LMQTT_CLUSTER": "true", "LMQTT_CLUSTER_LEASE": "6", "LMQTT_CLUSTER_HEARTBEAT": "1"}
    nodes = [spread_gateway(rocketmq, tmp_path / f"node{i}", topic, **env) for i in range(2)]
    try:
        for n in nodes:
            n.start()
        sub = Client(nodes[0].port, "roamer", clean=False)
        clients.append(sub)
        sub.subscribe("n/#", 1)
        pub = Client(nodes[1].port, "pub")
        clients.append(pub)
        names = [f"n/{i}" for i in range(12)]
        assert all(topics_by_broker(names).values())
        first = [(t, f"{t} {k}".encode()) for k in range(3) for t in names]
        for t, p in first:
            pub.publish(t, p, 1)
        sub.wait_messages(len(first), 60)
        sub.disconnect()
        later = [(t, f"{t} {k}".encode()) for k in range(3, 5) for t in names]
        for t, p in later:
            pub.publish(t, p, 1)
        moved = Client(nodes[1].port, "roamer", clean=False, connect=False)
        clients.append(moved)
        moved.connect()
        moved.wait_messages(len(later), 60)
        assert sorted(received(sub)) == sorted(first)
        got = received(moved)
        assert sorted(got) == sorted(later)
        for t in names:
            assert [p for tt, p in received(sub) + got if tt == t] == [
                f"{t} {k}".encode() for k in range(5)
            ]
    finally:
        for n in nodes:
            n.stop()


def test_spread_survives_the_loss_of_a_broker_and_takes_its_topics_back_in_order(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client]
) -> None:
    """broker-b (of the session) is SIGKILLed under two `--flush sync` spread gateways, then
    started again on its store. Gateway `polled` (route poll 2 s) sees it gone at its next
    poll, gateway `sending` (route poll 10 min) at its first send to it: every PUBLISH of
    either is acknowledged with reason 0 at once, its topics now on broker-a. Once broker-b is
    back, `polled` sends its topics there again. A persistent subscriber gets every
    acknowledged message once, each topic in publish order (before, during and after the
    outage), and the fan-out report's reader counts each message once."""
    poll = 2.0
    topic = f"t{uuid.uuid4().hex[:12]}"
    polled = spread_gateway(
        rocketmq, tmp_path / "polled", topic, "--flush", "sync", LMQTT_ROCKETMQ_ROUTE_POLL=str(poll)
    )
    other = f"t{uuid.uuid4().hex[:12]}"
    sending = spread_gateway(
        rocketmq, tmp_path / "sending", other, "--flush", "sync", LMQTT_ROCKETMQ_ROUTE_POLL="600"
    )
    names = [f"f/{i}" for i in range(8)]
    on_b = topics_by_broker(names)["broker-b"]
    assert on_b and len(on_b) < len(names)
    addr = ""
    try:
        polled.start()
        sending.start()
        keepers = {}
        pubs = {}
        for g in (polled, sending):
            keeper = Client(g.port, "keeper", clean=False)
            clients.append(keeper)
            keeper.subscribe("f/#", 1)
            pub = RawClient(g.port, level=5)
            pub.connect("writer")
            keepers[g], pubs[g] = keeper, pub
        acked: dict[ServeProcess, list[tuple[str, bytes]]] = {polled: [], sending: []}
        pids = iter(range(1, 65536))

        def publish(g: ServeProcess, phase: str) -> None:
            for t in names:
                pid = next(pids)
                payload = f"{t} {phase}".encode()
                pubs[g].send(Publish(t, payload, qos=1, packet_id=pid))
                ack = pubs[g].recv_until(PubAck)
                assert (ack.packet_id, ack.reason_code) == (pid, 0), (t, phase, ack)
                acked[g].append((t, payload))

        for g in (polled, sending):
            publish(g, "before")
            keepers[g].wait_messages(len(names))
        addr = rocketmq.stop_broker("broker-b", signal.SIGKILL)
        lost = time.monotonic()
        publish(sending, "during")  # its first send to broker-b fails over at once
        assert any("broker broker-b does not answer" in line for line in sending.output)
        wait_until(
            lambda: any("broker broker-b is not registered" in line for line in polled.output),
            max(0.0, lost + 2 * poll - time.monotonic()),
            "the route poll to see broker-b gone",
        )
        publish(polled, "during")
        for g in (polled, sending):
            keepers[g].wait_messages(2 * len(names), 30)  # from broker-a, broker-b still away
        sending.stop()

        rocketmq.start_broker_again("broker-b", addr)
        addr = ""
        wait_until(
            lambda: any("broker broker-b is back" in line for line in polled.output),
            2 * poll + 5,
            "the route poll to see broker-b back",
        )
        publish(polled, "after")
        keeper = keepers[polled]
        want = acked[polled]
        wait_until(lambda: len(received(keeper)) >= len(want), 60)
        got = received(keeper)
        assert sorted(got) == sorted(want), missing(keeper, set(want))  # each once
        for t in names:
            assert [p for tt, p in got if tt == t] == [p for tt, p in want if tt == t], t
        ends = broker_ends(rocketmq, topic, "f/#")
        # The phase after the return went back to broker-b: its copy grew by its topics.
        assert ends["broker-b"] == len(on_b) * 2, ends
        assert ends["broker-a"] + ends["broker-b"] == len(want)
    finally:
        stop_clients(clients)
        polled.stop()
        sending.stop()
        if addr:
            rocketmq.start_broker_again("broker-b", addr)
    rows = _rows(read_deployment(Deployment(rocketmq.namesrv_addr, topic)).ranges)
    assert len(rows) == len(want)
