"""How fast a held pull is answered when a message arrives: the broker's part of the latency of
the RocketMQ backend's read path (send -> broker -> the parent topic's tail -> mirrors).

Run: ``.venv/bin/python -m bench.rocketmq_wake_bench [--rounds N] [--jvm test|production]``
(needs Java; fetches the jars like the tests do). Starts the test cluster of
tests/rocketmq/cluster.py and, on each broker (broker-a ASYNC_FLUSH, broker-b SYNC_FLUSH), for
each kind of queue a gateway holds a pull on:

    parent  the parent topic's queue 0 (what gateway/storage/rocketmq/tail.py holds)
    light   a light queue the message is dispatched to (what a mirror holds with
            rocketmq_notify_pulls = false)

holds a pull at the queue's end (suspend 15 s), then sends one message to it (a separate
connection, as a gateway's sends and pulls are separate requests) and times, from the send:
the send's answer (SEND_OK; on the SYNC_FLUSH broker after its flush) and the held pull's
answer. A held pull woken by the broker's message-arriving listener answers within a few ms;
one the listener misses is answered by the hold service's periodic check (up to 5 s,
rocketmq_remoting.client HOLD_CHECK_S). Percentiles of N rounds; wall-clock figures of a
shared host are only comparable within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rocketmq_remoting import RemotingClient
from rocketmq_remoting.admin import create_topic
from tests.rocketmq.cluster import RocketMQCluster, ensure_jars
from topicmap.rocketmq import encode_lmq

GROUP = "%LMQ%lmqtt-wake-bench"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(rounds: int, jvm: str) -> None:
    ensure_jars()
    with tempfile.TemporaryDirectory(prefix="lmqtt-wake-") as tmp:
        cluster = RocketMQCluster(Path(tmp), jvm=jvm)
        await asyncio.to_thread(cluster.start)
        try:
            async with cluster.client() as puller, cluster.client() as sender:
                for name, addr in sorted(cluster.brokers.items()):
                    topic = f"wake-{uuid.uuid4().hex[:8]}"
                    await create_topic(puller, addr, topic)
                    lmq = encode_lmq(f"%LMQ%wake.{name}", topic)
                    await sender.send_message(addr, topic, b"warm", light_queues=[lmq])
                    for kind in ("parent", "light"):
                        sends, wakes = [], []
                        for _ in range(rounds):
                            s, w = await _one(puller, sender, addr, topic, lmq, kind)
                            sends.append(s)
                            wakes.append(w)
                        # The pull's answer past the send's: the broker's wake-up itself,
                        # what is left when the host's scheduling delays both alike.
                        after = [w - s for s, w in zip(sends, wakes, strict=True)]
                        print(
                            f"{name} {kind:6s} SEND_OK p50 {statistics.median(sends):7.2f} ms"
                            f" p99 {_pct(sends, 0.99):7.2f} | held pull answered p50"
                            f" {statistics.median(wakes):7.2f} p99 {_pct(wakes, 0.99):7.2f}"
                            f" max {max(wakes):7.2f} | after SEND_OK p50"
                            f" {statistics.median(after):7.2f} p99 {_pct(after, 0.99):7.2f}",
                            flush=True,
                        )
        finally:
            await asyncio.to_thread(cluster.stop)


async def _one(
    puller: RemotingClient, sender: RemotingClient, addr: str, topic: str, lmq: str, kind: str
) -> tuple[float, float]:
    """One held pull woken by one send: (ms to SEND_OK, ms to the pull's answer)."""
    queue = topic if kind == "parent" else lmq
    end = await puller.get_max_offset(addr, queue)
    done: dict[str, float] = {}
    pull = asyncio.ensure_future(
        puller.pull(addr, queue, end, consumer_group=GROUP, max_messages=32, suspend_timeout=15.0)
    )
    pull.add_done_callback(lambda _: done.setdefault("pull", time.perf_counter()))
    await asyncio.sleep(0.05)  # the pull is held by now (nothing to read at `end`)
    start = time.perf_counter()
    sent = asyncio.ensure_future(sender.send_message(addr, topic, b"x" * 64, light_queues=[lmq]))
    sent.add_done_callback(lambda _: done.setdefault("send", time.perf_counter()))
    await asyncio.gather(sent, pull)
    if not pull.result().messages:
        raise RuntimeError(f"{queue}: the held pull ended without the message")
    return 1000 * (done["send"] - start), 1000 * (done["pull"] - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--jvm", choices=("test", "production"), default="test")
    args = parser.parse_args()
    asyncio.run(run(args.rounds, args.jvm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
