"""rocketmq_remoting against a real RocketMQ 5.3.3 cluster (name server + two brokers).

The cluster is the session fixture ``rocketmq`` (conftest.py); every test opens its own client
and uses queue names of its own, so the tests share one cluster without seeing each other.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from rocketmq_remoting import (
    OffsetMovedError,
    PullResult,
    RemotingClient,
    RemotingClosedError,
    RemotingTimeoutError,
    ResponseCode,
    TopicNotExistError,
    broker_for,
)
from rocketmq_remoting.admin import create_topic, get_broker_config
from rocketmq_remoting.codes import RequestCode
from rocketmq_remoting.command import RemotingCommand
from tests.rocketmq.cluster import CLUSTER_NAME, RocketMQCluster, dispatched, eventually

# The first test also waits for the cluster to start (20-30 s on a loaded host; more on a cold
# one), so the per-test limit is raised for this module.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GROUP_PREFIX = "%LMQ%"


def _name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def client(rocketmq: RocketMQCluster) -> AsyncIterator[RemotingClient]:
    async with rocketmq.client(request_timeout=5.0) as c:
        yield c


@pytest.fixture
def broker_a(rocketmq: RocketMQCluster) -> str:
    return rocketmq.brokers["broker-a"]


async def _parent(client: RemotingClient, broker: str) -> str:
    topic = _name("lmqtt-parent-")
    await create_topic(client, broker, topic, queues=1)
    return topic


async def test_cluster_info_and_route_lookup(
    client: RemotingClient, rocketmq: RocketMQCluster
) -> None:
    info = await client.get_cluster_info()
    assert info.clusters[CLUSTER_NAME] == ["broker-a", "broker-b"]
    for name, addr in rocketmq.brokers.items():
        assert info.brokers[name].master_addr == addr

    topic = _name("lmqtt-route-")
    for addr in rocketmq.brokers.values():
        await create_topic(client, addr, topic, queues=2)

    async def both_brokers_listed() -> bool:
        try:
            route = await client.get_route(topic)
        except TopicNotExistError:
            return False
        return len(route.master_addrs()) == 2

    await eventually(both_brokers_listed)
    route = await client.get_route(topic)
    assert route.master_addrs() == rocketmq.brokers
    assert sorted((q.broker_name, q.read_queue_nums, q.write_queue_nums) for q in route.queues) == [
        ("broker-a", 2, 2),
        ("broker-b", 2, 2),
    ]

    with pytest.raises(TopicNotExistError) as missing:
        await client.get_route(_name("lmqtt-nowhere-"))
    assert missing.value.code == ResponseCode.TOPIC_NOT_EXIST
    assert missing.value.remark and "No topic route info" in missing.value.remark


async def test_name_server_json_quirk_integer_keys(
    client: RemotingClient, rocketmq: RocketMQCluster, broker_a: str
) -> None:
    """Without acceptStandardJsonOnly and with an old version, brokerAddrs keys are bare ints."""
    topic = await _parent(client, broker_a)

    async def routed() -> bool:
        try:
            await client.get_route(topic)
        except TopicNotExistError:
            return False
        return True

    await eventually(routed)
    conn = await client.connection(rocketmq.namesrv_addr)
    old = await conn.request(
        RemotingCommand(
            code=RequestCode.GET_ROUTEINFO_BY_TOPIC, ext_fields={"topic": topic}, version=400
        ),
        5.0,
    )
    assert old.code == ResponseCode.SUCCESS
    assert b'"brokerAddrs":{0:"' in old.body
    standard = await conn.request(
        RemotingCommand(
            code=RequestCode.GET_ROUTEINFO_BY_TOPIC,
            ext_fields={"topic": topic, "acceptStandardJsonOnly": "true"},
            version=400,
        ),
        5.0,
    )
    assert b'"brokerAddrs":{"0":"' in standard.body
    cluster = await conn.request(RemotingCommand(code=RequestCode.GET_BROKER_CLUSTER_INFO), 5.0)
    assert b'"brokerAddrs":{0:"' in cluster.body  # no opt-out here: parsed leniently


async def test_send_dispatches_to_light_queues_at_recorded_offsets(
    client: RemotingClient, broker_a: str
) -> None:
    parent = await _parent(client, broker_a)
    lmq_x, lmq_y = _name("%LMQ%x-"), _name("%LMQ%y-")
    assert await client.get_max_offset(broker_a, lmq_x) == 0

    # y already holds two messages, so the same message sits at different offsets in x and y.
    for i in range(2):
        await client.send_message(broker_a, parent, f"y-only {i}".encode(), light_queues=[lmq_y])
    sent = []
    for i in range(3):
        result = await client.send_message(
            broker_a, parent, f"both {i}".encode(), light_queues=[lmq_x, lmq_y]
        )
        assert result.ok and result.queue_id == 0
        sent.append(result)
    assert [r.queue_offset for r in sent] == [2, 3, 4]  # offsets in the parent queue

    await dispatched(client, broker_a, lmq_x, 3)
    await dispatched(client, broker_a, lmq_y, 5)
    assert await client.get_max_offset(broker_a, lmq_x) == 3
    assert await client.get_max_offset(broker_a, lmq_y) == 5
    assert await client.get_min_offset(broker_a, lmq_x) == 0

    got_x = await client.pull(broker_a, lmq_x, 0, consumer_group=_name(GROUP_PREFIX))
    assert got_x.found and got_x.next_begin_offset == 3 and got_x.max_offset == 3
    assert [m.body for m in got_x.messages] == [b"both 0", b"both 1", b"both 2"]
    assert [m.msg_id for m in got_x.messages] == [r.msg_id for r in sent]
    got_y = await client.pull(broker_a, lmq_y, 2, consumer_group=_name(GROUP_PREFIX))
    assert [m.body for m in got_y.messages] == [b"both 0", b"both 1", b"both 2"]
    for i, (mx, my) in enumerate(zip(got_x.messages, got_y.messages, strict=True)):
        # One stored record, indexed twice: the offsets the broker recorded at append.
        assert mx.commitlog_offset == my.commitlog_offset
        assert mx.topic == parent and mx.queue_offset == 2 + i
        assert mx.light_queue_offsets() == {lmq_x: i, lmq_y: 2 + i}
        assert mx.properties["INNER_MULTI_DISPATCH"] == f"{lmq_x},{lmq_y}"


async def test_suspended_pull_is_woken_by_a_send(client: RemotingClient, broker_a: str) -> None:
    parent = await _parent(client, broker_a)
    lmq = _name("%LMQ%poll-")
    suspend = 20.0
    pull = asyncio.create_task(
        client.pull(broker_a, lmq, 0, consumer_group=_name(GROUP_PREFIX), suspend_timeout=suspend)
    )
    # The broker holds the pull: after a moment it is still unanswered (NOT_FOUND would have
    # come back at once without the suspend flag).
    await asyncio.sleep(0.5)
    assert not pull.done()
    sent_at = time.monotonic()
    # Same client, same connection: the held pull does not block the send behind it.
    await client.send_message(broker_a, parent, b"wake up", light_queues=[lmq])
    result = await asyncio.wait_for(pull, suspend)
    woke_after = time.monotonic() - sent_at
    assert result.found and [m.body for m in result.messages] == [b"wake up"]
    assert woke_after < 2.0, f"long poll answered {woke_after:.3f}s after the send"


async def test_a_pull_without_a_coroutine_is_held_woken_and_failed_by_a_drop(
    rocketmq: RocketMQCluster, broker_a: str
) -> None:
    """held_pull (the parent topic's tail after its first pull): on the broker's open
    connection the pull is held, answered by callback with the records a send brought (parsed
    as pull's: `wanted`, offsets), counted as held meanwhile; a dropped connection ends it with
    the error, and with no open connection nothing is sent."""
    async with rocketmq.client(request_timeout=5.0) as client:
        parent = await _parent(client, broker_a)
        lmq, other = _name("%LMQ%nowait-"), _name("%LMQ%other-")
        got: list[object] = []
        held = client.held_pull(
            broker_a,
            parent,
            got.append,
            consumer_group=_name(GROUP_PREFIX),
            max_messages=32,
            suspend_timeout=20.0,
            wanted={lmq},
        )
        pull = held.send

        start = await client.get_max_offset(broker_a, parent)
        assert pull(start)
        await asyncio.sleep(0.5)
        assert got == [] and client.held_pulls == 1  # held by the broker
        await client.send_message(broker_a, parent, b"skipped", light_queues=[other])
        await client.send_message(broker_a, parent, b"wanted", light_queues=[lmq])
        deadline = time.monotonic() + 15
        while not got:
            assert time.monotonic() < deadline, "held pull not answered"
            await asyncio.sleep(0.02)
        (res,) = got
        assert isinstance(res, PullResult) and res.found and client.held_pulls == 0
        # Woken by the first send or both: only the wanted record is decoded, if in the answer.
        assert [m.body for m in res.messages] in ([], [b"wanted"])
        assert res.next_begin_offset > start
        got.clear()
        assert pull(await client.get_max_offset(broker_a, parent))  # held: nothing comes
        conn = client.open_broker_connection(broker_a)
        assert conn is not None
        conn.close_nowait()
        await asyncio.sleep(0)
        assert len(got) == 1 and isinstance(got[0], RemotingClosedError)
        assert client.held_pulls == 0
        assert not pull(0)  # no open connection now: nothing sent (the caller uses pull)
        held.close()


async def test_suspended_pull_without_arrival_answers_not_found_at_timeout(
    client: RemotingClient, broker_a: str
) -> None:
    lmq = _name("%LMQ%idle-")
    started = time.monotonic()
    # The broker answers at its hold checker's next pass after the suspend time (every 5 s,
    # docs/rocketmq.md quirk 7), later on a loaded host: the client's default wait (suspend +
    # HOLD_CHECK_S + request timeout = 11 s) covers the hold; 20 s leaves room for the load.
    result = await client.pull(
        broker_a, lmq, 0, consumer_group=_name(GROUP_PREFIX), suspend_timeout=1.0, timeout=20.0
    )
    assert result.code == ResponseCode.PULL_NOT_FOUND and result.messages == []
    assert time.monotonic() - started >= 0.9


async def test_a_held_pull_started_after_a_hold_check_ends_not_found_not_in_a_timeout(
    rocketmq: RocketMQCluster, broker_a: str
) -> None:
    """The client waits for the broker's whole hold: a pull held on an idle queue is answered
    PULL_NOT_FOUND at the first hold check after its suspend time, which is up to 5 s
    (HOLD_CHECK_S) after it arrived. A pull sent right after a hold check (as a mirror's next
    held pull is, after an idle one ended) waits the longest, longer than suspend + request
    timeout, the client's wait before the fix (there: "no answer to request code 11")."""
    lmq = _name("%LMQ%idle-")
    group = _name(GROUP_PREFIX)
    async with rocketmq.client(request_timeout=0.5) as client:
        # Answered at the broker's next hold check: the pull after it starts just past one.
        first = await client.pull(broker_a, lmq, 0, consumer_group=group, suspend_timeout=0.001)
        assert first.code == ResponseCode.PULL_NOT_FOUND
        started = time.monotonic()
        result = await client.pull(broker_a, lmq, 0, consumer_group=group, suspend_timeout=1.0)
        held = time.monotonic() - started
    assert result.code == ResponseCode.PULL_NOT_FOUND and result.messages == []
    assert held > 1.0 + 0.5, f"answered after {held:.2f} s: not past suspend + request timeout"


async def test_consumer_offsets_per_lmq_group(client: RemotingClient, broker_a: str) -> None:
    lmq = _name("%LMQ%offsets-")
    group, other = _name(GROUP_PREFIX), _name(GROUP_PREFIX)
    assert await client.query_consumer_offset(broker_a, group, lmq) is None
    await client.update_consumer_offset(broker_a, group, lmq, 5)
    assert await client.query_consumer_offset(broker_a, group, lmq) == 5
    assert await client.query_consumer_offset(broker_a, other, lmq) is None
    await client.update_consumer_offset(broker_a, group, lmq, 7, oneway=True)

    async def committed() -> bool:
        return await client.query_consumer_offset(broker_a, group, lmq) == 7

    await eventually(committed)

    # A pull can commit the group's offset on the way (PULL_COMMIT_OFFSET).
    await client.pull(broker_a, lmq, 0, consumer_group=group, commit_offset=9)
    assert await client.query_consumer_offset(broker_a, group, lmq) == 9


async def test_search_offset_by_timestamp(client: RemotingClient, broker_a: str) -> None:
    parent = await _parent(client, broker_a)
    lmq = _name("%LMQ%time-")
    for i in range(3):
        await client.send_message(broker_a, parent, f"t{i}".encode(), light_queues=[lmq])
        await asyncio.sleep(0.05)  # distinct store timestamps (milliseconds)
    await dispatched(client, broker_a, lmq, 3)
    got = await client.pull(broker_a, lmq, 0, consumer_group=_name(GROUP_PREFIX))
    stamps = [m.store_timestamp for m in got.messages]
    assert len(stamps) == 3 and stamps == sorted(stamps) and len(set(stamps)) == 3
    assert await client.search_offset(broker_a, lmq, stamps[1]) == 1
    assert await client.search_offset(broker_a, lmq, stamps[1] + 1) == 2
    assert await client.search_offset(broker_a, lmq, stamps[0] - 60_000) == 0
    assert await client.search_offset(broker_a, lmq, stamps[2], boundary="upper") == 2


async def test_errors_carry_the_brokers_code_and_remark(
    client: RemotingClient, rocketmq: RocketMQCluster, broker_a: str
) -> None:
    broker_b = rocketmq.brokers["broker-b"]  # autoCreateTopicEnable=false
    missing = _name("lmqtt-missing-")
    with pytest.raises(TopicNotExistError) as sent:
        await client.send_message(broker_b, missing, b"x", light_queues=[_name("%LMQ%e-")])
    assert sent.value.code == ResponseCode.TOPIC_NOT_EXIST == 17
    assert sent.value.remark and missing in sent.value.remark

    with pytest.raises(TopicNotExistError) as pulled:
        await client.pull(broker_a, missing, 0, consumer_group=_name(GROUP_PREFIX))
    assert pulled.value.remark and missing in pulled.value.remark

    parent = await _parent(client, broker_a)
    lmq = _name("%LMQ%moved-")
    for i in range(2):
        await client.send_message(broker_a, parent, f"m{i}".encode(), light_queues=[lmq])

    await dispatched(client, broker_a, lmq, 2)
    with pytest.raises(OffsetMovedError) as moved:
        await client.pull(broker_a, lmq, 100, consumer_group=_name(GROUP_PREFIX))
    assert moved.value.code == ResponseCode.PULL_OFFSET_MOVED == 21
    assert moved.value.remark == "OFFSET_OVERFLOW_BADLY"
    assert (moved.value.min_offset, moved.value.max_offset) == (0, 2)
    # The offset just past the end is not "moved": it is where the next message will go.
    at_end = await client.pull(broker_a, lmq, 2, consumer_group=_name(GROUP_PREFIX))
    assert at_end.code == ResponseCode.PULL_NOT_FOUND and at_end.next_begin_offset == 2


async def test_pipelined_sends_on_one_connection(client: RemotingClient, broker_a: str) -> None:
    parent = await _parent(client, broker_a)
    lmq = _name("%LMQ%pipe-")
    results = await asyncio.gather(
        *(
            client.send_message(broker_a, parent, f"p{i}".encode(), light_queues=[lmq])
            for i in range(200)
        )
    )
    assert sorted(r.queue_offset for r in results) == list(range(200))
    assert len({id(c) for c in client._conns.values()}) == len(client._conns)
    assert (await client.connection(broker_a)).in_flight == 0

    await dispatched(client, broker_a, lmq, 200)


async def test_timeout_leaves_the_connection_usable(client: RemotingClient, broker_a: str) -> None:
    lmq = _name("%LMQ%slow-")
    conn = await client.connection(broker_a)
    with pytest.raises(RemotingTimeoutError):
        await client.pull(
            broker_a, lmq, 0, consumer_group=_name(GROUP_PREFIX), suspend_timeout=3.0, timeout=0.3
        )
    assert not conn.closed
    assert await client.get_max_offset(broker_a, lmq) == 0
    assert await client.connection(broker_a) is conn


async def test_reconnect_after_the_connection_drops(client: RemotingClient, broker_a: str) -> None:
    parent = await _parent(client, broker_a)
    lmq = _name("%LMQ%drop-")
    first = await client.connection(broker_a)
    held = asyncio.create_task(
        client.pull(broker_a, lmq, 0, consumer_group=_name(GROUP_PREFIX), suspend_timeout=20.0)
    )
    await asyncio.sleep(0.3)
    assert not held.done()
    assert first._transport is not None
    first._transport.abort()  # the TCP connection is reset under the in-flight pull
    with pytest.raises(RemotingClosedError):
        await asyncio.wait_for(held, 5.0)
    assert first.closed

    result = await client.send_message(broker_a, parent, b"after reconnect", light_queues=[lmq])
    assert result.ok
    second = await client.connection(broker_a)
    assert second is not first and not second.closed
    await dispatched(client, broker_a, lmq, 1)
    got = await client.pull(broker_a, lmq, 0, consumer_group=_name(GROUP_PREFIX))
    assert [m.body for m in got.messages] == [b"after reconnect"]


async def test_sync_flush_broker_acknowledges_after_the_flush(
    client: RemotingClient, rocketmq: RocketMQCluster
) -> None:
    broker_b = rocketmq.brokers["broker-b"]  # flushDiskType=SYNC_FLUSH
    parent = await _parent(client, broker_b)
    lmq = _name("%LMQ%sync-")
    results = await asyncio.gather(
        *(
            client.send_message(broker_b, parent, f"s{i}".encode(), light_queues=[lmq])
            for i in range(20)
        )
    )
    assert all(r.code == ResponseCode.SUCCESS for r in results)  # not FLUSH_DISK_TIMEOUT
    await dispatched(client, broker_b, lmq, 20)
    got = await client.pull(broker_b, lmq, 0, consumer_group=_name(GROUP_PREFIX))
    assert sorted(m.body for m in got.messages) == sorted(f"s{i}".encode() for i in range(20))


async def test_heartbeat_is_accepted(client: RemotingClient, rocketmq: RocketMQCluster) -> None:
    for addr in rocketmq.brokers.values():
        await client.heartbeat(addr)


async def test_connect_error_names_the_address() -> None:
    from rocketmq_remoting import RemotingConnectError
    from tests.rocketmq.cluster import namesrv_port

    addr = f"127.0.0.1:{namesrv_port()}"
    async with RemotingClient([addr], connect_timeout=1.0) as c:
        with pytest.raises(RemotingConnectError, match=addr):
            await c.get_cluster_info()


async def test_broker_config_says_how_the_broker_runs(
    client: RemotingClient, rocketmq: RocketMQCluster
) -> None:
    """GET_BROKER_CONFIG: Java properties text; `\\:` in the name server address unescaped."""
    config = await get_broker_config(client, rocketmq.brokers["broker-b"])
    assert config["brokerName"] == "broker-b"
    assert config["flushDiskType"] == "SYNC_FLUSH"
    assert config["enableLmq"] == config["enableMultiDispatch"] == "true"
    assert config["namesrvAddr"] == rocketmq.namesrv_addr
    config_a = await get_broker_config(client, rocketmq.brokers["broker-a"])
    assert config_a["flushDiskType"] == "ASYNC_FLUSH"


async def test_messages_spread_over_the_routes_brokers_and_each_indexes_its_own_light_queue(
    client: RemotingClient, rocketmq: RocketMQCluster
) -> None:
    """The premise of a deployment over several brokers (docs/rocketmq.md "Several brokers"):
    messages keyed by MQTT topic go to one broker each (`broker_for` over the parent topic's
    writable brokers), every broker's dispatch indexes what it stored into its OWN copy of a
    light queue (offsets 0.. on each), and a reader that pulls the queue from every broker
    gets each message once, each topic's messages in the order they were sent."""
    parent = _name("lmqtt-spread-")
    for addr in rocketmq.brokers.values():
        await create_topic(client, addr, parent, queues=1)

    async def both_writable() -> bool:
        try:
            return len((await client.get_route(parent)).writable_brokers()) == 2
        except TopicNotExistError:
            return False

    await eventually(both_writable)
    route = await client.get_route(parent)
    brokers = route.writable_brokers()
    assert brokers == ["broker-a", "broker-b"] and route.readable_brokers() == brokers
    addrs = route.master_addrs()

    lmq = _name("%LMQ%all-")  # a `#` subscriber's queue: every message is dispatched to it
    topics = [f"site/{i}/temp" for i in range(40)]
    homes = {t: broker_for(t.encode(), brokers) for t in topics}
    sends = []
    for n in range(3):
        for t in topics:
            sends.append(
                client.send_message(
                    addrs[homes[t]], parent, f"{t} {n}".encode(), light_queues=[lmq]
                )
            )
    # Pipelined, as the gateway sends; one connection per broker keeps each broker's order.
    results = await asyncio.gather(*sends)
    assert all(r.ok for r in results)
    per_broker = {b: sum(1 for t in topics if homes[t] == b) * 3 for b in brokers}
    assert all(count > 0 for count in per_broker.values()), per_broker
    for b, count in per_broker.items():
        await dispatched(client, addrs[b], lmq, count)
        assert await client.get_max_offset(addrs[b], lmq) == count  # its own offsets 0..count
        assert await client.get_max_offset(addrs[b], parent) == count

    got: dict[str, list[int]] = {}
    for b in brokers:
        offsets: list[int] = []
        while len(offsets) < per_broker[b]:  # the broker sends at most 32 per pull
            res = await client.pull(
                addrs[b], lmq, len(offsets), consumer_group=_name(GROUP_PREFIX), max_messages=64
            )
            assert res.messages
            for m in res.messages:
                offsets.append(m.light_queue_offsets()[lmq])
                topic, seq = m.body.decode().rsplit(" ", 1)
                assert homes[topic] == b
                got.setdefault(topic, []).append(int(seq))
        assert offsets == list(range(per_broker[b]))
    assert got == {t: [0, 1, 2] for t in topics}
