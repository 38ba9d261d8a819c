"""The sessions bench's ratio does not count a broker whose generator was the limit."""

from __future__ import annotations

from bench.sessions_bench import ratio_line


def _result(broker: str, rate: float, bound: list[int], windows: int = 20) -> dict[str, object]:
    return {
        "broker": broker,
        "rate_per_s": rate,
        "window_rates": [rate] * windows,
        "generator_bound_windows": bound,
    }


def test_a_ratio_with_generators_that_had_headroom_counts() -> None:
    line = ratio_line([_result("lmqtt", 4890.0, []), _result("mosquitto", 12584.0, [14, 18, 19])])
    assert line == "rate lmqtt / mosquitto: 0.39"


def test_a_ratio_against_a_generator_bound_peer_is_marked_invalid() -> None:
    # Mosquitto's generator was the limit in 15 of 20 windows: its 7,824/s is a floor.
    line = ratio_line([_result("lmqtt", 4196.0, []), _result("mosquitto", 7824.0, list(range(15)))])
    assert line.startswith("rate lmqtt / mosquitto: 0.54 INVALID: mosquitto's generator")
    assert "15 of 20 windows" in line
