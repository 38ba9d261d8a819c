"""Wills of a lost node's clients, published by a surviving node.

A session's record in the state log holds the will of its live connection (gateway/session.py;
in cluster mode the record is written before CONNACK when the CONNECT carries a will) and
says which node wrote it (gateway/rocketmq_storage.py tails the log with the writers' ids).
When a node's lease runs out (gateway/membership.py), the leader among the survivors takes
over its wills:

    every session record last written by the lost node
        connected there (disconnected_at_ms null) with a will -> published after its will delay
                                                                 (MQTT 5; none: now)
        disconnected with a delayed will (will_due_ms)        -> published when due
    then the record is rewritten by the leader: a persistent session disconnected now without
    its will, a clean one deleted (so a later loss of the leader does not publish it again)

A connection of the same client id on any node before a delayed will is due cancels it (the
session continues: gateway/takeover.py's "conn" record). The timing promise: a client's will
is out within the lease (`cluster_lease`, shorter than keep-alive x 1.5 for the keep-alives in
use) plus its will delay after its node died.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from pydantic_core import from_json, to_json

from gateway.cluster_bus import ClusterBus, Record
from gateway.membership import Membership
from gateway.protocol import Publish
from gateway.session import SESSION_KEY_PREFIX, now_ms, will_from_json, will_publish
from gateway.storage import StateRecord

log = logging.getLogger("lmqtt.cluster")


class WrittenState(Protocol):
    """The state log as the cluster sees it: who wrote each record (RocketMqStorage)."""

    def written_by(self, node: str) -> list[tuple[str, bytes]]:
        """The live records (key, value) whose newest version `node` wrote."""
        ...

    def append_state(self, records: Iterable[StateRecord]) -> int: ...


StorePublish = Callable[[Publish, str], Awaitable[None]]


class NodeWills:
    """Takes over the wills of lost nodes when this node leads (see the module docstring)."""

    def __init__(
        self,
        bus: ClusterBus,
        membership: Membership,
        state: WrittenState,
        store_publish: StorePublish,
    ) -> None:
        self._members = membership
        self._state = state
        self._store_publish = store_publish
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        membership.on_lost.append(self._node_lost)
        bus.on("conn", self._on_connect)

    def __len__(self) -> int:
        return len(self._pending)

    def _node_lost(self, node: str) -> None:
        if not self._members.is_leader():
            return
        loop = asyncio.get_running_loop()
        now = now_ms()
        taken = 0
        for key, value in self._state.written_by(node):
            if not key.startswith(SESSION_KEY_PREFIX):
                continue
            cid = key[len(SESSION_KEY_PREFIX) :]
            try:
                d = from_json(value)
                if not d.get("will"):
                    continue
                due = d.get("will_due_ms")
                if d.get("disconnected_at_ms") is None or due is None:
                    delay = 0
                    props = d["will"].get("properties") or {}
                    if int(d.get("protocol_level", 4)) == 5:
                        delay = int(props.get("will_delay_interval") or 0)
                    delay = min(delay, int(d.get("expiry_interval", 0)))
                    due = now + delay * 1000
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.error("session %r of lost node %s unreadable (%s)", cid, node, exc)
                continue
            taken += 1
            self._pending[cid] = loop.call_later(
                max(0, int(due) - now) / 1000, self._due, cid, key, d
            )
        if taken:
            log.warning("cluster: taking over %d will(s) of lost node %s", taken, node)

    def _on_connect(self, rec: Record) -> None:
        cid = rec.get("c")
        if isinstance(cid, str):
            handle = self._pending.pop(cid, None)
            if handle is not None:
                handle.cancel()
                log.info("%r reconnected: the will of its lost connection is not published", cid)

    def _due(self, cid: str, key: str, d: dict[str, object]) -> None:
        self._pending.pop(cid, None)
        task = asyncio.get_running_loop().create_task(self._publish(cid, key, d))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, cid: str, key: str, d: dict[str, object]) -> None:
        will = will_from_json(d["will"])  # type: ignore[arg-type]
        log.info("publishing the will of %r (its node was lost) to %r", cid, will.topic)
        pub = will_publish(will)
        try:
            await self._store_publish(pub, cid)
        except Exception:
            log.exception("publishing the will of %r failed", cid)
            return
        if int(d.get("expiry_interval", 0) or 0) > 0:  # type: ignore[call-overload]
            d = {**d, "will": None, "will_due_ms": None}
            if d.get("disconnected_at_ms") is None:
                d["disconnected_at_ms"] = now_ms()
            self._state.append_state([(key, to_json(d))])
        else:
            self._state.append_state([(key, None)])

    def stop(self) -> None:
        for handle in self._pending.values():
            handle.cancel()
        self._pending.clear()
