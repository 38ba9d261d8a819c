"""Limits against hostile or broken clients, each with the reason code a client is told.

    limit                      setting                  when hit (MQTT 5 / 3.1.1)
    -------------------------  -----------------------  -------------------------------------
    connections                max_connections          CONNACK 0x97 quota exceeded / 3;
                                                        sockets beyond socket_limit() are
                                                        closed on accept, unread
    connect rate per address   connect_rate/_burst      CONNACK 0x9F connection rate exceeded / 3
    CONNECT timeout            connect_timeout          socket closed (nothing to answer)
    packet size                max_packet_size          DISCONNECT 0x95 / close (protocol core)
    in-flight per session      max_inflight,            window: messages wait in the store,
                               receive_maximum          on disk, not in memory
    topic length and levels    max_topic_length/levels  PUBLISH: DISCONNECT 0x90 / close;
                                                        SUBSCRIBE: SUBACK 0x8F / 0x80
    subscriptions per client   max_subscriptions        SUBACK 0x97 / 0x80

The connect-rate limit is a token bucket per source address: `connect_burst` connections at
once, refilled at `connect_rate` per second. The table of addresses is bounded (least recently
seen addresses are forgotten first), so a flood from many addresses cannot grow it without end.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict

__all__ = ["ConnectRateLimiter", "is_loopback", "socket_limit", "topic_limit_error"]

MAX_TRACKED_ADDRESSES = 65_536


def socket_limit(max_connections: int) -> int:
    """Open sockets allowed: the connection limit plus headroom to answer CONNECT politely."""
    return max_connections + max(16, max_connections // 10)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name to listen on / connect from) is loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name or "": could be anything, so not loopback


def topic_limit_error(text: str, max_length: int, max_levels: int) -> str | None:
    """Why a topic name or filter breaks the configured limits, or None."""
    size = len(text.encode("utf-8"))
    if size > max_length:
        return f"topic of {size} bytes is longer than the limit of {max_length}"
    levels = text.count("/") + 1
    if levels > max_levels:
        return f"topic of {levels} levels has more than the limit of {max_levels}"
    return None


class ConnectRateLimiter:
    """Token bucket per source address (see the module docstring)."""

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        limit_loopback: bool = False,
        max_addresses: int = MAX_TRACKED_ADDRESSES,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.limit_loopback = limit_loopback
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, time

    def allow(self, address: str, now: float | None = None) -> bool:
        """Take one token for `address`; False when it has none left."""
        if self.rate <= 0 or (not self.limit_loopback and is_loopback(address)):
            return True
        t = time.monotonic() if now is None else now
        tokens, last = self._buckets.pop(address, (float(self.burst), t))
        tokens = min(float(self.burst), tokens + (t - last) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._buckets[address] = (tokens, t)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)
        return allowed

    def __len__(self) -> int:
        return len(self._buckets)
