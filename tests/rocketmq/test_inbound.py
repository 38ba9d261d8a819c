"""RocketMQ applications and MQTT devices on one deployment, with the official Java client
(java/RocketApps.java): a producer's messages to the inbound topic
(gateway/storage/rocketmq/inbound.py, gateway/messages/inbound.py) reach MQTT subscribers on
every node; malformed ones land in the dead-letter topic; a node SIGKILLed while consuming loses
nothing; a native consumer with a SQL92 property filter reads one MQTT subtree of the parent
topic (docs/rocketmq-apps.md). Real `lmqtt serve` processes in cluster mode, real paho clients,
the session's real RocketMQ cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gateway.conftest import Client, paho_property, stop_clients, wait_until
from tests.rocketmq import java_apps
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ROOT, ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PRODUCER_GROUP = "command-service"
GOOD = [
    "open-{i}\tmqttTopic=cmd/dev1/valve\tmqttQos=1\tmqttPublisher=command-service\tsite=7"
    "\trequest={i}",
    "state\tmqttTopic=cmd/dev1/state\tmqttRetain=true\tmqttPublisher=command-service",
]
#: (body, properties): each must be dead-lettered, with the reason naming the property.
BAD = [
    ("bad-none", "other=1"),
    ("bad-wild", "mqttTopic=cmd/+/valve"),
    ("bad-dollar", "mqttTopic=$SYS/x"),
    ("bad-qos", "mqttTopic=cmd/dev1/valve\tmqttQos=3"),
    ("bad-long", "mqttTopic=" + "x" * 200),  # max_topic_length = MAX_TOPIC below
]
REPEAT = 3
MAX_TOPIC = 100


def _admin_port(node: ServeProcess) -> int:
    for line in node.output:
        m = re.match(r"lmqtt admin \(/metrics, /health\) on [^:]+:(\d+)", line)
        if m:
            return int(m.group(1))
    raise AssertionError("no admin line:\n" + "".join(node.output))


def metric(node: ServeProcess, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{_admin_port(node)}/metrics", timeout=5)
    for line in body.read().decode().splitlines():
        if line.startswith(f"lmqtt_{name} ") or line.startswith(f"lmqtt_{name}_total "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def start_nodes(rocketmq: RocketMQCluster, root: Path, topic: str, n: int) -> list[ServeProcess]:
    out = []
    for i in range(n):
        node = ServeProcess(
            root / f"node{i}",
            "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
            env={
                "LMQTT_ROCKETMQ_TOPIC": topic,
                "LMQTT_ROCKETMQ_BROKER": "broker-a",
                "LMQTT_CLUSTER": "true",
                "LMQTT_ADMIN_PORT": "0",
                "LMQTT_MAX_TOPIC_LENGTH": str(MAX_TOPIC),
                "LMQTT_ROCKETMQ_TOPIC_PROPERTY": "true",
            },
        )  # fmt: skip
        out.append(node.start())
    return out


def wait_shared(nodes: list[ServeProcess]) -> None:
    """Every node reads its share of the inbound topic's 4 queues, and no more (no queue read
    by two nodes): the consumer group is settled."""
    share = 4 // len(nodes)
    wait_until(
        lambda: all(metric(n, "inbound_queues") == share for n in nodes),
        30,
        "the inbound queues shared among the nodes",
    )


@dataclass
class Deployment:
    topic: str
    nodes: list[ServeProcess]
    clients: list[Client]
    sent: list[str]


@pytest.fixture(scope="module")
def deployment(
    rocketmq: RocketMQCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """Two nodes; on A a `cmd/+/valve` (MQTT 5) and a `#` subscriber, on B an exact one; then
    the Java producer's good and bad messages, sent once."""
    topic = f"i{uuid.uuid4().hex[:12]}"
    nodes = start_nodes(rocketmq, tmp_path_factory.mktemp("inbound"), topic, 2)
    clients: list[Client] = []
    try:
        a, b = nodes
        plus = Client(a.port, "plus", v5=True)
        everything = Client(a.port, "everything")
        exact = Client(b.port, "exact")
        clients += [plus, everything, exact]
        assert plus.subscribe("cmd/+/valve", 1) == [1]
        assert everything.subscribe("#", 1) == [1]
        assert exact.subscribe("cmd/dev1/valve", 2) == [2]
        wait_shared(nodes)
        lines = GOOD + [f"{body}\t{props}" for body, props in BAD]
        sent = java_apps.run(
            "send", rocketmq.namesrv_addr, f"{topic}-in", PRODUCER_GROUP, str(REPEAT), "0",
            stdin="\n".join(lines) + "\n",
        )  # fmt: skip
        assert sent[-1] == "DONE" and sum(s.startswith("SENT") for s in sent) == REPEAT * len(
            lines
        ), sent
        yield Deployment(topic, nodes, clients, sent)
    finally:
        stop_clients(clients)
        for node in nodes:
            node.stop()


