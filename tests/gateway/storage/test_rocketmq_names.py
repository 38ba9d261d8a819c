"""Gateway queue names as RocketMQ light queues (topicmap/rocketmq.py; the memo in
gateway/storage/rocketmq/names.py): valid topic names for the broker, injective, reversible,
namespaced."""

from __future__ import annotations

import re

import pytest

from gateway.storage.rocketmq.names import LightQueueNames
from topicmap import queue_name
from topicmap.rocketmq import MAX_LMQ_NAME, decode_lmq, encode_lmq

# TopicValidator.VALID_PATTERN_STR of RocketMQ 5.3.3
VALID = re.compile(r"^[%|a-zA-Z0-9_-]+$")

NAMES = [
    queue_name("site/+/dev/#"),
    queue_name("Home/x"),
    queue_name("a/b"),
    queue_name("a%b"),
    queue_name("a.b/ü"),
    queue_name("_0x/y"),
    "%RETAIN%",
    "client_1",
    "$share/g|x",
]


def test_names_are_valid_light_queues_and_reversible() -> None:
    for ns in ("lmqtt", "t_1", "a|b"):
        seen: set[str] = set()
        for q in NAMES:
            lmq = encode_lmq(q, ns)
            assert lmq.startswith("%LMQ%") and VALID.match(lmq) and "/" not in lmq, lmq
            assert decode_lmq(lmq, ns) == q
            seen.add(lmq)
        assert len(seen) == len(NAMES)


def test_examples_and_namespaces() -> None:
    assert encode_lmq("%LMQ%site.%2b") == "%LMQ%lmqtt_0site_1%2b"
    assert encode_lmq("%RETAIN%") == "%LMQ%lmqtt_0_2%RETAIN%"
    assert encode_lmq("%RETAIN%", "other") != encode_lmq("%RETAIN%")
    assert decode_lmq(encode_lmq("%LMQ%x", "a"), "b") is None


def test_long_names_are_hashed_and_not_decodable() -> None:
    long = queue_name("x/" * 60 + "y")
    lmq = encode_lmq(long + "z" * 100)
    assert len(lmq) <= MAX_LMQ_NAME and VALID.match(lmq)
    assert decode_lmq(lmq) is None


def test_state_batches_round_trip_and_damage_is_reported() -> None:
    from topicmap.rocketmq import decode_state, encode_state

    records = [("session/a", b'{"x":1}'), ("session/b", None), ("k\u00fc", b"")]
    body = encode_state(records)
    assert decode_state(body) == (records, True)
    assert decode_state(body[:-3]) == (records[:2], False)  # the last value cut short


def test_the_name_memo_is_bounded_and_hashed_names_stay_until_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.storage.rocketmq import names as rocketmq_names

    monkeypatch.setattr(rocketmq_names, "NAME_MEMO", 10)
    names = LightQueueNames("ns")
    long = "%LMQ%" + "x" * 300
    hashed = names.lmq(long)
    assert decode_lmq(hashed, "ns") is None
    for i in range(100):  # churn
        assert names.queue(names.lmq(f"%LMQ%q{i}")) == f"%LMQ%q{i}"
    assert len(names) <= 2 * 10 + 1
    assert names.queue(hashed) == long  # the memo dropped it, the hashed table did not
    names.forget(long)
    assert names.queue(hashed) == hashed  # forgotten: not decodable any more
