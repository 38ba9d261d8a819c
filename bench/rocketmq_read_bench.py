"""Reading a RocketMQ deployment's history: the fan-out report's pulls and a replay's pulls.

Run: ``.venv/bin/python -m bench.rocketmq_read_bench [--messages N]`` (needs Java; fetches the
jars like the tests do). Starts the test cluster of tests/rocketmq/cluster.py, sends N messages
of 100 bytes with the gateway's properties to a fresh parent topic on broker-a (three light
queues each, as a fan-out of 3), then reads them back twice, each pass timed in wall-clock and
CPU time of this process and of the broker's JVM:

    report  analytics.rocketmq.pull_batches over every range (rows of the report's schema)
    export  gateway.storage.rocketmq.history.PulledHistory through the replay cursor (lmqtt replay)

Figures from a shared, loaded host are only comparable within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

from rocketmq_remoting.admin import create_topic
from tests.rocketmq.cluster import RocketMQCluster, ensure_jars


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _fill(cluster: RocketMQCluster, topic: str, n: int) -> None:
    from rocketmq_remoting.message import encode_properties
    from topicmap import record
    from topicmap.rocketmq import encode_lmq

    broker = cluster.brokers["broker-a"]
    queues = [encode_lmq(f"%LMQ%b.{k}", topic) for k in range(3)]
    async with cluster.client() as client:
        await create_topic(client, broker, topic, queues=1)
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            async with sem:
                props = encode_properties(
                    {
                        record.TOPIC: f"b/{i % 50}",
                        record.QOS: "1",
                        record.RETAIN: "0",
                        record.CLIENT: f"dev-{i % 50}",
                    }
                )
                await client.send_message(
                    broker, topic, b"x" * 100, light_queues=queues, raw_properties=props
                )

        await asyncio.gather(*(one(i) for i in range(n)))
        deadline = time.monotonic() + 60
        while await client.get_max_offset(broker, topic) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)


def _timed(name: str, broker_pid: int, fn) -> None:  # type: ignore[no-untyped-def]
    wall, cpu, jvm = time.monotonic(), time.process_time(), _cpu_seconds(broker_pid)
    n = fn()
    wall = time.monotonic() - wall
    cpu = time.process_time() - cpu
    jvm = _cpu_seconds(broker_pid) - jvm
    print(
        f"{name}: {n:,} messages in {wall:.2f} s ({n / wall:,.0f}/s); reader CPU"
        f" {cpu / n * 1e6:.1f} us/msg, broker CPU {jvm / n * 1e6:.1f} us/msg"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=50_000)
    args = parser.parse_args()
    ensure_jars()
    from analytics.rocketmq import Deployment, pull_batches, read_deployment
    from gateway.ops.replay_export import open_rocketmq_history, replay_rows
    from topicmap import TopicFilter

    with tempfile.TemporaryDirectory(prefix="lmqtt-rmqread-") as tmp:
        cluster = RocketMQCluster(Path(tmp))
        try:
            cluster.start()
            topic = f"bench{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            asyncio.run(_fill(cluster, topic, args.messages))
            print(f"sent {args.messages:,} messages in {time.monotonic() - started:.1f} s")
            pid = cluster.procs["broker-a"].pid

            def report() -> int:
                snap = read_deployment(Deployment(cluster.namesrv_addr, topic, "broker-a"))
                return sum(b.num_rows for r in snap.ranges for b in pull_batches(r))

            def export() -> int:
                store = open_rocketmq_history(cluster.namesrv_addr, topic, "broker-a")
                try:
                    rows, _ = replay_rows(store, TopicFilter("b/#"), 0, None, "earliest")
                    return sum(1 for _ in rows)
                finally:
                    store.close()

            for _ in range(2):  # alternating, twice: the second pair reads a warm page cache
                _timed("report pulls", pid, report)
                _timed("replay export", pid, export)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
