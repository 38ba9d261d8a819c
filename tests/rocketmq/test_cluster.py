"""Cluster mode (gateway/cluster/node.py): several real `lmqtt serve --store rocketmq` processes on
one namespace of the session's real RocketMQ cluster, real MQTT clients (paho, and the raw client
for exact packets), every condition waited for with a deadline.

Each test gets its own namespace (`rocketmq_topic`), so its nodes see only each other.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.protocol import Connect, Disconnect, Publish, SubAck, Subscribe, Subscription, Will
from gateway.protocol import Properties as PProperties
from tests.gateway.conftest import Client, RawClient, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LEASE_S = 6.0
HEARTBEAT_S = 1.0
#: SUBSCRIBE on one node, PUBLISH on another right after each SUBACK, this many times.
GAP_ROUNDS = 1000
RACES = int(os.environ.get("LMQTT_TEST_RACES", "20"))

Nodes = Callable[[int], list[ServeProcess]]


@pytest.fixture
def nodes(rocketmq: RocketMQCluster, tmp_path: Path) -> Iterator[Nodes]:
    """`nodes(n)` starts n more cluster nodes on this test's namespace (broker-a)."""
    topic = f"c{uuid.uuid4().hex[:12]}"
    made: list[ServeProcess] = []

    def start(n: int) -> list[ServeProcess]:
        out = []
        for _ in range(n):
            g = ServeProcess(
                tmp_path / f"node{len(made)}",
                "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
                env={
                    "LMQTT_ROCKETMQ_TOPIC": topic,
                    "LMQTT_ROCKETMQ_BROKER": "broker-a",
                    "LMQTT_CLUSTER": "true",
                    "LMQTT_CLUSTER_LEASE": str(LEASE_S),
                    "LMQTT_CLUSTER_HEARTBEAT": str(HEARTBEAT_S),
                },
            )  # fmt: skip
            made.append(g)
            out.append(g.start())
        return out

    try:
        yield start
    finally:
        for g in made:
            if g.proc is not None and g.proc.poll() is None:
                g.proc.send_signal(signal.SIGCONT)  # a test may have stopped it
            g.stop()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def test_subscription_on_one_node_routes_publishes_of_another_with_no_gap(
    nodes: Nodes, clients: list[Client]
) -> None:
    """Point 1: a message published on node B the moment node A's SUBACK arrives reaches the
    subscriber, GAP_ROUNDS times over, each time through a filter new to the cluster."""
    a, b = nodes(2)
    sub = Client(a.port, "gap-sub")
    pub = Client(b.port, "gap-pub")
    clients += [sub, pub]
    topics: dict[int, str] = {}
    lock = threading.Lock()
    subacked: list[int] = []
    acked = threading.Condition(lock)
    published: list[mqtt.MQTTMessageInfo] = []

    def on_subscribe(c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
        # paho's network thread, the moment the SUBACK is read: publish on the other node.
        with lock:
            topic = topics[mid]
        published.append(pub.c.publish(topic, topic.encode(), 1))
        with acked:
            subacked.append(mid)
            acked.notify()

    sub.c.on_subscribe = on_subscribe
    for i in range(GAP_ROUNDS):
        # A new wildcard filter each round: its registration is what is under test.
        with lock:
            rc, mid = sub.c.subscribe(f"gap/{i}/+", 1)
            assert rc == mqtt.MQTT_ERR_SUCCESS and mid is not None
            topics[mid] = f"gap/{i}/x"
        # Woken by the SUBACK itself: a polling wait would add its interval to every round.
        with acked:

            def more(n: int = i) -> bool:
                return len(subacked) > n

            assert acked.wait_for(more, 10), f"timed out: SUBACK {i}"
    wait_until(lambda: all(p.is_published() for p in published), 120, "every PUBACK")
    sub.wait_messages(GAP_ROUNDS, timeout=120)
    got = sorted(bytes(m.payload).decode() for m in sub.messages)
    missing = sorted(set(topics.values()) - set(got))
    assert not missing, f"{len(missing)} of {GAP_ROUNDS} missed, e.g. {missing[:5]}"
    assert len(got) == GAP_ROUNDS  # and nothing twice


def test_a_node_that_joins_routes_to_the_filters_already_there(
    nodes: Nodes, clients: list[Client]
) -> None:
    """A node started after a subscription was made learns it before it takes clients."""
    (a,) = nodes(1)
    sub = Client(a.port, "early-sub")
    clients.append(sub)
    assert sub.subscribe("late/+/t", 1) == [1]
    (c,) = nodes(1)
    pub = Client(c.port, "late-pub")
    clients.append(pub)
    pub.publish("late/1/t", b"first", 1)
    assert [bytes(m.payload) for m in sub.wait_messages(1)] == [b"first"]


def test_same_client_id_on_another_node_takes_the_session_over(nodes: Nodes) -> None:
    """Point 3 (MQTT-3.1.4-3): connecting on node B closes the connection on node A with
    DISCONNECT 0x8E; the new connection stays."""
    a, b = nodes(2)
    first = RawClient(a.port, level=5)
    assert first.connect("dup").reason_code == 0
    second = RawClient(b.port, level=5)
    assert second.connect("dup").reason_code == 0
    ev = first.recv()
    assert isinstance(ev, Disconnect) and ev.reason_code == 0x8E
    assert first.is_closed()
    second.send(Subscribe(1, [Subscription("still/alive", 0)]))
    ack = second.recv()
    assert isinstance(ack, SubAck) and ack.reason_codes == [0]
    first.close()
    second.close()


def _watch(closed: dict[str, Any], name: str, raw: RawClient) -> None:
    """What `raw` reads next (None: closed), into closed[name]."""
    try:
        closed[name] = raw.recv(timeout=LEASE_S * 3)
    except TimeoutError:
        pass


def _wait_one(closed: dict[str, Any], cid: str) -> None:
    wait_until(lambda: len(closed) >= 1, what=f"{cid}: a takeover")


def test_racing_connects_on_two_nodes_leave_exactly_one_connection(nodes: Nodes) -> None:
    """Point 3, the race: the same id's CONNECTs sent to two nodes at once, 20 times: each
    time both are answered and exactly one connection is closed with 0x8E."""
    a, b = nodes(2)
    survivors = {"a": 0, "b": 0}
    for i in range(RACES):
        cid = f"race-{i}"
        ca, cb = RawClient(a.port, level=5), RawClient(b.port, level=5)
        for raw in (ca, cb):
            raw.send(Connect(5, cid, True, 60, properties=PProperties()))
        for raw in (ca, cb):
            ack = raw.recv()
            assert ack is not None and ack.reason_code == 0
        # Exactly one of them is told 0x8E and closed.
        closed: dict[str, Any] = {}
        threads = [
            threading.Thread(target=_watch, args=(closed, name, raw))
            for name, raw in (("a", ca), ("b", cb))
        ]
        for t in threads:
            t.start()
        _wait_one(closed, cid)
        (loser,) = closed
        ev = closed[loser]
        assert isinstance(ev, Disconnect) and ev.reason_code == 0x8E
        winner, wraw = ("b", cb) if loser == "a" else ("a", ca)
        # The survivor works, after its node has read both claims (its SUBSCRIBE's filter
        # registration is later in the cluster log than the claim that closed the loser).
        wraw.send(Subscribe(1, [Subscription(f"race/{i}/+", 0)]))
        for t in threads:
            t.join(LEASE_S * 3 + 5)
        assert isinstance(closed.get(winner), SubAck), closed
        survivors[winner] += 1
        ca.close()
        cb.close()
    assert sum(survivors.values()) == RACES


def test_wills_of_a_killed_node_are_published_by_a_survivor_in_time(
    nodes: Nodes, clients: list[Client]
) -> None:
    """Point 4: SIGKILL of node A; the wills of its clients (3.1.1 without delay, MQTT 5 with a
    2 s will delay) are published by node B within keep-alive x 1.5 (+ the will delay)."""
    a, b = nodes(2)
    keepalive = 10
    watcher = Client(b.port, "will-watcher")
    clients.append(watcher)
    assert watcher.subscribe("wills/#", 1) == [1]
    plain = Client(a.port, "dev-311", keepalive=keepalive, will=("wills/311", b"gone", 1, False))
    props = Properties(PacketTypes.WILLMESSAGE)
    props.WillDelayInterval = 2
    delayed = Client(
        a.port,
        "dev-5",
        v5=True,
        session_expiry=60,
        keepalive=keepalive,
        will=("wills/5", b"gone later", 1, False),
        will_props=props,
    )
    clients += [plain, delayed]
    killed = time.monotonic()
    a.stop(signal.SIGKILL)
    arrived: dict[str, float] = {}

    def seen() -> bool:
        for m in watcher.messages:
            arrived.setdefault(m.topic, time.monotonic() - killed)
        return len(arrived) >= 2

    wait_until(seen, keepalive * 1.5 + 2 + 10, "both wills")
    assert arrived["wills/311"] <= keepalive * 1.5, arrived
    assert 2.0 <= arrived["wills/5"] <= keepalive * 1.5 + 2, arrived
    assert sorted(bytes(m.payload) for m in watcher.messages) == [b"gone", b"gone later"]


def test_a_stalled_node_is_fenced_its_wills_taken_over_and_it_stops(
    nodes: Nodes, clients: list[Client]
) -> None:
    """Leases: node A stopped (SIGSTOP) longer than its lease is declared lost by B, which
    publishes A's client's will; resumed, A finds its own lease gone, refuses the PUBLISH
    waiting in its socket and exits with status 1."""
    a, b = nodes(2)
    watcher = Client(b.port, "fence-watcher")
    clients.append(watcher)
    assert watcher.subscribe("fence/#", 1) == [1]
    dev = RawClient(a.port, level=5)
    will = Publish(topic="fence/will", payload=b"stalled", qos=1)
    dev.send(
        Connect(
            5, "fence-dev", True, 60, properties=PProperties(),
            will=Will(topic=will.topic, payload=will.payload, qos=1, retain=False),
        )
    )  # fmt: skip
    assert dev.recv().reason_code == 0
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    watcher.wait_messages(1, timeout=LEASE_S * 4)
    assert bytes(watcher.messages[0].payload) == b"stalled"
    dev.send(Publish(topic="fence/late", payload=b"must not pass", qos=1, packet_id=7))
    a.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: a.proc is None or a.proc.poll() is not None, 30, "node A to stop")
    assert a.proc.poll() == 1
    assert any("fenced" in line for line in a.output), "".join(a.output)
    # The PUBLISH sent while A was stopped was never stored: only the will arrived.
    pub = Client(b.port, "fence-marker")
    clients.append(pub)
    pub.publish("fence/marker", b"end", 1)
    wait_until(lambda: len(watcher.messages) >= 2, what="the marker")
    assert [m.topic for m in watcher.messages] == ["fence/will", "fence/marker"]
    dev.close()


def test_a_joining_node_leaves_the_sessions_of_live_nodes_alone(
    nodes: Nodes, clients: list[Client]
) -> None:
    """A node that starts reads every session record of the namespace; those a live node wrote
    are that node's: adopted as copies (gateway/cluster/sessions.py), not restored as its own,
    their wills not taken for a crash's orphans."""
    (a,) = nodes(1)
    watcher = Client(a.port, "join-watcher")
    dev = Client(a.port, "join-dev", will=("join/will", b"not yet", 1, False))
    clients += [watcher, dev]
    assert watcher.subscribe("join/#", 1) == [1]
    (b,) = nodes(1)
    pub = Client(b.port, "join-pub")
    clients.append(pub)
    pub.publish("join/marker", b"after B started", 1)
    # A will published by B's start would be in the log before the marker.
    assert [m.topic for m in watcher.wait_messages(1)] == ["join/marker"]
    line = next(line for line in b.output if "sessions restored" in line)
    assert "0 sessions restored, 2 adopted from live nodes" in line, line
