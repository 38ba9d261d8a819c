"""Fence markers in the state log: a lost node's state writes that land after its takeover are
nobody's (cluster mode; the rule every reader of the %STATE% queue applies, in one place).

A node cut off from the brokers fences itself within its lease (gateway/cluster/membership.py),
but what it had sent before, or sends while it stops (the disconnect records of the connections
it closes), can wait in its TCP send buffers and be stored once the cut heals: after the
survivors declared it lost and rewrote its sessions. Refusing writes once fenced cannot stop
those; readers must. So every node that declares a node lost appends a *marker* naming it
before it acts on the loss (the leader's rewrites of the lost node's sessions, a session resumed
from the lost node's record), and every reader drops the lost node's ordinary batches stored
after the first marker:

    %STATE% offset    batch (writer)            a reader applies
    100               session/c {..}  (A)       yes
    101               fence/A ""      (B)       marker: A fenced at 101 (the first one counts)
    102               session/c {..}  (B)       yes (B's takeover, after its marker)
    103               fence/A ""      (C)       a later marker: no change
    104               session/c {..}  (A, late) no: A's, stored after 101
    ...               snapshot: fence/A "101"   the marker's copy keeps its offset (a replay
                                                that starts after 101 learns it from there)

    marker record := key FENCE_KEY_PREFIX + node id, value b"" (as written) or the offset of the
                     first marker as ASCII digits (as readers keep it, and compaction copies it)
    marker batch  := a batch of its own whose properties carry FENCE_PROPERTY (a tail that skips
                     its own batches still finds its own markers)

Who reads: the tail of every node (gateway/storage/rocketmq/state.py `follow`, its own markers
included), every replay (`load`, at every start: a fenced node restarted is a new node id and
replays like any other), compaction (it copies the honoured records with their writers and the
markers with their offsets; a snapshot's copies are honoured as they are, since the compaction
copied only what the rule let through). A replay that reads a lost node's late batch before the
snapshot copy of its marker (the batch landed between the compaction's start and that copy)
replays again with the markers known from the first pass.

A node id is never reused (gateway/cluster/membership.py `new_node_id`, and a node that comes back
is a new member), so a marker never hides a later process's writes. Markers stay in the log (one
small record per node ever lost): a late write can land as long as the lost process's TCP
connection retransmits.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.storage.port import StateRecord

#: Key of a marker record: this prefix and the fenced node's id.
FENCE_KEY_PREFIX = "fence/"
#: Property of a marker batch (its value: the fenced node's id).
FENCE_PROPERTY = "lmqtt.fence"


def marker(node: str) -> StateRecord:
    """The marker record fencing `node`, as its writer appends it."""
    return (FENCE_KEY_PREFIX + node, b"")


class Fences:
    """The markers read so far: node -> offset of its first marker in the state queue."""

    __slots__ = ("_applied", "at", "late")

    def __init__(self, known: dict[str, int] | None = None) -> None:
        self.at: dict[str, int] = dict(known or {})
        self._applied: dict[str, int] = {}  # replay: node -> offset of its newest batch applied
        #: A replay applied a batch its node's marker, read later, excludes: it is done again
        #: with the markers known from the start.
        self.late = False

    def admits(self, node: str, offset: int, *, snapshot: bool = False) -> bool:
        """Whether a batch written by `node`, stored at `offset` of the state queue, is applied.
        A compaction's copies are (they are what the rule let through)."""
        if snapshot:
            return True
        at = self.at.get(node)
        return at is None or offset < at

    def applied(self, node: str, offset: int) -> None:
        """A replay applied `node`'s ordinary batch at `offset` (see `late`)."""
        self._applied[node] = offset

    def read(self, records: Iterable[StateRecord], offset: int) -> list[StateRecord]:
        """Take the markers among `records` (a batch stored at `offset`); returns the markers
        as readers keep them (value: the first marker's offset), to apply in their place."""
        kept: list[StateRecord] = []
        for key, value in records:
            if not key.startswith(FENCE_KEY_PREFIX) or value is None:
                continue
            node = key[len(FENCE_KEY_PREFIX) :]
            if node not in self.at:
                at = self.at[node] = int(value) if value.isdigit() else offset
                if self._applied.get(node, -1) >= at:
                    self.late = True
            kept.append((key, str(self.at[node]).encode()))
        return kept


def has_marker(records: Iterable[StateRecord]) -> bool:
    return any(key.startswith(FENCE_KEY_PREFIX) for key, _value in records)
