"""Cluster mode's wills across two losses (gateway/cluster/node_wills.py,
gateway/messages/will_log.py): real `lmqtt serve --store rocketmq` processes on the session's
real RocketMQ cluster, real MQTT clients, every condition waited for with a deadline.

The crash window: the leader published a lost node's will and was killed before the rewrite of
the session's record without the will was stored. No signal lands there reliably (the rewrite
follows the publication within microseconds), so the test leaves the log exactly as that kill
would: the will published for real by the leader, then the leader's own record with the will
still pending stored again as the newest (written as the leader, to the real state queue), and
the leader killed. The next leader must not publish the will a second time.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pydantic_core import from_json

from gateway.config import GatewaySettings
from gateway.session.registry import SESSION_KEY_PREFIX
from gateway.storage.embedded import open_storage
from gateway.storage.rocketmq.adapter import RocketMqStorage
from gateway.storage.rocketmq.start import open_rocketmq
from gateway.storage.rocketmq.state import NODE_PROPERTY
from tests.gateway.conftest import Client, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_gateway_rocketmq import ServeProcess
from topicmap.rocketmq import STATE_QUEUE, decode_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LEASE_S = 4.0
HEARTBEAT_S = 0.5


@pytest.fixture
def namespace() -> str:
    return f"w{uuid.uuid4().hex[:12]}"


@pytest.fixture
def made() -> Iterator[list[ServeProcess]]:
    out: list[ServeProcess] = []
    yield out
    for g in out:
        g.stop()


def _node(rocketmq: RocketMQCluster, root: Path, namespace: str, node_id: str) -> ServeProcess:
    return ServeProcess(
        root / node_id,
        "--store", "rocketmq", "--namesrv", rocketmq.namesrv_addr,
        env={
            "LMQTT_ROCKETMQ_TOPIC": namespace,
            "LMQTT_ROCKETMQ_BROKER": "broker-a",
            "LMQTT_CLUSTER": "true",
            "LMQTT_CLUSTER_LEASE": str(LEASE_S),
            "LMQTT_CLUSTER_HEARTBEAT": str(HEARTBEAT_S),
            "LMQTT_NODE_ID": node_id,
        },
    )  # fmt: skip


async def _stager(
    rocketmq: RocketMQCluster, root: Path, namespace: str, node: str
) -> RocketMqStorage:
    """A storage writing state records as `node` (for `_store_newest`)."""
    settings = GatewaySettings(
        data_dir=root / f"stager-{node}",
        store="rocketmq",
        namesrv=rocketmq.namesrv_addr,
        rocketmq_broker="broker-a",
        rocketmq_topic=namespace,
    )
    storage = await open_rocketmq(settings, open_storage(settings), node_id=node)
    assert isinstance(storage, RocketMqStorage)
    return storage


async def _store_newest(
    storage: RocketMqStorage, node: str, client_id: str, which: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Store again, as `node` (the stager's), the newest record of `client_id` that `node`
    wrote and `which` accepts: the log a kill before `node`'s next write of it leaves.
    Returns that record."""
    broker = storage._broker
    lmq = broker.names.lmq(STATE_QUEUE)
    hi = await broker.client.get_max_offset(broker.addr, lmq)
    key = SESSION_KEY_PREFIX + client_id
    found: bytes | None = None
    async for batch in broker.read(lmq, 0, hi):
        for rec in batch:
            if rec.properties.get(NODE_PROPERTY) != node:
                continue
            for k, value in decode_state(rec.body)[0]:
                if k == key and value is not None and which(from_json(value)):
                    found = value
    assert found is not None, f"{node}'s record of {client_id}"
    state = storage._state_log
    await state.wait_durable(state.append([(key, found)]))
    doc: dict[str, Any] = from_json(found)
    return doc


async def _close(storage: RocketMqStorage) -> None:
    storage.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _restore_pending_will(
    rocketmq: RocketMQCluster, root: Path, namespace: str, leader: str, client_id: str
) -> dict[str, Any]:
    """Store again, as `leader`, its takeover rewrite of `client_id` with the will pending."""
    storage = await _stager(rocketmq, root, namespace, leader)
    try:
        return await _store_newest(storage, leader, client_id, lambda d: bool(d.get("will")))
    finally:
        storage.close()


