"""Gateway queue names as RocketMQ light queues (gateway/rocketmq_names.py): valid topic
names for the broker, injective, reversible, namespaced."""

from __future__ import annotations

import re

import pytest

from gateway.rocketmq_names import MAX_LMQ_NAME, LightQueueNames, decode_lmq, encode_lmq
from topicmap import queue_name

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


def test_the_name_memo_is_bounded_and_hashed_names_stay_until_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway import rocketmq_names

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
