"""The fan-out report of a deployment spread over the two brokers of the session's real cluster
(analytics/rocketmq.py; docs/rocketmq.md "Several brokers").

The deployment is written here with the remoting client exactly as the gateway writes one: each
message to the parent topic on `broker_for(MQTT topic, writable brokers)` with its matching light
queues in INNER_MULTI_DISPATCH and the gateway's `mqtt.*` properties; the sessions as state
batches in the %STATE% queue of the home broker (broker-a): the broker slots (`meta/brokers`,
broker-a slot 0) and ONE subscription entry per light queue `Q` whose start/next offsets are
merged (topicmap/spread.py: the per-broker offsets packed, above 2**62), which the report
splits into its copies (`Q` on broker-a, `Q\\x00broker-b` on broker-b); committed offsets per
copy on the copy's broker. The expected numbers are simulated from what was sent, broker by
broker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
import pytest

from analytics.copies import copy_name, split_copy
from analytics.rocketmq import (
    Deployment,
    PullRange,
    Snapshot,
    plan_ranges,
    pull_batches,
    read_deployment,
)
from rocketmq_remoting import RemotingClient, TopicNotExistError, TopicRoute, broker_for
from rocketmq_remoting.admin import create_topic
from tests.rocketmq.cluster import RocketMQCluster
from topicmap.naming import queue_name
from topicmap.rocketmq import STATE_QUEUE, encode_lmq, encode_state
from topicmap.spread import SLOTS_KEY, encode

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.timeout(300)]

HOME = "broker-a"
#: device -> [(MQTT topic, messages)]: plant/1/* and plant/2/temp go to broker-a,
#: plant/3/temp, plant/4/temp and other/3 to broker-b (asserted below: broker_for is pinned).
TRAFFIC = {
    "dev-1": [("plant/1/temp", 6), ("plant/1/hum", 4)],
    "dev-2": [("plant/2/temp", 4), ("plant/3/temp", 5)],
    "dev-3": [("other/3", 3)],
    "dev-4": [("plant/4/temp", 2)],
}
FILTERS = {"sub-all": "plant/#", "sub-temp": "plant/+/temp"}
#: Where each subscription starts, per broker slot (broker-a, broker-b): sub-all subscribed
#: after broker-b's first message of its queue (dev-2's first plant/3/temp).
STARTS = {"sub-all": [0, 1], "sub-temp": [0, 0]}
#: Range size of the pruning test: several ranges per broker.
SMALL_RANGES = 3


def _matches(filt: str, topic: str) -> bool:
    f, t = filt.split("/"), topic.split("/")
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(t) or (level != "+" and level != t[i]):
            return False
    return len(f) == len(t)


@dataclass
class Sent:
    """What was written, and the offsets each broker's copies gave it (send order)."""

    topic: str
    brokers: list[str]
    messages: list[tuple[str, str, str]] = field(default_factory=list)  # device, topic, broker
    copies: dict[str, list[str]] = field(default_factory=dict)  # copy -> devices by offset
    committed: dict[tuple[str, str], int] = field(default_factory=dict)  # (subscriber, copy)


def _send_order() -> list[tuple[str, str]]:
    """Round-robin over (device, topic), so every broker has messages all along the run."""
    queues = [[(d, t)] * n for d, ts in TRAFFIC.items() for t, n in ts]
    out = []
    for i in range(max(len(q) for q in queues)):
        out += [q[i] for q in queues if i < len(q)]
    return out


async def _topic_on_both(
    client: RemotingClient, cluster: RocketMQCluster, topic: str
) -> TopicRoute:
    """`topic` created on both brokers; returns its route once the name server lists both
    as writable (their registrations come a moment after the creation)."""
    for addr in cluster.brokers.values():
        await create_topic(client, addr, topic, queues=1)
    deadline = time.monotonic() + 30
    while True:
        try:
            route = await client.get_route(topic)
            if len(route.writable_brokers()) == 2:
                return route
        except TopicNotExistError:
            pass
        assert time.monotonic() < deadline, "the topic never got both brokers"
        await asyncio.sleep(0.05)


