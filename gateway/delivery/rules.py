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
`identifiers()`. The plain delivery run (gateway/delivery/run.py `plain_run_py` and its C twin
gateway/delivery/_run.c) is `decide` for one subscription without identifier and a message
without expiry, over the stored properties; tests/gateway/delivery/test_delivery_plain_run.py
checks every message it sends against `decide`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gateway.messages.records import RecordedPublish
from gateway.session.model import SubscriptionState

__all__ = ["Outbound", "decide", "identifiers", "retain_flag"]

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
    """RETAIN of a message delivered because it was published (not sent on SUBSCRIBE)."""
    return rec.retain and level == 5 and any(s.retain_as_published for s in subs)


def identifiers(subs: Sequence[SubscriptionState]) -> list[int]:
    """The subscription identifiers a message delivered through `subs` carries."""
    return sorted({s.subscription_identifier for s in subs if s.subscription_identifier})
