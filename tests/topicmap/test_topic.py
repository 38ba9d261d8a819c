"""Topic name and filter validation and matching, from the MQTT 3.1.1 / 5.0 examples."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topicmap import MAX_TOPIC_BYTES, Topic, TopicError, TopicFilter
from topicmap.errors import TOPIC_FILTER_INVALID, TOPIC_NAME_INVALID

# MQTT 5.0 section 4.7.1 (and 3.1.1 section 4.7.1): valid and invalid filters.
VALID_FILTERS = [
    "#",
    "sport/tennis/#",
    "sport/tennis/player1/#",
    "+",
    "+/tennis/#",
    "sport/+/player1",
    "+/+",
    "/+",
    "/",
    "//",
    "a//b",
    "$SYS/#",
    "$SYS/monitor/+",
    "+/monitor/Clients",
    "$share",
    "$share/g/#",
    "$share/group-1/sport/+/player1",
    "$share/g/$SYS/#",
    "$share/g//",
    "héllo/wörld",
]
INVALID_FILTERS = [
    ("", "empty"),
    ("sport/tennis#", "inside level"),
    ("sport/tennis/#/ranking", "must be the last level"),
    ("sport+", "inside level"),
    ("a/b+/c", "inside level"),
    ("#/a", "must be the last level"),
    ("a/\x00", "U+0000"),
    ("$share/", "empty share name"),
    ("$share//a", "empty share name"),
    ("$share/g", "no topic filter"),
    ("$share/g/", "empty topic filter"),
    ("$share/g+/a", "'+'"),
    ("$share/#/a", "'#'"),
    ("$share/g/a#", "inside level"),
    ("a/\ud800", "lone surrogate"),
]


@pytest.mark.parametrize("text", VALID_FILTERS)
def test_valid_filters_parse(text: str) -> None:
    parsed = TopicFilter(text)
    assert str(parsed) == text
    assert "/".join(parsed.levels) == parsed.filter


@pytest.mark.parametrize(("text", "hint"), INVALID_FILTERS)
def test_invalid_filters_say_why(text: str, hint: str) -> None:
    with pytest.raises(TopicError, match=re.escape(hint)) as caught:
        TopicFilter(text)
    assert caught.value.reason_code == TOPIC_FILTER_INVALID
    assert caught.value.value == text
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("text", "group", "underlying"),
    [
        ("$share/g/site/+/dev/#", "g", "site/+/dev/#"),
        ("$share/consumers/#", "consumers", "#"),
        ("$share/g//x", "g", "/x"),
        ("$share/g/$share/h/x", "g", "$share/h/x"),
        ("site/#", None, "site/#"),
        ("$share", None, "$share"),
    ],
)
def test_shared_subscription_parsing(text: str, group: str | None, underlying: str) -> None:
    parsed = TopicFilter(text)
    assert parsed.share_group == group
    assert parsed.is_shared == (group is not None)
    assert parsed.filter == underlying
    assert parsed.levels == tuple(underlying.split("/"))


@pytest.mark.parametrize(
    "name", ["a", "/", "//", "/finance", "sport/", "$SYS/x", "a b/ü/温度", "a/%/\u2215"]
)
def test_valid_topic_names(name: str) -> None:
    topic = Topic(name)
    assert str(topic) == name
    assert topic.levels == tuple(name.split("/"))
    assert topic.is_system == name.startswith("$")


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("", "empty"),
        ("a/+", "wildcard"),
        ("a/#", "wildcard"),
        ("a+b", "wildcard"),
        ("a\x00b", "U+0000 at index 1"),
        ("\udfff", "lone surrogate"),
    ],
)
def test_invalid_topic_names(name: str, hint: str) -> None:
    with pytest.raises(TopicError, match=re.escape(hint)) as caught:
        Topic(name)
    assert caught.value.reason_code == TOPIC_NAME_INVALID


def test_non_str_is_rejected() -> None:
    with pytest.raises(TopicError, match="must be a str"):
        Topic(b"a/b")
    with pytest.raises(TopicError, match="must be a str"):
        TopicFilter(None)


def test_length_limit_counts_utf8_bytes() -> None:
    Topic("a" * MAX_TOPIC_BYTES)
    TopicFilter("a" * (MAX_TOPIC_BYTES - 2) + "/#")
    with pytest.raises(TopicError, match="65536 bytes"):
        Topic("a" * (MAX_TOPIC_BYTES + 1))
    Topic("é" * (MAX_TOPIC_BYTES // 2))  # 65,534 bytes
    with pytest.raises(TopicError, match="65536 bytes"):
        Topic("é" * (MAX_TOPIC_BYTES // 2 + 1))
    # 16,384 four-byte characters: few code points, too many bytes.
    with pytest.raises(TopicError, match="65536 bytes"):
        TopicFilter("\U0001f321" * 16_384)


def test_error_messages_stay_short_for_huge_input() -> None:
    with pytest.raises(TopicError) as caught:
        Topic("x" * 70_000)
    assert len(str(caught.value)) < 300


def test_from_bytes() -> None:
    assert Topic.from_bytes("温度/a".encode()) == Topic("温度/a")
    with pytest.raises(TopicError, match="not valid UTF-8") as caught:
        Topic.from_bytes(b"a/\xff")
    assert caught.value.reason_code == TOPIC_NAME_INVALID
    with pytest.raises(TopicError, match="not valid UTF-8"):
        Topic.from_bytes(b"\xed\xa0\x80")  # an encoded surrogate is not UTF-8


def test_values_are_immutable_and_hashable() -> None:
    topic, parsed = Topic("a/b"), TopicFilter("$share/g/a/+")
    with pytest.raises(AttributeError):
        topic.name = "c"
    with pytest.raises(AttributeError):
        parsed.filter = "c"
    assert {Topic("a/b"), topic} == {topic}
    assert {TopicFilter("$share/g/a/+"), parsed} == {parsed}
    assert TopicFilter("a/+") != parsed
    assert repr(topic) == "Topic('a/b')"


# MQTT 5.0 section 4.7.1.2, 4.7.1.3 and 4.7.2 examples: (filter, topic, matches).
SPEC_MATCHES = [
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/tennis/player1/#", "sport/tennis/player2", False),
    ("sport/#", "sport", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player2", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("#", "/finance", True),
    ("#", "$SYS/monitor/Clients", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("+/monitor/Clients", "SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS/monitor/Clients", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS", True),
    ("+", "$SYS", False),
    ("#", "$", False),
    ("$/+", "$/a", True),
    ("+/#", "a", True),
    ("+/#", "/", True),
    ("a/b", "a/b", True),
    ("a/b", "a/b/", False),
    ("a/b", "A/b", False),
    ("a//b", "a//b", True),
    ("a/+/b", "a//b", True),
    ("$share/g/sport/#", "sport/x", True),
    ("$share/g/#", "$SYS/x", False),
]


@pytest.mark.parametrize(("text", "topic", "expected"), SPEC_MATCHES)
def test_spec_matching_examples(text: str, topic: str, expected: bool) -> None:
    assert TopicFilter(text).matches(topic) is expected
    assert TopicFilter(text).matches(Topic(topic)) is expected


def test_matches_rejects_a_filter_as_topic() -> None:
    with pytest.raises(TopicError):
        TopicFilter("#").matches("a/+")


@given(st.text(max_size=40))
def test_validation_never_crashes(text: str) -> None:
    """Arbitrary text either parses or raises TopicError, never anything else."""
    for kind in (Topic, TopicFilter):
        try:
            kind(text)
        except TopicError:
            pass


@given(st.binary(max_size=40))
def test_from_bytes_never_crashes(raw: bytes) -> None:
    try:
        Topic.from_bytes(raw)
    except TopicError:
        pass
