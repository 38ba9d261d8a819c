"""Inbound QoS 2 across a crash: the packet ids of publishes stored after a session's last save.

A QoS 2 PUBLISH is stored (in sync mode: fsynced) before its packet id joins the session's
`qos2_inbound` and the session record holding it is saved; only then is PUBREC sent. A crash
between the two leaves the message in the log and its id nowhere, and the client's resend
(DUP) would be stored a second time. The log knows better: each record names its publisher's
client id and packet id (topicmap/record.py CLIENT, PID, QOS). So every saved session record
carries `log_pos`, a log position such that each QoS 2 message of the session stored below
it has its id in the record's `qos2_inbound` (or was released since). At a restart the log is
read from the lowest `log_pos` of the sessions connected at the crash, and the id of each
QoS 2 message of such a session at or past its own `log_pos` joins its `qos2_inbound`: the
resent PUBLISH is answered with PUBREC and stored once.

`log_pos` is the log's end when the record is encoded, lowered to the end before the append of
any QoS 2 PUBLISH of the session still between its append and its id joining `qos2_inbound`
(`storing` ... `stored`). A message past `log_pos` cannot have been PUBREC'd (that waits for a
record saved after its id joined), so no id of a completed exchange is brought back. A session
offline at the crash published nothing after its last record and is not read for.

An idle connected session's record is not rewritten (progress passes write only what moved), so
its `log_pos` may be old. What bounds the read is the *floor*: a position below which every
QoS 2 message of every session has its id in a saved record. Each progress pass appends it
(gateway/session/registry.py QOS2_FLOOR_KEY): the log's end then, lowered to the oldest mark of
a PUBLISH still being stored. It holds because an id joining `qos2_inbound` is saved at once
(the record appended before the PUBREC, and before any later record such as the floor's). A
restart reads from the larger of the floor and a session's own `log_pos`: about one progress
pass of log.

Only where the log reads back in order (storage.port.LogScan: the embedded store); elsewhere
nothing is written or read at a restart.

On RocketMQ (storage.port.PublishScan: the parent topic's queue, read asynchronously) the log is
not read at a restart but when a resend asks for it, and the question is narrower: a QoS 2
PUBLISH whose outcome this node does not know. A session carries `qos2_since` (record field
QOS2_SINCE_FIELD), a position at or below every such PUBLISH of the client:

    set by     a QoS 2 PUBLISH whose store ended without its id joining `qos2_inbound` (the
               send failed or was not answered: maybe stored; the client left before PUBREC):
               its mark; a record encoded while a QoS 2 PUBLISH is being stored: its mark (the
               node may be lost before the outcome); a session resumed from the record of a
               node that crashed or was lost with it connected: that record's `log_pos`
    used by    a QoS 2 PUBLISH with DUP whose id is not in `qos2_inbound`: the parent queue is
               read from `qos2_since` for a message of this client with that packet id, topic
               and payload; found, it is acknowledged (PUBREC) and not stored again
    cleared by a QoS 2 PUBLISH without DUP: the client resends its unacknowledged PUBLISH
               packets first, in order (MQTT-4.6.0-1), so none of those comes after it

A QoS 2 PUBLISH pays one mark (as on the embedded store); the read happens only for such a
resend, from the position of the client's last record before its outcome was lost. Not kept
with `rocketmq_spread` (one parent queue per broker): there the resend is stored again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.storage.port import LogScan, PublishScan, StoreError
from topicmap.record import CLIENT, PID, QOS, TOPIC

if TYPE_CHECKING:
    from gateway.session.model import Session

if TYPE_CHECKING:
    from gateway.protocol import Publish

log = logging.getLogger("lmqtt.session")

#: The session record's fields (gateway/session/model.py, written by the registry).
LOG_POS_FIELD = "log_pos"
QOS2_SINCE_FIELD = "qos2_since"


class InboundQos2:
    """The `log_pos` of each session record, and its use at a restart (or at a resend)."""

    __slots__ = ("_publishes", "_scan", "_storing", "floor", "saved")

    def __init__(self, store: object) -> None:
        self._scan = store if isinstance(store, LogScan) else None
        self._publishes = store if self._scan is None and isinstance(store, PublishScan) else None
        # client id -> {packet id: the log's end before that PUBLISH's append}
        self._storing: dict[str, dict[int, int]] = {}
        #: client id -> `log_pos` of the record of a session connected at the crash (load()).
        self.saved: dict[str, int] = {}
        #: The newest floor the state log holds (load()); 0: none.
        self.floor = 0

    def end(self) -> int | None:
        """The log's end now (None: no `log_pos` is kept with this backend)."""
        if self._scan is not None:
            return self._scan.log_max_offset
        if self._publishes is not None:
            return self._publishes.publish_position
        return None

    def storing(self, client_id: str, packet_id: int) -> None:
        """A QoS 2 PUBLISH is about to be appended."""
        end = self.end()
        if end is not None:
            self._storing.setdefault(client_id, {})[packet_id] = end

    def unsure(self, session: Session, packet_id: int) -> None:
        """A QoS 2 PUBLISH of `session` ended without its id joining `qos2_inbound`: maybe
        stored (a resend of it is looked for, see the module docstring). Call before
        `stored`."""
        if self._publishes is None:
            return
        marks = self._storing.get(session.client_id)
        mark = None if marks is None else marks.get(packet_id)
        if mark is not None:
            since = session.qos2_since
            session.qos2_since = mark if since is None else min(since, mark)

    def resumed_behind(self, session: Session) -> None:
        """`session` resumes from the record of a node (or run) that ended with it connected:
        whatever it published after that record has an unknown outcome."""
        pos = session.log_pos
        if self._publishes is None or pos is None:
            return
        since = session.qos2_since
        session.qos2_since = pos if since is None else min(since, pos)

    def since(self, session: Session) -> int | None:
        """The record's QOS2_SINCE_FIELD now: the session's, lowered to the marks of its QoS 2
        PUBLISH packets still being stored (None: none)."""
        if self._publishes is None:
            return None
        since = session.qos2_since
        marks = self._storing.get(session.client_id)
        if marks:
            low = min(marks.values())
            since = low if since is None else min(since, low)
        return since

    async def stored_before(self, session: Session, pub: Publish) -> bool:
        """`pub` (QoS 2, DUP, its id not in `qos2_inbound`) is in the log already: a message of
        this client with its packet id, topic and payload at or past `qos2_since`."""
        publishes, since = self._publishes, session.qos2_since
        if publishes is None or since is None:
            return False
        cid, pid = session.client_id, str(pub.packet_id)
        try:
            async for m in publishes.publishes_since(since):
                props = m.properties
                if (
                    props.get(PID) == pid
                    and props.get(CLIENT) == cid
                    and props.get(QOS) == "2"
                    and props.get(TOPIC) == pub.topic
                    and m.body == pub.payload
                ):
                    log.info(
                        "%r: QoS 2 PUBLISH %s resent after an unknown outcome was stored"
                        " already (offset %d): acknowledged, not stored again",
                        cid, pid, m.queue_offset,
                    )  # fmt: skip
                    return True
        except StoreError as exc:
            # At least once rather than never: stored (again).
            log.warning("%r: the log not read for QoS 2 PUBLISH %s (%s)", cid, pid, exc)
        return False

    def stored(self, client_id: str, packet_id: int) -> None:
        """Its id joined `qos2_inbound` (or the append failed, or the exchange was dropped)."""
        marks = self._storing.get(client_id)
        if marks is not None:
            marks.pop(packet_id, None)
            if not marks:
                del self._storing[client_id]

    def record_fields(self, session: Session, end: int, record: dict[str, Any]) -> None:
        """Put LOG_POS_FIELD (`position` at `end`) and QOS2_SINCE_FIELD (`since`, when set)
        into `session`'s record: one call per record encoded, none of the lookups when no QoS 2
        PUBLISH is being stored (the common case)."""
        if not self._storing:
            record[LOG_POS_FIELD] = end
            since = session.qos2_since if self._publishes is not None else None
        else:
            record[LOG_POS_FIELD] = self.position(session.client_id, end)
            since = self.since(session)
        if since is not None:
            record[QOS2_SINCE_FIELD] = since

    def position(self, client_id: str, end: int) -> int:
        """The `log_pos` of a record of `client_id` encoded when the log ends at `end`."""
        marks = self._storing.get(client_id)
        return min(end, *marks.values()) if marks else end

    def floor_now(self) -> int | None:
        """The floor to record now (see the module docstring); None: no `log_pos` is kept."""
        if self._scan is None:
            return None
        end = self._scan.log_max_offset
        for marks in self._storing.values():
            end = min(end, *marks.values())
        return end

    def recover(self, sessions: Mapping[str, Session]) -> int:
        """At a restart, after the sessions were loaded: add to each crashed session's
        `qos2_inbound` the ids of its QoS 2 messages stored at or past its `log_pos`. Returns
        how many ids were added."""
        saved, self.saved = self.saved, {}
        floor = self.floor
        since = {cid: max(pos, floor) for cid, pos in saved.items() if cid in sessions}
        if self._scan is None or not since:
            return 0
        added = 0
        for m in self._scan.messages_since(min(since.values())):
            props = m.properties
            if props.get(QOS) != "2":
                continue
            cid = props.get(CLIENT, "")
            start = since.get(cid)
            pid = props.get(PID)
            if start is None or pid is None or m.physical_offset < start:
                continue
            if sessions[cid].add_qos2(int(pid)):
                added += 1
        return added
