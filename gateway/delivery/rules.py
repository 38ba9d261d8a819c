"""Whether a stored message M goes to a subscription S, and how: MQTT's delivery rule, `decide`.

Every path that sends a message to a subscriber asks `decide()`: its own light queue (the
general and the plain send paths, gateway/delivery/send.py), a shared group, a replay, a
retained message sent on SUBSCRIBE. `sub` is the subscription the message is delivered from,
`also` the session's other subscriptions that match it (overlapping filters deliver it once,
gateway/delivery/overlap.py); the rule reads them as one set:

    rule                  spec               inputs                 the answer
    no local              MQTT-3.8.3-3       publisher, receiver,   not sent through a no-local
                                             no-local               subscription to its publisher
    expiry                MQTT-3.3.2-5       expiry, stored at      not sent once expired; sent
                                                                    with the seconds left
    QoS                   MQTT-3.8.4-8       message QoS, granted   min(message QoS, the highest
                                             QoS                    granted QoS)
    retain flag           MQTT-3.3.1-12/13   retain, level,         1 on SUBSCRIBE; else the
                                             retain-as-published    message's at level 5 with a
                                                                    retain-as-published
                                                                    subscription, else 0
    subscription ids      MQTT-3.3.4-3       identifiers            every matching subscription's,
                                                                    sorted

A re-send after a reconnect repeats what was decided when the message was first sent (same
QoS, MQTT-4.4.0-1): it takes the flags from the rule's two parts, `retain_flag()` and
`identifiers()`.

Three of the rules are spelled once, each as a function of its inputs: `no_local_skips`,
`delivered_qos`, `retain_out`. `decide` runs once per message sent, so it spells them inline
(a Python call each would cost more than the rule); tests/gateway/delivery/test_outbound.py
proves, for every combination of their inputs, that `decide` answers what the functions do.
The plain delivery run (gateway/delivery/run.py `plain_run_py` and its C twin
gateway/delivery/_run.c) is `decide` for one subscription without identifier and a message
without expiry, over the stored properties; it spells none of the three but takes them as
inputs derived here: the tables `QOS_TABLE` and `RETAIN_TABLE` (handed to the C kernel once,
by its configure call) and, per call, `passed_over(no_local, receiver)`, the publisher whose
messages the subscription passes over. tests/gateway/delivery/test_delivery_plain_run.py
checks every message the run sends against `decide`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gateway.messages.records import RecordedPublish
from gateway.session.model import SubscriptionState

__all__ = [
    "QOS_TABLE",
    "RETAIN_TABLE",
    "Outbound",
    "decide",
    "delivered_qos",
    "identifiers",
    "no_local_skips",
    "passed_over",
    "retain_flag",
    "retain_out",
]

# Outbound(...) runs NamedTuple's generated __new__ (a Python frame); tuple.__new__ builds the
# same object without it, once per delivery.
_new = tuple.__new__


class Outbound(NamedTuple):
    qos: int
    retain: bool
    sub_ids: list[int]
    expiry_left: int | None  # seconds left of the Message Expiry Interval, None: no expiry


def decide(
    rec: RecordedPublish,
    sub: SubscriptionState,
    receiver: str,
    level: int,
    on_subscribe: bool = False,
    also: Sequence[SubscriptionState] = (),
) -> Outbound | None:
    """How `rec` goes to the session `receiver` (its client id; protocol `level`) through
    `sub` and the session's other subscriptions `also` that match it, or None when it must not
    be sent at all (see the module docstring). `on_subscribe`: a retained message sent
    because of a SUBSCRIBE."""
    # The three rules' expressions below are no_local_skips, delivered_qos and retain_out
    # written inline (see the module docstring).
    if not also:
        # One subscription, the common case: the same rule without building lists.
        if sub.no_local and rec.client_id == receiver:
            return None
        expiry_left = None if rec.expiry is None else rec.remaining_expiry()
        if expiry_left is not None and expiry_left <= 0:
            return None
        sid = sub.subscription_identifier
        qos = rec.qos
        return _new(
            Outbound,
            (
                qos if qos < sub.qos else sub.qos,
                on_subscribe or (rec.retain and level == 5 and sub.retain_as_published),
                [sid] if sid else [],
                expiry_left,
            ),
        )
    subs = [s for s in (sub, *also) if not (s.no_local and rec.client_id == receiver)]
    if not subs:
        return None
    expiry_left = rec.remaining_expiry()
    if expiry_left is not None and expiry_left <= 0:
        return None
    return Outbound(
        min(rec.qos, max(s.qos for s in subs)),
        on_subscribe or retain_flag(rec, subs, level),
        identifiers(subs),
        expiry_left,
    )


def retain_flag(rec: RecordedPublish, subs: Sequence[SubscriptionState], level: int) -> bool:
    """RETAIN of a message delivered because it was published (not sent on SUBSCRIBE) through
    the subscriptions `subs`: `retain_out` with retain-as-published if any of them has it,
    inline as in `decide`."""
    return rec.retain and level == 5 and any(s.retain_as_published for s in subs)


def identifiers(subs: Sequence[SubscriptionState]) -> list[int]:
    """The subscription identifiers a message delivered through `subs` carries."""
    return sorted({s.subscription_identifier for s in subs if s.subscription_identifier})


def no_local_skips(no_local: bool, publisher: str, receiver: str) -> bool:
    """No local (MQTT-3.8.3-3): whether a subscription of the session `receiver` (its client
    id) with the No Local option `no_local` passes over a message from `publisher`."""
    return no_local and publisher == receiver


def passed_over(no_local: bool, receiver: str) -> str | None:
    """The publisher whose messages a subscription of `receiver` with the No Local option
    `no_local` passes over, None when it passes over none: `no_local_skips(no_local, p,
    receiver)` is `p == passed_over(no_local, receiver)` for every publisher `p`. What the
    plain run takes in place of the flag (one equality test per message, none without it)."""
    return receiver if no_local else None


def delivered_qos(message_qos: int, granted_qos: int) -> int:
    """QoS (MQTT-3.8.4-8): a message of `message_qos` goes out through a subscription granted
    `granted_qos` at the lower of the two."""
    return min(message_qos, granted_qos)


def retain_out(
    retain: bool, level: int, retain_as_published: bool, on_subscribe: bool = False
) -> bool:
    """RETAIN (MQTT-3.3.1-12/13) of a message published with `retain`, sent to a session of
    protocol `level` through a subscription with `retain_as_published`: 1 when it is sent
    because of a SUBSCRIBE (`on_subscribe`), else as published at level 5 with
    retain-as-published, else 0."""
    return on_subscribe or (retain and level == 5 and retain_as_published)


# The plain run's rule inputs (see the module docstring), computed once from the functions:
# QOS_TABLE[message QoS][granted QoS] -> delivered QoS;
# RETAIN_TABLE[retain][level == 5][retain as published] -> RETAIN of a message delivered
# because it was published (index 0 of the level: any level below 5).
QOS_TABLE: tuple[tuple[int, ...], ...] = tuple(
    tuple(delivered_qos(m, g) for g in range(3)) for m in range(3)
)
RETAIN_TABLE: tuple[tuple[tuple[bool, ...], ...], ...] = tuple(
    tuple(
        tuple(retain_out(r, 5 if v5 else 4, rap) for rap in (False, True)) for v5 in (False, True)
    )
    for r in (False, True)
)
