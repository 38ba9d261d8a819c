"""Subscriber mix and filter matching."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.plan import filter_matches, plan_subscribers
from sim.telemetry import DeviceIdentity


@pytest.mark.parametrize(
    ("topic_filter", "topic", "matches"),
    [
        # MQTT 3.1.1 section 4.7.1 examples
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
        ("sport/#", "sport", True),
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+", "/finance", False),
        ("#", "$SYS/broker/uptime", False),
        ("+/broker/uptime", "$SYS/broker/uptime", False),
        ("$SYS/#", "$SYS/broker/uptime", True),
        # the simulator's own shapes
        ("site/+/dev/+/temperature", "site/s1/dev/d0001/temperature", True),
        ("site/+/dev/+/temperature", "site/s1/dev/d0001/humidity", False),
        ("site/s1/#", "site/s2/dev/d0002/power", False),
        ("site/s1/dev/d0001/co2", "site/s1/dev/d0001/co2", True),
    ],
)
def test_filter_matching_follows_the_spec(topic_filter: str, topic: str, matches: bool) -> None:
    assert filter_matches(topic_filter, topic) is matches


LEVEL = st.text(alphabet="abz019-_", min_size=0, max_size=4)
TOPIC_LEVELS = st.lists(LEVEL, min_size=1, max_size=6)


@given(TOPIC_LEVELS, st.data())
def test_wildcards_match_what_they_replace_and_nothing_else(
    levels: list[str], data: st.DataObject
) -> None:
    topic = "/".join(levels)
    assert filter_matches(topic, topic)
    assert filter_matches("#", topic)
    position = data.draw(st.integers(0, len(levels) - 1))
    plus = [*levels[:position], "+", *levels[position + 1 :]]
    assert filter_matches("/".join(plus), topic)
    assert filter_matches("/".join([*levels[:position], "#"]), topic)
    other = [*levels[:position], levels[position] + "x", *levels[position + 1 :]]
    assert not filter_matches("/".join(other), topic)
    assert not filter_matches("/".join([*levels, "+"]), topic)


def test_six_subscribers_cover_every_filter_kind_and_session_kind() -> None:
    plans = plan_subscribers(6, sites=4)
    filters = [f for p in plans for f in p.filters]
    assert any("#" in f for f in filters)
    assert any("+" in f and "#" not in f for f in filters)
    assert any("+" not in f and "#" not in f for f in filters)
    assert {p.persistent for p in plans} == {True, False}
    away = [p for p in plans if p.offline is not None]
    assert away and all(p.persistent for p in away)
    assert all(0 < p.offline[0] < p.offline[1] < 1 for p in away if p.offline)
    assert len({p.name for p in plan_subscribers(30, sites=4)}) == 30


def test_a_subscribers_filters_never_overlap_on_device_topics() -> None:
    devices = [DeviceIdentity.of(i, 4) for i in range(40)]
    topics = [d.topic(m) for d in devices for m in d.metrics]
    for plan in plan_subscribers(24, sites=4):
        for topic in topics:
            assert sum(filter_matches(f, topic) for f in plan.filters) <= 1
        assert any(plan.matches(t) for t in topics), plan


def test_plans_do_not_depend_on_the_number_of_devices_or_on_chance() -> None:
    # An observer-only simulator (--devices 0) must pick the same topics as the devices' one.
    assert plan_subscribers(12, sites=3) == plan_subscribers(12, sites=3)
    assert plan_subscribers(12, sites=3)[:6] == plan_subscribers(6, sites=3)
