"""TimerWheel: due items are asked once, rescheduling is lazy, a due slot is handled in steps.

The wheel is driven through ``advance(now)`` with chosen times: no sleeping, no timing (but
for the last test, a real gateway's keep-alive through the wheel).
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from pathlib import Path

from gateway.connection import timers
from gateway.connection.timers import TimerWheel
from gateway.protocol import Disconnect, ReasonCode
from tests.gateway.conftest import GatewayHarness, RawClient


class Device:
    """Last activity moves freely; the wheel only learns of it when the deadline comes."""

    def __init__(self, name: str, last_seen: float, idle_limit: float) -> None:
        self.name = name
        self.timer_due: float | None = None
        self.last_seen = last_seen
        self.idle_limit = idle_limit
        self.asked: list[float] = []
        self.expired = False

    def on_due(self, now: float) -> float | None:
        self.asked.append(now)
        if now - self.last_seen >= self.idle_limit:
            self.expired = True
            return None
        return self.last_seen + self.idle_limit


async def test_item_is_asked_only_when_due_and_reinserted_after_activity() -> None:
    wheel = TimerWheel(asyncio.get_running_loop())
    start = float(wheel._next)  # slot times are absolute: start on a slot boundary
    device = Device("d", last_seen=start, idle_limit=10)
    wheel.schedule(device, start + 10)
    assert await wheel.advance(start + 9.5) == 0
    device.last_seen = start + 8  # activity: no call into the wheel
    assert await wheel.advance(start + 10.2) == 1
    assert not device.expired and device.timer_due == start + 18
    assert await wheel.advance(start + 17.5) == 0
    assert await wheel.advance(start + 18.1) == 1
    assert device.expired and device.timer_due is None
    assert len(wheel) == 0


async def test_rescheduled_and_cancelled_entries_are_dropped_unasked() -> None:
    wheel = TimerWheel(asyncio.get_running_loop())
    start = float(wheel._next)
    moved_later = Device("later", start, 100)
    moved_earlier = Device("earlier", start, 100)
    cancelled = Device("cancelled", start, 1)
    wheel.schedule(moved_later, start + 2)
    wheel.schedule(moved_later, start + 50)
    wheel.schedule(moved_earlier, start + 50)
    wheel.schedule(moved_earlier, start + 3)
    wheel.schedule(cancelled, start + 2)
    wheel.cancel(cancelled)
    await wheel.advance(start + 4)
    assert moved_later.asked == [] and cancelled.asked == []
    assert moved_earlier.asked == [start + 4]
    await wheel.advance(start + 51)
    assert moved_later.asked == [start + 51]
    assert moved_earlier.asked == [start + 4]  # its slot-50 entry was stale


async def test_an_item_answering_now_again_waits_for_the_next_tick() -> None:
    wheel = TimerWheel(asyncio.get_running_loop())
    start = float(wheel._next)

    class Stubborn(Device):
        def on_due(self, now: float) -> float | None:
            self.asked.append(now)
            return now  # "look again now"

    item = Stubborn("s", start, 0)
    wheel.schedule(item, start)
    assert await wheel.advance(start + 0.5) == 1
    assert await wheel.advance(start + 0.9) == 0
    assert await wheel.advance(start + 1.5) == 1


async def test_a_crowded_slot_yields_to_the_loop_between_budgets() -> None:
    wheel = TimerWheel(asyncio.get_running_loop())
    start = float(wheel._next)
    devices = [Device(str(i), start, 1) for i in range(timers.BUDGET * 3 + 7)]
    for device in devices:
        wheel.schedule(device, start + 1)
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count_turns())
    await asyncio.sleep(0)
    before = turns
    called = await wheel.advance(start + 1.5)
    counter.cancel()
    assert called == len(devices)
    assert all(d.expired for d in devices)
    assert turns - before >= 3  # the loop ran other work between the budgets


async def test_a_cancelled_or_rescheduled_entry_leaves_the_wheel_at_once() -> None:
    wheel = TimerWheel(asyncio.get_running_loop())
    start = float(wheel._next)
    closed = Device("closed", start, 90)
    wheel.schedule(closed, start + 10)  # the CONNECT timeout
    wheel.schedule(closed, start + 90)  # then the keep-alive deadline: one entry, not two
    assert len(wheel) == 1
    wheel.cancel(closed)  # the connection closed long before its deadline
    assert len(wheel) == 0
    gone = weakref.ref(closed)
    del closed
    gc.collect()
    assert gone() is None, "the wheel still holds the closed item"
    overdue = Device("overdue", start, 1)
    wheel.schedule(overdue, start - 5)  # a deadline already past: the first slot not handled
    wheel.cancel(overdue)
    assert len(wheel) == 0 and await wheel.advance(start + 100) == 0 and overdue.asked == []


def test_a_keep_alive_after_the_connect_deadline_still_closes_a_silent_client(
    tmp_path: Path,
) -> None:
    """The CONNECT deadline's entry (0.5 s) comes before the keep-alive deadline (1.5 x 1 s):
    CONNACK leaves the entry in place, and when it comes due the connection answers its
    keep-alive deadline, which then closes the silent client (0x8D), not the CONNECT one."""
    gateway = GatewayHarness(tmp_path / "data", connect_timeout=0.5).start()
    try:
        c = RawClient(gateway.port, level=5)
        t0 = time.monotonic()
        assert c.connect("silent", keep_alive=1).reason_code == 0
        ev = c.recv(timeout=5)
        assert isinstance(ev, Disconnect) and ev.reason_code == ReasonCode.KEEP_ALIVE_TIMEOUT
        assert 1.4 <= time.monotonic() - t0 < 4
        c.close()
    finally:
        gateway.stop()
