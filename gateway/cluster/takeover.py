"""Takeover across nodes: a client id connected on one node is closed when it connects on another
(MQTT-3.1.4-3), and of two CONNECTs racing on two nodes exactly one connection survives.

    node B: CONNECT "c" accepted  -> "conn" record {c: "c", cs: clean start, h: hand-over
                                     wanted (gateway/cluster/handover.py)}
                                     CONNACK once B read its own record back
    every node reading a "conn" record for "c" with another token:
        its own connection of "c" whose record it has read already (older in the log)
            -> closed with DISCONNECT 0x8E (Session taken over)
        its own connection whose record it has not read yet (newer in the log) -> kept

The broker's order of the records decides: every node reads the same order, so the connection
whose record came last survives and every other one is closed, however the CONNECTs raced.
A takeover that continues the session (no clean start) also cancels the delayed will the
closed connection left behind, as a reconnection on the same node does.

Every node also keeps, per client id, the claims read in the last CHAIN_S seconds, in the
log's order: the claim just before a claim (`previous`) names the node whose connection that
claim takes the session from, so a hand-over (gateway/cluster/handover.py) always comes from
the latest holder, even when a third CONNECT's node still saw an earlier holder's record.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from gateway.cluster.bus import ClusterBus, Record
from gateway.protocol import ReasonCode
from gateway.session.model import Connected

log = logging.getLogger("lmqtt.cluster")

CLAIM_TIMEOUT_S = 10.0
#: Claims remembered per client id this long (a hand-over is waited for a few heartbeats).
CHAIN_S = 60.0

Claim = tuple[str, int]  # (node, its record's sequence number)


class _Claim:
    __slots__ = ("answered", "conn", "seen", "seq", "superseded")

    def __init__(self, conn: Connected, seq: int) -> None:
        self.conn = conn
        self.seq = seq
        self.seen = False  # our record read back: every later "conn" of the id is newer
        self.answered = False  # CONNACK written
        self.superseded: bool = False  # a newer claim was read before our CONNACK went out


class ClusterTakeover:
    """Claims of client ids by this node's connections (see the module docstring)."""

    def __init__(
        self,
        bus: ClusterBus,
        cancel_will: Callable[[str], None],
        moved: Callable[[str, Record], None] = lambda _cid, _rec: None,
    ) -> None:
        """`moved(client id, claim record)`: a connection here is closed for another node's
        (its session record is the other node's from now on)."""
        self._bus = bus
        self._cancel_will = cancel_will
        self._moved = moved
        self._claims: dict[str, _Claim] = {}
        # Recent claims per client id in the log's order, and when each was read (pruning).
        self._chain: dict[str, list[Claim]] = {}
        self._read: deque[tuple[float, str]] = deque()
        bus.on("conn", self._on_connect)

    async def claim(
        self, client_id: str, conn: Connected, clean_start: bool, *, handover: bool = False
    ) -> int:
        """Announce that `conn` now holds `client_id`; returns its sequence number once the
        claim is in the log and read back (TimeoutError / StoreError: not announced, refuse
        the CONNECT; `drop` it). A second call for the same connection waits for the first
        claim. `handover`: the node holding the session is asked to hand it over."""
        claim = self._claims.get(client_id)
        if claim is None or claim.conn is not conn:
            fields = {"h": True} if handover else {}
            seq = self._bus.send("conn", c=client_id, cs=clean_start, **fields)
            claim = self._claims[client_id] = _Claim(conn, seq)
        await self._bus.sent(claim.seq, CLAIM_TIMEOUT_S)
        return claim.seq

    def holds(self, client_id: str, conn: Connected) -> bool:
        """`conn`'s claim of `client_id` stands (no newer claim was read)."""
        claim = self._claims.get(client_id)
        return claim is not None and claim.conn is conn and not claim.superseded

    def superseded(self, client_id: str, conn: Connected) -> bool:
        """A newer claim of `client_id` was read before `conn`'s CONNACK (it closes then)."""
        claim = self._claims.get(client_id)
        return claim is not None and claim.conn is conn and claim.superseded

    def answered(self, client_id: str, conn: Connected) -> None:
        """`conn`'s CONNACK is written: a takeover read in between closes it only now (a
        client is told 0x8E after its CONNACK, never instead of it)."""
        claim = self._claims.get(client_id)
        if claim is None or claim.conn is not conn:
            return
        claim.answered = True
        if claim.superseded:
            del self._claims[client_id]
            conn.close(ReasonCode.SESSION_TAKEN_OVER)

    def release(self, client_id: str, conn: Connected) -> None:
        """`conn` closed (or its claim failed): it holds the id no more."""
        claim = self._claims.get(client_id)
        if claim is not None and claim.conn is conn:
            del self._claims[client_id]

    def previous(self, client_id: str, node: str, seq: int) -> Claim | None:
        """The claim of `client_id` read just before claim `seq` of `node` (None: none in the
        last CHAIN_S seconds, or that claim is not known)."""
        chain = self._chain.get(client_id, [])
        try:
            at = chain.index((node, seq))
        except ValueError:
            return None
        return chain[at - 1] if at > 0 else None

    def _remember(self, cid: str, node: str, seq: int) -> None:
        now = time.monotonic()
        read = self._read
        while read and now - read[0][0] > CHAIN_S:
            _, old = read.popleft()
            chain = self._chain.get(old)
            if chain:
                del chain[0]
                if not chain:
                    del self._chain[old]
        self._chain.setdefault(cid, []).append((node, seq))
        read.append((now, cid))

    def _on_connect(self, rec: Record) -> None:
        cid = rec.get("c")
        if not isinstance(cid, str):
            return
        self._remember(cid, rec["n"], rec["i"])
        claim = self._claims.get(cid)
        if claim is None:
            return
        if rec["n"] == self._bus.node_id and rec["i"] == claim.seq:
            claim.seen = True
            return
        if not claim.seen:
            return  # ours is later in the log: the other connection is the one to go
        log.info("%r: session taken over by a connection on node %s", cid, rec["n"])
        self._moved(cid, rec)
        if claim.answered:
            del self._claims[cid]
            claim.conn.close(ReasonCode.SESSION_TAKEN_OVER)
        else:
            claim.superseded = True  # closed once its CONNACK is out (answered)
        if not rec.get("cs", True):
            self._cancel_will(cid)
