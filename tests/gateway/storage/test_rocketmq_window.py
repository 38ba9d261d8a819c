"""The window of read messages a mirror and a history keep (gateway/storage/rocketmq/broker.py
`trim_window`): past its limit the oldest offsets go, whatever order they were read in."""

from __future__ import annotations

import random

from gateway.storage.port import StoredMessage
from gateway.storage.rocketmq.broker import trim_window


def _window(offsets: list[int]) -> dict[int, StoredMessage]:
    return {
        off: StoredMessage("t", b"%d" % off, {}, off, off, 0, 0, off, ("q",)) for off in offsets
    }


def test_a_window_within_its_limit_is_left_alone() -> None:
    msgs = _window(list(range(40)))
    trim_window(msgs, 40)
    assert sorted(msgs) == list(range(40))


def test_past_its_limit_the_newest_three_quarters_stay_in_any_read_order() -> None:
    # A catch-up reads older offsets after newer ones: the dict's order is not the offsets'.
    offsets = list(range(100))
    random.Random(7).shuffle(offsets)
    msgs = _window(offsets)
    trim_window(msgs, 40)
    assert sorted(msgs) == list(range(70, 100))
    assert all(msgs[off].queue_offset == off for off in msgs)
