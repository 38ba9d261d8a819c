"""The loss rules of the DeliveryLedger, one by one."""

from __future__ import annotations

from sim.ledger import DeliveryLedger, message_key
from sim.plan import SubscriberPlan

TEMP = "site/s1/dev/d0001/temperature"
POWER = "site/s1/dev/d0002/power"


def ledger(qos: int = 1) -> DeliveryLedger:
    plans = [
        SubscriberPlan(0, "temps", ("site/+/dev/+/temperature",), False, None),
        SubscriberPlan(1, "all", ("site/#",), True, (0.2, 0.4)),
    ]
    book = DeliveryLedger(plans, subscription_qos=qos)
    book.subscribed(0, at=10.0)
    book.subscribed(1, at=20.0)
    return book


def test_an_acknowledged_message_is_expected_by_every_matching_subscriber() -> None:
    book = ledger()
    book.acknowledged_publish(message_key(0, 1), TEMP, qos=1, sent_at=30.0)
    book.acknowledged_publish(message_key(1, 1), POWER, qos=1, sent_at=30.0)
    assert [len(s.expected) for s in book.subscribers] == [1, 2]
    assert (book.expected, book.outstanding) == (3, 3)
    book.delivery(0, message_key(0, 1), TEMP)
    book.delivery(1, message_key(0, 1), TEMP)
    book.delivery(1, message_key(1, 1), POWER)
    assert (book.received, book.outstanding) == (3, 0)


def test_messages_sent_before_the_suback_are_not_expected_but_count_when_they_come() -> None:
    book = ledger()
    book.acknowledged_publish(message_key(0, 1), TEMP, qos=1, sent_at=15.0)
    assert [len(s.expected) for s in book.subscribers] == [1, 0]
    book.delivery(1, message_key(0, 1), TEMP)
    assert book.received == 1 and book.outstanding == 1  # subscriber 0 still owes it


def test_qos0_publishes_or_subscriptions_are_never_expected() -> None:
    book = ledger()
    book.acknowledged_publish(message_key(0, 1), TEMP, qos=0, sent_at=30.0)
    assert book.expected == 0 and book.acknowledged == 0
    book = ledger(qos=0)
    book.acknowledged_publish(message_key(0, 1), TEMP, qos=1, sent_at=30.0)
    assert book.expected == 0 and book.acknowledged == 1


def test_a_delivery_racing_ahead_of_its_puback_is_matched_once_the_ack_arrives() -> None:
    book = ledger()
    book.delivery(0, message_key(0, 5), TEMP)
    assert (book.received, book.expected, book.outstanding) == (1, 0, 0)
    book.acknowledged_publish(message_key(0, 5), TEMP, qos=1, sent_at=30.0)
    assert book.subscribers[0].delivered == 1
    assert book.subscribers[1].outstanding == 1


def test_duplicates_and_misrouted_deliveries_are_told_apart() -> None:
    book = ledger()
    book.acknowledged_publish(message_key(0, 1), TEMP, qos=1, sent_at=30.0)
    book.delivery(0, message_key(0, 1), TEMP)
    book.delivery(0, message_key(0, 1), TEMP)
    book.delivery(0, message_key(1, 1), POWER)  # not matched by "site/+/dev/+/temperature"
    assert (book.duplicates, book.misrouted, book.received) == (1, 1, 1)
    assert book.outstanding == 1  # subscriber 1 never got it


def test_message_keys_are_unique_per_device_and_sequence() -> None:
    keys = {message_key(d, s) for d in range(50) for s in range(0, 2**32, 2**28)}
    assert len(keys) == 50 * 16


def test_a_dropped_clean_session_forgives_what_it_had_not_delivered() -> None:
    book = ledger()
    book.acknowledged_publish(message_key(0, 1), TEMP, qos=1, sent_at=30.0)
    book.acknowledged_publish(message_key(0, 2), TEMP, qos=1, sent_at=31.0)
    book.delivery(0, message_key(0, 1), TEMP)
    book.session_ended(0)
    temps = book.subscribers[0]
    assert (len(temps.expected), temps.forgiven, temps.outstanding) == (1, 1, 0)
    # While it has no session nothing is expected; after its new SUBACK, again.
    book.acknowledged_publish(message_key(0, 3), TEMP, qos=1, sent_at=32.0)
    book.subscribed(0, at=33.0)
    book.acknowledged_publish(message_key(0, 4), TEMP, qos=1, sent_at=34.0)
    assert temps.expected == {message_key(0, 1), message_key(0, 4)}
    assert book.expected == 2 + 4  # subscriber 1 (persistent) still expects all four
