"""Persistent sessions: how fast a fleet gets them, and how fast a gateway full of them restarts.

    python -m bench.sessions_bench create [--sessions 10000] [--brokers lmqtt mosquitto]
        [--clients 4] [--workers 2] [--flush async|sync]
    python -m bench.sessions_bench restart [--sessions 1000000]

``create``: devices connect over MQTT 3.1.1 with clean session 0, each subscribes to its own
``dev/<n>/cmd`` (QoS 1), waits for the SUBACK, disconnects and waits for the broker to close.
``--clients K`` clients do this at the same time, each creating sessions one after another
(K > 1: the broker's concurrent session writes can share one fsync, ``--flush sync``), in
``--workers W`` generator processes (bare asyncio protocols on uvloop). The rate is reported
per window of 1,000 sessions (0-1k, 1k-2k, ...), with the broker's CPU time per session and
the generator's CPU (all its processes) in each window, so a broker that slows down as its
sessions accumulate shows it, and so does a generator that was the limit: a window where one
generator process was busy >= GENERATOR_BOUND of a core is listed in
``generator_bound_windows`` (give it more ``--workers`` then); when that is more than
INVALID_BOUND_SHARE of a broker's windows, its rate is the generator's, and the printed ratio
says INVALID instead of counting it. Brokers run one after the other
on the same host (Mosquitto with persistence on, autosave every second, the closest to lmqtt,
which always stores; or without it: --mosquitto-memory). ``session-floor`` (bench/
session_floor.py) is a bare uvloop protocol answering the same exchange with no work of its
own: what any broker on uvloop pays per session.

``restart``: N persistent sessions with one subscription each are written straight into a
data directory's state log (the records the gateway itself writes, through the store's
writer), then ``lmqtt serve`` is started on it; reported: the time from the process start to
the first CONNACK (the gateway serving, every session restored) and the peak RSS by then.

Figures taken on a shared, loaded host: compare the ratios of one run, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench import wire  # noqa: E402
from bench.brokers import LMQTT_BROKERS, BrokerOptions, BrokerProcess, free_port  # noqa: E402
from bench.report import _cpu_model as cpu_model  # noqa: E402

WINDOW = 1000
#: A generator process busy this share of a core in a window was the limit of that window's
#: rate (the broker may have had more to give): the window is flagged.
GENERATOR_BOUND = 0.9
#: A broker's rate whose generator was the limit in more than this share of the windows is a
#: floor, not the broker's: the ratio of such a run does not count.
INVALID_BOUND_SHARE = 0.25
#: How often the parent reads the workers' completion counters (window boundaries).
POLL_S = 0.002


class _Exchange(asyncio.Protocol):
    """One device's session: CONNECT (clean session 0) -> CONNACK, SUBSCRIBE -> SUBACK,
    DISCONNECT, then the broker closes the connection (so the TIME_WAIT is the broker's and
    100,000 connections in a row do not run the generator out of ports). A bare protocol on
    uvloop: the generator must cost far less than the broker it measures."""

    def __init__(self, n: int, done: asyncio.Future[None]) -> None:
        self.n = n
        self.done = done
        self.buf = b""
        self.step = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(wire.connect(f"dev-{self.n}", clean_session=False, keep_alive=60))  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        packets, used = wire.split_packets(self.buf)
        self.buf = self.buf[used:]
        for first, body in packets:
            self._packet(first >> 4, body)

    def _packet(self, kind: int, body: memoryview) -> None:
        assert self.transport is not None
        if self.step == 0 and kind == wire.CONNACK and body[1] == 0:
            self.step = 1
            self.transport.write(wire.subscribe(1, [f"dev/{self.n}/cmd"], 1))
        elif self.step == 1 and kind == wire.SUBACK and body[2] < 0x80:
            self.step = 2
            self.transport.write(wire.DISCONNECT_PACKET)
        else:
            self._fail(
                RuntimeError(f"dev-{self.n}: step {self.step}: packet {kind} {bytes(body).hex()}")
            )

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self.step == 2:
            self.done.set_result(None)
        else:
            self.done.set_exception(
                exc or RuntimeError(f"dev-{self.n}: closed at step {self.step}")
            )


async def _client(port: int, numbers: Iterator[int], count: Any, slot: int) -> None:
    """One client: sessions one after another, the next number each time."""
    loop = asyncio.get_running_loop()
    for n in numbers:
        done: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(functools.partial(_Exchange, n, done), "127.0.0.1", port)
        await asyncio.wait_for(done, 60)
        count[slot] += 1


def _worker(port: int, numbers: range, clients: int, count: Any, slot: int, go: Any) -> None:
    """A generator process: `clients` concurrent clients share `numbers`, from the moment
    `go` is set (the process started and imported before the clock starts)."""
    import uvloop

    count[slot] = -1  # ready
    go.wait()
    count[slot] = 0

    async def run() -> None:
        it = iter(numbers)
        await asyncio.gather(*(_client(port, it, count, slot) for _ in range(clients)))

    uvloop.run(run())


class GeneratorCpu:
    """The generator's CPU seconds: its worker processes' and this process's."""

    def __init__(self, workers: list[psutil.Process]) -> None:
        self.workers = workers
        self.me = psutil.Process()
        # Each worker's CPU seconds at its last read: a worker that has finished its share and
        # exited keeps what it used (left out, the sum fell and a window read negative cores).
        self.last = [0.0] * len(workers)

    def read(self) -> tuple[float, float]:
        """(CPU seconds of the workers and this process, the busiest worker's)."""
        for i, ps in enumerate(self.workers):
            with contextlib.suppress(psutil.Error):
                t = ps.cpu_times()
                self.last[i] = t.user + t.system
        t = self.me.cpu_times()
        return sum(self.last) + t.user + t.system, max(self.last, default=0.0)