async def _write_deployment(cluster: RocketMQCluster, topic: str) -> Sent:
    client = cluster.client()
    try:
        route = await _topic_on_both(client, cluster, topic)
        brokers = route.writable_brokers()
        addrs = route.master_addrs()
        sent = Sent(topic, brokers)
        queue_of = {sub: queue_name(f) for sub, f in FILTERS.items()}
        # The session records as the gateway writes them: one entry per light queue, its
        # offsets merged over the broker slots, numbered in `meta/brokers`.
        assert brokers[0] == HOME

        async def save_sessions(next_of: dict[str, list[int]], *extra: tuple[str, bytes]) -> None:
            sessions = {
                sub: {"disconnected_at_ms": None, "subscriptions": [
                    {"filter": filt, "queue": queue_of[sub], "share_group": None, "qos": 1,
                     "start_offset": encode(STARTS[sub]), "next_offset": encode(next_of[sub])}
                ]}
                for sub, filt in FILTERS.items()
            }  # fmt: skip
            records = [
                *extra,
                *((f"session/{k}", json.dumps(v).encode()) for k, v in sessions.items()),
            ]
            await client.send_message(
                addrs[HOME], topic, encode_state(records),
                light_queues=[encode_lmq(STATE_QUEUE, topic)],
            )  # fmt: skip

        await save_sessions(STARTS, (SLOTS_KEY, json.dumps(brokers).encode()))
        for device, mqtt_topic in _send_order():
            broker = broker_for(mqtt_topic.encode(), brokers)
            queues = [q for sub, q in queue_of.items() if _matches(FILTERS[sub], mqtt_topic)]
            res = await client.send_message(
                addrs[broker],
                topic,
                f"{device}:{mqtt_topic}".encode(),
                light_queues=[encode_lmq(q, topic) for q in queues],
                properties={"mqtt.topic": mqtt_topic, "mqtt.client": device, "mqtt.qos": "1"},
            )
            assert res.ok
            sent.messages.append((device, mqtt_topic, broker))
            for q in queues:
                sent.copies.setdefault(copy_name(q, broker, HOME), []).append(device)
            await asyncio.sleep(0.004)  # store timestamps spread over the run (pruning test)
        # sub-all got everything; sub-temp all of broker-a's copy and 2 of broker-b's. The
        # gateway commits each broker's component of the merged position on that broker, and
        # saves the session's read position (here: the same) merged.
        read: dict[str, list[int]] = {}
        for sub, q in queue_of.items():
            for b in brokers:
                copy = copy_name(q, b, HOME)
                done = len(sent.copies.get(copy, []))
                if sub == "sub-temp" and b != HOME:
                    done = 2
                sent.committed[(sub, copy)] = done
                read.setdefault(sub, []).append(done)
                await client.update_consumer_offset(
                    addrs[b], encode_lmq(sub, topic), encode_lmq(q, topic), done
                )
        await save_sessions(read)
        # The brokers index light queues right after the append (their dispatch thread).
        deadline = time.monotonic() + 30
        for copy, devices in sent.copies.items():
            q, _, b = copy.partition("\x00")
            lmq = encode_lmq(q, topic)
            while await client.get_max_offset(addrs[b or HOME], lmq) < len(devices):
                assert time.monotonic() < deadline, f"{copy!r} not dispatched"
                await asyncio.sleep(0.05)
        return sent
    finally:
        await client.close()


@pytest.fixture(scope="module")
def spread(rocketmq: RocketMQCluster) -> Sent:
    sent = asyncio.run(_write_deployment(rocketmq, f"s{uuid.uuid4().hex[:12]}"))
    on = Counter(b for _, _, b in sent.messages)
    assert sent.brokers == ["broker-a", "broker-b"] and on["broker-a"] == 14, on
    assert on["broker-b"] == 10, on  # broker_for's choice of TRAFFIC's topics
    return sent


def _rows(ranges: list[PullRange]) -> dict[int, tuple[int, str, list[str], list[int], int]]:
    """physical offset -> (store ms, device, queues, their offsets, range key)."""
    out = {}
    for rng in ranges:
        for batch in pull_batches(rng):
            for r in batch.to_pylist():
                ts = int(r["store_timestamp"].timestamp() * 1000)
                row = (ts, r["client_id"], r["queues"], r["queue_offsets"], rng.start_offset)
                out[r["physical_offset"]] = row
    return out


