"""The lean load generator: one OS process per role, driven over stdin, reporting JSON on stdout.

Run as ``python -m bench.loadgen '<json spec>'``. The orchestrator (bench.runner) writes one
command per line on stdin (``start``, ``report``, ``stop``) and reads one JSON object per line
from stdout (``ready``, ``progress``, ``result``, ``error``). Roles:

- ``sub``: N connections, each subscribing to its filters; counts deliveries, acknowledges QoS 1,
  optionally measures latency (from the payload's send timestamp) and records sequence numbers.
- ``pub``: one connection publishing a fixed-size payload round-robin over topics, at full speed
  or at a given rate, with a window of unacknowledged QoS 1 packets; stops after a duration or a
  count, or when the broker goes away (durability), and reports which sequence numbers were
  acknowledged.
- ``fleet``: many device connections, one paced PUBLISH per write each (bench.fleetgen).
- ``idle``: N connections that connect and then stay silent (memory per connection, connect rate).

Timestamps are ``time.monotonic()``: CLOCK_MONOTONIC is system-wide on Linux, so the orchestrator
and every worker process share one clock.

Self-check (paced runs): a latency figure is only the broker's if the generator kept its schedule.
The publisher records how late each message left against its schedule (``send_lag_ms``: the
process was not woken or not given a core in time) and the PUBACK round trip of each QoS 1
message (``puback_ms``: one broker hop, no subscriber in the path); every worker reports its own
garbage-collector pauses (``gc_ms``). The cyclic collector is switched off while measuring: the
workers build no reference cycles, and a collection walking the sample lists would show up as
broker latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import mmap
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

from bench import wire

# Latency "after the start" counts messages sent this long after a phase's first message.
STEADY_AFTER_NS = 1_000_000_000


class DeliveryBoard:
    """Delivery counters shared between processes through a small mapped file.

    Each subscriber process owns one 8-byte slot and writes its running count there; the
    publisher reads the sum to stay at most ``lead`` messages ahead of delivery (closed loop),
    so a run measures the rate a broker sustains rather than how fast it can queue.

        +------------------+------------------+-----+
        | slot 0: u64 (LE) | slot 1: u64 (LE) | ... |
        +------------------+------------------+-----+
    """

    SLOT = struct.Struct("<Q")

    def __init__(self, path: str, slots: int) -> None:
        self.slots = slots
        with open(path, "r+b") as handle:
            self.map = mmap.mmap(handle.fileno(), slots * self.SLOT.size)

    @classmethod
    def create(cls, path: str, slots: int) -> None:
        with open(path, "wb") as handle:
            handle.write(b"\x00" * cls.SLOT.size * slots)

    def set(self, slot: int, value: int) -> None:
        self.SLOT.pack_into(self.map, slot * self.SLOT.size, value)

    def total(self) -> int:
        size = self.SLOT.size
        return sum(self.SLOT.unpack_from(self.map, i * size)[0] for i in range(self.slots))


@dataclass(slots=True)
class Deliveries:
    """What every subscriber connection of a worker received, merged."""

    count: int = 0
    first: float = 0.0
    last: float = 0.0
    latencies_ns: list[int] = field(default_factory=list)
    # Latencies of the messages sent STEADY_AFTER_NS or more after the phase's first one (by
    # their send stamps): the run without its start, whose first publish of every device
    # (a topic the broker has not routed yet) weighs on the tail.
    steady_ns: list[int] = field(default_factory=list)
    first_sent_ns: int = 0
    seqs: list[int] = field(default_factory=list)
    measure_latency: bool = False
    track_seqs: bool = False
    skip_latency: int = 0
    board: DeliveryBoard | None = None
    slot: int = 0


class BenchClient(asyncio.Protocol):
    """One MQTT connection: moves bytes, answers PUBLISH QoS 1 with PUBACK, wakes waiters."""

    def __init__(self, deliveries: Deliveries | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.deliveries = deliveries
        loop = asyncio.get_running_loop()
        self.connack: asyncio.Future[int] = loop.create_future()
        self.suback: asyncio.Future[bytes] = loop.create_future()
        self.lost = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.on_puback: Any = None
        self.on_lost: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only duck-typed ones.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()
        self.writable.set()
        if self.on_lost is not None:
            self.on_lost()
        for fut in (self.connack, self.suback):
            if not fut.done():
                fut.set_exception(ConnectionError("connection lost"))
                fut.exception()  # nobody may be waiting any more: mark it retrieved

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        if self.buffer:
            self.buffer += data
            data = bytes(self.buffer)
        packets, consumed = wire.split_packets(data)
        # Views point into the immutable ``data``; only the unparsed tail is kept.
        self.buffer = bytearray(data[consumed:]) if consumed < len(data) else bytearray()
        acks: list[bytes] = []
        deliveries = self.deliveries
        now_ns = 0
        before = deliveries.count if deliveries is not None else 0
        for first, body in packets:
            kind = first >> 4
            if kind == wire.PUBLISH and deliveries is not None:
                qos, packet_id, payload = wire.publish_fields(first, body)
                if qos:
                    acks.append(wire.puback(packet_id))
                deliveries.count += 1
                if deliveries.measure_latency or deliveries.track_seqs:
                    seq, sent_ns = wire.PAYLOAD_HEADER.unpack_from(payload)
                    if deliveries.track_seqs:
                        deliveries.seqs.append(seq)
                    if deliveries.measure_latency:
                        if not now_ns:
                            now_ns = time.monotonic_ns()
                        if deliveries.skip_latency:
                            deliveries.skip_latency -= 1
                        else:
                            deliveries.latencies_ns.append(now_ns - sent_ns)
                            first_sent = deliveries.first_sent_ns
                            if not first_sent:
                                deliveries.first_sent_ns = sent_ns
                            elif sent_ns - first_sent >= STEADY_AFTER_NS:
                                deliveries.steady_ns.append(now_ns - sent_ns)
            elif kind == wire.PUBACK:
                if self.on_puback is not None:
                    self.on_puback((body[0] << 8) | body[1])
            elif kind == wire.CONNACK:
                if not self.connack.done():
                    self.connack.set_result(body[1])
            elif kind == wire.SUBACK and not self.suback.done():
                self.suback.set_result(bytes(body[2:]))
        if deliveries is not None and deliveries.count != before:
            now = time.monotonic()
            if not deliveries.first:
                deliveries.first = now
            deliveries.last = now
            if deliveries.board is not None:
                deliveries.board.set(deliveries.slot, deliveries.count)
        if acks and self.transport is not None:
            self.transport.write(b"".join(acks))

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self, graceful: bool = True) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if graceful:
                self.transport.write(wire.DISCONNECT_PACKET)
            self.transport.close()


async def open_client(
    host: str,
    port: int,
    client_id: str,
    clean: bool = True,
    deliveries: Deliveries | None = None,
    timeout: float = 10.0,
) -> BenchClient:
    loop = asyncio.get_running_loop()
    _, client = await asyncio.wait_for(
        loop.create_connection(lambda: BenchClient(deliveries), host, port), timeout
    )
    client.write(wire.connect(client_id, clean_session=clean))
    code = await asyncio.wait_for(client.connack, timeout)
    if code != 0:
        client.close(graceful=False)
        raise ConnectionError(f"CONNACK return code {code} for {client_id}")
    return client


class GcPauses:
    """Durations of this process's garbage collections, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses_ns: list[int] = []
        self._started = 0

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started:
            self.pauses_ns.append(time.perf_counter_ns() - self._started)