async def create(
    broker: str,
    sessions: int,
    workdir: Path,
    persistence: bool = True,
    *,
    flush: str = "async",
    clients: int = 4,
    workers: int = 1,
) -> dict[str, object]:
    """Create `sessions` sessions with `workers` generator processes of `clients` concurrent
    clients each; per window of WINDOW sessions: rate, broker CPU and generator CPU."""
    opts = BrokerOptions(persistence=persistence, flush=flush)
    proc = BrokerProcess(broker, workdir / broker, opts)
    await proc.start()
    ctx = multiprocessing.get_context("spawn")
    count = ctx.RawArray("q", workers)  # sessions completed, per worker (one writer each)
    go = ctx.Event()
    procs = [
        ctx.Process(
            target=_worker, args=(proc.port, range(w, sessions, workers), clients, count, w, go)
        )
        for w in range(workers)
    ]
    rates: list[float] = []
    cpu_ms: list[float] = []  # broker CPU per session: what the host's load does not distort
    gen_cores: list[float] = []  # generator CPU (every process) per second of the window
    gen_ms: list[float] = []
    bound: list[int] = []  # windows where a generator process was the limit
    try:
        for p in procs:
            p.start()
        pss = [psutil.Process(p.pid) for p in procs]
        while not all(c == -1 for c in count):  # every process started and imported
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("a generator process did not start")
            await asyncio.sleep(0.01)
        go.set()

        gen_cpu = GeneratorCpu(pss).read

        t0 = time.perf_counter()
        window_start = t0
        cpu_start = proc.cpu_seconds()
        split_start = proc.cpu_split()
        gen_start, busiest_start = gen_cpu()
        last_n, last_t = 0, t0
        while True:
            await asyncio.sleep(POLL_S)
            n, now = sum(max(0, c) for c in count), time.perf_counter()
            if n >= (len(rates) + 1) * WINDOW:
                # The boundary's time, interpolated between this poll and the last.
                edge = (len(rates) + 1) * WINDOW
                at = last_t + (now - last_t) * (edge - last_n) / max(1, n - last_n)
                wall = at - window_start
                rates.append(WINDOW / wall)
                cpu = proc.cpu_seconds()
                cpu_ms.append((cpu - cpu_start) * 1000 / WINDOW)
                gen, busiest = gen_cpu()
                gen_cores.append((gen - gen_start) / wall)
                gen_ms.append((gen - gen_start) * 1000 / WINDOW)
                if (busiest - busiest_start) / wall >= GENERATOR_BOUND:
                    bound.append(len(rates) - 1)
                print(
                    f"{broker} {edge}: {rates[-1]:.0f}/s, broker {cpu_ms[-1]:.3f} ms CPU"
                    f" per session, generator {gen_cores[-1]:.2f} cores",
                    file=sys.stderr,
                    flush=True,
                )
                window_start, cpu_start, gen_start, busiest_start = at, cpu, gen, busiest
            last_n, last_t = n, now
            if n >= sessions or not any(p.is_alive() for p in procs):
                break
        total = time.perf_counter() - t0
        user, system = (b - a for a, b in zip(split_start, proc.cpu_split(), strict=True))
        for p in procs:
            p.join(30)
            if p.exitcode:
                raise RuntimeError(f"generator process exited with {p.exitcode}")
        if sum(count) < sessions:
            raise RuntimeError(f"{sum(count)} of {sessions} sessions created")
        rss = proc.rss()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        await proc.stop()
    fifth = max(1, len(rates) // 5)
    return {
        "broker": broker,
        "cpu_model": cpu_model(),
        "persistence": persistence if broker == "mosquitto" else broker in LMQTT_BROKERS,
        "flush": flush if broker in LMQTT_BROKERS else None,
        "sessions": sessions,
        "clients": clients * workers,
        "generator_processes": workers,
        "rate_per_s": sessions / total,
        "first_fifth_per_s": round(statistics.mean(rates[:fifth])),
        "last_fifth_per_s": round(statistics.mean(rates[-fifth:])),
        "window_rates": [round(r) for r in rates],
        "window_cpu_ms_per_session": [round(c, 3) for c in cpu_ms],
        # The whole run's CPU per session, split: the broker's own code and the kernel's work.
        "user_ms_per_session": round(user * 1000 / sessions, 4),
        "system_ms_per_session": round(system * 1000 / sessions, 4),
        "window_generator_cores": [round(c, 2) for c in gen_cores],
        "window_generator_cpu_ms_per_session": [round(c, 3) for c in gen_ms],
        # Windows in which one generator process was busy >= GENERATOR_BOUND of a core: their
        # rate says what the generator could do, not the broker.
        "generator_bound_windows": bound,
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


def ratio_line(results: list[dict[str, object]]) -> str:
    """The rate ratio of two brokers' `create` results, marked INVALID when a generator was
    the limit of either in more than INVALID_BOUND_SHARE of its windows."""
    a, b = (float(str(r["rate_per_s"])) for r in results)
    line = f"rate {results[0]['broker']} / {results[1]['broker']}: {a / b:.2f}"
    for r in results:
        bound = r["generator_bound_windows"]
        windows = r["window_rates"]
        assert isinstance(bound, list) and isinstance(windows, list)
        if windows and len(bound) / len(windows) > INVALID_BOUND_SHARE:
            line += (
                f" INVALID: {r['broker']}'s generator was the limit in {len(bound)} of"
                f" {len(windows)} windows (give it more --workers)"
            )
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("create")
    c.add_argument("--sessions", type=int, default=10_000)
    c.add_argument("--brokers", nargs="+", default=["lmqtt", "mosquitto"])
    c.add_argument("--mosquitto-memory", action="store_true", help="Mosquitto without persistence")
    c.add_argument("--flush", choices=["async", "sync"], default="async", help="lmqtt's flush mode")
    c.add_argument(
        "--clients", type=int, default=4, help="concurrent clients per generator process"
    )
    c.add_argument(
        "--workers",
        type=int,
        default=2,
        help="generator processes (one cannot keep up with Mosquitto)",
    )
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
            results = [
                asyncio.run(
                    create(
                        b,
                        args.sessions,
                        workdir,
                        keep,
                        flush=args.flush,
                        clients=args.clients,
                        workers=args.workers,
                    )
                )
                for b in args.brokers
            ]
            for res in results:
                print(json.dumps(res))
            if len(results) == 2:
                print(ratio_line(results))
        else:
            res = asyncio.run(restart(args.sessions, workdir, args.data, args.offsets))
            print(json.dumps(res))
    finally:
        if os.environ.get("KEEP_BENCH_DIR") is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
