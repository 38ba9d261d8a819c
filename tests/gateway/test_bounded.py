"""gateway/bounded.py: a dict kept to its bound, oldest entries dropped first."""

from __future__ import annotations

from gateway.bounded import trim_oldest


def test_under_the_bound_nothing_is_dropped() -> None:
    table = {i: str(i) for i in range(8)}
    trim_oldest(table, 8)
    assert table == {i: str(i) for i in range(8)}


def test_over_the_bound_the_oldest_go_down_to_an_eighth_below_it() -> None:
    table = {i: str(i) for i in range(65)}
    trim_oldest(table, 64)
    assert list(table) == list(range(9, 65))  # 65 - (1 + 64 // 8) = 56 newest kept, in order


def test_insertion_order_decides_not_the_key() -> None:
    names = [f"k{n:02d}" for n in range(19, -1, -1)]  # k19 first, k00 last
    table = dict.fromkeys(names, 0)
    table["k19"] = table.pop("k19")  # taken out and put back: now the newest
    trim_oldest(table, 16)
    # 20 > 16: 4 + 16 // 8 = 6 oldest dropped (k18 .. k13); k19 stays, the newest
    assert list(table) == [f"k{n:02d}" for n in range(12, -1, -1)] + ["k19"]


def test_a_table_filled_on_and_on_stays_bounded_and_keeps_the_newest() -> None:
    table: dict[int, int] = {}
    for i in range(100_000):
        table[i] = i
        trim_oldest(table, 1_000)
        assert len(table) <= 1_000
    assert list(table) == list(range(100_000 - len(table), 100_000))
    assert len(table) > 1_000 - 1_000 // 8 - 1
