"""What the simulated devices publish: realistic telemetry with a verifiable identity.

Every device belongs to a site and has a kind that decides its metrics. Each tick it publishes
one reading of its next metric to ``site/{site}/dev/{device}/{metric}`` as a JSON object:

    {"run": "3f9a1c", "site": "s2", "device": "d0007", "kind": "meter",
     "metric": "power", "value": 412.6, "unit": "W", "seq": 118,
     "ts": 1763779200.123, "rssi": -67, "fw": "2.4.1"}

``run`` and ``seq`` make every message identifiable: (run, device, seq) is unique, so the
subscribers can tell what they received, what they received twice, and what never arrived.
Values follow a bounded random walk, seeded, so a run with ``--seed`` publishes the same values.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MetricShape:
    """The physical range of one metric and how fast it moves between readings."""

    unit: str
    low: float
    high: float
    step: float
    decimals: int


METRICS: dict[str, MetricShape] = {
    "temperature": MetricShape("C", -10.0, 45.0, 0.4, 2),
    "humidity": MetricShape("%", 5.0, 100.0, 1.5, 1),
    "battery": MetricShape("%", 0.0, 100.0, 0.2, 1),
    "power": MetricShape("W", 0.0, 3500.0, 60.0, 1),
    "voltage": MetricShape("V", 207.0, 253.0, 1.2, 1),
    "co2": MetricShape("ppm", 380.0, 2500.0, 25.0, 0),
    "pm25": MetricShape("ug/m3", 0.0, 300.0, 3.0, 1),
}

# Device kinds and their metrics, in publishing order. Several kinds share a metric
# (temperature), which is what makes `site/+/dev/+/temperature` an interesting filter.
DEVICE_KINDS: dict[str, tuple[str, ...]] = {
    "thermostat": ("temperature", "humidity", "battery"),
    "meter": ("power", "voltage"),
    "air": ("co2", "pm25", "temperature"),
}
_KIND_ORDER = tuple(DEVICE_KINDS)
FIRMWARE = ("2.4.1", "2.4.2", "3.0.0")


def site_name(index: int) -> str:
    return f"s{index + 1}"


def device_name(index: int) -> str:
    return f"d{index + 1:04d}"


def telemetry_topic(site: str, device: str, metric: str) -> str:
    return f"site/{site}/dev/{device}/{metric}"


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """Who a simulated device is. Deterministic in its index, so separate simulator processes
    (the compose `devices` and `subscribers` services) agree on names without talking."""

    index: int
    site: str
    device: str
    kind: str

    @classmethod
    def of(cls, index: int, sites: int) -> DeviceIdentity:
        return cls(
            index=index,
            site=site_name(index % sites),
            device=device_name(index),
            kind=_KIND_ORDER[index % len(_KIND_ORDER)],
        )

    @property
    def metrics(self) -> tuple[str, ...]:
        return DEVICE_KINDS[self.kind]

    def topic(self, metric: str) -> str:
        return telemetry_topic(self.site, self.device, metric)


@dataclass(frozen=True, slots=True)
class Reading:
    """One message as published: its topic, its bytes and the sequence number inside them."""

    topic: str
    payload: bytes
    seq: int


class TelemetrySource:
    """The readings of one device, one metric after the other."""

    def __init__(self, identity: DeviceIdentity, run_id: str, rng: random.Random) -> None:
        self.identity = identity
        self._run_id = run_id
        self._rng = rng
        self._seq = 0
        self._rssi = rng.randint(-90, -45)
        self._firmware = FIRMWARE[identity.index % len(FIRMWARE)]
        self._values = {
            metric: rng.uniform(METRICS[metric].low, METRICS[metric].high)
            for metric in identity.metrics
        }

    def next_reading(self) -> Reading:
        metrics = self.identity.metrics
        metric = metrics[self._seq % len(metrics)]
        shape = METRICS[metric]
        value = self._values[metric] + self._rng.gauss(0.0, shape.step)
        value = min(shape.high, max(shape.low, value))
        self._values[metric] = value
        self._rssi = min(-30, max(-110, self._rssi + self._rng.randint(-2, 2)))
        seq = self._seq
        self._seq += 1
        body = {
            "run": self._run_id,
            "site": self.identity.site,
            "device": self.identity.device,
            "kind": self.identity.kind,
            "metric": metric,
            "value": round(value, shape.decimals),
            "unit": shape.unit,
            "seq": seq,
            "ts": round(time.time(), 3),
            "rssi": self._rssi,
            "fw": self._firmware,
        }
        payload = json.dumps(body, separators=(",", ":")).encode()
        return Reading(topic=self.identity.topic(metric), payload=payload, seq=seq)


@dataclass(frozen=True, slots=True)
class ReadingId:
    """What a subscriber needs from a received payload to account for it."""

    run: str
    device: str
    seq: int
    topic: str


def parse_reading(payload: bytes) -> ReadingId | None:
    """The identity of a received payload, or None if it is not a simulator reading."""
    try:
        body = json.loads(payload)
        run, site, device, metric, seq = (
            body["run"],
            body["site"],
            body["device"],
            body["metric"],
            body["seq"],
        )
    except (ValueError, TypeError, KeyError):
        return None
    if not (
        isinstance(run, str)
        and isinstance(site, str)
        and isinstance(device, str)
        and isinstance(metric, str)
        and isinstance(seq, int)
    ):
        return None
    return ReadingId(run=run, device=device, seq=seq, topic=telemetry_topic(site, device, metric))