def test_rows_come_from_both_brokers_named_by_copy_and_a_window_pulls_fewer_ranges(
    rocketmq: RocketMQCluster, spread: Sent
) -> None:
    dep = Deployment(rocketmq.namesrv_addr, spread.topic)
    snap = read_deployment(dep, range_messages=SMALL_RANGES)
    assert snap.home == HOME and list(snap.brokers) == ["broker-a", "broker-b"]
    assert {r.broker for r in snap.ranges} == {"broker-a", "broker-b"}
    # Committed offsets and ends per copy, each from its own broker.
    assert snap.committed == spread.committed
    # The merged session entries, one per copy with that broker's offsets (64-bit ints).
    assert {
        (s.client_id, s.queue): (s.start_offset, s.next_offset) for s in snap.subscriptions
    } == {
        (sub, copy): (STARTS[sub][spread.brokers.index(split_copy(copy)[1] or HOME)], done)
        for (sub, copy), done in spread.committed.items()
    }
    ends = {q.queue: q.end_offset for q in snap.ends}
    assert ends == {c: len(d) for c, d in spread.copies.items()}

    rows = _rows(snap.ranges)
    assert len(rows) == len(spread.messages)  # the state batch is no message
    # Each copy's rows: its broker's offsets 0.., in send order, from that broker only.
    by_copy: dict[str, list[tuple[int, str]]] = {}
    for _, device, queues, offsets, _ in rows.values():
        for q, off in zip(queues, offsets, strict=True):
            by_copy.setdefault(q, []).append((off, device))
    assert {c: [d for _, d in sorted(v)] for c, v in by_copy.items()} == spread.copies
    assert all(sorted(o for o, _ in v) == list(range(len(v))) for v in by_copy.values())

    # A narrow window: the middle third of the run's store times.
    stamps = sorted({ts for ts, *_ in rows.values()})
    since, until = stamps[len(stamps) // 3], stamps[2 * len(stamps) // 3]
    plan = plan_ranges(snap, since, until)
    assert plan.tail == [] and plan.read == plan.window
    assert {r.broker for r in plan.read} == {"broker-a", "broker-b"}
    for b in snap.brokers:
        n_read = sum(r.broker == b for r in plan.read)
        assert 0 < n_read < sum(r.broker == b for r in snap.ranges), (b, plan.read)
    in_window = {p for p, (ts, *_) in rows.items() if since <= ts < until}
    assert in_window
    assert {p for p, (ts, *_) in _rows(plan.read).items() if since <= ts < until} == in_window

    # The backlog's tail: sub-temp's copy on broker-b is committed up to 2, so a window after
    # everything still pulls broker-b's ranges from the one holding that copy's offset 2.
    copy_b = copy_name(queue_name("plant/+/temp"), "broker-b", HOME)
    holder = next(
        key
        for _, _, queues, offsets, key in rows.values()
        if copy_b in queues and offsets[queues.index(copy_b)] == 2
    )
    late = plan_ranges(snap, stamps[-1] + 1000, None, [(copy_b, 2)])
    assert late.window == []
    assert late.read == late.tail
    assert [r.start_offset for r in late.tail] == [
        r.start_offset for r in snap.ranges if r.broker == "broker-b" and r.start_offset >= holder
    ]


def _expected(sent: Sent) -> dict[str, dict[str, float]]:
    """Per device: messages, fan-out, deliveries and eligible, simulated copy by copy."""
    fanout: dict[str, list[int]] = {}
    for device, mqtt_topic, _ in sent.messages:
        fanout.setdefault(device, []).append(sum(_matches(f, mqtt_topic) for f in FILTERS.values()))
    due: Counter[str] = Counter()
    done: Counter[str] = Counter()
    for (sub, copy), committed in sent.committed.items():
        start = STARTS[sub][sent.brokers.index(split_copy(copy)[1] or HOME)]
        for offset, device in enumerate(sent.copies.get(copy, [])):
            due[device] += offset >= start
            done[device] += start <= offset < committed
    return {
        d: {
            "messages": len(f),
            "fanout_max": max(f),
            "fanout_mean": sum(f) / len(f),
            "deliveries": done[d],
            "eligible": due[d],
        }
        for d, f in fanout.items()
    }


@pytest.mark.slow
@pytest.mark.spark
def test_report_of_a_deployment_on_two_brokers(
    rocketmq: RocketMQCluster, spread: Sent, spark: SparkSession, tmp_path: Path
) -> None:
    from analytics.fanout import run_fanout

    snap: Snapshot = read_deployment(Deployment(rocketmq.namesrv_addr, spread.topic))
    meta = run_fanout(spark, "", tmp_path / "all", rocketmq=snap)
    assert meta.messages == len(spread.messages) and meta.segments == 2  # one range a broker
    rows = {
        r["client_id"]: r
        for r in pq.read_table(tmp_path / "all" / "report" / "device_fanout").to_pylist()
    }
    expected = _expected(spread)
    # dev-2: sub-all its 9 but the first on broker-b (before sub-all's start there), sub-temp
    # its 4 on broker-a and 1 of the 2 below its committed offset on broker-b's copy (dev-4
    # sent the other).
    assert expected["dev-2"]["deliveries"] == 8 + 4 + 1
    assert expected["dev-2"]["eligible"] == 8 + 4 + 5
    assert set(rows) == set(expected)
    for device, want in expected.items():
        got = rows[device]
        assert {k: got[k] for k in want} == pytest.approx(want), device
    assert rows["dev-2"]["subscribers_reached"] == 2
    backlog = pq.read_table(tmp_path / "all" / "report" / "queue_backlog").to_pylist()
    waiting = {r["queue"]: r["backlog_messages"] for r in backlog}
    copy_b = copy_name(queue_name("plant/+/temp"), "broker-b", HOME)
    assert waiting[copy_b] == len(spread.copies[copy_b]) - 2
    assert {r["queue"]: r["filter"] for r in backlog}[copy_b] == "plant/+/temp"
    assert sum(waiting.values()) == len(spread.copies[copy_b]) - 2

    # Windowed, with small ranges: the rows of the window only, read from fewer ranges, and
    # the same backlog (its tail, from broker-b's copy offset 2 on, is pulled too).
    small = read_deployment(Deployment(rocketmq.namesrv_addr, spread.topic), SMALL_RANGES)
    stamps = sorted(ts for ts, *_ in _rows(small.ranges).values())
    since = stamps[len(stamps) // 2]
    windowed = run_fanout(spark, "", tmp_path / "win", since_ms=since, rocketmq=small)
    assert windowed.messages == sum(ts >= since for ts in stamps)
    assert windowed.segments_read < windowed.segments == len(small.ranges)
    again = pq.read_table(tmp_path / "win" / "report" / "queue_backlog").to_pylist()
    for key in ("backlog_messages", "backlog_bytes", "oldest_undelivered_at"):
        assert {r["queue"]: r[key] for r in again} == {r["queue"]: r[key] for r in backlog}, key


@pytest.mark.slow
@pytest.mark.spark
def test_report_of_a_real_spread_gateway_as_an_operator_runs_it(
    rocketmq: RocketMQCluster, tmp_path: Path
) -> None:
    """A real `lmqtt serve --store rocketmq` with spread on: dev-1 publishes on `r/<i>/x`
    (matched by `r/#` and `r/+/x`), dev-2 on `r/<i>/y` (`r/#` only), topics on both brokers.
    `all` (r/#) acknowledges everything; the persistent `slow` (r/+/x) receives the first
    round, acknowledges part of it and goes offline, then a second round is published. Then
    `lmqtt report fanout --store rocketmq` from the name server alone (the sessions' merged
    offsets decoded per broker): fan-out and deliveries per device, and each copy's backlog =
    what `slow` has not acknowledged on that broker."""
    from tests.gateway.conftest import Client, stop_clients
    from tests.rocketmq.test_gateway_rocketmq import ROOT
    from tests.rocketmq.test_spread import (
        BROKERS,
        leave_after_acks,
        spread_gateway,
        topics_by_broker,
    )

    topic = f"e{uuid.uuid4().hex[:12]}"
    xs = [f"r/{i}/x" for i in range(8)]
    ys = [f"r/{i}/y" for i in range(8)]
    assert all(topics_by_broker(xs).values()) and all(topics_by_broker(ys).values())
    rounds = [[(t, f"{t} #{n}".encode()) for t in xs + ys] for n in range(2)]
    g = spread_gateway(rocketmq, tmp_path / "data", topic).start()
    made: list[Client] = []
    try:
        every = Client(g.port, "all", clean=False)
        slow = Client(g.port, "slow", clean=False, auto_ack=False)
        dev1, dev2 = Client(g.port, "dev-1"), Client(g.port, "dev-2")
        made += [every, slow, dev1, dev2]
        every.subscribe("r/#", 1)
        slow.subscribe("r/+/x", 1)

        def publish(msgs: list[tuple[str, bytes]]) -> None:
            infos = [(dev1 if t.endswith("/x") else dev2).c.publish(t, p, 1) for t, p in msgs]
            for info in infos:
                info.wait_for_publish(30)

        publish(rounds[0])
        first = slow.wait_messages(len(xs), 60)
        for m in first[:5]:
            slow.c.ack(m.mid, m.qos)
        acked = [m.topic for m in first[:5]]
        leave_after_acks(slow, g, "slow")
        publish(rounds[1])
        every.wait_messages(len(rounds[0]) + len(rounds[1]), 60)
    finally:
        stop_clients(made)
        assert g.stop() == 0  # graceful: the committed offsets are pushed to the brokers

    out = tmp_path / "report"
    lmqtt = Path(sys.executable).parent / "lmqtt"
    done = subprocess.run(
        [str(lmqtt), "report", "fanout", "--store", "rocketmq",
         "--namesrv", rocketmq.namesrv_addr, "--rocketmq-topic", topic,
         "--out", str(out), "--no-progress"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {r["client_id"]: r for r in pq.read_table(out / "report" / "device_fanout").to_pylist()}
    n = len(rounds)
    assert set(rows) == {"dev-1", "dev-2"}
    want = {
        # dev-1: to `all` and `slow`, of which `slow` acknowledged 5.
        "dev-1": {"messages": n * len(xs), "fanout_max": 2, "fanout_mean": 2.0,
                  "eligible": 2 * n * len(xs), "deliveries": n * len(xs) + 5},
        "dev-2": {"messages": n * len(ys), "fanout_max": 1, "fanout_mean": 1.0,
                  "eligible": n * len(ys), "deliveries": n * len(ys)},
    }  # fmt: skip
    for device, numbers in want.items():
        assert {k: rows[device][k] for k in numbers} == pytest.approx(numbers), device
    backlog = pq.read_table(out / "report" / "queue_backlog").to_pylist()
    waiting = {r["queue"]: r["backlog_messages"] for r in backlog}
    on = {t: broker_for(t.encode(), BROKERS) for t in xs}
    x_queue, all_queue = queue_name("r/+/x"), queue_name("r/#")
    assert waiting == {
        **{copy_name(all_queue, b, HOME): 0 for b in BROKERS},
        **{
            copy_name(x_queue, b, HOME): sum(on[t] == b for t in xs) * n
            - sum(on[t] == b for t in acked)
            for b in BROKERS
        },
    }
    assert all(waiting[copy_name(x_queue, b, HOME)] > 0 for b in BROKERS)

    # With the gateway's data directory: its delivery account counts the light queues'
    # messages over both brokers together, which no copy's offsets are: left out.
    from store import read_account

    assert any(r.queue == x_queue for r in read_account(tmp_path / "data"))
    snap = read_deployment(
        Deployment(rocketmq.namesrv_addr, topic, data_dir=str(tmp_path / "data"))
    )
    assert not [r for r in snap.account if r.queue.startswith("%LMQ%")]
    slow_at = {s.queue: s for s in snap.subscriptions if s.client_id == "slow"}
    assert set(slow_at) == {copy_name(x_queue, b, HOME) for b in BROKERS}


def test_a_spread_home_that_does_not_sort_first_is_found_by_its_state(
    rocketmq: RocketMQCluster,
) -> None:
    """A spread deployment whose home is broker-b (broker-a joined later, slot 1): the topic
    is on both brokers, so the first by name is no longer the home; the report takes the one
    whose %STATE% names the slots, as the gateway does, and names the copies from it."""
    topic = f"h{uuid.uuid4().hex[:12]}"
    q = queue_name("h/#")

    async def write() -> None:
        client = rocketmq.client()
        try:
            await _topic_on_both(client, rocketmq, topic)
            entry = {"filter": "h/#", "queue": q, "share_group": None, "qos": 1,
                     "start_offset": encode([0, 0]), "next_offset": encode([2, 1], 4)}  # fmt: skip
            session = {"disconnected_at_ms": 1, "subscriptions": [entry]}
            state = encode_state(
                [(SLOTS_KEY, b'["broker-b", "broker-a"]'),
                 ("session/s", json.dumps(session).encode())]
            )  # fmt: skip
            await client.send_message(
                rocketmq.brokers["broker-b"], topic, state,
                light_queues=[encode_lmq(STATE_QUEUE, topic)],
            )  # fmt: skip
            for addr in rocketmq.brokers.values():
                await client.send_message(
                    addr, topic, b"m", light_queues=[encode_lmq(q, topic)],
                    properties={"mqtt.topic": "h/1", "mqtt.client": "d", "mqtt.qos": "1"},
                )  # fmt: skip
        finally:
            await client.close()

    asyncio.run(write())
    snap = read_deployment(Deployment(rocketmq.namesrv_addr, topic))
    assert snap.home == "broker-b"
    # idx 4: the position after slot 1's (broker-a's) offset 1.
    got = {s.queue: (s.start_offset, s.next_offset) for s in snap.subscriptions}
    assert got == {q: (0, 2), q + "\x00broker-a": (0, 2)}
    assert {r.home for r in snap.ranges} == {"broker-b"}
