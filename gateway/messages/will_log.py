"""The wills log: which wills were published, so that none is published twice after a crash.

A will published by the gateway is one store record like any PUBLISH, also dispatched to the
light queue WILLS_QUEUE and marked with the will's id (record key `mqtt.will`,
topicmap/record.py):

    will id = "<client id>@<start of the connection that left it, ms since the epoch>"
              (records without `will_conn_ms`: "<client id>@<due time>")

The connection's start is in the session's record with the will from the CONNECT on
(gateway/session/wills.py, gateway/cluster/node_wills.py), so every process that finds the same
will, pending or still of a live connection, computes the same id, whoever published it and
whenever: a cluster leader taking over the record of a node lost right after it published its
client's will finds that publication here. A process that takes over a will from a process
that may have published it already (its publisher died before the rewrite of the record without
the will was stored) reads the wills log back to the connection's start (`published_wills`) and
publishes only the wills not found there.

Only will publications pay for this (one more light queue, one property); the wills log is
read only when a pending will is taken over from a process that is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Final, Protocol

from gateway.storage.port import GetResult, GetStatus, StoreError
from topicmap.record import WILL_ID

log = logging.getLogger("lmqtt.gateway")

WILLS_QUEUE: Final = "%WILLS%"
#: Messages read per step when reading the wills log back.
PAGE: Final = 32
#: The due time is one node's clock, a message's store time the broker's: read this much
#: further back than the earliest due time.
CLOCK_SKEW_MS: Final = 60_000


def will_id(client_id: str, conn_ms: int | None, due_ms: int | None) -> str:
    """The will's id: its connection's start, or for records without it its due time."""
    return f"{client_id}@{conn_ms if conn_ms is not None else (due_ms or 0)}"


class WillsReader(Protocol):
    """What reading the wills log back needs of storage (RocketMqStorage has it)."""

    async def catch_up_queue(self, queue: str) -> None: ...

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None: ...

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult: ...

    def min_offset(self, queue: str) -> int: ...

    def max_offset(self, queue: str) -> int: ...

    def close_queue(self, queue: str) -> None: ...


async def published_wills(reader: WillsReader, since_ms: int) -> set[str]:
    """The ids of the wills in the wills log stored at `since_ms` (less CLOCK_SKEW_MS) or
    later, read from its end backwards. StoreError when it cannot be read."""
    q = WILLS_QUEUE
    found: set[str] = set()
    try:
        await reader.catch_up_queue(q)
        end = reader.max_offset(q)
        low = reader.min_offset(q)
        while end > low:
            start = max(low, end - PAGE)
            await reader.prefetch(q, range(start, end))
            offset = start
            oldest: int | None = None
            while offset < end:
                res = reader.get(q, offset, end - offset)
                if res.status is GetStatus.OFFSET_TOO_SMALL and res.next_offset > offset:
                    offset = low = res.next_offset  # deleted by age meanwhile
                    continue
                if res.status is not GetStatus.FOUND:
                    raise StoreError(f"{q} unreadable at {offset} ({res.status.value})")
                for m in res.messages:
                    wid = m.properties.get(WILL_ID)
                    if wid is not None:
                        found.add(wid)
                    if oldest is None or m.store_timestamp < oldest:
                        oldest = m.store_timestamp
                offset = res.next_offset
            if oldest is not None and oldest < since_ms - CLOCK_SKEW_MS:
                break
            end = start
    finally:
        reader.close_queue(q)
    return found
