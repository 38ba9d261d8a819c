"""The share table's rules (gateway/cluster/share_table.py): what a node that joined late
rebuilds from the bus records it reads back from "p"."""

from __future__ import annotations

from typing import Any

from gateway.cluster.share_table import ShareTable


def _replay(table: ShareTable, records: list[tuple[int, str, dict[str, Any]]]) -> None:
    for at, kind, rec in records:
        if kind == "shd":
            table.take_assign(rec["o"], rec["c"], rec.get("p"), at)
        elif kind == "sha":
            table.take_done(rec["n"], rec["o"])
        else:
            table.take_returned(rec["x"], rec["o"])


#: A dispatcher's history: offsets 0-3 to A and B, A holds 0 unacknowledged, B acknowledges
#: 1 and 3, then 2 is given back by A... (bus offset, kind, record).
HISTORY: list[tuple[int, str, dict[str, Any]]] = [
    (10, "shd", {"o": [[0, "A"], [1, "B"]], "c": 0, "p": 10}),
    (11, "sha", {"n": "B", "o": [1]}),
    (12, "shd", {"o": [[2, "A"], [3, "B"]], "c": 0, "p": 10}),
    (13, "sha", {"n": "B", "o": [3]}),
    (14, "shr", {"x": "A", "o": [2]}),
]


def test_the_dispatchers_origin_is_the_first_assignment_above_the_committed_position() -> None:
    table = ShareTable()
    _replay(table, HISTORY)
    assert table.assigned == {0: "A"}
    assert table.done == {1, 3}
    assert table.origin(0, 20) == 10
    assert table.origin(2, 20) == 12
    assert table.origin(4, 20) == 20  # nothing assigned at or above: where it reads now


def test_a_late_table_rebuilt_from_the_records_read_back_knows_what_was_done() -> None:
    """A node that read only from bus offset 13 on (an "sha" it could not place, an "shr",
    then an announcement of c and p) rebuilds the whole table from p."""
    late = ShareTable()
    _replay(late, HISTORY[3:])
    late.take_assign([], 0, 10, 15)
    assert late.done == set() and late.c == 0 and late.p == 10
    late.take_history([*HISTORY, (15, "shd", {"o": [], "c": 0, "p": 10})])
    full = ShareTable()
    _replay(full, HISTORY)
    assert (late.assigned, late.done, late.c, late.hi) == (full.assigned, full.done, 0, 4)


def test_a_committed_position_forgets_what_is_below_it() -> None:
    table = ShareTable()
    _replay(table, HISTORY)
    table.take_done("A", [0])
    table.take_assign([[2, "B"]], 2, 12, 16)
    assert table.done == {3} and table.c == 2 and table.p == 12
    assert table.first == {2: 12, 3: 12}
    table.take_assign([[1, "A"]], 2, 12, 17)  # below the committed position: done already
    assert 1 not in table.assigned
