"""Wall-clock time in milliseconds: the unit of store timestamps, expiries and leases."""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the epoch, as the store and MQTT expiry intervals count them."""
    return int(time.time() * 1000)
