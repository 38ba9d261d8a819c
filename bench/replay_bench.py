"""Fleet latency with and without a large replay running beside it.

    python -m bench.replay_bench [--messages 1000000] [--duration 10] [--rate 1000]

1. An lmqtt gateway (its own process, async flush) is preloaded with `--messages` messages on
   the parent topic `hist` (100 topics `hist/dev/N`, QoS 1, 64-byte payloads) by a full-speed
   publisher.
2. Fleet without replay: a paced publisher (`--rate` msg/s QoS 1 over 100 topics
   `fleet/dev/N/t`) and a live subscriber on `fleet/#` that measures end-to-end latency from the
   send timestamp in each payload; p50/p99 and the gateway's CPU over the window.
3. Fleet with a replay: a subscriber asks for `$replay/earliest/hist/#` (the whole history, QoS
   1, acknowledging as fast as it reads), then the same fleet measurement runs while the replay
   is delivering; the replayer disconnects after the window. The replay's own progress
   (messages, msg/s) is reported, and whether it was still running when the window ended (if it
   finished early, part of the window ran without it: raise --messages or lower --duration).

Steps 2 and 3 repeat `--repeat` times (a new replayer each time, from the start of the
history); the medians and the with/without ratios of the medians are printed. On a shared host
the absolute figures move with the neighbours' load; compare the ratios, and look at the
generator's own send lag (a late generator's figures are the host's, not the gateway's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.brokers import BrokerOptions, BrokerProcess
from bench.scenarios import RunSettings, fanout
from bench.workers import Worker

FLEET_TOPICS = [f"fleet/dev/{i}/t" for i in range(100)]
HIST_TOPICS = [f"hist/dev/{i}" for i in range(100)]


async def preload(broker: BrokerProcess, messages: int, payload: int) -> dict[str, Any]:
    pub = Worker(
        {
            "role": "pub",
            "host": "127.0.0.1",
            "port": broker.port,
            "id": "hist-pub",
            "qos": 1,
            "topics": HIST_TOPICS,
            "payload": payload,
            "count": messages,
            "duration": 3600.0,
            "window": 256,
        }
    )
    try:
        await pub.start()
        await pub.expect("ready", 60)
        t0 = time.monotonic()
        pub.send("start")
        result = await pub.expect("result", 3600)
        return {
            "acked": int(result["acked"]),
            "seconds": round(time.monotonic() - t0, 1),
        }
    finally:
        await pub.close()


async def fleet(
    broker: BrokerProcess, duration: float, rate: float, payload: int
) -> dict[str, Any]:
    settings = RunSettings(duration=duration, payload=payload)
    return await fanout(
        broker,
        settings,
        qos=1,
        connections=[{"id": "fleet-sub", "filters": ["fleet/#"]}],
        topics=FLEET_TOPICS,
        per_message=1,
        rate=rate,
        latency=True,
    )


async def _replayer(broker: BrokerProcess, n: int, nice: int) -> Worker:
    """A subscriber replaying the whole history (a new client id: each starts at the start).
    `nice` > 0 lowers its OS priority: it is a client process that competes for the host's
    cores with the fleet's generator, which says whether a latency rise is the gateway's."""
    worker = Worker(
        {
            "role": "sub",
            "host": "127.0.0.1",
            "port": broker.port,
            "qos": 1,
            "connections": [{"id": f"replayer-{n}", "filters": ["$replay/earliest/hist/#"]}],
        }
    )
    await worker.start()
    if nice and worker.process is not None:
        os.setpriority(os.PRIO_PROCESS, worker.process.pid, nice)
    await worker.expect("ready", 60)
    return worker


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """`--repeat` pairs of windows, each pair: fleet alone, then fleet beside a fresh replay
    (stopped after its window), so both sides of a pair see about the same neighbours."""
    with tempfile.TemporaryDirectory(prefix="lmqtt-replay-bench-") as tmp:
        broker = BrokerProcess("lmqtt", Path(tmp), BrokerOptions())
        await broker.start()
        try:
            loaded = await preload(broker, args.messages, args.payload)
            print(f"preloaded {loaded['acked']:,} messages in {loaded['seconds']} s", flush=True)
            pairs = []
            for n in range(args.repeat):
                without = await fleet(broker, args.duration, args.rate, args.payload)
                print(f"[{n}] fleet without replay:", _line(without), flush=True)
                replay = await _replayer(broker, n, args.nice_replayer)
                try:
                    t0 = time.monotonic()
                    beside = await fleet(broker, args.duration, args.rate, args.payload)
                    progress = await replay.request("report", "progress", 10)
                    elapsed = time.monotonic() - t0
                finally:
                    await replay.close()
                replayed = int(progress["count"])
                print(f"[{n}] fleet with replay:   ", _line(beside), flush=True)
                print(
                    f"[{n}] replay: {replayed:,} of {loaded['acked']:,} delivered in the window "
                    f"({replayed / max(elapsed, 1e-6):,.0f} msg/s), "
                    f"still running: {replayed < loaded['acked']}",
                    flush=True,
                )
                pairs.append(
                    {
                        "without": _summary(without),
                        "with_replay": _summary(beside),
                        "replayed": replayed,
                        "replay_msg_per_s": round(replayed / max(elapsed, 1e-6)),
                        "replay_still_running": replayed < loaded["acked"],
                    }
                )
        finally:
            await broker.stop()
    med = {
        side: {k: _median([p[side][k] for p in pairs]) for k in ("p50_ms", "p99_ms", "broker_cpu")}
        for side in ("without", "with_replay")
    }
    return {
        "messages": loaded["acked"],
        "preload_s": loaded["seconds"],
        "rate": args.rate,
        "duration_s": args.duration,
        "pairs": pairs,
        "median": med,
        "replay_msg_per_s": _median([p["replay_msg_per_s"] for p in pairs]),
        "ratio_p50": _ratio(med["with_replay"]["p50_ms"], med["without"]["p50_ms"]),
        "ratio_p99": _ratio(med["with_replay"]["p99_ms"], med["without"]["p99_ms"]),
        "ratio_broker_cpu": _ratio(med["with_replay"]["broker_cpu"], med["without"]["broker_cpu"]),
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _summary(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("p50_ms", "p99_ms", "p999_ms", "max_ms", "puback_p99_ms", "send_lag_p99_ms",
            "broker_cpu", "other_cpu", "delivered", "loss_pct", "flags")  # fmt: skip
    return {k: m.get(k) for k in keys}


def _line(m: dict[str, Any]) -> str:
    return (
        f"p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms, p99.9 {m['p999_ms']:.2f} ms, "
        f"gateway CPU {m['broker_cpu']:.2f} cores, PUBACK p99 {m['puback_p99_ms']:.2f} ms, "
        f"send lag p99 {m['send_lag_p99_ms']:.2f} ms, "
        f"loss {m['loss_pct']} %, flags {m['flags'] or '-'}"
    )


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_bench", description=__doc__)
    parser.add_argument("--messages", type=int, default=1_000_000, help="history to replay")
    parser.add_argument("--duration", type=float, default=10.0, help="each fleet window, s")
    parser.add_argument("--rate", type=float, default=1000.0, help="fleet publishes per second")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes")
    parser.add_argument("--repeat", type=int, default=3, help="window pairs (medians shown)")
    parser.add_argument(
        "--nice-replayer",
        type=int,
        default=0,
        metavar="N",
        help="run the replaying client at nice N",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
        return 0
    w, b = result["median"]["without"], result["median"]["with_replay"]
    print(
        f"median of {len(result['pairs'])} pairs: without p50 {w['p50_ms']:.2f} ms p99 "
        f"{w['p99_ms']:.2f} ms CPU {w['broker_cpu']:.2f}; with replay p50 {b['p50_ms']:.2f} ms "
        f"p99 {b['p99_ms']:.2f} ms CPU {b['broker_cpu']:.2f}; replay "
        f"{result['replay_msg_per_s']:,} msg/s"
    )
    print(
        f"with/without: p50 x{result['ratio_p50']}, p99 x{result['ratio_p99']}, "
        f"gateway CPU x{result['ratio_broker_cpu']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