def test_a_producers_messages_reach_wildcard_and_exact_subscribers_on_both_nodes(
    deployment: Deployment,
) -> None:
    plus, everything, exact = deployment.clients
    valves = [f"open-{i}".encode() for i in range(REPEAT)]
    # Exactly once each (the producer spreads its messages over the topic's queues, read by
    # both nodes: no order across them).
    for client, want in ((plus, valves), (exact, valves), (everything, [*valves, *[b"state"] * 3])):
        client.wait_messages(len(want))
        with client.lock:
            got = [bytes(m.payload) for m in client.messages if m.topic.startswith("cmd/dev1/")]
        assert sorted(got) == sorted(want), got
    m = {bytes(m.payload): m for m in plus.messages}[b"open-1"]
    assert m.topic == "cmd/dev1/valve" and m.qos == 1
    assert sorted(paho_property(m, "UserProperty")) == [("request", "1"), ("site", "7")]
    assert all(m.qos == 1 for m in exact.messages)  # min(publish 1, subscription 2)
    late = Client(deployment.nodes[1].port, "late")
    deployment.clients.append(late)
    late.subscribe("cmd/dev1/state", 1)
    (retained,) = late.wait_messages(1)
    assert retained.retain and bytes(retained.payload) == b"state"
    good = REPEAT * len(GOOD)
    wait_until(
        lambda: sum(metric(n, "inbound_consumed") for n in deployment.nodes) == good,
        10,
        "lmqtt_inbound_consumed",
    )
    assert not [p for p in everything.payloads() if p.startswith(b"bad-")]


def test_malformed_messages_land_in_the_dead_letter_topic(
    rocketmq: RocketMQCluster, deployment: Deployment
) -> None:
    bad = REPEAT * len(BAD)
    wait_until(
        lambda: sum(metric(n, "inbound_dead_lettered") for n in deployment.nodes) == bad,
        30,
        "lmqtt_inbound_dead_lettered",
    )

    async def read() -> list[tuple[bytes, dict[str, str]]]:
        async with rocketmq.client() as client:
            addr = rocketmq.brokers["broker-a"]
            result = await client.pull(
                addr, f"{deployment.topic}-dlq", 0, consumer_group="dlq-reader", queue_id=0,
                max_messages=64,
            )  # fmt: skip
            return [(r.body, r.properties) for r in result.messages]

    letters = asyncio.run(read())
    assert sorted(body for body, _ in letters) == sorted(
        body.encode() for body, _ in BAD for _ in range(REPEAT)
    )
    reasons = {body.decode(): props["lmqttDeadLetterReason"] for body, props in letters}
    assert reasons["bad-none"] == "no mqttTopic property"
    assert "wildcard" in reasons["bad-wild"]
    assert "$-topic" in reasons["bad-dollar"]
    assert "mqttQos '3'" in reasons["bad-qos"]
    assert f"200 bytes, over {MAX_TOPIC}" in reasons["bad-long"]
    _, props = letters[0]
    assert props["DLQ_ORIGIN_TOPIC"] == f"{deployment.topic}-in"


def test_replay_export_shows_inbound_messages_with_their_producer_group(
    rocketmq: RocketMQCluster, deployment: Deployment
) -> None:
    deployment.clients[0].wait_messages(REPEAT)
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", "--store", "rocketmq",
         "--namesrv", rocketmq.namesrv_addr, "--rocketmq-topic", deployment.topic,
         "--rocketmq-broker", "broker-a", "--filter", "cmd/#", "--since", "earliest"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert sorted(row["payload"] for row in rows) == sorted(
        [f"open-{i}" for i in range(REPEAT)] + ["state"] * REPEAT
    )
    assert {row["client_id"] for row in rows} == {f"rocketmq:{PRODUCER_GROUP}"}


