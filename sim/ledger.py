"""Expected versus actual deliveries, per subscriber: the simulator's definition of "lost".

A message m is *expected* at subscriber s iff all of these hold:

1. m's PUBLISH was acknowledged by the gateway (PUBACK for QoS 1, PUBCOMP for QoS 2).
   QoS 0 publishes are never acknowledged, so they are counted but never expected.
2. min(m's QoS, s's subscription QoS) >= 1: QoS 0 deliveries may be dropped by design.
3. m's topic matches one of s's filters.
4. m was handed to the device's socket after s's SUBACK arrived. Before that the gateway may
   not know the subscription yet; such messages count as received if they come, never as lost.
5. s still has a session: persistent (clean_session=0) subscribers keep theirs while offline,
   so whatever was acknowledged while they were away is expected once they return. A
   clean-session subscriber stays connected for the whole run unless the gateway drops it;
   then its session is gone, with whatever it had not delivered yet (those deliveries are
   *forgiven*, counted apart), and it expects again from its new SUBACK on.

*Lost* is expected and not received by the end of the drain period. Receiving a message twice
is allowed at QoS 1 (counted as a duplicate); receiving one of ours on a topic the subscriber's
filters do not match is a routing bug (counted as misrouted, and fails the run like a loss).

Acknowledgements and deliveries race (a subscriber often gets a message before the device gets
its PUBACK), so both sides are recorded and the intersection is kept incrementally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sim.plan import SubscriberPlan


def message_key(device_index: int, seq: int) -> int:
    """One int per message of this run: device index in the high bits, sequence in the low."""
    return (device_index << 32) | seq


@dataclass(slots=True)
class SubscriberLedger:
    plan: SubscriberPlan
    qos: int
    subscribed_at: float | None = None
    expected: set[int] = field(default_factory=set)
    received: set[int] = field(default_factory=set)
    delivered: int = 0  # |expected & received|, kept incrementally
    duplicates: int = 0
    misrouted: int = 0
    foreign: int = 0  # messages from outside this run (other simulators, mosquitto_pub, ...)
    forgiven: int = 0  # expected once, then discarded with the clean session that held them

    @property
    def outstanding(self) -> int:
        return len(self.expected) - self.delivered


class DeliveryLedger:
    """Bookkeeping for one run. Single-threaded: called from the event loop only."""

    def __init__(self, plans: Sequence[SubscriberPlan], subscription_qos: int) -> None:
        self.subscribers = [SubscriberLedger(plan, subscription_qos) for plan in plans]
        self.sent = 0
        self.acknowledged = 0
        self.failed = 0
        self.received = 0
        self.expected = 0
        self.delivered = 0
        self._routes: dict[str, tuple[int, ...]] = {}

    def subscribed(self, subscriber: int, at: float) -> None:
        self.subscribers[subscriber].subscribed_at = at

    def session_ended(self, subscriber: int) -> None:
        """A clean session ended (connection dropped): forgive what it had not delivered."""
        ledger = self.subscribers[subscriber]
        ledger.subscribed_at = None
        undelivered = ledger.expected - ledger.received
        ledger.expected -= undelivered
        ledger.forgiven += len(undelivered)
        self.expected -= len(undelivered)

    def publish_sent(self) -> None:
        self.sent += 1

    def publish_failed(self) -> None:
        self.failed += 1

    def acknowledged_publish(self, key: int, topic: str, qos: int, sent_at: float) -> None:
        if qos == 0:
            return  # "sent" is all a QoS 0 publish ever is
        self.acknowledged += 1
        for index in self._route(topic):
            ledger = self.subscribers[index]
            if ledger.qos == 0 or ledger.subscribed_at is None or sent_at < ledger.subscribed_at:
                continue
            ledger.expected.add(key)
            self.expected += 1
            if key in ledger.received:
                ledger.delivered += 1
                self.delivered += 1

    def delivery(self, subscriber: int, key: int, topic: str) -> None:
        ledger = self.subscribers[subscriber]
        if subscriber not in self._route(topic):
            ledger.misrouted += 1
            return
        if key in ledger.received:
            ledger.duplicates += 1
            return
        ledger.received.add(key)
        self.received += 1
        if key in ledger.expected:
            ledger.delivered += 1
            self.delivered += 1

    @property
    def outstanding(self) -> int:
        return self.expected - self.delivered

    @property
    def duplicates(self) -> int:
        return sum(s.duplicates for s in self.subscribers)

    @property
    def misrouted(self) -> int:
        return sum(s.misrouted for s in self.subscribers)

    @property
    def forgiven(self) -> int:
        return sum(s.forgiven for s in self.subscribers)

    @property
    def foreign(self) -> int:
        return sum(s.foreign for s in self.subscribers)

    def _route(self, topic: str) -> tuple[int, ...]:
        # Topics repeat (devices x metrics), so matching is done once per topic.
        route = self._routes.get(topic)
        if route is None:
            route = tuple(s.plan.index for s in self.subscribers if s.plan.matches(topic))
            self._routes[topic] = route
        return route
