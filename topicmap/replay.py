"""Replay requests: a subscription that starts in the past.

Two spellings ask for one thing, "this filter, from time T, then live":

- MQTT 3.1.1 (and 5.0): the filter prefix `$replay/{from}/{filter}`, in the spirit of
  `$share/`: `$replay/2026-11-25T10:00:00Z/site/+/dev/#`, `$replay/earliest/site/#`.
- MQTT 5.0: the SUBSCRIBE user property `replay-from` = `{from}` on a plain filter.

`{from}` is one of:

    earliest                      every message retention kept
    1764064800000                 epoch milliseconds (digits only)
    2026-11-25T10:00:00Z          RFC 3339 date-time with an offset (`Z` or `+hh:mm`),
    2026-11-25T10:00:00.250+01:00 fractions of a second allowed

`{from}` holds no `/` (none of the forms has one), so the filter is everything after the
second `/`. It must be a complete, valid, non-shared filter: `$replay/T/$share/g/f` is refused
(a shared group has one position; replaying for one member would skip the others).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from topicmap.errors import TOPIC_FILTER_INVALID, TopicError, shown
from topicmap.naming import LMQ_PREFIX, parent_topic
from topicmap.topic import SHARE_PREFIX, TopicFilter

REPLAY_PREFIX = "$replay/"
REPLAY_PROPERTY = "replay-from"
EARLIEST = "earliest"
_EPOCH_MS = re.compile(r"[0-9]{1,15}")
# RFC 3339 section 5.6 date-time; `t`/`z` lower case and a space separator are RFC 3339 too.
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}"
    r"(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
# A parent topic's store name: encoding tokens only (`%` always followed by two lower-case hex
# digits). Store queues that are neither parents nor light queues (`%RETAIN%`) fail it.
_PARENT_NAME = re.compile(r"(?:[a-z0-9_.-]|%[0-9a-f]{2})+")


def parse_replay_from(value: str) -> int:
    """Epoch milliseconds of a `{from}` value (`earliest` is 0); TopicError when malformed."""
    if value == EARLIEST:
        return 0
    if _EPOCH_MS.fullmatch(value):
        return int(value)
    if _RFC3339.fullmatch(value):
        text = value.replace(" ", "T").replace("t", "T").upper().replace("Z", "+00:00")
        frac = re.search(r"\.([0-9]+)", text)
        if frac is not None and len(frac.group(1)) > 6:  # fromisoformat takes microseconds
            text = text[: frac.start(1) + 6] + text[frac.end(1) :]
        try:
            return int(datetime.fromisoformat(text).timestamp() * 1000)
        except ValueError as e:
            raise _bad(value, str(e)) from None
    raise _bad(value, "expected 'earliest', epoch milliseconds or an RFC 3339 date-time")


def _bad(value: str, why: str) -> TopicError:
    return TopicError(
        f"replay start {shown(value)} is invalid: {why}",
        value=value,
        reason_code=TOPIC_FILTER_INVALID,
    )


@dataclass(frozen=True, slots=True)
class ReplayFilter:
    """A parsed `$replay/{from}/{filter}`: `since_ms` and the plain `filter`."""

    since_ms: int
    filter: TopicFilter
    start: str  # `{from}` as written (for log lines and SUBACK reason strings)


def split_replay(text: str) -> ReplayFilter | None:
    """The replay request in a subscribed filter, None when it has no `$replay/` prefix.

    TopicError when the prefix is there but the rest is not `{from}/{valid filter}`. A filter
    that is exactly `$replay` is an ordinary filter (like `$share`).
    """
    if not text.startswith(REPLAY_PREFIX):
        return None
    start, slash, rest = text[len(REPLAY_PREFIX) :].partition("/")
    if not slash or not rest:
        raise TopicError(
            f"replay filter {shown(text)} has no topic filter; the form is "
            "$replay/{from}/{filter}",
            value=text,
            reason_code=TOPIC_FILTER_INVALID,
        )
    since = parse_replay_from(start)
    if rest.startswith(SHARE_PREFIX) or rest.startswith(REPLAY_PREFIX):
        raise TopicError(
            f"replay filter {shown(text)} wraps {rest.split('/', 1)[0]}/; only a plain filter "
            "can be replayed",
            value=text,
            reason_code=TOPIC_FILTER_INVALID,
        )
    return ReplayFilter(since, TopicFilter(rest), start)


def replay_parents(tf: TopicFilter, store_queues: list[str]) -> list[str]:
    """Parent topics (store names) whose messages `tf` may match, among `store_queues`.

    A filter whose first level is literal has one parent; one starting with `+` or `#` spans
    every parent topic the store has (light queues and store-internal queues left out).
    """
    first = tf.levels[0]
    if first not in ("+", "#"):
        name = parent_topic(first + "/x")  # parent_topic wants a topic name; `x` is ignored
        return [name] if name in store_queues else []
    return sorted(q for q in store_queues if is_parent_name(q))


def is_parent_name(name: str) -> bool:
    """True when `name` can be a parent topic's store name (not a light or internal queue)."""
    return not name.startswith(LMQ_PREFIX) and _PARENT_NAME.fullmatch(name) is not None


__all__ = [
    "EARLIEST",
    "REPLAY_PREFIX",
    "REPLAY_PROPERTY",
    "ReplayFilter",
    "is_parent_name",
    "parse_replay_from",
    "replay_parents",
    "split_replay",
]
