"""decide(): every MQTT delivery rule, for one subscription and for several overlapping ones
(`also`: the session's other subscriptions that match).
The end-to-end tests (test_mqtt5.py, test_conformance_311.py, test_shared.py) check the same
rules on the wire; these pin each rule to its spec line."""

from __future__ import annotations

import itertools
import time

import pytest

from gateway.delivery.rules import (
    QOS_TABLE,
    RETAIN_TABLE,
    Outbound,
    decide,
    delivered_qos,
    no_local_skips,
    passed_over,
    retain_out,
)
from gateway.messages.records import RecordedPublish
from gateway.session.model import SubscriptionState


def _rec(qos: int = 2, retain: bool = False, client: str = "pub", expiry: int | None = None,
         age_s: float = 0.0) -> RecordedPublish:  # fmt: skip
    stored = int((time.time() - age_s) * 1000)
    return RecordedPublish("a/b", b"x", qos, retain, client, expiry, stored, {})


def _sub(qos: int = 2, **kw: object) -> SubscriptionState:
    return SubscriptionState("a/#", "%LMQ%a%2F%23", None, qos, **kw)  # type: ignore[arg-type]


def _decide(
    rec: RecordedPublish, subs: list[SubscriptionState], receiver: str, level: int,
    on_subscribe: bool = False,
) -> Outbound | None:  # fmt: skip
    """decide() for the matching subscriptions `subs`, delivered through the first."""
    return decide(rec, subs[0], receiver, level, on_subscribe, subs[1:])


@pytest.mark.parametrize("n", [1, 2])  # the single-subscription path and the general one
def test_qos_is_the_minimum_of_message_and_granted(n: int) -> None:
    subs = [_sub(qos=1)] * n
    out = _decide(_rec(qos=2), subs, "me", 5)
    assert out is not None and out.qos == 1
    out = _decide(_rec(qos=0), subs, "me", 5)
    assert out is not None and out.qos == 0


def test_overlapping_subscriptions_take_the_highest_granted_qos_and_every_identifier() -> None:
    subs = [_sub(qos=0, subscription_identifier=7), _sub(qos=1, subscription_identifier=3)]
    assert _decide(_rec(qos=2), subs, "me", 5) == Outbound(1, False, [3, 7], None)


def test_no_local_drops_the_publishers_own_messages_only() -> None:
    assert _decide(_rec(client="me"), [_sub(no_local=True)], "me", 5) is None
    assert _decide(_rec(client="other"), [_sub(no_local=True)], "me", 5) is not None
    # With another matching subscription without no-local, it is sent through that one.
    subs = [_sub(no_local=True, subscription_identifier=1), _sub(subscription_identifier=2)]
    out = _decide(_rec(client="me"), subs, "me", 5)
    assert out is not None and out.sub_ids == [2]


@pytest.mark.parametrize("n", [1, 2])
def test_expired_messages_are_not_sent_and_the_rest_carries_what_is_left(n: int) -> None:
    assert _decide(_rec(expiry=5, age_s=6), [_sub()] * n, "me", 5) is None
    out = _decide(_rec(expiry=60, age_s=10), [_sub()] * n, "me", 5)
    assert out is not None and out.expiry_left is not None and 49 <= out.expiry_left <= 50


def test_retain_flag() -> None:
    rap = _sub(retain_as_published=True)
    assert _decide(_rec(retain=True), [_sub()], "me", 5).retain is False  # type: ignore[union-attr]
    assert _decide(_rec(retain=True), [rap], "me", 5).retain is True  # type: ignore[union-attr]
    assert _decide(_rec(retain=True), [rap], "me", 4).retain is False  # type: ignore[union-attr]
    assert _decide(_rec(retain=True), [_sub(), rap], "me", 5).retain is True  # type: ignore[union-attr]
    # Sent because of the SUBSCRIBE: always RETAIN 1 (MQTT-3.3.1-12).
    out = _decide(_rec(retain=True), [_sub()], "me", 4, on_subscribe=True)
    assert out is not None and out.retain is True


def test_one_subscription_answers_what_the_general_rules_answer() -> None:
    """decide() for one subscription (the delivery loop's per-message call) against its path
    for several, given the same subscription twice: every combination of the rules' inputs."""
    combos = itertools.product(
        [0, 1, 2],  # message QoS
        [0, 1, 2],  # granted QoS
        [False, True],  # message retain
        [False, True],  # retain as published
        [False, True],  # no local
        ["me", "other"],  # publisher
        [None, 60, 5],  # expiry (5 s: expired, the record is 6 s old)
        [0, 9],  # subscription identifier (0: none)
        [4, 5],  # protocol level
        [False, True],  # on subscribe
    )
    for mq, gq, retain, rap, nl, pub, exp, sid, level, on_sub in combos:
        rec = _rec(qos=mq, retain=retain, client=pub, expiry=exp, age_s=6)
        sub = _sub(qos=gq, retain_as_published=rap, no_local=nl, subscription_identifier=sid)
        one = decide(rec, sub, "me", level, on_sub)
        assert one == decide(rec, sub, "me", level, on_sub, [sub])
        assert one is None or type(one) is Outbound


def test_decide_applies_the_named_rules() -> None:
    """decide() spells no local, QoS and RETAIN inline (it runs per message): for every
    combination of their inputs it answers what no_local_skips, delivered_qos and retain_out
    do, on the single-subscription path and on the path for several."""
    combos = itertools.product(
        [0, 1, 2],  # message QoS
        [0, 1, 2],  # granted QoS
        [False, True],  # message retain
        [False, True],  # retain as published
        [False, True],  # no local
        ["me", "other", ""],  # publisher
        [3, 4, 5],  # protocol level
        [False, True],  # on subscribe
    )
    for mq, gq, retain, rap, nl, pub, level, on_sub in combos:
        rec = _rec(qos=mq, retain=retain, client=pub)
        sub = _sub(qos=gq, retain_as_published=rap, no_local=nl)
        for also in ([], [sub]):
            out = decide(rec, sub, "me", level, on_sub, also)
            if no_local_skips(nl, pub, "me"):
                assert out is None
                continue
            assert out is not None
            assert out.qos == delivered_qos(mq, gq)
            assert out.retain is retain_out(retain, level, rap, on_sub)


def test_the_plain_runs_inputs_are_the_named_rules() -> None:
    """The tables and the passed-over publisher the plain run takes (gateway/delivery/run.py)
    answer what the rule's functions do, for every combination of their inputs."""
    for mq, gq in itertools.product(range(3), range(3)):
        assert QOS_TABLE[mq][gq] == delivered_qos(mq, gq)
    for retain, level, rap in itertools.product([False, True], [3, 4, 5], [False, True]):
        assert RETAIN_TABLE[retain][level == 5][rap] is retain_out(retain, level, rap)
    for nl, pub in itertools.product([False, True], ["me", "other", ""]):
        assert (pub == passed_over(nl, "me")) is no_local_skips(nl, pub, "me")
