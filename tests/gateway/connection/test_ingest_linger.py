"""Linger: when an ingest batch waits for more publishes (gateway/connection/ingest.py).

Behaviour against a given clock, not timing: the arrival rate the policy measures from the
stores decides whether a new batch lingers. An idle gateway stores a lone publish at the end of
its turn; a steady moderate stream lingers; a stream whose turns already gather enough does not.
"""

from __future__ import annotations

from gateway.connection.ingest import GATHERS_AT_LEAST, GATHERS_AT_MOST, RATE_HORIZON, Linger

MOST = 0.001  # ingest_linger_ms = 1


def _steady(linger: Linger, per_second: float, seconds: float, start: float = 0.0) -> float:
    """A store of a millisecond's publishes (at least one) as often as that rate makes them;
    returns the time of the last."""
    per_store = max(1, round(per_second * 0.001))
    step = per_store / per_second
    now = start
    for _ in range(round(seconds / step)):
        now += step
        linger.stored(per_store, now)
    return now


def test_an_idle_gateway_stores_a_lone_publish_at_once() -> None:
    linger = Linger(MOST)
    assert linger.linger(1, 1000.0) == 0.0  # nothing stored ever
    linger.stored(1, 1000.0)
    assert linger.linger(1, 1000.0 + 2 * RATE_HORIZON) == 0.0  # one now and then


def test_a_steady_moderate_stream_lingers() -> None:
    """5,000 publishes a second: a 1 ms linger gathers about 5, within the band."""
    assert GATHERS_AT_LEAST <= 5 <= GATHERS_AT_MOST
    linger = Linger(MOST)
    now = _steady(linger, 5000, 0.5)
    assert linger.linger(1, now + 0.0002) == MOST


def test_a_stream_whose_turns_gather_enough_does_not_linger() -> None:
    """20,000 a second: a 1 ms linger would hold 20, more than a batch needs to pay its way."""
    assert GATHERS_AT_MOST < 20
    linger = Linger(MOST)
    now = _steady(linger, 20000, 0.5)
    assert linger.linger(5, now + 0.0002) == 0.0


def test_lingering_stops_after_a_quiet_spell_and_resumes_under_load() -> None:
    linger = Linger(MOST)
    now = _steady(linger, 5000, 0.5)
    assert linger.linger(1, now + 0.0002) == MOST
    now += 10.0  # quiet
    assert linger.linger(1, now) == 0.0
    linger.stored(1, now)
    now = _steady(linger, 5000, 0.5, start=now)
    assert linger.linger(1, now + 0.0002) == MOST


def test_a_longer_linger_is_for_slower_streams() -> None:
    """The band is in publishes per linger: 10 ms lingers at 500 a second, not at 5,000."""
    slow, fast = Linger(0.01), Linger(0.01)
    t_slow = _steady(slow, 500, 0.5)
    t_fast = _steady(fast, 5000, 0.5)
    assert slow.linger(1, t_slow + 0.0002) == 0.01
    assert fast.linger(1, t_fast + 0.0002) == 0.0
