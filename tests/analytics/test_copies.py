"""A light queue's copies on a deployment over several RocketMQ brokers (analytics/copies.py):
the names the report gives them, and how its pages show them."""

from __future__ import annotations

from analytics.copies import base_queue, copy_name, shown, split_copy
from analytics.snapshots import QueueEnd, queue_ends_table
from topicmap.naming import queue_name


def test_copy_names_round_trip_and_the_home_copy_keeps_the_queue_name() -> None:
    q = queue_name("plant/+/temp")
    assert copy_name(q, "broker-a", home="broker-a") == q
    other = copy_name(q, "broker-b", home="broker-a")
    assert other == q + "\x00broker-b"
    assert split_copy(other) == (q, "broker-b") and split_copy(q) == (q, None)
    assert base_queue(other) == base_queue(q) == q
    # Prefix order survives the suffix: the gateway's owner among overlapping subscriptions is
    # the first queue by name, on the record's own broker.
    a, b = queue_name("a/#"), queue_name("a/b/#")
    assert (a < b) == (copy_name(a, "x", "h") < copy_name(b, "x", "h"))


def test_a_copy_is_shown_with_its_broker_and_keeps_its_filter() -> None:
    q = queue_name("plant/#")
    other = copy_name(q, "broker-b", home="broker-a")
    assert shown(q, "plant/#") == "plant/#"
    assert shown(other, "plant/#") == "plant/# @broker-b"
    assert shown(other) == f"{q} @broker-b" and "\x00" not in shown(other)
    rows = queue_ends_table([QueueEnd(q, 0, 3), QueueEnd(other, 0, 5)]).to_pylist()
    assert [r["queue_filter"] for r in rows] == ["plant/#", "plant/#"]


def test_a_spread_session_entry_is_split_into_one_subscription_per_copy() -> None:
    """The gateway saves one entry per light queue with merged offsets (topicmap/spread.py);
    the report gives each broker's copy that broker's offsets, and leaves the rest alone."""
    from analytics.rocketmq import per_copy
    from analytics.snapshots import Subscription
    from topicmap.spread import BASE, encode

    q = queue_name("plant/#")
    slots = ["broker-a", "broker-b", "broker-c"]
    big = (1 << 40) + 7  # a broker offset far past 32 bits survives
    merged = Subscription("c", "plant/#", q, None, 1, encode([3, 0, big]), encode([5, 2, big], 4),
                          False)  # fmt: skip
    old = Subscription("d", "plant/#", q, None, 1, 4, None, True)  # saved before spread
    home_only = Subscription("e", "x", "%RETAIN%", None, 0, 9, 9, True)
    got = per_copy([merged, old, home_only], slots)
    assert [(s.client_id, s.queue, s.start_offset, s.next_offset) for s in got] == [
        ("c", q, 3, 5),
        ("c", q + "\x00broker-b", 0, 3),  # idx 4: the position after slot 1's offset 2
        ("c", q + "\x00broker-c", big, big),
        ("d", q, 4, None),
        ("d", q + "\x00broker-b", 0, None),
        ("d", q + "\x00broker-c", 0, None),
        ("e", "%RETAIN%", 9, 9),
    ]
    assert all(s.start_offset is None or s.start_offset < BASE for s in got)
