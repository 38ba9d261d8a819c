"""The device side of the fleet scenario: many device connections in one generator process.

Each device is a plain non-blocking socket (no client object, no Protocol): at connect it sends
CONNECT and SUBSCRIBE ``cmd/{d}`` in one write and reads CONNACK + SUBACK; while publishing it
sends its own PUBLISH to ``site/{d % 50}/dev/{d}/temp`` in its own ``send()`` (one TCP write per
message, as a device does), from a packet prefix built at connect. PUBACKs are read by one
reader callback per socket and only counted: a device receives nothing else (no one publishes
on ``cmd/#`` during a run), so the bytes read are 4 per PUBACK.

Pacing: the process owns ``rate`` messages per second spread evenly over its devices in turn
(device i sends every ``devices / rate`` s); a timer wakes every millisecond or so and sends
what is due. ``send_lag_ms`` says how late messages left against that schedule.

In-flight window (``window`` > 0, QoS 1): a device with that many PUBLISHes not yet
acknowledged sends nothing when its turn comes, as a real device's MQTT client waits for
PUBACKs (paho's max_inflight_messages, 1 on many embedded stacks); the turn is counted in
``held_back`` and the message is not expected. This is how an overloaded broker that holds
PUBACKs (or stops reading) slows devices down; without a window (0, the default) devices keep
writing whatever the broker does, and their messages wait in the sockets. ``puback_ms``:
each device's wait from its write to the PUBACK (PUBACKs of one connection come in order).

Commands on stdin (one per line): ``connect`` -> ``connected``; ``run <rate> <duration>`` ->
``result`` (repeatable: the capacity search reuses the connected fleet); ``stop``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from typing import Any

from bench import wire
from bench.loadgen import GC_PAUSES, Commands, emit, percentiles_ms, quiet_gc

SITES = 50
# Backends subscribed to site/{k}/# for k below this receive one more copy of the message.
SITE_BACKENDS = 5
CONNECT_CONCURRENCY = 200
KEEP_ALIVE_S = 60


def device_topic(device: int) -> str:
    return f"site/{device % SITES}/dev/{device}/temp"


def deliveries_per_message(device: int) -> int:
    """Backends reached by one message of ``device``: site/#, site/+/dev/+/temp, and
    site/{k}/# when the device's site k is one of the first SITE_BACKENDS."""
    return 2 + (1 if device % SITES < SITE_BACKENDS else 0)


