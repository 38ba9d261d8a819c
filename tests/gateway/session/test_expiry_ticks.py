"""Offline sessions expire in ticks under one loop timer (gateway/session/expiry.py): on
time, not when they came back meanwhile, and a tick emptied by returning devices does not
stay behind (memory follows the sessions offline, not the time the gateway has run)."""

from __future__ import annotations

import asyncio
import time

from gateway.clock import now_ms
from gateway.session.expiry import EXPIRY_TICK_MS, ExpiryTicks
from gateway.session.model import Session
from gateway.session.registry import SessionRegistry


def _offline(registry: SessionRegistry, cid: str, expiry_s: int, since_ms: int) -> Session:
    s = Session(cid, 4, expiry_s)
    registry.sessions[cid] = s
    s.disconnected_at_ms = since_ms
    registry.schedule_expiry(s)
    return s


def test_offline_sessions_expire_on_time_unless_back() -> None:
    async def main() -> None:
        registry = SessionRegistry(object())  # type: ignore[arg-type]  # no store used here
        expired: list[str] = []
        registry.on_expire = lambda s: expired.append(s.client_id)
        now = now_ms()
        _offline(registry, "soon", 1, now - 800)  # due in about 0.2 s
        back = _offline(registry, "back", 1, now - 800)
        _offline(registry, "later", 3600, now)
        back.connection = object()  # type: ignore[assignment]  # it reconnected
        registry.cancel_expiry(back)
        deadline = time.monotonic() + 5
        while not expired and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert expired == ["soon"]
        assert now_ms() >= now + 200  # not before its expiry
        await registry.close()

    asyncio.run(main())


def test_ticks_emptied_by_returning_devices_do_not_accumulate() -> None:
    async def main() -> None:
        ticks: ExpiryTicks[str] = ExpiryTicks(lambda cid: None)
        now = now_ms() + 3_600_000
        # 20,000 disconnects of 100 devices, each due in its own tick, each device back
        # before its expiry: what is kept is what is offline now.
        for i in range(20_000):
            cid = f"d{i % 100}"
            ticks.add(cid, cid, now + i * EXPIRY_TICK_MS)
            ticks.discard(cid)
        assert len(ticks) == 0
        assert ticks.heap_size <= 64
        ticks.close()

    asyncio.run(main())
