"""Who subscribes to what: the subscriber mix and MQTT filter matching.

Subscribers cycle through six profiles so that any K >= 4 covers exact filters, `+`, `#`,
persistent sessions and sessions that go offline mid-run and come back:

    profile           filters                                   session     offline window
    ----------------  ----------------------------------------  ----------  --------------
    all-temperatures  site/+/dev/+/temperature                  clean       -
    site-archive      site/{site}/#                             persistent  30% .. 55%
    watchlist         3 exact topics                            clean       -
    device-twin       site/+/dev/{device}/#                     persistent  45% .. 75%
    power-dashboard   site/{site}/dev/+/power, .../+/voltage     clean       -
    everything        site/#                                    persistent  -

Offline windows are fractions of the publishing duration. A subscriber's filters never overlap
each other, so one message is delivered to a subscriber at most once per matching filter set.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.telemetry import DeviceIdentity

# How many device names the profiles may refer to. Fixed (not the run's device count) so that
# an observer-only simulator (`--devices 0`) picks the same topics as the devices' process.
NAMED_DEVICES = 12


@dataclass(frozen=True, slots=True)
class SubscriberPlan:
    """One simulated subscriber: its filters, its session kind and when it is away."""

    index: int
    profile: str
    filters: tuple[str, ...]
    persistent: bool
    offline: tuple[float, float] | None  # (leave, return) as fractions of the duration

    @property
    def name(self) -> str:
        return f"{self.profile}-{self.index + 1}"

    def matches(self, topic: str) -> bool:
        return any(filter_matches(topic_filter, topic) for topic_filter in self.filters)


def filter_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 3.1.1 section 4.7 matching (the simulator's own topics never start with `$`)."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    for position, level in enumerate(filter_levels):
        if level == "#":
            return True
        if position >= len(topic_levels):
            return False
        if level != "+" and level != topic_levels[position]:
            return False
    return len(filter_levels) == len(topic_levels)


def plan_subscribers(count: int, sites: int) -> list[SubscriberPlan]:
    """The first ``count`` subscribers of the mix, with sites and devices rotating per cycle."""
    named = [DeviceIdentity.of(i, sites) for i in range(NAMED_DEVICES)]
    plans = []
    for index in range(count):
        cycle, profile = divmod(index, 6)
        site = f"s{cycle % sites + 1}"
        device = named[(cycle * 5 + 1) % NAMED_DEVICES]
        watched = [named[(cycle * 3 + k) % NAMED_DEVICES] for k in range(3)]
        offline: tuple[float, float] | None = None
        filters: tuple[str, ...]
        if profile == 0:
            name, filters, persistent = "all-temperatures", ("site/+/dev/+/temperature",), False
        elif profile == 1:
            name, filters, persistent = "site-archive", (f"site/{site}/#",), True
            offline = (0.30, 0.55)
        elif profile == 2:
            name, persistent = "watchlist", False
            filters = tuple(d.topic(d.metrics[0]) for d in watched)
        elif profile == 3:
            name, filters, persistent = "device-twin", (f"site/+/dev/{device.device}/#",), True
            offline = (0.45, 0.75)
        elif profile == 4:
            name, persistent = "power-dashboard", False
            filters = (f"site/{site}/dev/+/power", f"site/{site}/dev/+/voltage")
        else:
            name, filters, persistent = "everything", ("site/#",), True
        plans.append(SubscriberPlan(index, name, filters, persistent, offline))
    return plans