def test_a_native_consumer_with_a_property_filter_reads_one_subtree(
    rocketmq: RocketMQCluster, deployment: Deployment
) -> None:
    """docs/rocketmq-apps.md's SQL92 filter: `site/7/#` out of the parent topic, nothing else
    (the others are published first, so the last wanted message is read after all of them)."""
    pub = Client(deployment.nodes[0].port, "site-publisher")
    deployment.clients.append(pub)
    for t in ("site/8/a", "site/70/x", "other/site/7/a", "site/7x"):
        pub.publish(t, t.encode(), 1)
    for t in ("site/7", "site/7/a/b"):
        pub.publish(t, t.encode(), 1)
    lines = java_apps.run(
        "filter", rocketmq.namesrv_addr, deployment.topic, "site7-service",
        "mqttTopic = 'site/7' OR mqttTopic STARTSWITH 'site/7/'", "2", "60",
    )  # fmt: skip
    assert [line for line in lines if line.startswith("GOT")] == [
        "GOT site/7 site/7",
        "GOT site/7/a/b site/7/a/b",
    ], lines


def test_one_light_queue_read_directly_as_the_docs_show(
    rocketmq: RocketMQCluster, deployment: Deployment
) -> None:
    """docs/rocketmq-apps.md "One light queue directly": the light queue of `cmd/+/valve`
    (held by the subscriber `plus`) pulled from the broker holds exactly its messages."""
    from topicmap import Router
    from topicmap.rocketmq import encode_lmq

    deployment.clients[0].wait_messages(REPEAT)
    lmq = encode_lmq(Router().add("cmd/+/valve"), deployment.topic)

    async def pull() -> list[tuple[str, bytes]]:
        async with rocketmq.client() as client:
            route = await client.get_route(deployment.topic)
            addr = route.master_addrs()["broker-a"]
            result = await client.pull(addr, lmq, 0, consumer_group="%LMQ%my-service")
            return [(r.properties["mqtt.topic"], r.body) for r in result.messages]

    assert sorted(asyncio.run(pull())) == [
        ("cmd/dev1/valve", f"open-{i}".encode()) for i in range(REPEAT)
    ]


def test_the_shell_sender_commands_a_device(
    rocketmq: RocketMQCluster, deployment: Deployment
) -> None:
    """`python -m rocketmq_remoting send` (the compose profile's command service) to the
    inbound topic reaches a device subscribed on either node."""
    device = Client(deployment.nodes[1].port, "valve-1")
    deployment.clients.append(device)
    device.subscribe("cmd/valve-1/#", 1)
    r = subprocess.run(
        [sys.executable, "-m", "rocketmq_remoting", "send", "--namesrv", rocketmq.namesrv_addr,
         "--topic", f"{deployment.topic}-in", "--property", "mqttTopic=cmd/valve-1/open",
         "--property", "mqttQos=1", "90"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (m,) = device.wait_messages(1)
    assert (m.topic, bytes(m.payload), m.qos) == ("cmd/valve-1/open", b"90", 1)


def test_a_node_killed_while_consuming_loses_nothing(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    """SIGKILL node A while the producer sends and A consumes its half of the queues: B takes
    A's queues from the group's committed offsets, so every message reaches B's subscriber
    (at least once; what A stored after its last commit comes again)."""
    topic = f"k{uuid.uuid4().hex[:12]}"
    nodes = start_nodes(rocketmq, tmp_path, topic, 2)
    a, b = nodes
    clients: list[Client] = []
    producer: subprocess.Popen[str] | None = None
    n = 300
    try:
        sub = Client(b.port, "survivor-sub", v5=True, clean=False, session_expiry=600)
        clients.append(sub)
        assert sub.subscribe("cmd/#", 1) == [1]
        wait_shared(nodes)
        producer = java_apps.start(
            "send", rocketmq.namesrv_addr, f"{topic}-in", PRODUCER_GROUP, str(n), "10",
            stdin="m-{i}\tmqttTopic=cmd/dev{i}/x\tmqttQos=1\n",
        )  # fmt: skip
        sub.wait_messages(n // 5, 60)
        a_consumed = metric(a, "inbound_consumed")
        a.stop(signal.SIGKILL)
        assert a_consumed > 0  # A was consuming when it died
        assert producer.wait(120) == 0
        want = {f"m-{i}".encode() for i in range(n)}
        wait_until(lambda: want <= set(sub.payloads()), 60, "every message at B's subscriber")
        print(f"{len(sub.payloads()) - n} message(s) handled again after the kill")
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
        stop_clients(clients)
        for node in nodes:
            node.stop()