def test_a_will_published_by_a_leader_killed_before_its_rewrite_is_not_published_again(
    rocketmq: RocketMQCluster, tmp_path: Path, namespace: str, made: list[ServeProcess]
) -> None:
    """Node A (its client has a will) is killed; leader B publishes the will; the log is then
    left as if B had been killed before storing the rewrite without the will (see the module
    docstring), and B is killed. C, the next leader, finds the will pending in B's record and
    its id in the wills log: the watcher gets the will once, then the marker."""
    tag = uuid.uuid4().hex[:6]
    b_id, c_id, a_id = f"{tag}-1", f"{tag}-2", f"{tag}-3"  # the leader: the smallest live id
    b, c, a = (_node(rocketmq, tmp_path, namespace, n) for n in (b_id, c_id, a_id))
    made += [b, c, a]
    with ThreadPoolExecutor(3) as pool:  # started side by side: each start takes seconds
        list(pool.map(ServeProcess.start, made))
    clients: list[Client] = []
    try:
        watcher = Client(c.port, "dupwill-watcher")
        clients.append(watcher)
        assert watcher.subscribe("dupwill/#", 1) == [1]
        dev = Client(a.port, "dupwill-dev", clean=False, will=("dupwill/dev", b"gone", 1, False))
        clients.append(dev)
        a.stop(signal.SIGKILL)
        watcher.wait_messages(1, timeout=LEASE_S * 5)
        assert bytes(watcher.messages[0].payload) == b"gone"
        published = "publishing the will of 'dupwill-dev'"
        wait_until(lambda: any(published in line for line in b.output), 10, "B's will log line")
        record = asyncio.run(
            _restore_pending_will(rocketmq, tmp_path, namespace, b_id, "dupwill-dev")
        )
        assert record.get("will_due_ms") and record.get("disconnected_at_ms")
        b.stop(signal.SIGKILL)

        def settled() -> bool:
            return len(watcher.messages) >= 2 or any(
                "was published before its publisher was lost" in line for line in c.output
            )

        wait_until(settled, LEASE_S * 6, "C's handling of B's loss")
        marker = Client(c.port, "dupwill-marker")
        clients.append(marker)
        marker.publish("dupwill/marker", b"end", 1)
        wait_until(
            lambda: any(m.topic == "dupwill/marker" for m in watcher.messages), 10, "the marker"
        )
        assert [m.topic for m in watcher.messages] == ["dupwill/dev", "dupwill/marker"]
    finally:
        stop_clients(clients)


def test_a_will_its_node_published_before_dying_is_not_published_again(
    rocketmq: RocketMQCluster, tmp_path: Path, namespace: str, made: list[ServeProcess]
) -> None:
    """Node A publishes the will of a dropped connection (no delay) at once and is SIGKILLed
    right after; its record still saying connected with the will (the housekeeping pass that
    writes it disconnected may not have run: that record is stored again as A's newest, so the
    window is hit every time), leader B takes it over: the watcher gets the will once."""
    tag = uuid.uuid4().hex[:6]
    b_id, a_id = f"{tag}-1", f"{tag}-2"  # the leader: the smallest live id
    b, a = (_node(rocketmq, tmp_path, namespace, n) for n in (b_id, a_id))
    made += [b, a]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ServeProcess.start, made))
    clients: list[Client] = []
    loop = asyncio.new_event_loop()
    stager = loop.run_until_complete(_stager(rocketmq, tmp_path, namespace, a_id))
    try:
        watcher = Client(b.port, "oncewill-watcher")
        clients.append(watcher)
        assert watcher.subscribe("oncewill/#", 1) == [1]
        dev = Client(a.port, "oncewill-dev", clean=False, will=("oncewill/dev", b"gone", 1, False))
        dev.drop()  # no DISCONNECT: A publishes the will now
        watcher.wait_messages(1, timeout=10)
        a.stop(signal.SIGKILL)
        assert bytes(watcher.messages[0].payload) == b"gone"
        record = loop.run_until_complete(
            _store_newest(stager, a_id, "oncewill-dev", lambda d: d.get("will") is not None)
        )
        assert record.get("disconnected_at_ms") is None, "A's record from the CONNECT"

        def settled() -> bool:
            return len(watcher.messages) >= 2 or any(
                "was published before its publisher was lost" in line for line in b.output
            )

        wait_until(settled, LEASE_S * 6, "B's takeover of A's will")
        marker = Client(b.port, "oncewill-marker")
        clients.append(marker)
        marker.publish("oncewill/marker", b"end", 1)
        wait_until(
            lambda: any(m.topic == "oncewill/marker" for m in watcher.messages), 10, "the marker"
        )
        assert [m.topic for m in watcher.messages] == ["oncewill/dev", "oncewill/marker"]
    finally:
        loop.run_until_complete(_close(stager))
        loop.close()
        stop_clients(clients)