def quiet_gc() -> None:
    """Freeze what setup allocated and stop automatic collections for the measured phase."""
    gc.collect()
    gc.freeze()
    gc.disable()
    GC_PAUSES.pauses_ns.clear()  # setup's collections are not part of the measured phase


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class Commands:
    """Lines from the orchestrator on stdin."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    async def next(self) -> str:
        line = await self.reader.readline()
        return line.decode().strip() or "stop"


async def stdin_commands() -> Commands:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return Commands(reader)


def percentiles_ms(samples_ns: list[int]) -> dict[str, float]:
    if not samples_ns:
        return {}
    ordered = sorted(samples_ns)
    size = len(ordered)

    def at(q: float) -> float:
        return ordered[min(size - 1, int(q * size))] / 1e6

    return {
        "p50": at(0.50),
        "p99": at(0.99),
        "p999": at(0.999),
        "max": ordered[-1] / 1e6,
        "samples": float(size),
    }


async def run_sub(spec: dict[str, Any], commands: Commands) -> None:
    deliveries = Deliveries(
        measure_latency=bool(spec.get("latency")),
        track_seqs=bool(spec.get("track")),
        skip_latency=int(spec.get("skip_latency", 0)),
        board=DeliveryBoard(spec["board"], int(spec["slots"])) if spec.get("board") else None,
        slot=int(spec.get("slot", 0)),
    )
    clients: list[BenchClient] = []
    for conn in spec["connections"]:
        client = await open_client(
            spec["host"], spec["port"], conn["id"], conn.get("clean", True), deliveries
        )
        if conn.get("filters"):
            client.write(wire.subscribe(1, conn["filters"], spec.get("qos", 0)))
            granted = await asyncio.wait_for(client.suback, 10)
            if any(code == 0x80 for code in granted):
                raise ConnectionError(f"subscription refused for {conn['id']}")
        clients.append(client)
    quiet_gc()
    emit("ready")
    while True:
        command = await commands.next()
        if command == "report":
            emit("progress", count=deliveries.count, first=deliveries.first, last=deliveries.last)
            continue
        if command == "snapshot":
            # One phase of a repeated measurement (fleet capacity search): the latency of what
            # arrived since the last snapshot, then a fresh sample list and warm-up.
            emit(
                "snapshot",
                count=deliveries.count,
                last=deliveries.last,
                latency_ms=percentiles_ms(deliveries.latencies_ns),
                steady_latency_ms=percentiles_ms(deliveries.steady_ns),
            )
            deliveries.latencies_ns = []
            deliveries.steady_ns = []
            deliveries.first_sent_ns = 0
            deliveries.skip_latency = int(spec.get("skip_latency", 0))
            continue
        break
    for client in clients:
        client.close(graceful=True)
    await asyncio.sleep(0.05)
    emit(
        "result",
        count=deliveries.count,
        first=deliveries.first,
        last=deliveries.last,
        latency_ms=percentiles_ms(deliveries.latencies_ns),
        steady_latency_ms=percentiles_ms(deliveries.steady_ns),
        gc_ms=percentiles_ms(GC_PAUSES.pauses_ns),
        seqs=deliveries.seqs if deliveries.track_seqs else None,
    )


async def run_pub(spec: dict[str, Any], commands: Commands) -> None:
    qos = int(spec.get("qos", 0))
    topics: list[str] = spec["topics"]
    templates = [wire.PublishTemplate(t, qos, int(spec.get("payload", 64))) for t in topics]
    n_templates = len(templates)
    rate: float | None = spec.get("rate")
    duration: float = float(spec.get("duration", 5.0))
    count_limit: int | None = spec.get("count")
    window = int(spec.get("window", 256))
    track = bool(spec.get("track"))
    board = DeliveryBoard(spec["board"], int(spec["slots"])) if spec.get("board") else None
    per_message = int(spec.get("per_message", 1))
    lead = int(spec.get("lead", 1000)) * per_message
    shares = max(1, int(spec.get("shares", 1)))
    forgiven = 0  # deliveries given up on (a broker dropped QoS 0 messages)
    stalled_since = 0.0
    # ``connections`` publishing connections take the batches in turn (one write each); packet
    # ids are drawn from one sequence, so one in-flight table serves them all.
    base_id = spec.get("id", "bench-pub")
    clients = [
        await open_client(spec["host"], spec["port"], base_id if i == 0 else f"{base_id}-{i}")
        for i in range(max(1, int(spec.get("connections", 1))))
    ]
    client = clients[0]
    turn = 0
    inflight: dict[int, int] = {}
    acked_seqs: list[int] = []
    acked = 0
    # Self-check of paced runs: send time of each in-flight packet id (PUBACK round trip) and
    # how late each message left against its schedule.
    paced = rate is not None
    sent_ns: dict[int, int] = {}
    puback_ns: list[int] = []
    send_lag_ns: list[int] = []
    skip_checks = int(spec.get("skip_checks", 0))
    room = asyncio.Event()
    room.set()

    def on_puback(packet_id: int) -> None:
        nonlocal acked
        seq = inflight.pop(packet_id, None)
        if seq is None:
            return
        if paced:
            sent = sent_ns.pop(packet_id, 0)
            if sent and seq >= skip_checks:
                puback_ns.append(monotonic_ns() - sent)
        acked += 1
        if track:
            acked_seqs.append(seq)
        if len(inflight) <= window // 2:
            room.set()

    monotonic_ns = time.monotonic_ns
    lost = asyncio.Event()  # any connection lost ends the run
    for each in clients:
        each.on_puback = on_puback
        each.on_lost = room.set
        each.lost = lost
    quiet_gc()
    emit("ready")
    await commands.next()
    start = time.monotonic()
    start_ns = monotonic_ns()
    interval_ns = 1e9 / rate if rate else 0.0
    deadline = start + duration
    seq = 0
    batch_max = 64 if rate is None else 1_000_000
    while not client.lost.is_set():
        now = time.monotonic()
        if now >= deadline or (count_limit is not None and seq >= count_limit):
            break
        if not client.writable.is_set():
            await client.writable.wait()
            continue
        want = batch_max
        if board is not None:
            # Several publisher processes: each counts an even share of the deliveries as its own.
            delivered = board.total() // shares
            room_left = (lead - (seq * per_message - delivered - forgiven)) // per_message
            if room_left <= 0:
                if not stalled_since:
                    stalled_since = now
                elif now - stalled_since > 1.0:
                    # Nothing moved for a second: the broker dropped what is outstanding.
                    forgiven = seq * per_message - delivered
                    stalled_since = 0.0
                await asyncio.sleep(0.001)
                continue
            stalled_since = 0.0
            want = min(want, room_left)
        if rate is not None:
            want = int((now - start) * rate) - seq
            if want <= 0:
                # Sleep until the next message is due, at least 1 ms: uvloop rounds a delay
                # to whole milliseconds and runs one under 0.5 ms on the next loop pass, which
                # would spin. So a message leaves up to ~1 ms after its slot (the timestamp is
                # taken at the write, not at the slot); send_lag_ms shows how late it was.
                await asyncio.sleep(max(start + (seq + 1) / rate - now, 0.001))
                continue
        if count_limit is not None:
            want = min(want, count_limit - seq)
        if qos:
            want = min(want, window - len(inflight))
            if want <= 0:
                room.clear()
                await room.wait()
                continue
        stamp = monotonic_ns()
        packets = []
        for _ in range(want):
            packet_id = 0
            if qos:
                packet_id = seq % 65535 + 1
                inflight[packet_id] = seq
                if paced:
                    sent_ns[packet_id] = stamp
            if paced and seq >= skip_checks:
                send_lag_ns.append(stamp - start_ns - int((seq + 1) * interval_ns))
            packets.append(templates[seq % n_templates].encode(seq, stamp, packet_id))
            seq += 1
        # The stamp is taken just before this write: uvloop sends at once (no write buffer
        # while the socket is writable), so it is when the bytes reach the socket.
        client.write(b"".join(packets))
        if len(clients) > 1:
            turn = (turn + 1) % len(clients)
            client = clients[turn]
        await asyncio.sleep(0)
    end = time.monotonic()
    if qos:
        settle = time.monotonic() + 5.0
        while inflight and not client.lost.is_set() and time.monotonic() < settle:
            room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.wait(), 0.1)
    acked_end = time.monotonic()
    lost_connection = client.lost.is_set()
    emit(
        "result",
        sent=seq,
        acked=acked if qos else seq,
        start=start,
        end=end,
        acked_end=acked_end,
        lost_connection=lost_connection,
        acked_seqs=acked_seqs if track else None,
        send_lag_ms=percentiles_ms(send_lag_ns),
        puback_ms=percentiles_ms(puback_ns),
        gc_ms=percentiles_ms(GC_PAUSES.pauses_ns),
    )
    # The publishers stay connected until the orchestrator has drained the subscribers, as
    # devices do. amqtt 0.12 sends PUBACK once a PUBLISH is queued for routing, and its client
    # loop stops routing that queue at DISCONNECT: a disconnect right after the last PUBACK
    # could lose what a loaded broker had not routed yet.
    with contextlib.suppress(Exception):
        await commands.next()
    for each in clients:
        each.close(graceful=not lost_connection)
    await asyncio.sleep(0.05)


async def run_idle(spec: dict[str, Any], commands: Commands) -> None:
    count = int(spec["count"])
    concurrency = int(spec.get("concurrency", 100))
    deadline_s = float(spec.get("timeout", 30.0))
    prefix = spec.get("prefix", "idle")
    gate = asyncio.Semaphore(concurrency)
    clients: list[BenchClient] = []
    failures = 0

    async def one(index: int) -> None:
        nonlocal failures
        async with gate:
            try:
                clients.append(await open_client(spec["host"], spec["port"], f"{prefix}-{index}"))
            except (OSError, TimeoutError, ConnectionError):
                failures += 1

    emit("ready")
    await commands.next()
    start = time.monotonic()
    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    _done, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for task in pending:
        task.cancel()
    end = time.monotonic()
    emit(
        "connected",
        connected=len(clients),
        failures=failures + len(pending),
        start=start,
        end=end,
    )
    await commands.next()
    for client in clients:
        client.close(graceful=False)
    emit("result", connected=len(clients))


GC_PAUSES = GcPauses()
ROLES = {"sub": run_sub, "pub": run_pub, "idle": run_idle}


async def main_async(spec: dict[str, Any]) -> None:
    commands = await stdin_commands()
    if spec["role"] == "fleet":
        from bench.fleetgen import run_fleet  # the fleet module builds on this one

        ROLES["fleet"] = run_fleet
    try:
        await ROLES[spec["role"]](spec, commands)
    except (OSError, TimeoutError, ConnectionError, wire.WireError) as exc:
        emit("error", message=f"{type(exc).__name__}: {exc}")


def main() -> None:
    spec = json.loads(sys.argv[1])
    GC_PAUSES.install()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
        asyncio.run(main_async(spec))
    else:
        uvloop.run(main_async(spec))


if __name__ == "__main__":
    main()
