"""rocketmq_remoting on a local RocketMQ cluster: long-poll wake latency, send rate, broker CPU.

Run: ``.venv/bin/python -m bench.rocketmq_remoting_bench`` (needs Java; fetches the jars like the
tests do). Starts the test cluster of tests/rocketmq/cluster.py (name server + two brokers, small
heaps, one visible CPU each), measures, stops it. Figures from a shared, loaded host are only
comparable within one run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rocketmq_remoting.admin import create_topic
from tests.rocketmq.cluster import RocketMQCluster, ensure_jars


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(cluster: RocketMQCluster, wakes: int, sends: int, in_flight: int) -> None:
    broker = cluster.brokers["broker-a"]
    pids = {name: proc.pid for name, proc in cluster.procs.items()}
    async with cluster.client() as client:
        parent = f"bench-{uuid.uuid4().hex[:8]}"
        await create_topic(client, broker, parent)

        before = {n: _cpu_seconds(p) for n, p in pids.items()}
        await asyncio.sleep(10)
        idle = {n: round((_cpu_seconds(p) - before[n]) / 10 * 100, 1) for n, p in pids.items()}
        print(f"idle CPU, % of one core: {idle}")

        latencies = []
        for _ in range(wakes):
            queue = f"%LMQ%wake-{uuid.uuid4().hex[:10]}"
            pull = asyncio.create_task(
                client.pull(broker, queue, 0, consumer_group="%LMQ%bench", suspend_timeout=10)
            )
            await asyncio.sleep(0.2)  # let the broker hold the pull
            assert not pull.done()
            start = time.perf_counter()
            await client.send_message(broker, parent, b"wake", light_queues=[queue])
            result = await pull
            latencies.append((time.perf_counter() - start) * 1000)
            assert result.found
        latencies.sort()
        print(
            f"send -> suspended pull answered, ms (n={wakes}): median "
            f"{statistics.median(latencies):.2f}, p90 {latencies[int(wakes * 0.9) - 1]:.2f}, "
            f"max {latencies[-1]:.2f}"
        )

        gate = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with gate:
                await client.send_message(
                    broker, parent, b"z" * 100, light_queues=["%LMQ%bench-1", "%LMQ%bench-2"]
                )

        cpu0 = _cpu_seconds(pids["broker-a"])
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(sends)))
        elapsed = time.perf_counter() - start
        cpu = _cpu_seconds(pids["broker-a"]) - cpu0
        print(
            f"{sends} sends of 100 B to 2 light queues, {in_flight} in flight on one connection: "
            f"{sends / elapsed:.0f}/s, broker CPU {cpu / sends * 1e6:.0f} us/message"
        )


def main() -> None:
    ensure_jars()
    cluster = RocketMQCluster(Path(tempfile.mkdtemp(prefix="lmqtt-rocketmq-bench-")))
    started = time.monotonic()
    try:
        cluster.start()
        print(f"cluster ready in {time.monotonic() - started:.1f}s")
        asyncio.run(_measure(cluster, wakes=30, sends=2000, in_flight=64))
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


if __name__ == "__main__":
    main()
