"""Telemetry payloads: realistic, bounded, reproducible, and identifiable on receipt."""

from __future__ import annotations

import json
import random

from hypothesis import given
from hypothesis import strategies as st

from sim.telemetry import (
    DEVICE_KINDS,
    METRICS,
    DeviceIdentity,
    TelemetrySource,
    parse_reading,
)


def test_a_reading_parses_back_to_its_run_device_sequence_and_topic() -> None:
    identity = DeviceIdentity.of(6, sites=4)
    source = TelemetrySource(identity, "abc123", random.Random(1))
    readings = [source.next_reading() for _ in range(7)]

    for expected_seq, reading in enumerate(readings):
        parsed = parse_reading(reading.payload)
        assert parsed is not None
        assert (parsed.run, parsed.device, parsed.seq) == ("abc123", "d0007", expected_seq)
        assert parsed.topic == reading.topic
    # The device cycles through its kind's metrics, one per reading.
    metrics = [r.topic.rsplit("/", 1)[1] for r in readings]
    kind_metrics = DEVICE_KINDS[identity.kind]
    assert metrics == [kind_metrics[i % len(kind_metrics)] for i in range(7)]
    assert readings[0].topic == f"site/s3/dev/d0007/{kind_metrics[0]}"


def test_values_stay_within_each_metrics_physical_range() -> None:
    for index in range(6):
        source = TelemetrySource(DeviceIdentity.of(index, 2), "r", random.Random(index))
        for _ in range(500):
            body = json.loads(source.next_reading().payload)
            shape = METRICS[body["metric"]]
            assert shape.low <= body["value"] <= shape.high
            assert body["unit"] == shape.unit
            assert -110 <= body["rssi"] <= -30


def test_the_same_seed_gives_the_same_values() -> None:
    def values(seed: int) -> list[float]:
        source = TelemetrySource(DeviceIdentity.of(0, 1), "r", random.Random(seed))
        return [json.loads(source.next_reading().payload)["value"] for _ in range(20)]

    assert values(7) == values(7)
    assert values(7) != values(8)


def test_device_identities_are_deterministic_and_spread_over_sites() -> None:
    identities = [DeviceIdentity.of(i, 3) for i in range(9)]
    assert [d.device for d in identities[:3]] == ["d0001", "d0002", "d0003"]
    assert {d.site for d in identities} == {"s1", "s2", "s3"}
    assert {d.kind for d in identities} == set(DEVICE_KINDS)
    assert identities == [DeviceIdentity.of(i, 3) for i in range(9)]


@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_not_mistaken_for_readings(payload: bytes) -> None:
    parsed = parse_reading(payload)
    assert parsed is None or isinstance(parsed.seq, int)


@given(
    st.dictionaries(
        st.sampled_from(["run", "site", "device", "metric", "seq", "value"]),
        st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers())),
    )
)
def test_json_objects_with_missing_or_mistyped_fields_are_rejected(body: dict[str, object]) -> None:
    parsed = parse_reading(json.dumps(body).encode())
    well_formed = all(isinstance(body.get(k), str) for k in ("run", "site", "device", "metric"))
    well_formed = well_formed and isinstance(body.get("seq"), int)
    assert (parsed is not None) == well_formed
