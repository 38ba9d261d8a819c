"""Per-client publish quotas: a token bucket per connection, messages and payload bytes.

    setting                   per client                         default burst
    ------------------------  ---------------------------------  --------------------------
    max_publish_rate          PUBLISH packets per second         max_publish_burst = 1 s
    max_publish_bytes_rate    payload bytes per second           max_publish_bytes_burst = 1 s
    [[quotas]]                the same per user / client-id glob, the first matching rule wins

A client may send `burst` at once, then `rate` a second. Over its quota (quota_action):

    pause    its connection is not read until the bucket has refilled: TCP flow control slows
             the device down, nothing it sent is dropped, nothing acknowledged is lost
    reject   MQTT 5 QoS 1 / 2: PUBACK / PUBREC 0x97 (Quota exceeded), not stored; QoS 0:
             dropped; MQTT 3.1.1 QoS 1 / 2 (no negative acknowledgement): paused.
             0x96 (Message rate too high) would say it better, but MQTT 5 allows it only in
             DISCONNECT; a PUBACK or PUBREC may carry 0x97 (spec 3.4.2.1, 3.5.2.1)

No quota configured for a client: its connection holds None and the read path tests that one
attribute; there is no work per message. With one, each PUBLISH costs one `take()`.

A message larger than the bytes burst is let through when the bytes bucket is full; the debt
it leaves (a negative level) makes the next ones wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from gateway.config import GatewaySettings, QuotaRule

__all__ = ["PublishQuotas", "QuotaBucket", "QuotaCounts"]

RATE = 0  # the reason a publish was over quota: messages per second
BYTES = 1  # payload bytes per second
REASONS = ("rate", "bytes")


@dataclass(slots=True)
class QuotaCounts:
    """Gateway-wide counters, read by the metrics: index RATE or BYTES."""

    throttled: list[int]  # publishes that waited for their bucket, reading paused (pause)
    rejected: list[int]  # publishes refused with 0x97 or dropped (reject, QoS 0)

    @classmethod
    def zero(cls) -> QuotaCounts:
        return cls([0, 0], [0, 0])


@dataclass(frozen=True, slots=True)
class Quota:
    """One client's limits; 0 = no limit of that kind."""

    rate: float
    burst: float
    bytes_rate: float
    bytes_burst: float

    @property
    def limited(self) -> bool:
        return bool(self.rate or self.bytes_rate)


class QuotaBucket:
    """The token buckets of one connection (see the module docstring)."""

    __slots__ = ("_bytes", "_last", "_tokens", "counts", "quota", "reason", "reject", "waiting")

    def __init__(self, quota: Quota, reject: bool, counts: QuotaCounts, now: float) -> None:
        self.quota = quota
        self.reject = reject
        self.counts = counts
        self._tokens = quota.burst
        self._bytes = quota.bytes_burst
        self._last = now
        self.reason = RATE  # why the last take() said wait
        self.waiting = False  # the connection's reader waits for this bucket (reading paused)

    def take(self, size: int, now: float) -> float:
        """0.0 when a PUBLISH of `size` payload bytes is within quota (taken from the
        buckets); else the seconds until it would be (nothing taken)."""
        q = self.quota
        elapsed = now - self._last
        self._last = now
        wait = 0.0
        if q.rate:
            tokens = self._tokens = min(q.burst, self._tokens + elapsed * q.rate)
            if tokens < 1.0:
                wait = (1.0 - tokens) / q.rate
                self.reason = RATE
        if q.bytes_rate:
            level = self._bytes = min(q.bytes_burst, self._bytes + elapsed * q.bytes_rate)
            need = min(float(size), q.bytes_burst)
            if level < need:
                bytes_wait = (need - level) / q.bytes_rate
                if bytes_wait > wait:
                    wait = bytes_wait
                    self.reason = BYTES
        if wait > 0.0:
            return wait
        self._tokens -= 1.0
        self._bytes -= size
        return 0.0

    def throttled(self) -> None:
        self.counts.throttled[self.reason] += 1

    def rejected(self) -> None:
        self.counts.rejected[self.reason] += 1


class PublishQuotas:
    """Which quota each client gets, from the settings (global and [[quotas]] rules)."""

    __slots__ = ("_default", "_reject", "_rules", "configured", "counts")

    def __init__(self, settings: GatewaySettings) -> None:
        s = settings
        self._default = _quota(
            s.max_publish_rate, s.max_publish_bytes_rate, s.max_publish_burst,
            s.max_publish_bytes_burst,
        )  # fmt: skip
        self._rules: tuple[tuple[QuotaRule, Quota], ...] = tuple(
            (rule, self._for_rule(rule, s)) for rule in s.quotas
        )
        self._reject = s.quota_action == "reject"
        self.counts = QuotaCounts.zero()
        #: Whether any client can have a quota (False: `bucket` is None at once, every CONNECT).
        self.configured = self._default.limited or any(q.limited for _, q in self._rules)

    def quota(self, client_id: str, username: str | None) -> Quota:
        for rule, quota in self._rules:
            if rule.client_id is not None and not fnmatchcase(client_id, rule.client_id):
                continue
            if rule.username is not None and (
                username is None or not fnmatchcase(username, rule.username)
            ):
                continue
            return quota
        return self._default

    def bucket(self, client_id: str, username: str | None, now: float) -> QuotaBucket | None:
        """The buckets of a client that just connected; None when it has no quota."""
        if not self.configured:
            return None
        quota = self.quota(client_id, username)
        if not quota.limited:
            return None
        return QuotaBucket(quota, self._reject, self.counts, now)

    @staticmethod
    def _for_rule(rule: QuotaRule, s: GatewaySettings) -> Quota:
        def pick(own: float | None, default: float | None) -> float | None:
            return default if own is None else own

        return _quota(
            pick(rule.max_publish_rate, s.max_publish_rate),
            pick(rule.max_publish_bytes_rate, s.max_publish_bytes_rate),
            pick(rule.max_publish_burst, s.max_publish_burst),
            pick(rule.max_publish_bytes_burst, s.max_publish_bytes_burst),
        )


def _quota(
    rate: float | None, bytes_rate: float | None, burst: float | None, bytes_burst: float | None
) -> Quota:
    """A Quota; a missing or zero rate is no limit, a missing burst is one second of the rate
    (at least one message)."""
    r = rate or 0.0
    b = bytes_rate or 0.0
    return Quota(
        rate=r,
        burst=max(burst or r, 1.0) if r else 0.0,
        bytes_rate=b,
        bytes_burst=max(bytes_burst or b, 1.0) if b else 0.0,
    )
