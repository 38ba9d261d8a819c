"""Committed offsets on RocketMQ live on the broker: a gateway restarted with its data
directory wiped resumes shared subscription groups where their acknowledgements left them
(gateway/storage/rocketmq/offsets.py), and a mirror no subscription reads is released
(gateway/storage/rocketmq/mirrors.py). Real gateway processes, paho clients, the session's cluster.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rocketmq_remoting import RemotingClient
from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ServeProcess
from topicmap import queue_name
from topicmap.rocketmq import encode_lmq

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def _broker_offset(rocketmq: RocketMQCluster, group: str, lmq: str, want: int) -> int | None:
    """The broker's committed offset of `group` in `lmq`, polled until it is `want` (10 s)."""

    async def read() -> int | None:
        async with RemotingClient([rocketmq.namesrv_addr]) as client:
            deadline = time.monotonic() + 10
            committed = None
            while committed != want and time.monotonic() < deadline:
                committed = await client.query_consumer_offset(
                    rocketmq.brokers["broker-a"], group, lmq
                )
                await asyncio.sleep(0.1)
            return committed

    return asyncio.run(read())


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["graceful", "killed"])
def test_shared_group_resumes_from_the_broker_with_data_dir_wiped(
    rocketmq: RocketMQCluster, tmp_path: Path, clients: list[Client], stop: signal.Signals
) -> None:
    """30 messages to a shared group, the first 20 acknowledged; the gateway stops (or is
    killed once the broker has the group's offset) and starts again on an empty data
    directory: the group resumes at 20, so the member gets 20..29 again (never acknowledged)
    and 30..39 (published after the restart), and none of the 20 it acknowledged. A persistent
    session's own subscription resumes the same way: after the graceful stop from its session
    record, after the kill from the broker's offset where it is fresher than the record
    (which may predate the acknowledgements: gateway/session/model.py `behind`)."""
    topic = f"t{uuid.uuid4().hex[:12]}"
    data = tmp_path / "data"
    serve = ServeProcess(
        data,
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
        env={"LMQTT_ROCKETMQ_TOPIC": topic, "LMQTT_ROCKETMQ_BROKER": "broker-a"},
    ).start()  # fmt: skip
    try:
        member = Client(serve.port, "member", clean=False, auto_ack=False)
        pub = Client(serve.port, "pub")
        clients += [member, pub]
        own = Client(serve.port, "own", clean=False, auto_ack=False)
        clients.append(own)
        assert member.subscribe("$share/g/sh/t", 1) == [1]
        assert own.subscribe("sh/t", 1) == [1]
        for i in range(30):
            pub.publish("sh/t", f"m{i}", 1)
        msgs = member.wait_messages(30)
        assert [bytes(m.payload) for m in msgs] == [f"m{i}".encode() for i in range(30)]
        for m in msgs[:20]:
            member.c.ack(m.mid, m.qos)
        for m in own.wait_messages(30)[:20]:
            own.c.ack(m.mid, m.qos)
        group = encode_lmq("$share/g", topic)
        lmq = encode_lmq(queue_name("sh/t"), topic)
        assert _broker_offset(rocketmq, group, lmq, 20) == 20
        assert _broker_offset(rocketmq, encode_lmq("own", topic), lmq, 20) == 20
        pub.disconnect()
        assert serve.stop(stop) in (0, -signal.SIGKILL)
        member.drop()
        own.drop()
        shutil.rmtree(data)  # nothing of the first run is left on this machine

        serve.start()
        pub = Client(serve.port, "pub")
        clients.append(pub)
        for i in range(30, 40):
            pub.publish("sh/t", f"m{i}", 1)
        again = Client(serve.port, "member", clean=False)
        clients.append(again)
        assert again.connack == (True, 0)  # the session came back from the broker's %STATE%
        wait_until(
            lambda: {f"m{i}".encode() for i in range(20, 40)} <= set(again.payloads()),
            what="messages 20..39 after the restart",
        )
        got = again.payloads()
        assert not {f"m{i}".encode() for i in range(20)} & set(got), got  # acknowledged ones
        assert len(got) == len(set(got)), got  # each once
        own = Client(serve.port, "own", clean=False)
        clients.append(own)
        assert own.connack == (True, 0)
        wait_until(
            lambda: {f"m{i}".encode() for i in range(20, 40)} <= set(own.payloads()),
            what="the own subscription's messages 20..39 after the restart",
        )
        got = own.payloads()
        assert not {f"m{i}".encode() for i in range(20)} & set(got), got
    finally:
        serve.stop()
