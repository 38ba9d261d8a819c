"""A fleet's first round against its next ones: the gateway's event-loop CPU per publish.

``python -m bench.first_round [--devices N] [--rate R] [--rounds K]``: an lmqtt gateway (its
own process), the fleet scenario's backends (site/#, site/+/dev/+/temp, site/k/# for k < 5)
and N devices (each subscribed to cmd/<d>) connected, then K rounds in which every device
publishes once (QoS 1, 64 B, to its own site/<d % 50>/dev/<d>/temp), paced at R msg/s. Per
round: the CPU time of the gateway's main thread (the event loop; /proc/<pid>/task/<pid>/
schedstat, nanoseconds, whatever else the host runs) per publish, and the latency of the
round's deliveries. Round 0 is every device's first publish, to a topic never routed before
(what `bench fleet` runs into in its first 100 ms at 20k msg/s); the later rounds are the same
publishes again. On a busy host the latencies are the host's, the CPU per publish is not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import wire

BACKENDS = [("b-all", False, "site/#"), ("b-shape", True, "site/+/dev/+/temp")] + [
    (f"b-site{k}", True, f"site/{k}/#") for k in range(5)
]
STEP = 20  # devices whose publishes leave together, one write each
CONNECT_BATCH = 100
SETTLE_S = 3.0  # after the connects: the gateway freezes what they made
ROUND_GAP_S = 1.0
ROUND_TIMEOUT_S = 30.0


class Client(asyncio.Protocol):
    """One MQTT connection: acknowledges QoS 1 deliveries, counts PUBACKs, stamps latency."""

    def __init__(self, latencies: list[int] | None) -> None:
        self.buffer = b""
        self.latencies = latencies
        self.answered = asyncio.Event()
        self.pubacks = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        data = self.buffer + data
        packets, used = wire.split_packets(data)
        self.buffer = data[used:]
        now = time.monotonic_ns()
        acks = []
        for first, body in packets:
            kind = first >> 4
            if kind == wire.PUBLISH:
                qos, packet_id, payload = wire.publish_fields(first, body)
                if qos:
                    acks.append(wire.puback(packet_id))
                if self.latencies is not None:
                    self.latencies.append(now - wire.PAYLOAD_HEADER.unpack_from(payload)[1])
            elif kind == wire.PUBACK:
                self.pubacks += 1
            else:
                self.answered.set()  # CONNACK, SUBACK
        if acks and self.transport is not None:
            self.transport.write(b"".join(acks))

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


def loop_cpu_ns(pid: int) -> int:
    """CPU time of the process's main thread, ns."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(devices: int, rate: float, rounds: int) -> None:
    exe = shutil.which("lmqtt") or str(Path(sys.executable).parent / "lmqtt")
    port = free_port()
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory() as tmp:
        gateway = subprocess.Popen(
            [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir",
             f"{tmp}/data", "--flush", "async", "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert gateway.stdout is not None
            gateway.stdout.readline()  # "lmqtt listening on ..."

            async def connect(cid: str, latencies: list[int] | None, clean: bool, f: str) -> Client:
                _, client = await loop.create_connection(
                    lambda: Client(latencies), "127.0.0.1", port
                )
                client.write(wire.connect(cid, clean))
                await client.answered.wait()
                client.answered.clear()
                client.write(wire.subscribe(1, [f], 1))
                await client.answered.wait()
                return client

            latencies: list[int] = []
            for cid, clean, f in BACKENDS:
                await connect(cid, latencies, clean, f)
            fleet: list[Client] = []
            for start in range(0, devices, CONNECT_BATCH):
                batch = range(start, min(devices, start + CONNECT_BATCH))
                fleet += await asyncio.gather(*(connect(f"dev-{d}", None, True, f"cmd/{d}")
                                                for d in batch))  # fmt: skip
            expected = sum(3 if d % 50 < 5 else 2 for d in range(devices))
            templates = [
                wire.PublishTemplate(f"site/{d % 50}/dev/{d}/temp", 1, 64) for d in range(devices)
            ]
            await asyncio.sleep(SETTLE_S)
            for r in range(rounds):
                latencies.clear()
                acked = sum(c.pubacks for c in fleet)
                cpu0 = loop_cpu_ns(gateway.pid)
                t0 = time.monotonic()
                for start in range(0, devices, STEP):
                    delay = t0 + start / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    now = time.monotonic_ns()
                    for d in range(start, min(devices, start + STEP)):
                        fleet[d].write(templates[d].encode(d, now, r + 1))
                while len(latencies) < expected or sum(c.pubacks for c in fleet) - acked < devices:
                    if time.monotonic() - t0 > ROUND_TIMEOUT_S:
                        print(f"round {r}: timed out ({len(latencies)} of {expected} delivered)")
                        break
                    await asyncio.sleep(0.002)
                cpu = loop_cpu_ns(gateway.pid) - cpu0
                ms = sorted(x / 1e6 for x in latencies) or [0.0]

                def at(q: float, ms: list[float] = ms) -> float:
                    return ms[min(len(ms) - 1, int(q * len(ms)))]

                print(
                    f"round {r}{' (first)' if r == 0 else ''}: event-loop CPU "
                    f"{cpu / 1e6:.1f} ms, {cpu / devices / 1e3:.2f} us per publish; latency p50 "
                    f"{at(0.5):.2f} p99 {at(0.99):.2f} max {ms[-1]:.2f} ms",
                    flush=True,
                )
                await asyncio.sleep(ROUND_GAP_S)
        finally:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=20_000.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not os.path.exists("/proc/self/task"):
        sys.exit("needs Linux /proc (the event loop's CPU time per thread)")
    asyncio.run(run(args.devices, args.rate, args.rounds))


if __name__ == "__main__":
    main()
