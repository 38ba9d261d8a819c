"""One simulator run: devices publishing, subscribers receiving, and the loss verdict.

Timeline of a run (all bounded):

    connect subscribers + SUBSCRIBE     connect devices
    |---------------------------------->|--- publishing: `duration` s or `max_messages` ---|
                                           persistent subscribers leave and come back        |
                                                                         drain: <= `drain_timeout` s
                                                       disconnect, drop the persistent sessions

A Ctrl-C (``stop()``) ends publishing early and still drains and reports; a second one
(``abort()``) skips the rest of the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from sim.client import PublishFailed, SimClient
from sim.errors import SimError
from sim.ledger import DeliveryLedger, message_key
from sim.plan import SubscriberPlan, plan_subscribers
from sim.telemetry import DeviceIdentity, Reading, TelemetrySource, parse_reading

MAX_DEVICES = 10_000
MAX_SUBSCRIBERS = 1_000
MAX_RATE = 1_000.0
MAX_DURATION = 24 * 3600.0
MAX_MESSAGES = 50_000_000
CONNECT_CONCURRENCY = 32  # simultaneous CONNECTs at start-up: no thundering herd
CLIENT_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What to simulate. ``rate`` is messages per second per device."""

    host: str = "127.0.0.1"
    port: int = 1883
    # Nodes of one gateway cluster, (host, port) each; empty: just `host`:`port`. Devices and
    # subscribers are spread over them (client i starts at address i mod n) and fail over to
    # the next address when theirs stops answering.
    gateways: tuple[tuple[str, int], ...] = ()
    devices: int = 10
    rate: float = 1.0
    duration: float = 10.0
    subscribers: int = 4
    qos: int = 1
    seed: int | None = None
    sites: int = 4
    max_messages: int = 1_000_000
    drain_timeout: float = 10.0
    connect_timeout: float = 10.0
    max_inflight: int = 8  # unacknowledged publishes per device
    name: str = "sim"  # subscribers' client-id prefix: one name per simultaneous simulator
    drop_sessions: bool = False  # discard the persistent sessions at the end
    run_id: str | None = None  # default: random; tags every payload of this run
    username: str | None = None
    password: str | None = None

    def check(self) -> None:
        """Raise SimError unless every setting is within the simulator's bounds."""
        problems = []
        if not 0 <= self.devices <= MAX_DEVICES:
            problems.append(f"devices must be 0..{MAX_DEVICES}")
        if not 0 <= self.subscribers <= MAX_SUBSCRIBERS:
            problems.append(f"subscribers must be 0..{MAX_SUBSCRIBERS}")
        if not 0 < self.rate <= MAX_RATE:
            problems.append(f"rate must be in (0, {MAX_RATE:g}] messages/s per device")
        if not 0 < self.duration <= MAX_DURATION:
            problems.append(f"duration must be in (0, {MAX_DURATION:g}] seconds")
        if self.qos not in (0, 1, 2):
            problems.append("qos must be 0, 1 or 2")
        if not 1 <= self.sites <= 1000:
            problems.append("sites must be 1..1000")
        if not 1 <= self.max_messages <= MAX_MESSAGES:
            problems.append(f"max messages must be 1..{MAX_MESSAGES}")
        if not 0 <= self.drain_timeout <= 600:
            problems.append("drain timeout must be 0..600 seconds")
        if not all(0 < port < 65536 for _host, port in self.addresses):
            problems.append("port must be 1..65535")
        if self.max_inflight < 1:
            problems.append("max inflight must be >= 1")
        if not CLIENT_NAME.fullmatch(self.name):
            problems.append("name must be 1-32 letters, digits, '-' or '_'")
        if problems:
            raise SimError("; ".join(problems))

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return self.gateways or ((self.host, self.port),)


@dataclass(frozen=True, slots=True)
class SimSnapshot:
    """Live counters for the progress line."""

    phase: str
    elapsed: float
    devices_online: int
    subscribers_online: int
    sent: int
    acknowledged: int
    failed: int
    received: int
    expected: int
    outstanding: int
    foreign: int  # received from publishers outside this run (other simulators, mosquitto_pub)


@dataclass(frozen=True, slots=True)
class SubscriberReport:
    name: str
    client_id: str
    filters: tuple[str, ...]
    persistent: bool
    went_offline: bool
    expected: int
    received: int
    lost: int
    duplicates: int
    misrouted: int
    dropped: int
    foreign: int
    forgiven: int


