"""The merged offsets of a spread RocketMQ deployment (gateway/storage/rocketmq/spread.py): what the
gateway's core relies on (offsets rise along a read, `off + 1` is the position after `off`,
a message's offset names its broker and its offset there), and the merge of the brokers'
copies. The real brokers: tests/rocketmq/test_spread.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.delivery.account import CountedAccount
from gateway.storage.port import AccountRecord, AccountWriter, GetResult, GetStatus, StoredMessage
from gateway.storage.rocketmq.spread import (
    BASE,
    MergedReads,
    decode,
    encode,
    message_at,
    phys,
    slots_from_state,
)
from store import read_account


class Copy:
    """One broker's copy of a light queue, in memory (the Mirrors protocol the merge reads)."""

    def __init__(self, stamps: list[int], slot: int) -> None:
        self.msgs = [
            StoredMessage("t", f"{slot}:{i}".encode(), {}, i, 1000 * slot + i, ts, ts, i, ("q",))
            for i, ts in enumerate(stamps)
        ]

    def get(self, queue: str, offset: int, max_messages: int = 32) -> GetResult:
        run = self.msgs[offset : offset + max_messages]
        if not run:
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, 0, len(self.msgs))
        return GetResult(GetStatus.FOUND, run, offset + len(run), 0, len(self.msgs))

    def min_offset(self, queue: str) -> int:
        return 0

    def max_offset(self, queue: str) -> int:
        return len(self.msgs)


def test_a_message_offset_plus_one_is_the_position_after_it() -> None:
    vec = [5, 7, 0]
    for k in range(3):
        off = encode(vec, 2 * k + 1)
        assert message_at(off, 3) == (k, vec[k])
        after, first = decode(off + 1, 3)
        assert first == -1
        assert after == [v + (i == k) for i, v in enumerate(vec)]
        assert off >= BASE and off + 1 > off
    assert decode(encode(vec), 3) == (vec, -1)
    assert message_at(encode(vec), 3) is None  # a position, not a message


def test_an_offset_saved_before_spread_is_the_home_brokers() -> None:
    assert decode(42, 2) == ([42, 0], -1)
    assert message_at(42, 2) == (0, 42)


def test_a_read_merges_the_copies_by_store_time_and_resumes_exactly() -> None:
    reads = MergedReads([Copy([10, 30, 50], 0), Copy([20, 40], 1)])
    start = reads.min_offset("q")
    got = reads.get("q", start, 3)
    assert got.status is GetStatus.FOUND
    assert [m.body for m in got.messages] == [b"0:0", b"1:0", b"0:1"]
    offsets = [m.queue_offset for m in got.messages]
    assert offsets == sorted(offsets) and len(set(offsets)) == 3
    # The delivery loop moves on from the last offset + 1.
    rest = reads.get("q", offsets[-1] + 1, 32)
    assert [m.body for m in rest.messages] == [b"1:1", b"0:2"]
    assert rest.messages[0].queue_offset > offsets[-1]
    # Any message is found again by its offset (a resend after a restart).
    one = reads.get("q", offsets[1], 1)
    assert [m.body for m in one.messages] == [b"1:0"]
    assert reads.get("q", rest.messages[-1].queue_offset + 1, 32).messages == []
    # Physical offsets follow store time across brokers.
    merged = got.messages + rest.messages
    assert [m.physical_offset for m in merged] == sorted(m.physical_offset for m in merged)
    assert merged[0].physical_offset == phys(0, Copy([10], 0).msgs[0])


def test_slots_keep_their_numbers_and_new_brokers_follow() -> None:
    assert slots_from_state(None, "b", ["a", "b", "c"]) == ["b", "a", "c"]
    recorded = json.dumps(["b", "c"]).encode()
    assert slots_from_state(recorded, "b", ["a", "b", "c"]) == ["b", "c", "a"]
    with pytest.raises(ValueError):
        slots_from_state(None, "b0", [f"b{i}" for i in range(40)])


def test_the_delivery_account_counts_messages_of_a_merged_queue(tmp_path: Path) -> None:
    """A merged offset is far past the account's signed 64-bit fields: the account of a
    spread deployment records the messages read instead (the sum of the per-broker
    offsets), so the report's differences count messages."""
    reads = MergedReads([Copy([10, 30, 50], 0), Copy([20] * 300, 1)])
    start, end = encode([1, 2]), encode([3, 300])
    assert end >= 1 << 63
    writer = CountedAccount(AccountWriter(tmp_path), reads.count)
    writer.append([AccountRecord("c", "%LMQ%q", 0, 1, start, start, end, end, 5)])
    writer.append([AccountRecord("c", "%RETAIN%", 0, 1, 7, 7, 9, 9, 5)])  # not merged
    writer.close()
    got = read_account(tmp_path)
    assert [(r.queue, r.start, r.sent, r.queue_end) for r in got] == [
        ("%LMQ%q", 3, 303, 303),
        ("%RETAIN%", 7, 9, 9),
    ]
