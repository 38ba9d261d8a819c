"""Persistent sessions: how fast a fleet gets them, and how fast a gateway full of them restarts.

    python -m bench.sessions_bench create [--sessions 10000] [--brokers lmqtt mosquitto]
    python -m bench.sessions_bench restart [--sessions 1000000]

``create``: devices connect one after another over MQTT 3.1.1 with clean session 0, each
subscribes to its own ``dev/<n>/cmd`` (QoS 1), waits for the SUBACK, disconnects. The rate is
reported per window of 1,000 devices (0-1k, 1k-2k, ...), with the broker's CPU time per
session in each window, so a broker that slows down as its sessions accumulate shows it.
Brokers run one after the other on the same host (Mosquitto with persistence on, autosave
every second, the closest to lmqtt, which always stores; or without it: --mosquitto-memory).

``restart``: N persistent sessions with one subscription each are written straight into a
data directory's state log (the records the gateway itself writes, through the store's
writer), then ``lmqtt serve`` is started on it; reported: the time from the process start to
the first CONNACK (the gateway serving, every session restored) and the peak RSS by then.

Figures taken on a shared, loaded host: compare the ratios of one run, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench import wire  # noqa: E402
from bench.brokers import BrokerOptions, BrokerProcess, free_port  # noqa: E402

WINDOW = 1000


async def _read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first = (await reader.readexactly(1))[0]
    length = shift = 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    return first, await reader.readexactly(length)


async def one_device(port: int, n: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(wire.connect(f"dev-{n}", clean_session=False, keep_alive=60))
        first, body = await _read_packet(reader)
        if first >> 4 != wire.CONNACK or body[1] != 0:
            raise RuntimeError(f"dev-{n}: CONNACK {body.hex()}")
        writer.write(wire.subscribe(1, [f"dev/{n}/cmd"], 1))
        first, body = await _read_packet(reader)
        if first >> 4 != wire.SUBACK or body[2] >= 0x80:
            raise RuntimeError(f"dev-{n}: SUBACK {body.hex()}")
        writer.write(wire.DISCONNECT_PACKET)
        await writer.drain()
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def create(
    broker: str, sessions: int, workdir: Path, persistence: bool = True
) -> dict[str, object]:
    proc = BrokerProcess(broker, workdir / broker, BrokerOptions(persistence=persistence))
    await proc.start()
    rates: list[float] = []
    cpu_ms: list[float] = []  # broker CPU per session: what the host's load does not distort
    try:
        t0 = time.perf_counter()
        window_start = t0
        cpu_start = proc.cpu_seconds()
        for n in range(sessions):
            await one_device(proc.port, n)
            if (n + 1) % WINDOW == 0:
                now = time.perf_counter()
                rates.append(WINDOW / (now - window_start))
                window_start = now
                cpu = proc.cpu_seconds()
                cpu_ms.append((cpu - cpu_start) * 1000 / WINDOW)
                cpu_start = cpu
        total = time.perf_counter() - t0
        rss = proc.rss()
    finally:
        await proc.stop()
    return {
        "broker": broker,
        "persistence": persistence if broker == "mosquitto" else True,
        "sessions": sessions,
        "rate_per_s": sessions / total,
        "window_rates": [round(r) for r in rates],
        "window_cpu_ms_per_session": [round(c, 2) for c in cpu_ms],
        "rss_mb": round(rss / 1e6, 1),
    }


def write_sessions(data_dir: Path, sessions: int, offsets: bool = False) -> float:
    """N session records as the gateway writes them (gateway.session.registry), via the store's
    writer; with `offsets`, also the committed offset a subscription gets (store.offsets)."""
    from gateway.session.model import Session, SubscriptionState
    from gateway.session.registry import SESSION_KEY_PREFIX
    from store import MessageStore, StoreConfig
    from topicmap import Router, TopicFilter

    t0 = time.perf_counter()
    router = Router()
    store = MessageStore.open(StoreConfig(data_dir=data_dir))
    try:
        batch: list[tuple[str, bytes | None]] = []
        now = int(time.time() * 1000)
        for n in range(sessions):
            cid = f"dev-{n}"
            # MQTT 3.1.1, clean session 0: the default session expiry (7 days)
            s = Session(cid, 4, 7 * 24 * 3600)
            s.disconnected_at_ms = now
            text = f"dev/{n}/cmd"
            queue = router.add(TopicFilter(text))
            router.remove(text)
            s.add_subscription(SubscriptionState(text, queue, None, 1))
            if offsets:
                store.offsets.commit(cid, queue, 0)
            batch.append((SESSION_KEY_PREFIX + cid, json.dumps(s.to_json()).encode()))
            if len(batch) >= 10_000:
                store.append_state(batch)
                batch = []
        store.append_state(batch)
        store.sync_state()
    finally:
        store.close()
    return time.perf_counter() - t0


def _vm(pid: int, field: str) -> int:
    """A /proc/<pid>/status memory figure in bytes: VmHWM (peak RSS), VmRSS."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


