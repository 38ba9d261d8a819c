"""Linger: when an ingest batch waits for more publishes (gateway/connection/ingest.py).

Behaviour against a given clock, not timing: the arrival rate the policy measures from the
stores decides whether a new batch lingers. An idle gateway stores a lone publish at the end of
its turn; a steady stream lingers, however fast (IngestBatch stores a batch that holds
GATHERS_AT_MOST sooner: tests/gateway/connection/test_batch_ingest.py).
"""

from __future__ import annotations

from gateway.connection.ingest import GATHERS_AT_LEAST, RATE_HORIZON, Linger

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
    assert GATHERS_AT_LEAST <= 5
    linger = Linger(MOST)
    now = _steady(linger, 5000, 0.5)
    assert linger.linger(1, now + 0.0002) == MOST


def test_a_fast_stream_lingers_too() -> None:
    """20,000 a second: a turn of a busy loop reads a few of a fleet's publishes, so the batch
    lingers (and is stored once it holds GATHERS_AT_MOST, not at the linger's end)."""
    linger = Linger(MOST)
    now = _steady(linger, 20000, 0.5)
    assert linger.linger(5, now + 0.0002) == MOST


def test_lingering_stops_after_a_quiet_spell_and_resumes_under_load() -> None:
    linger = Linger(MOST)
    now = _steady(linger, 5000, 0.5)
    assert linger.linger(1, now + 0.0002) == MOST
    now += 10.0  # quiet
    assert linger.linger(1, now) == 0.0
    linger.stored(1, now)
    now = _steady(linger, 5000, 0.5, start=now)
    assert linger.linger(1, now + 0.0002) == MOST


def test_a_longer_linger_lingers_at_a_slower_stream() -> None:
    """The threshold is in publishes per linger: at 200 a second a 10 ms linger gathers 2,
    a 1 ms one 0.2 (no linger)."""
    long, short = Linger(0.01), Linger(MOST)
    t_long = _steady(long, 200, 0.5)
    t_short = _steady(short, 200, 0.5)
    assert long.linger(1, t_long + 0.0002) == 0.01
    assert short.linger(1, t_short + 0.0002) == 0.0
