"""A deployment's messages spread over both brokers of the test cluster (`rocketmq_spread`,
gateway/rocketmq_spread.py): real `lmqtt serve --store rocketmq` processes, paho clients.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rocketmq_remoting import RemotingClient
from rocketmq_remoting.route import broker_for
from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ServeProcess
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
        acked = {(m.topic, bytes(m.payload)) for m in first[:60]}
        unacked = {(m.topic, bytes(m.payload)) for m in first[60:]}
        assert {broker_for(t.encode(), BROKERS) for t, _ in unacked} == set(BROKERS)
        slow.disconnect()  # DISCONNECT follows the PUBACKs on the connection
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
        assert len(got2) == len(want) and set(got2) == want
        assert unacked <= set(got2[: len(unacked)])  # the in-flight ones first, again
        for t in names:
            mine = [p for tt, p in got2 if tt == t]
            assert mine == sorted(mine, key=lambda p: (p.endswith(b"later"), p))
    finally:
        g.stop()
