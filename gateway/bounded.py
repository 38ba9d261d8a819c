"""Dicts kept to a bound by dropping their oldest entries (insertion order): the tables of
client ids, tickets and failures that must not grow without end.

Dropping one entry per insert, `del d[next(iter(d))]`, is the obvious way and a slow one in
CPython: a deleted entry's slot stays in the dict's entry array until the dict is resized (a
resize comes only from inserts, every ~2x the live size), and iteration starts at the first
slot. So each such call walks past every entry dropped since the last resize: at a bound of
tens of thousands, tens of thousands of empty slots per insert, until the next resize.
Persistent sessions created one after another met it in the flapping detector
(docs/benchmarks.md, "The flapping detector's table").

`trim_oldest` drops an eighth of the bound at once, with one walk: that walk is paid once per
bound/8 inserts.
"""

from __future__ import annotations

from itertools import islice
from typing import TypeVar

__all__ = ["trim_oldest"]

K = TypeVar("K")
V = TypeVar("V")


def trim_oldest(table: dict[K, V], limit: int) -> None:
    """Keep `table` to `limit` entries: once it holds more, drop its oldest (first inserted)
    entries down to `limit` less an eighth of it."""
    excess = len(table) - limit
    if excess > 0:
        for key in list(islice(table, excess + limit // 8)):
            del table[key]