async def _first_connack(port: int, deadline: float) -> None:
    while time.perf_counter() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        try:
            writer.write(wire.connect("probe", clean_session=True))
            first, _ = await asyncio.wait_for(_read_packet(reader), deadline - time.perf_counter())
            if first >> 4 == wire.CONNACK:
                return
        except (OSError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.05)
        finally:
            writer.close()
    raise TimeoutError("no CONNACK")


async def restart(
    sessions: int, workdir: Path, data: Path | None = None, offsets: bool = False
) -> dict[str, object]:
    """`data`: a data directory this command wrote before, reused as is."""
    write_s = 0.0
    if data is None:
        data = workdir / "data"
        write_s = write_sessions(data, sessions, offsets)
    state_bytes = sum(p.stat().st_size for p in (data / "state").iterdir())
    port = free_port()
    exe = Path(sys.executable).parent / "lmqtt"
    cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)]
    cmd += ["--sys-interval", "0", "--log-level", "WARNING"]
    log = open(workdir / "lmqtt.log", "ab")  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        await _first_connack(port, t0 + 600)
        serving_s = time.perf_counter() - t0
        peak, now_rss = _vm(p.pid, "VmHWM"), _vm(p.pid, "VmRSS")
        times = psutil.Process(p.pid).cpu_times()
        cpu_s = times.user + times.system  # what a loaded host's wall time distorts least
    finally:
        p.terminate()
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
    return {
        "sessions": sessions,
        "committed_offsets": offsets,
        "state_log_mb": round(state_bytes / 1e6, 1),
        "records_written_s": round(write_s, 1),
        "start_to_first_connack_s": round(serving_s, 2),
        "cpu_s_to_first_connack": round(cpu_s, 2),
        "peak_rss_mb": round(peak / 1e6, 1),
        "rss_serving_mb": round(now_rss / 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("create")
    c.add_argument("--sessions", type=int, default=10_000)
    c.add_argument("--brokers", nargs="+", default=["lmqtt", "mosquitto"])
    c.add_argument("--mosquitto-memory", action="store_true", help="Mosquitto without persistence")
    r = sub.add_parser("restart")
    r.add_argument("--sessions", type=int, default=1_000_000)
    r.add_argument("--data", type=Path, default=None, help="reuse this written data directory")
    r.add_argument(
        "--offsets", action="store_true", help="also a committed offset per subscription"
    )
    for p in (c, r):
        p.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="lmqtt-sessions-", dir=args.dir))
    try:
        if args.what == "create":
            keep = not args.mosquitto_memory
            results = [asyncio.run(create(b, args.sessions, workdir, keep)) for b in args.brokers]
            for res in results:
                print(json.dumps(res))
            if len(results) == 2:
                a, b = (float(str(x["rate_per_s"])) for x in results)
                print(f"rate {results[0]['broker']} / {results[1]['broker']}: {a / b:.2f}")
        else:
            res = asyncio.run(restart(args.sessions, workdir, args.data, args.offsets))
            print(json.dumps(res))
    finally:
        if os.environ.get("KEEP_BENCH_DIR") is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
