"""A share group's cluster-wide table: which node holds which message, which are done.

Every node builds it from the "shd", "sha" and "shr" records of the cluster bus
(gateway/cluster/shared.py has the records and the dispatch), with the same rules in the bus's
one order, so every node that read the same records holds the same table:

    shd  offset -> node, unless the offset is assigned already (first assignment wins) or done
         (acknowledged, or below a dispatcher's committed position "c"); the record's "c"
         (and "p", below) replace the table's when "c" is newer
    sha  unassigned and done, if it was assigned to the sending node
    shr  unassigned, if it was assigned to the node named "x"

A node reads the bus from where it started (gateway/cluster/bus.py `origin`), so its table
lacks what was assigned and acknowledged before: a node that takes the dispatch over rebuilds
the table from the records it did not read. Where they start is what "p" says:

    p  the bus offset of the first assignment of any offset at or above "c": every record
       about an offset the table must know (not below "c") is stored at or after "p"

Offsets are first assigned in increasing order by a dispatcher (a proposal lost with its bus
send is assigned later, hence the minimum), so `first` is kept in bus order and "p" is the first
of its entries at or above "c".
"""

from __future__ import annotations

from typing import Any

#: Acknowledged offsets remembered above the committed position (a member that never
#: acknowledges holds the position down): beyond this the oldest are forgotten, which costs
#: at most a second delivery of them when the dispatch moves to another node.
DONE_MAX = 65536


class ShareTable:
    """The table's state and its rules, without side effects (see the module docstring)."""

    def __init__(self) -> None:
        self.assigned: dict[int, str] = {}  # offset -> node holding it
        self.done: set[int] = set()  # acknowledged offsets at or above `c`
        self.c: int | None = None  # the newest committed position read from a dispatcher
        self.p: int | None = None  # the bus offset the records about offsets >= c start at
        self.hi = 0  # 1 + the highest offset ever assigned (0: none)
        self.first: dict[int, int] = {}  # offset >= c -> bus offset of its first assignment

    def take_assign(
        self, pairs: list[list[Any]], c: int, p: int | None, position: int
    ) -> list[tuple[int, str]]:
        """Apply an "shd" read at bus offset `position`; returns the assignments taken."""
        taken: list[tuple[int, str]] = []
        assigned, done, first = self.assigned, self.done, self.first
        for off, node in pairs:
            off = int(off)
            if off in assigned or off in done or (self.c is not None and off < self.c):
                continue
            assigned[off] = node
            self.hi = max(self.hi, off + 1)
            first.setdefault(off, position)
            taken.append((off, node))
        if self.c is None or c > self.c:
            self.c = c
            if p is not None:
                self.p = p
            self.done = {o for o in done if o >= c}
            self.first = {o: at for o, at in first.items() if o >= c}
        return taken

    def take_done(self, node: str, offsets: list[int]) -> None:
        """Apply an "sha" of `node`."""
        for off in offsets:
            if self.assigned.get(off) == node:
                del self.assigned[off]
                if self.c is None or off >= self.c:
                    self.done.add(off)
        if len(self.done) > DONE_MAX:
            self.done = set(sorted(self.done)[DONE_MAX // 2 :])

    def take_returned(self, node: str, offsets: list[int]) -> list[int]:
        """Apply an "shr" for `node`; returns the offsets unassigned."""
        out = []
        for off in offsets:
            if self.assigned.get(off) == node:
                del self.assigned[off]
                out.append(off)
        return out

    def origin(self, c: int, position: int) -> int:
        """The "p" to send with committed position `c` by a node that reads the bus at
        `position`: the first assignment at or above `c`, or `position` if there is none."""
        at = next((at for off, at in self.first.items() if off >= c), position)
        return min(at, position)

    def take_history(self, records: list[tuple[int, str, dict[str, Any]]]) -> None:
        """Rebuild from the records read back from "p" (`(bus offset, kind, record)`, in bus
        order, up to what this node has read): they hold everything about the offsets at or
        above "c", this table's own records included, so they replace it."""
        fresh = ShareTable()
        for position, kind, rec in records:
            if kind == "shd":
                fresh.take_assign(rec.get("o", []), int(rec.get("c", 0)), rec.get("p"), position)
            elif kind == "sha":
                fresh.take_done(str(rec["n"]), [int(o) for o in rec.get("o", [])])
            elif kind == "shr":
                fresh.take_returned(str(rec.get("x")), [int(o) for o in rec.get("o", [])])
        self.assigned = fresh.assigned
        if fresh.c is not None and (self.c is None or fresh.c > self.c):
            self.c, self.p = fresh.c, fresh.p
        c = self.c
        self.done = {o for o in fresh.done | self.done if c is None or o >= c}
        self.first = {o: at for o, at in fresh.first.items() if c is None or o >= c}
        self.hi = max(self.hi, fresh.hi)
