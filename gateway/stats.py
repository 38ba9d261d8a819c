"""Gateway counters, read by `$SYS` publishing and `lmqtt inspect`-style reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GatewayStats:
    """Plain counters; the event loop is the only writer, so no locking is needed."""

    clients_connected: int = 0
    clients_total: int = 0
    messages_received: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    publish_dropped: int = 0
    subscriptions: int = 0
    retained_count: int = 0
    store_bytes: int = 0
    inbound_consumed: int = 0  # inbound topic messages stored (gateway/messages/inbound.py)
    inbound_dead_lettered: int = 0
