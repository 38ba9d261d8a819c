"""Takeover while connected, exactly: the node a session is taken from hands its state over.

A session's record in the state log is rewritten by its node at CONNECT, SUBACK, disconnect
and every progress pass (up to PROGRESS_SAVE_S, 10 s, apart): while its client is connected,
the record's positions and in-flight window lag what the client has acknowledged since. A
node taking such a session over (gateway/cluster/takeover.py) would resume it from that record, so
messages delivered since would come again from the old position, without DUP. Instead the
node that holds the session hands over its state as it stands when its connection closes:

    node B: CONNECT "c" (no clean start); the newest record of c, by live node A, says connected
        "conn" {c, cs: false, h: true}        the claim asks for a hand-over
        waits for "hand" addressed to it      (deadline: 3 heartbeats; A lost meanwhile: no
                                               longer)
    node A, reading the claim:
        c connected here -> closed with 0x8E (takeover.py); once the connection has ended:
        c not connected here, A wrote its newest record -> at once:
            every state write A made so far durable (none lands after B's record)
            "hand" {c, to: B, s: B's claim sequence, r: the session's JSON | null (ended)}
    node B: the hand's session replaces its copy (cluster_sessions.py adopt); CONNACK with
            session present, the in-flight window re-sent with DUP (MQTT-4.4.0-1), the backlog
            from the handed positions; B's record (connected on B) follows A's in the log

Racing CONNECTs on three nodes: the claims are read in the log's order, say B's then C's, and
C may have seen A's record (B had written none yet). The hand for a claim comes only from the
node of the claim just before it (gateway/cluster/takeover.py `previous`), the latest holder:
A hands to B only, and B, superseded by C's claim while it waits, still waits for A's hand,
resumes it (CONNACK, then 0x8E) and hands the session as it stands to C when that connection
ends; C waits for B's hand (twice the deadline: B waits for A's first). So C resumes from
what B delivered, never from A's older state.

Without an answer (A killed, or too slow) B resumes from A's newest record, marked `behind`
(gateway/session/model.py: the broker's committed offsets are taken where fresher): what A had in
flight, and what was acknowledged in the last second, comes again without DUP.
The hand travels on the cluster bus (an event for one node), not the state log: A writes
nothing for a session taken from it, so no late record of A's can follow B's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.cluster.bus import ClusterBus, Record

log = logging.getLogger("lmqtt.cluster")

#: What `receive` returns when no hand-over came (resume from the record as known here).
NO_HAND = object()
#: How often a wait for a hand-over looks whether the holder is still alive.
POLL_S = 0.1


class _Wait:
    __slots__ = ("arrived", "got")

    def __init__(self) -> None:
        # claim sequence -> giving node -> the session's JSON (dict) or None
        self.got: dict[int, dict[str, Any]] = {}
        self.arrived = asyncio.Event()


class Handover:
    """Both ends of a hand-over (see the module docstring)."""

    def __init__(self, bus: ClusterBus, state_durable: Callable[[], Awaitable[None]]) -> None:
        """`state_durable()`: returns once every state record this node appended so far is
        stored."""
        self._bus = bus
        self._state_durable = state_durable
        self._waits: dict[str, _Wait] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        bus.on("hand", self._on_hand)

    # -- the node taking the session -----------------------------------------------------------

    def expect(self, client_id: str) -> _Wait:
        """Register before the claim is sent: its answer may be read with the claim itself."""
        wait = self._waits[client_id] = _Wait()
        return wait

    def forget(self, client_id: str, wait: _Wait) -> None:
        if self._waits.get(client_id) is wait:
            del self._waits[client_id]

    async def receive(
        self, wait: _Wait, seq: int, giver: str, timeout: float, still: Callable[[], bool]
    ) -> Any:
        """The session handed over by node `giver` for claim `seq` (its JSON as a dict, None:
        it ended there), or NO_HAND after `timeout` or as soon as `still()` is false (the
        giver was lost)."""
        deadline = time.monotonic() + timeout
        while giver not in wait.got.get(seq, {}):
            left = deadline - time.monotonic()
            if left <= 0 or not still():
                return NO_HAND
            wait.arrived.clear()
            try:
                await asyncio.wait_for(wait.arrived.wait(), min(POLL_S, left))
            except TimeoutError:
                pass
        return wait.got[seq][giver]

    def _on_hand(self, rec: Record) -> None:
        if rec.get("to") != self._bus.node_id:
            return
        wait = self._waits.get(rec.get("c"))  # type: ignore[arg-type]
        seq = rec.get("s")
        if wait is not None and isinstance(seq, int):
            wait.got.setdefault(seq, {})[str(rec.get("n"))] = rec.get("r")
            wait.arrived.set()

    # -- the node giving it ----------------------------------------------------------------------

    def give(self, client_id: str, to: str, seq: int, session: dict[str, Any] | None) -> None:
        """Hand `session` (its JSON; None: ended here) to node `to` for its claim `seq`, once
        this node's state writes so far are stored."""

        async def send() -> None:
            try:
                await self._state_durable()
            except Exception as exc:  # the hand still goes: it is the fresher state
                log.warning("%r: state writes before the hand-over failed: %s", client_id, exc)
            self._bus.send("hand", c=client_id, to=to, s=seq, r=session)
            log.info("%r: session handed over to node %s", client_id, to)

        task = asyncio.get_running_loop().create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
