"""A lost node's sessions: rewritten as disconnected by a surviving node, their wills published.

A session's record in the state log holds the will of its live connection
(gateway/session/registry.py; in cluster mode the record is written before CONNACK when the CONNECT
carries a will) and says which node wrote it (gateway/storage/rocketmq/adapter.py tails the log with
the writers' ids). When a node's lease runs out (gateway/cluster/membership.py), the leader among
the survivors takes over the session records of every node that is gone (the lost one, and any
earlier one whose records nobody took over, e.g. a leader that died while doing so; not a node that
stopped gracefully: it wrote its sessions as disconnected, without wills):

    connected there (disconnected_at_ms null)   -> rewritten by the leader as disconnected at
                                                   the loss: its expiry runs on every node
                                                   (each adopts the record); a clean session's
                                                   record deleted (it ended with its node);
                                                   marked `behind` (its next CONNECT takes the
                                                   broker's fresher committed offsets)
        ... with a will                         -> the rewrite keeps it, with its due time
                                                   (will_due_ms: the loss + its will delay,
                                                   MQTT 5; none: now)
    disconnected with a pending will           -> kept (its will_due_ms says when)
    each pending will, when due                 -> published, then the record rewritten
                                                   without it (a clean session's deleted)

The rewrite is what makes a pending will durable: it is in the state log, written by the
leader, before its delay runs. If the leader dies too, the next leader finds the will in the
records of a node that is gone and publishes it when due, once: the dead leader's rewrite
after publishing removes it, and when the leader was killed between publishing and that
rewrite being stored, the will is in the wills log (gateway/messages/will_log.py) with its id
(client id @ its connection's start, both in the record). The same holds for a will its own
node published when the connection was lost, the node dying before its record said so: the
record still says connected, with the will. So a will found in a record that already says its
session is disconnected (a process before this one had it pending), or in a connected one
whose will has an id (its node may have published it), is published only if the wills log has
no such id from the connection's start on; else only the rewrite is written.

A connection of the same client id on any node before a delayed will is due cancels it (the
session continues: gateway/cluster/takeover.py's "conn" record; the new node's record replaces the
leader's). The timing promise: a client's will is out within the lease (`cluster_lease`,
shorter than keep-alive x 1.5 for the keep-alives in use) plus its will delay after its node
died.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Protocol

from pydantic_core import from_json, to_json

from gateway.clock import now_ms
from gateway.cluster.bus import ClusterBus, Record
from gateway.cluster.membership import Membership
from gateway.messages.message_json import will_from_json
from gateway.messages.will_log import WillsReader, published_wills, will_id
from gateway.protocol import Publish
from gateway.session.model import will_publish
from gateway.session.registry import SESSION_KEY_PREFIX
from gateway.storage.port import StateRecord

log = logging.getLogger("lmqtt.cluster")


class WrittenState(Protocol):
    """The state log as the cluster sees it: who wrote each record (RocketMqStorage)."""

    def written_by(self, node: str) -> list[tuple[str, bytes]]:
        """The live records (key, value) whose newest version `node` wrote."""
        ...

    def state_writers(self) -> set[str]:
        """The nodes that wrote the newest version of some live record."""
        ...

    def append_state(self, records: Iterable[StateRecord]) -> int: ...


class NodeState(WrittenState, WillsReader, Protocol):
    """The state log and the wills log (RocketMqStorage)."""


#: Stores a will's PUBLISH (publisher's client id, the will's id: PublishPath.store_publish).
StorePublish = Callable[[Publish, str, str], Awaitable[None]]


class NodeWills:
    """Takes over the sessions and wills of gone nodes when this node leads (see the module
    docstring)."""

    def __init__(
        self,
        bus: ClusterBus,
        membership: Membership,
        state: NodeState,
        store_publish: StorePublish,
        adopt: Callable[[str, bytes | None], None] = lambda _cid, _value: None,
    ) -> None:
        """`adopt(client id, record)`: a record this node rewrote, for its own session copies
        (the other nodes adopt it from the state log)."""
        self._members = membership
        self._state = state
        self._store_publish = store_publish
        self._adopt = adopt
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._publishing: set[str] = set()
        self._recovering: set[str] = set()  # wills looked up in the wills log (_recover)
        self._tasks: set[asyncio.Task[None]] = set()
        # Nodes that stopped gracefully ("bye"): they write their sessions as disconnected,
        # without wills, after saying goodbye; nothing of theirs is taken over.
        self._left: set[str] = set()
        membership.on_lost.append(self._node_gone)
        membership.on_left.append(self._left.add)
        bus.on("conn", self._on_connect)

    def __len__(self) -> int:
        return len(self._pending)

    def _node_gone(self, node: str) -> None:
        if not self._members.is_leader():
            return
        # Not gone: this node, the live ones, those that left, "" (a record of no cluster node).
        here = {self._members.node_id, *self._members.live_peers(), *self._left, ""}
        rewrites: list[StateRecord] = []
        at_risk: list[tuple[str, str, dict[str, Any]]] = []
        wills = 0
        now = now_ms()
        for writer in sorted(self._state.state_writers() - here):
            for key, value in self._state.written_by(writer):
                if not key.startswith(SESSION_KEY_PREFIX):
                    continue
                cid = key[len(SESSION_KEY_PREFIX) :]
                if cid in self._pending or cid in self._publishing or cid in self._recovering:
                    continue  # taken over at an earlier loss
                try:
                    d, rewrite = _taken_over(from_json(value), now)
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    log.error("session %r of lost node %s unreadable (%s)", cid, writer, exc)
                    continue
                if rewrite:
                    keep = d.get("will") or int(d.get("expiry_interval", 0) or 0) > 0
                    rewrites.append((key, to_json(d) if keep else None))
                if d.get("will"):
                    wills += 1
                    if rewrite and d.get("will_conn_ms") is None:
                        self._schedule(cid, key, d, now)
                    else:
                        at_risk.append((cid, key, d))  # maybe published by its writer
        if rewrites:
            # Before any will is due (the timers run after this call): the pending wills are
            # in the log with their due times, and every node starts the sessions' expiry.
            self._state.append_state(rewrites)
            for key, new in rewrites:
                self._adopt(key[len(SESSION_KEY_PREFIX) :], new)
        if at_risk:
            self._recovering.update(cid for cid, _key, _d in at_risk)
            self._spawn(self._recover(at_risk))
        if rewrites or wills:
            log.warning(
                "cluster: node %s gone: %d session(s) of gone nodes rewritten as disconnected,"
                " %d will(s) taken over",
                node, len(rewrites), wills,
            )  # fmt: skip

    def _schedule(self, cid: str, key: str, d: dict[str, Any], now: int) -> None:
        due = int(d.get("will_due_ms") or now)
        loop = asyncio.get_running_loop()
        self._pending[cid] = loop.call_later(max(0, due - now) / 1000, self._due, cid, key, d)

    def _on_connect(self, rec: Record) -> None:
        cid = rec.get("c")
        if isinstance(cid, str):
            handle = self._pending.pop(cid, None)
            if handle is not None or cid in self._recovering:
                self._recovering.discard(cid)
                if handle is not None:
                    handle.cancel()
                log.info("%r reconnected: the will of its lost connection is not published", cid)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recover(self, at_risk: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Wills found pending in records that already said their session was disconnected:
        the ones in the wills log are only removed from their records, the others scheduled.
        The wills log unreadable: they are published (at least once rather than never)."""
        since = min(_since(d) for _cid, _key, d in at_risk)
        try:
            published = await published_wills(self._state, since)
        except Exception as exc:  # whatever failed, the wills go out (never lost)
            log.warning("the wills log could not be read (%s): wills may be published twice", exc)
            published = set()
        now = now_ms()
        for cid, key, d in at_risk:
            if cid not in self._recovering:
                continue  # its client connected again meanwhile: no will
            self._recovering.discard(cid)
            if _will_id(cid, d) in published:
                log.info("the will of %r was published before its publisher was lost", cid)
                self._without_will(cid, key, d)
            else:
                self._schedule(cid, key, d, now)

    def _due(self, cid: str, key: str, d: dict[str, Any]) -> None:
        self._pending.pop(cid, None)
        self._publishing.add(cid)
        self._spawn(self._publish(cid, key, d))

    async def _publish(self, cid: str, key: str, d: dict[str, Any]) -> None:
        try:
            will = will_from_json(d["will"])
            log.info("publishing the will of %r (its node was lost) to %r", cid, will.topic)
            try:
                await self._store_publish(will_publish(will), cid, _will_id(cid, d))
            except Exception:
                log.exception("publishing the will of %r failed", cid)
                return
            self._without_will(cid, key, d)
        finally:
            self._publishing.discard(cid)

    def _without_will(self, cid: str, key: str, d: dict[str, Any]) -> None:
        """The will is out: its session's record rewritten without it (a clean session's
        deleted)."""
        record: bytes | None = None
        if int(d.get("expiry_interval", 0) or 0) > 0:
            record = to_json({**d, "will": None, "will_due_ms": None})
        self._state.append_state([(key, record)])
        self._adopt(cid, record)

    def stop(self) -> None:
        for handle in self._pending.values():
            handle.cancel()
        self._pending.clear()
        self._recovering.clear()  # a wills-log read still running schedules nothing