@dataclass(frozen=True, slots=True)
class SimReport:
    run_id: str
    qos: int
    elapsed: float
    sent: int
    acknowledged: int
    failed: int
    received: int
    expected: int
    lost: int
    duplicates: int
    misrouted: int
    dropped: int  # subscriber connections the gateway closed (they reconnect)
    foreign: int
    forgiven: int  # undelivered when a clean session was dropped: not counted as lost
    interrupted: bool
    subscribers: tuple[SubscriberReport, ...] = field(default=())
    failovers: int = 0  # connects that landed on another gateway address than before

    @property
    def ok(self) -> bool:
        """Nothing acknowledged was lost and nothing was misrouted."""
        return self.lost == 0 and self.misrouted == 0

    @property
    def exit_code(self) -> int:
        if not self.ok:
            return 1
        return 130 if self.interrupted else 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass(slots=True)
class _Device:
    identity: DeviceIdentity
    source: TelemetrySource
    client: SimClient
    online: bool = False


@dataclass(slots=True)
class _Subscriber:
    plan: SubscriberPlan
    client: SimClient
    online: bool = False
    went_offline: bool = False
    dropped: int = 0


class Simulation:
    """Runs once: ``report = await Simulation(config).run()``."""

    def __init__(self, config: SimConfig) -> None:
        config.check()
        self.config = config
        self.run_id = config.run_id or os.urandom(3).hex()
        rng = random.Random(config.seed)
        self._plans = plan_subscribers(config.subscribers, config.sites)
        self.ledger = DeliveryLedger(self._plans, subscription_qos=config.qos)
        self._devices = [
            _Device(
                identity=(identity := DeviceIdentity.of(i, config.sites)),
                source=TelemetrySource(identity, self.run_id, random.Random(rng.random())),
                # A device's client id is its name, stable across runs like a real device's,
                # so the analytics report lists d0001, d0002, ... The price: two device
                # simulators on one gateway would take over each other's connections.
                client=self._new_client(identity.device, spread=i),
            )
            for i in range(config.devices)
        ]
        self._device_index = {d.identity.device: d.identity.index for d in self._devices}
        self._subscribers = [
            _Subscriber(
                plan,
                # Stable ids too: the persistent sessions stay on the gateway after the run (one
                # per subscriber, not one per run), so the analytics report still sees their
                # deliveries and backlogs; each run starts them afresh.
                self._new_client(
                    f"{config.name}-{plan.name}",
                    clean_session=not plan.persistent,
                    spread=plan.index,
                ),
            )
            for plan in self._plans
        ]
        self._stop = asyncio.Event()
        self._abort = asyncio.Event()
        self._delivered = asyncio.Event()
        self._budget = config.max_messages
        self._phase = "created"
        self._started_at: float | None = None
        self._publish_start = 0.0
        self._publish_end = 0.0
        self._interrupted = False
        self._background: set[asyncio.Task[None]] = set()
        self._receivers: list[asyncio.Task[None]] = []

    def _new_client(self, client_id: str, clean_session: bool = True, spread: int = 0) -> SimClient:
        """A client starting at gateway address `spread` mod n, failing over to the others."""
        config = self.config
        addresses = config.addresses
        first = spread % len(addresses)
        (host, port), *others = addresses[first:] + addresses[:first]
        return SimClient(
            client_id,
            host,
            port,
            clean_session=clean_session,
            username=config.username,
            password=config.password,
            others=others,
        )

    # -- control ------------------------------------------------------------------------

    def stop(self) -> None:
        """End publishing now; still drain and report (first Ctrl-C)."""
        self._interrupted = True
        self._stop.set()

    def abort(self) -> None:
        """Also skip the rest of the drain (second Ctrl-C)."""
        self._interrupted = True
        self._stop.set()
        self._abort.set()

    def snapshot(self) -> SimSnapshot:
        ledger = self.ledger
        now = asyncio.get_running_loop().time()
        return SimSnapshot(
            phase=self._phase,
            elapsed=0.0 if self._started_at is None else now - self._started_at,
            devices_online=sum(d.online for d in self._devices),
            subscribers_online=sum(s.online for s in self._subscribers),
            sent=ledger.sent,
            acknowledged=ledger.acknowledged,
            failed=ledger.failed,
            received=ledger.received,
            expected=ledger.expected,
            outstanding=ledger.outstanding,
            foreign=ledger.foreign,
        )

    # -- the run ------------------------------------------------------------------------

    @property
    def time_bound(self) -> float:
        """Seconds a run may take before it is abandoned: each phase is bounded on its own
        (connect and publish timeouts, duration, drain); this catches what slips through."""
        config = self.config
        connecting = 2 * config.connect_timeout + (config.devices + config.subscribers) / 50
        return connecting + config.duration + config.drain_timeout + 60.0

    async def run(self) -> SimReport:
        """Run once and report; SimError if the gateway cannot be reached or the run hangs."""
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        try:
            async with asyncio.timeout(self.time_bound):
                await self._run_phases()
        except TimeoutError as exc:
            raise SimError(f"the run did not finish within {self.time_bound:.0f}s") from exc
        finally:
            self._phase = "closing"
            for task in self._receivers:
                task.cancel()
            await asyncio.gather(*self._receivers, return_exceptions=True)
            await self._close()
            self._phase = "done"
        return self._report(loop.time() - self._started_at)

    async def _run_phases(self) -> None:
        loop = asyncio.get_running_loop()
        self._phase = "connecting"
        await self._connect_subscribers()
        self._receivers = [
            asyncio.create_task(self._receive(s), name=f"receive {s.plan.name}")
            for s in self._subscribers
        ]
        await self._connect_devices()
        self._phase = "publishing"
        self._publish_start = loop.time()
        self._publish_end = self._publish_start + self.config.duration
        schedules = [asyncio.create_task(self._schedule(s)) for s in self._subscribers]
        try:
            await asyncio.gather(*(self._publish_from(d) for d in self._devices))
            if not self._devices:  # observers only: listen for the whole duration
                await self._stopped_within(self._publish_end - loop.time())
            self._stop.set()  # publishing is over: the schedules bring everyone back
            await asyncio.gather(*schedules)
        finally:
            for task in schedules:
                task.cancel()
        self._phase = "draining"
        await self._drain(loop.time() + self.config.drain_timeout)

    async def _connect_subscribers(self) -> None:
        # A session left by an earlier run may hold other filters (say, other --sites), which
        # would look like misrouting: discard it first.
        persistent = [s.client.client_id for s in self._subscribers if s.plan.persistent]
        await asyncio.gather(*(self._discard_session(client_id) for client_id in persistent))
        for subscriber in self._subscribers:  # in order: SUBACK times are the baseline
            await subscriber.client.connect(self.config.connect_timeout)
            subscriber.online = True
            await subscriber.client.subscribe(subscriber.plan.filters, self.config.qos)
            self.ledger.subscribed(subscriber.plan.index, asyncio.get_running_loop().time())

    async def _connect_devices(self) -> None:
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

        async def connect(device: _Device) -> None:
            async with gate:
                await device.client.connect(self.config.connect_timeout)
                device.online = True

        await asyncio.gather(*(connect(d) for d in self._devices))

    async def _publish_from(self, device: _Device) -> None:
        loop = asyncio.get_running_loop()
        interval = 1.0 / self.config.rate
        # Spread the devices over the first interval so they do not publish in lock-step.
        next_at = self._publish_start + interval * (device.identity.index % 97) / 97
        window = asyncio.Semaphore(self.config.max_inflight)
        inflight: set[asyncio.Task[None]] = set()
        while not self._stop.is_set():
            now = loop.time()
            if now >= self._publish_end:
                break
            if next_at > now and await self._stopped_within(min(next_at, self._publish_end) - now):
                break
            if loop.time() >= self._publish_end or not self._take_budget():
                break
            await window.acquire()
            task = asyncio.create_task(self._publish_one(device, device.source.next_reading()))
            task.add_done_callback(lambda _t: window.release())
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            # A device that fell behind (slow acknowledgements) does not burst to catch up.
            next_at = max(next_at + interval, loop.time() - interval)
        await asyncio.gather(*inflight)

    async def _publish_one(self, device: _Device, reading: Reading) -> None:
        key = message_key(device.identity.index, reading.seq)
        sent_at = asyncio.get_running_loop().time()
        self.ledger.publish_sent()
        try:
            if not device.online:
                raise PublishFailed(f"{device.client.client_id} is offline")
            await device.client.publish(reading.topic, reading.payload, self.config.qos)
        except PublishFailed:
            self.ledger.publish_failed()
            if not device.client.alive and device.online:
                device.online = False
                reconnect = asyncio.create_task(self._reconnect_device(device))
                self._background.add(reconnect)
                reconnect.add_done_callback(self._background.discard)
            return
        self.ledger.acknowledged_publish(key, reading.topic, self.config.qos, sent_at)

    async def _reconnect_device(self, device: _Device) -> None:
        await device.client.disconnect()
        while not self._stop.is_set():
            with contextlib.suppress(SimError):
                await device.client.connect(self.config.connect_timeout)
                device.online = True
                return
            if await self._stopped_within(1.0):
                return

    def _take_budget(self) -> bool:
        if self._budget <= 0:
            return False
        self._budget -= 1
        return True

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True if stop() was called meanwhile."""
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def _schedule(self, subscriber: _Subscriber) -> None:
        """Take a persistent subscriber offline and back; reconnect dropped connections."""
        plan, duration = subscriber.plan, self.config.duration
        leave_at = return_at = None
        if plan.offline is not None and plan.persistent:
            leave_at = self._publish_start + plan.offline[0] * duration
            return_at = self._publish_start + plan.offline[1] * duration
        loop = asyncio.get_running_loop()
        while True:
            stopping = self._stop.is_set()
            now = loop.time()
            away = leave_at is not None and return_at is not None and leave_at <= now < return_at
            if subscriber.online and not subscriber.client.alive:
                subscriber.dropped += 1  # the gateway closed a connection we did not close
                subscriber.online = False
                if not plan.persistent:
                    self.ledger.session_ended(plan.index)
            if subscriber.online and away and not stopping:
                await subscriber.client.disconnect()
                subscriber.online = False
                subscriber.went_offline = True
            elif not subscriber.online and (stopping or not away):
                await self._bring_back(subscriber)
            if stopping:
                return
            await self._stopped_within(0.2)

    async def _bring_back(self, subscriber: _Subscriber) -> None:
        await subscriber.client.disconnect()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2 * self.config.connect_timeout
        while True:
            try:
                await subscriber.client.connect(self.config.connect_timeout)
            except SimError:
                if self._abort.is_set() or loop.time() >= deadline:
                    return  # still offline: a persistent one's misses are reported as lost
                await asyncio.sleep(0.5)
                continue
            if not subscriber.plan.persistent:  # a clean session lost its subscriptions
                await subscriber.client.subscribe(subscriber.plan.filters, self.config.qos)
                self.ledger.subscribed(subscriber.plan.index, loop.time())
            subscriber.online = True
            return

    async def _receive(self, subscriber: _Subscriber) -> None:
        index = subscriber.plan.index
        while True:
            delivery = await subscriber.client.next_delivery()
            reading = parse_reading(delivery.payload)
            if reading is None or reading.run != self.run_id:
                self.ledger.subscribers[index].foreign += 1
                continue
            device = self._device_index.get(reading.device)
            if device is None or reading.topic != delivery.topic:
                self.ledger.subscribers[index].misrouted += 1
                continue
            self.ledger.delivery(index, message_key(device, reading.seq), delivery.topic)
            self._delivered.set()

    async def _drain(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.ledger.outstanding > 0 and not self._abort.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._delivered.clear()
            waiters = [
                asyncio.create_task(self._delivered.wait()),
                asyncio.create_task(self._abort.wait()),
            ]
            await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()

    async def _close(self) -> None:
        clients = [d.client for d in self._devices] + [s.client for s in self._subscribers]
        await asyncio.gather(*(c.disconnect() for c in clients))
        for device in self._devices:
            device.online = False
        for subscriber in self._subscribers:
            subscriber.online = False
        if not self.config.drop_sessions or self._abort.is_set():
            return

        await asyncio.gather(
            *(
                self._discard_session(s.client.client_id)
                for s in self._subscribers
                if s.plan.persistent and s.client.has_connected
            )
        )

    async def _discard_session(self, client_id: str) -> None:
        """A clean-session CONNECT with the same client id ends any session it had."""
        cleaner = self._new_client(client_id)
        with contextlib.suppress(SimError):
            await cleaner.connect(self.config.connect_timeout)
        await cleaner.disconnect()

    def _report(self, elapsed: float) -> SimReport:
        subscribers = []
        for subscriber, ledger in zip(self._subscribers, self.ledger.subscribers, strict=True):
            subscribers.append(
                SubscriberReport(
                    name=subscriber.plan.name,
                    client_id=subscriber.client.client_id,
                    filters=subscriber.plan.filters,
                    persistent=subscriber.plan.persistent,
                    went_offline=subscriber.went_offline,
                    expected=len(ledger.expected),
                    received=len(ledger.received),
                    lost=ledger.outstanding,
                    duplicates=ledger.duplicates,
                    misrouted=ledger.misrouted,
                    dropped=subscriber.dropped,
                    foreign=ledger.foreign,
                    forgiven=ledger.forgiven,
                )
            )
        return SimReport(
            run_id=self.run_id,
            qos=self.config.qos,
            elapsed=round(elapsed, 3),
            sent=self.ledger.sent,
            acknowledged=self.ledger.acknowledged,
            failed=self.ledger.failed,
            received=self.ledger.received,
            expected=self.ledger.expected,
            lost=self.ledger.outstanding,
            duplicates=self.ledger.duplicates,
            misrouted=self.ledger.misrouted,
            dropped=sum(s.dropped for s in self._subscribers),
            foreign=self.ledger.foreign,
            forgiven=self.ledger.forgiven,
            interrupted=self._interrupted,
            subscribers=tuple(subscribers),
            failovers=sum(d.client.failovers for d in self._devices)
            + sum(s.client.failovers for s in self._subscribers),
        )


async def run_simulation(config: SimConfig) -> SimReport:
    """Library entry point for tests: run once and return the report."""
    return await Simulation(config).run()
