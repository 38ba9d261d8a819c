"""allocate_averagely (gateway/storage/rocketmq/inbound.py) against RocketMQ's
AllocateMessageQueueAveragely: the shares Java consumers of the same group would take."""

from __future__ import annotations

import pytest

from gateway.storage.rocketmq.inbound import allocate_averagely

Q = [("broker-a", i) for i in range(4)] + [("broker-b", i) for i in range(3)]


def test_shares_as_java_computes_them() -> None:
    members = ["c1", "c2", "c3"]
    # 7 queues over 3 members: 3, 2, 2 (the first `7 % 3` members one more), contiguous.
    assert allocate_averagely(Q, members, "c1") == Q[0:3]
    assert allocate_averagely(Q, members, "c2") == Q[3:5]
    assert allocate_averagely(Q, members, "c3") == Q[5:7]
    assert allocate_averagely(Q[:2], members, "c3") == []  # more members than queues
    assert allocate_averagely(Q, members, "gone") == []
    assert allocate_averagely([], members, "c1") == []


@pytest.mark.parametrize("queues", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("members", [1, 2, 3, 5, 8])
def test_every_queue_has_exactly_one_member(queues: int, members: int) -> None:
    qs = [("b", i) for i in range(queues)]
    ms = [f"m{i}" for i in range(members)]
    shares = [allocate_averagely(qs, ms, m) for m in ms]
    assert sorted(q for share in shares for q in share) == qs
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