class Fleet:
    """The connected devices of this process and their prebuilt packets."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.host: str = spec["host"]
        self.port = int(spec["port"])
        self.source: str = spec.get("source", "")
        self.devices: list[int] = list(range(int(spec["first"]), int(spec["last"])))
        self.qos = int(spec.get("qos", 1))
        self.payload = int(spec.get("payload", 64))
        self.prefix = spec.get("prefix", "dev")
        self.window = int(spec.get("window", 0)) if self.qos else 0
        self.socks: list[socket.socket] = []
        # Per device: bytes of PUBACKs read (4 each) and the write times of those unanswered.
        self.ack_bytes: list[int] = []
        self.unacked: list[deque[int]] = []
        self.puback_ns: list[int] = []
        self.templates: list[wire.PublishTemplate] = []
        self.fanout: list[int] = []
        self.received = 0
        self.lost = 0
        self.failures = 0

    async def connect_all(self) -> None:
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
        slots: list[socket.socket | None] = [None] * len(self.devices)

        async def one(index: int, device: int) -> None:
            async with gate:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    if self.source:
                        sock.bind((self.source, 0))
                    await asyncio.wait_for(loop.sock_connect(sock, (self.host, self.port)), 30)
                    hello = wire.connect(
                        f"{self.prefix}-{device}", clean_session=True, keep_alive=KEEP_ALIVE_S
                    ) + wire.subscribe(1, [f"cmd/{device}"], 1)
                    await loop.sock_sendall(sock, hello)
                    got = b""
                    while len(got) < 9:  # CONNACK (4) + SUBACK (5)
                        chunk = await asyncio.wait_for(loop.sock_recv(sock, 64), 30)
                        if not chunk:
                            raise ConnectionError("closed during CONNECT")
                        got += chunk
                    if got[0] >> 4 != wire.CONNACK or got[3] != 0 or got[8] == 0x80:
                        raise ConnectionError(f"refused: {got.hex()}")
                except (OSError, TimeoutError, ConnectionError):
                    self.failures += 1
                    sock.close()
                    return
                slots[index] = sock

        await asyncio.gather(*(one(i, d) for i, d in enumerate(self.devices)))
        kept = [(d, s) for d, s in zip(self.devices, slots, strict=True) if s is not None]
        self.devices = [d for d, _ in kept]
        self.socks = [s for _, s in kept]
        self.templates = [
            wire.PublishTemplate(device_topic(d), self.qos, self.payload) for d in self.devices
        ]
        self.fanout = [deliveries_per_message(d) for d in self.devices]
        self.ack_bytes = [0] * len(self.socks)
        self.unacked = [deque() for _ in self.socks]
        for index, sock in enumerate(self.socks):
            loop.add_reader(sock.fileno(), self._on_readable, sock, index)

    def _on_readable(self, sock: socket.socket, index: int) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.lost += 1
            asyncio.get_running_loop().remove_reader(sock.fileno())
            return
        self.received += len(data)
        if self.qos:
            before = self.ack_bytes[index] // 4
            self.ack_bytes[index] += len(data)
            unacked = self.unacked[index]
            now = time.monotonic_ns()
            for _ in range(min(self.ack_bytes[index] // 4 - before, len(unacked))):
                self.puback_ns.append(now - unacked.popleft())

    async def run(self, rate: float, duration: float) -> dict[str, Any]:
        """Send ``rate`` msg/s for ``duration`` s, device after device, one write each."""
        n = len(self.socks)
        socks, templates, fanout = self.socks, self.templates, self.fanout
        received0 = self.received
        monotonic_ns = time.monotonic_ns
        window, unacked = self.window, self.unacked
        self.puback_ns = []
        held_back = 0
        per_device = [0] * n  # messages each device wrote (the fairness of a broker's holds)
        lag_ns: list[int] = []
        sent = 0
        expected = 0
        failed_sends = 0
        start = time.monotonic()
        start_ns = monotonic_ns()
        # A process whose devices all failed to connect is handed rate 0: it sends nothing.
        interval_ns = 1e9 / rate if rate > 0 else 0.0
        deadline = start + duration
        total = int(rate * duration)
        cursor = 0
        while sent < total and n:
            now = time.monotonic()
            if now >= deadline + 1.0:
                break
            due = min(int((now - start) * rate), total) - sent
            if due <= 0:
                await asyncio.sleep(max(start + (sent + 1) / rate - now, 0.001))
                continue
            stamp = monotonic_ns()
            for _ in range(due):
                index = cursor
                cursor = cursor + 1 if cursor + 1 < n else 0
                packet_id = (sent % 65535) + 1
                waiting = unacked[index]
                if window and len(waiting) >= window:
                    held_back += 1  # the device waits for its PUBACKs
                    sent += 1
                    continue
                try:
                    socks[index].send(templates[index].encode(sent, stamp, packet_id))
                except OSError:
                    failed_sends += 1
                else:
                    expected += fanout[index]
                    per_device[index] += 1
                    if self.qos:
                        waiting.append(stamp)
                lag_ns.append(stamp - start_ns - int((sent + 1) * interval_ns))
                sent += 1
            await asyncio.sleep(0)
        end = time.monotonic()
        if self.qos:
            settle = time.monotonic() + 5.0
            while (self.received - received0) // 4 < sent - failed_sends - held_back:
                if time.monotonic() > settle:
                    break
                await asyncio.sleep(0.01)
        written = sent - failed_sends - held_back
        return {
            "sent": written,
            "failed_sends": failed_sends,
            "held_back": held_back,
            "per_device": per_device,
            "puback_ms": percentiles_ms(self.puback_ns),
            "acked": (self.received - received0) // 4 if self.qos else written,
            "expected": expected,
            "start": start,
            "end": end,
            "lost_connections": self.lost,
            "send_lag_ms": percentiles_ms(lag_ns),
            "gc_ms": percentiles_ms(GC_PAUSES.pauses_ns),
        }

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self.socks:
            try:
                loop.remove_reader(sock.fileno())
                sock.send(wire.DISCONNECT_PACKET)
            except OSError:
                pass
            sock.close()


async def run_fleet(spec: dict[str, Any], commands: Commands) -> None:
    fleet = Fleet(spec)
    emit("ready")
    try:
        while True:
            command = (await commands.next()).split()
            if command[0] == "connect":
                start = time.monotonic()
                await fleet.connect_all()
                quiet_gc()
                emit(
                    "connected",
                    connected=len(fleet.socks),
                    failures=fleet.failures,
                    start=start,
                    end=time.monotonic(),
                )
            elif command[0] == "run":
                result = await fleet.run(float(command[1]), float(command[2]))
                emit("result", **result)
            else:
                break
    finally:
        fleet.close()
