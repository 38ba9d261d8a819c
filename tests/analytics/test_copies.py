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
