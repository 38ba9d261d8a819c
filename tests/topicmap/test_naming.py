"""Parent topics, light-queue names and the NameTable: reversible, collision-free, file-safe."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.topicmap.strategies import tricky_filters, tricky_texts
from topicmap import (
    EMPTY_PARENT,
    LMQ_PREFIX,
    MAX_STORE_NAME_LENGTH,
    NameTable,
    TopicError,
    TopicFilter,
    filter_of,
    is_store_name,
    parent_topic,
    queue_name,
)
from topicmap.naming import decode_text, encode_text

ANY_TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)


# --- the encoding ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "encoded"),
    [
        ("site/7/dev-42", "site.7.dev-42"),
        ("Home", "_home"),
        ("a/b", "a.b"),
        ("a%b", "a%25b"),
        ("a.b", "a%2eb"),
        ("a_b", "a%5fb"),
        ("+/#", "%2b.%23"),
        ("$SYS", "%24_s_y_s"),
        ("é", "%c3%a9"),
        ("a\u2215b", "a%e2%88%95b"),
    ],
)
def test_encoding_examples(text: str, encoded: str) -> None:
    assert encode_text(text) == encoded
    assert decode_text(encoded) == text


def test_rocketmq_mqtt_collision_is_gone() -> None:
    """rocketmq-mqtt names both `a/b` and `a%b` as `%LMQ%a%b`."""
    assert queue_name("a/b") != queue_name("a%b")
    assert {filter_of(queue_name("a/b")), filter_of(queue_name("a%b"))} == {"a/b", "a%b"}


@given(ANY_TEXT)
def test_encoding_round_trips_any_text(text: str) -> None:
    encoded = encode_text(text)
    assert decode_text(encoded) == text
    assert encoded == encoded.lower()
    assert set(encoded) <= set("abcdefghijklmnopqrstuvwxyz0123456789._%-")


@given(tricky_texts(), tricky_texts())
def test_encoding_is_injective(first: str, second: str) -> None:
    if first != second:
        assert encode_text(first) != encode_text(second)


@given(st.text(st.sampled_from(list("._%-ab019fzAZ!")), max_size=12))
def test_decoding_accepts_only_canonical_encodings(body: str) -> None:
    try:
        text = decode_text(body)
    except TopicError:
        return
    assert encode_text(text) == body


@pytest.mark.parametrize("body", ["%2B", "%61", "_0", "_", "%2", "%zz", "A", "%c3", "\u00e9"])
def test_non_canonical_bodies_are_rejected(body: str) -> None:
    with pytest.raises(TopicError, match="not an encoding made by topicmap"):
        decode_text(body)


# --- light-queue names ----------------------------------------------------------------------


@given(tricky_filters())
def test_queue_names_round_trip_and_are_store_names(text: str) -> None:
    name = queue_name(text)
    assert name.startswith(LMQ_PREFIX)
    assert is_store_name(name)
    assert len(name) <= MAX_STORE_NAME_LENGTH
    assert "," not in name and "\x01" not in name and "\x02" not in name
    assert filter_of(name) == text


@settings(max_examples=60)
@given(st.lists(tricky_filters(), min_size=2, max_size=20, unique=True))
def test_queue_names_are_collision_free_even_ignoring_case(texts: list[str]) -> None:
    names = [queue_name(text) for text in texts]
    assert len({name.casefold() for name in names}) == len(texts)


@pytest.mark.parametrize(
    "group",
    [
        ["a/b", "a%b", "a%2fb", "a.b", "a\u2215b", "a\uff0fb", "a\u2044b", "a//b", "a/b/"],
        ["Site", "site", "SITE", "_site", "%5fsite"],
        ["+", "%2b", "#", "%23", "a/+", "a/%2b", "a/#", "a/%23"],
        ["caf\u00e9", "cafe\u0301", "CAF\u00c9"],
    ],
)
def test_look_alikes_get_distinct_queues(group: list[str]) -> None:
    names = [queue_name(text) for text in group]
    assert len({name.casefold() for name in names}) == len(group)
    assert [filter_of(name) for name in names] == group


def test_shared_filters_name_the_underlying_queue() -> None:
    assert queue_name("$share/g/site/#") == queue_name("site/#")
    assert queue_name(TopicFilter("$share/h/site/#")) == queue_name("site/#")
    assert filter_of(queue_name("$share/g/site/#")) == "site/#"


def test_queue_name_validates() -> None:
    with pytest.raises(TopicError, match="whole level"):
        queue_name("a/b+")


def test_names_are_usable_as_file_names(tmp_path: Path) -> None:
    texts = ["a/b", "a%b", "+/#", "$SYS/#", "x" * 300 + "/#", "温度/\u2215", "/", "#"]
    for text in texts:
        (tmp_path / queue_name(text)).mkdir()
    assert sorted(os.listdir(tmp_path)) == sorted({queue_name(text) for text in texts})


def test_long_filters_get_bounded_hash_names() -> None:
    table = NameTable()
    long_a = "site/" + "x" * 200 + "/a"
    long_b = "site/" + "x" * 200 + "/b"
    name_a, name_b = table.queue_name(long_a), table.queue_name(long_b)
    assert name_a != name_b
    assert len(name_a) == len(name_b) == MAX_STORE_NAME_LENGTH
    assert name_a.startswith(LMQ_PREFIX + "site.xxx") and "_0" in name_a
    assert is_store_name(name_a)
    assert table.filter_of(name_a) == long_a
    assert table.filter_of(name_b) == long_b
    assert len(table) == 2 and name_a in table


def test_length_boundary_between_direct_and_hashed() -> None:
    room = MAX_STORE_NAME_LENGTH - len(LMQ_PREFIX)
    fits = "a" * room
    assert queue_name(fits) == LMQ_PREFIX + fits
    assert "_0" in queue_name("a" * (room + 1))
    # A multi-byte character is never split in the readable part of a hashed name.
    hashed = queue_name("é" * 100)
    assert hashed.count("%") == (hashed.index("_0") - len(LMQ_PREFIX)) // 3 + 2


def test_hashed_name_cuts_at_token_boundaries() -> None:
    for pad in range(4):
        for filler in ("A", "é", "%", "a"):
            name = queue_name("p" * pad + filler * 130)
            readable = name[len(LMQ_PREFIX) : name.index("_0")]
            assert readable and readable[-1] not in "_%"
            assert "%" not in readable[-2:]


def test_unknown_hashed_name_needs_the_table() -> None:
    name = NameTable().queue_name("k/" + "y" * 300)
    with pytest.raises(TopicError, match="restore the NameTable"):
        NameTable().filter_of(name)


@pytest.mark.parametrize(
    "name",
    ["site", "%LMQ", "%LMQ%A", "%LMQ%", "%LMQ%a+b", "%LMQ%%24share.g.a", "%LMQ%a%2bb", "%LMQ%_0"],
)
def test_filter_of_rejects_foreign_names(name: str) -> None:
    with pytest.raises(TopicError):
        filter_of(name)


@settings(max_examples=40)
@given(st.lists(tricky_filters().map(lambda f: "long/" + "z" * 130 + "/" + f), max_size=8))
def test_name_table_snapshot_restores_through_json(texts: list[str]) -> None:
    table = NameTable()
    names = [table.queue_name(text) for text in texts]
    restored = NameTable.restore(json.loads(json.dumps(table.snapshot())))
    assert [restored.filter_of(name) for name in names] == texts
    assert restored.snapshot() == table.snapshot()


def test_name_table_restore_rejects_corrupt_entries() -> None:
    table = NameTable()
    name = table.queue_name("q/" + "w" * 300)
    with pytest.raises(TopicError, match="does not match the naming scheme"):
        NameTable.restore({name: "q/" + "w" * 299})
    with pytest.raises(TopicError, match="str queue names"):
        NameTable.restore({name: 7})
    with pytest.raises(TopicError, match="mapping"):
        NameTable.restore(["x"])
    with pytest.raises(TopicError):
        NameTable.restore({name: "bad/#/filter"})


def test_name_table_refuses_a_hash_collision() -> None:
    table = NameTable()
    name = table.queue_name("c/" + "v" * 300)
    # Forge a colliding entry (a real 160-bit collision is not constructible).
    table._filters[name] = "c/other"
    with pytest.raises(TopicError, match="hash collision"):
        table.queue_name("c/" + "v" * 300)


# --- parent topics --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic", "parent"),
    [
        ("site/7/dev/42/temp", "site"),
        ("site", "site"),
        ("/a/b", EMPTY_PARENT),
        ("/", EMPTY_PARENT),
        ("Home/x", "_home"),
        ("$SYS/broker", "%24_s_y_s"),
        ("%LMQ%x/y", "%25_l_m_q%25x"),
        ("a.b/c", "a%2eb"),
        ("温度/c", "%e6%b8%a9%e5%ba%a6"),
    ],
)
def test_parent_topic_examples(topic: str, parent: str) -> None:
    assert parent_topic(topic) == parent
    assert is_store_name(parent)
    assert parent_topic(topic + "/more") == parent  # the first level's cached parent


def test_parent_topic_of_long_first_level_is_bounded() -> None:
    first_a, first_b = "L" * 500, "L" * 499 + "M"
    parents = parent_topic(first_a + "/x"), parent_topic(first_b)
    assert parents[0] != parents[1]
    assert all(is_store_name(p) and len(p) <= MAX_STORE_NAME_LENGTH for p in parents)
    assert parent_topic(first_a + "/y") == parents[0]  # stable


def test_parent_topic_rejects_invalid_topics() -> None:
    with pytest.raises(TopicError):
        parent_topic("a/#")
    with pytest.raises(TopicError):
        parent_topic("")


LEVEL = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="/+#\x00"), max_size=70)


@given(LEVEL, LEVEL)
def test_parent_topics_are_collision_free_store_names(first: str, second: str) -> None:
    parent = parent_topic(first + "/rest")
    assert is_store_name(parent)
    assert not parent.startswith(LMQ_PREFIX)
    if first != second:
        assert parent_topic(second + "/rest").casefold() != parent.casefold()


@given(tricky_filters(), LEVEL)
def test_parent_topics_never_collide_with_queue_names(text: str, first: str) -> None:
    assert parent_topic(first or "x") != queue_name(text)