def _will_id(cid: str, d: dict[str, Any]) -> str:
    conn = d.get("will_conn_ms")
    return will_id(cid, None if conn is None else int(conn), int(d.get("will_due_ms") or 0))


def _since(d: dict[str, Any]) -> int:
    """Its will was published (if at all) at this time or later: the connection's start, the
    due time for a record without it."""
    conn = d.get("will_conn_ms")
    return int(conn) if conn is not None else int(d.get("will_due_ms") or 0)


def _taken_over(d: dict[str, Any], now: int) -> tuple[dict[str, Any], bool]:
    """The record of a gone node's session as the leader keeps it, and whether it changed: a
    connected one disconnected at `now`, its will (if any) due after its delay."""
    if d.get("disconnected_at_ms") is not None:
        if d.get("will") and d.get("will_due_ms") is None:
            return {**d, "will_due_ms": now}, True  # (not written so: published now)
        return d, False
    # `behind`: its positions may lag the broker's committed offsets (gateway/session/model.py).
    d = {**d, "disconnected_at_ms": now, "behind": True}
    if d.get("will"):
        delay = 0
        if int(d.get("protocol_level", 4)) == 5:
            delay = int((d["will"].get("properties") or {}).get("will_delay_interval") or 0)
        d["will_due_ms"] = now + min(delay, int(d.get("expiry_interval", 0))) * 1000
    return d, True
