"""Session's QoS 2 ids, subscriptions and pending offsets: shared empty (and one subscription
without a dict) until more come (memory per device), with dict semantics."""

from __future__ import annotations

import pytest

from gateway.session.model import (
    NO_IDS,
    NO_INFLIGHT,
    NO_PENDING,
    NO_SUBSCRIPTIONS,
    Inflight,
    OneSubscription,
    Session,
    SubscriptionState,
    pending_of,
)


def test_qos2_ids_are_shared_until_the_first_and_round_trip() -> None:
    a, b = Session("a", 5, 0), Session("b", 5, 0)
    assert a.qos2_inbound is NO_IDS and b.qos2_inbound is NO_IDS  # no set per session
    assert a.add_qos2(7) and not a.add_qos2(7)  # a duplicate is known
    assert a.add_qos2(9) and a.qos2_inbound == {7, 9}
    assert b.qos2_inbound is NO_IDS  # the shared empty one was not changed
    assert a.release_qos2(7) and not a.release_qos2(7) and a.qos2_inbound == {9}
    assert a.release_qos2(9) and a.qos2_inbound is NO_IDS
    assert not b.release_qos2(1)
    a.add_qos2(3)
    restored = Session.from_json("a", a.to_json())
    assert restored.qos2_inbound == {3}
    assert Session.from_json("b", b.to_json()).qos2_inbound is NO_IDS


def _sub(topic_filter: str, share_group: str | None = None) -> SubscriptionState:
    return SubscriptionState(topic_filter, f"q/{topic_filter}", share_group, 1)


def test_subscriptions_none_one_then_a_dict_in_order() -> None:
    s = Session("a", 5, 0)
    assert s.subscriptions is NO_SUBSCRIPTIONS and not s.subscriptions and s.by_queue == {}
    a, b, c = _sub("a/1"), _sub("$share/g/b", "g"), _sub("c/#")
    s.add_subscription(a)
    assert isinstance(s.subscriptions, OneSubscription) and dict(s.subscriptions) == {"a/1": a}
    assert (
        "a/1" in s.subscriptions and "x" not in s.subscriptions and s.subscriptions.get("x") is None
    )
    again = _sub("a/1")
    s.add_subscription(again)  # the same filter again replaces it
    assert list(s.subscriptions.values()) == [again] and s.by_queue == {"q/a/1": again}
    s.add_subscription(b)
    s.add_subscription(c)
    assert list(s.subscriptions) == ["a/1", "$share/g/b", "c/#"]
    assert list(s.by_queue) == ["q/a/1", "q/c/#"]  # shared ones are not the session's queues
    assert s.remove_subscription("a/1") is again and s.remove_subscription("a/1") is None
    assert s.remove_subscription("c/#") is c and s.remove_subscription("$share/g/b") is b
    assert not s.subscriptions and s.by_queue == {}
    one = Session("o", 5, 0)
    one.add_subscription(a)
    assert one.remove_subscription("x") is None and one.remove_subscription("a/1") is a
    assert one.subscriptions is NO_SUBSCRIPTIONS
    assert NO_SUBSCRIPTIONS == {}  # the shared empty one was not changed


def test_subscription_list_is_every_shape_in_order_and_a_copy() -> None:
    s = Session("a", 5, 0)
    assert s.subscription_list() == ()
    a, b, c = _sub("a/1"), _sub("$share/g/b", "g"), _sub("c/#")
    s.add_subscription(a)
    taken = s.subscription_list()
    assert taken == (a,)
    s.add_subscription(b)  # the walk that took it may change the session meanwhile
    assert taken == (a,)
    s.add_subscription(c)
    taken = s.subscription_list()
    assert taken == tuple(s.subscriptions.values()) == (a, b, c)
    assert s.remove_subscription("a/1") is a and taken == (a, b, c)
    assert s.subscription_list() == (b, c)


def test_by_queue_holds_no_dict_until_a_delivery_loop_asks_for_one() -> None:
    s = Session("a", 5, 0)
    a, b, g = _sub("a/1"), _sub("b/+"), _sub("$share/g/c", "g")
    assert s.by_queue is NO_SUBSCRIPTIONS
    s.add_subscription(g)  # a shared one is not the session's queue
    assert s.by_queue is NO_SUBSCRIPTIONS
    s.add_subscription(a)
    assert isinstance(s.by_queue, OneSubscription) and s.by_queue.get("q/a/1") is a
    assert s.by_queue.get("a/1") is None  # keyed by queue, not by filter
    assert s.remove_subscription("a/1") is a and s.by_queue is NO_SUBSCRIPTIONS
    s.add_subscription(a)
    s.add_subscription(b)  # a second one: a dict, in order
    assert type(s.by_queue) is dict and list(s.by_queue) == ["q/a/1", "q/b/+"]
    one = Session("o", 5, 0)
    one.add_subscription(a)
    own = one.by_queue_of()  # a delivery loop starts: a dict of the session's own
    assert type(own) is dict and own == {"q/a/1": a} and one.by_queue is own
    assert one.by_queue_of() is own
    assert one.remove_subscription("a/1") is a and one.by_queue is own and own == {}
    one.add_subscription(b)
    assert own == {"q/b/+": b}  # the loop's dict stays the one written


def test_pending_is_shared_until_delivery_gives_its_own_and_round_trips() -> None:
    a, b = _sub("a"), _sub("b")
    assert a.pending is NO_PENDING and b.pending is NO_PENDING
    with pytest.raises(TypeError):
        a.pending[5] = 1  # a missed pending_of raises instead of writing every subscription's
    pending_of(a)[5] = 1
    assert a.pending == {5: 1} and b.pending is NO_PENDING and NO_PENDING == {}
    assert a.committed() == 5 and b.committed() == 0
    s = Session("s", 5, 60)
    s.add_subscription(a)
    s.add_subscription(b)
    assert s.inflight is NO_INFLIGHT
    with pytest.raises(TypeError):
        s.inflight[3] = Inflight(3, a.queue, 5, 1)
    s.inflight_of()[3] = Inflight(3, a.queue, 5, 1)
    assert NO_INFLIGHT == {} and Session("t", 5, 60).inflight is NO_INFLIGHT
    restored = Session.from_json("s", s.to_json())
    assert restored.subscriptions["a"].pending == {5: 3} and restored.inflight.keys() == {3}
    assert restored.subscriptions["b"].pending is NO_PENDING
    assert Session.from_json("b", Session("b", 5, 60).to_json()).inflight is NO_INFLIGHT


def test_persistent_follows_the_expiry_interval() -> None:
    """`persistent` is an attribute (read at every step of a session): set_expiry keeps it with
    the interval, and a restored session has it from its record."""
    s = Session("a", 5, 0)
    assert not s.persistent
    s.set_expiry(60)
    assert s.persistent and s.expiry_interval == 60
    assert Session.from_json("a", s.to_json()).persistent
    s.set_expiry(0)
    assert not s.persistent and s.expiry_interval == 0
    assert not Session.from_json("a", s.to_json()).persistent
