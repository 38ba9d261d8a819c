"""Fleet latency with and without a large replay running beside it (issue 20).

    python -m bench.replay_bench [--messages 1000000] [--duration 10] [--rate 1000]

1. An lmqtt gateway (its own process, async flush) is preloaded with `--messages` messages on
   the parent topic `hist` (100 topics `hist/dev/N`, QoS 1, 64-byte payloads) by a full-speed
   publisher.
2. Fleet without replay: a paced publisher (`--rate` msg/s QoS 1 over 100 topics
   `fleet/dev/N/t`) and a live subscriber on `fleet/#` that measures end-to-end latency from the
   send timestamp in each payload; p50/p99 and the gateway's CPU over the window.
3. Fleet with a replay: a subscriber asks for `$replay/earliest/hist/#` (the whole history, QoS
   1, acknowledging as fast as it reads), then the same fleet measurement runs while the replay
   is delivering. The replay's own progress (messages, msg/s) is reported, and whether it was
   still running when the window ended (if it finished early, part of the window ran without it:
   raise --messages or lower --duration).

Prints both measurements and the with/without ratios. On a shared host the absolute figures
move with the neighbours' load; the ratio of two windows taken one after the other is what to
compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lmqtt-replay-bench-") as tmp:
        broker = BrokerProcess("lmqtt", Path(tmp), BrokerOptions())
        await broker.start()
        replay: Worker | None = None
        try:
            loaded = await preload(broker, args.messages, args.payload)
            print(f"preloaded {loaded['acked']:,} messages in {loaded['seconds']} s", flush=True)
            without = await fleet(broker, args.duration, args.rate, args.payload)
            print("fleet without replay:", _line(without), flush=True)
            replay = Worker(
                {
                    "role": "sub",
                    "host": "127.0.0.1",
                    "port": broker.port,
                    "qos": 1,
                    "connections": [{"id": "replayer", "filters": ["$replay/earliest/hist/#"]}],
                }
            )
            await replay.start()
            await replay.expect("ready", 60)
            t0 = time.monotonic()
            first = await replay.request("report", "progress", 10)
            beside = await fleet(broker, args.duration, args.rate, args.payload)
            progress = await replay.request("report", "progress", 10)
            elapsed = time.monotonic() - t0
            print("fleet with replay:   ", _line(beside), flush=True)
            replayed = int(progress["count"])
            still_running = replayed < loaded["acked"]
            result: dict[str, Any] = {
                "messages": loaded["acked"],
                "rate": args.rate,
                "duration_s": args.duration,
                "without": _summary(without),
                "with_replay": _summary(beside),
                "replay": {
                    "delivered_at_window_start": int(first["count"]),
                    "delivered": replayed,
                    "msg_per_s": round(replayed / max(elapsed, 1e-6)),
                    "still_running_at_window_end": still_running,
                },
                "ratio_p50": _ratio(beside["p50_ms"], without["p50_ms"]),
                "ratio_p99": _ratio(beside["p99_ms"], without["p99_ms"]),
                "ratio_broker_cpu": _ratio(beside["broker_cpu"], without["broker_cpu"]),
            }
            return result
        finally:
            if replay is not None:
                await replay.close()
            await broker.stop()


def _summary(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("p50_ms", "p99_ms", "p999_ms", "max_ms", "send_lag_p99_ms", "broker_cpu",
            "other_cpu", "delivered", "loss_pct", "flags")  # fmt: skip
    return {k: m.get(k) for k in keys}


def _line(m: dict[str, Any]) -> str:
    return (
        f"p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms, p99.9 {m['p999_ms']:.2f} ms, "
        f"gateway CPU {m['broker_cpu']:.2f} cores, send lag p99 {m['send_lag_p99_ms']:.2f} ms, "
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
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
        return 0
    rep = result["replay"]
    print(
        f"replay of {result['messages']:,}: {rep['delivered']:,} delivered by the window's end "
        f"({rep['msg_per_s']:,} msg/s), still running: {rep['still_running_at_window_end']}"
    )
    print(
        f"with/without: p50 x{result['ratio_p50']}, p99 x{result['ratio_p99']}, "
        f"gateway CPU x{result['ratio_broker_cpu']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
