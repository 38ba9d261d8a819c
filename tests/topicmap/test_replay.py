"""`$replay/{from}/{filter}` and `replay-from` values (topicmap/replay.py)."""

from __future__ import annotations

import pytest

from topicmap import (
    TopicError,
    TopicFilter,
    is_parent_name,
    parent_topic,
    parse_replay_from,
    queue_name,
    replay_parents,
    split_replay,
)


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        ("earliest", 0),
        ("0", 0),
        ("1795600800000", 1795600800000),
        ("2026-11-25T10:00:00Z", 1795600800000),
        ("2026-11-25t10:00:00z", 1795600800000),
        ("2026-11-25 10:00:00Z", 1795600800000),
        ("2026-11-25T11:00:00+01:00", 1795600800000),
        ("2026-11-25T10:00:00.250Z", 1795600800250),
        ("2026-11-25T10:00:00.2509999Z", 1795600800250),
    ],
)
def test_parse_replay_from(value: str, ms: int) -> None:
    assert parse_replay_from(value) == ms


@pytest.mark.parametrize(
    "value",
    ["", "latest", "Earliest", "-5", "1.5", "2026-11-25", "2026-11-25T10:00:00",
     "2026-13-01T00:00:00Z", "2026-11-25T25:00:00Z", "yesterday", "1" * 16],
)  # fmt: skip
def test_bad_replay_from_is_a_clear_error(value: str) -> None:
    with pytest.raises(TopicError) as e:
        parse_replay_from(value)
    assert e.value.reason_code == 0x8F
    assert "replay start" in str(e.value)


def test_split_replay() -> None:
    assert split_replay("site/#") is None
    assert split_replay("$replay") is None  # an ordinary filter, like `$share`
    r = split_replay("$replay/2026-11-25T10:00:00Z/site/+/dev/#")
    assert r is not None
    assert r.since_ms == 1795600800000
    assert r.filter == TopicFilter("site/+/dev/#")
    assert r.start == "2026-11-25T10:00:00Z"
    r = split_replay("$replay/earliest/#")
    assert r is not None and r.since_ms == 0 and r.filter.text == "#"
    r = split_replay("$replay/earliest//a")  # the empty first level is a level
    assert r is not None and r.filter.text == "/a"


@pytest.mark.parametrize(
    "text",
    ["$replay/", "$replay/earliest", "$replay/earliest/", "$replay/nope/site/#",
     "$replay/earliest/site/#/x", "$replay/earliest/$share/g/site/#",
     "$replay/earliest/$replay/0/site"],
)  # fmt: skip
def test_bad_replay_filters(text: str) -> None:
    with pytest.raises(TopicError):
        split_replay(text)


def test_replay_parents() -> None:
    queues = [
        parent_topic("site/1"),
        parent_topic("Home/x"),
        parent_topic("$SYS/x"),
        parent_topic("/x"),
        queue_name("site/#"),
        "%RETAIN%",
    ]
    assert replay_parents(TopicFilter("site/+/t"), queues) == ["site"]
    assert replay_parents(TopicFilter("Home/#"), queues) == ["_home"]
    assert replay_parents(TopicFilter("nothing/#"), queues) == []
    assert replay_parents(TopicFilter("/x"), queues) == [parent_topic("/x")]
    # A wildcard first level spans every parent (the `$` rule is applied per message).
    assert replay_parents(TopicFilter("#"), queues) == sorted(
        [parent_topic("site/1"), parent_topic("Home/x"), parent_topic("$SYS/x"), "_0empty"]
    )
    assert not is_parent_name(queue_name("site/#"))
    assert not is_parent_name("%RETAIN%")
    assert is_parent_name(parent_topic("x" * 300 + "/y"))  # hash-based long parent name
