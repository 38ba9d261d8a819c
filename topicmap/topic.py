"""MQTT topic names and topic filters (MQTT 3.1.1 section 4.7, MQTT 5.0 sections 4.7 and 4.8.2).

Rules enforced here, for both versions of the protocol:

- A topic name or filter is a UTF-8 string of 1 to 65,535 bytes without U+0000. Lone
  surrogates cannot be encoded and are rejected.
- Levels are separated by `/`; empty levels are allowed (`/a`, `a//b`, `/` are valid).
- Topic names contain no wildcards. In a filter `+` is a whole level, `#` is a whole level and
  the last one (`sport/#` also matches `sport`).
- Topics starting with `$` are not matched by filters whose first level is a wildcard
  (`#` and `+/monitor` do not match `$SYS/monitor`).
- `$share/{group}/{filter}` is a shared subscription: the group is non-empty without `/`, `+`
  or `#`, and `{filter}` is a complete, valid filter (`$share/g` and `$share/g/` are rejected).
  A filter that is exactly `$share` is an ordinary filter matching the topic `$share`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from topicmap.errors import TOPIC_FILTER_INVALID, TOPIC_NAME_INVALID, TopicError, shown

MAX_TOPIC_BYTES = 65_535
SHARE_PREFIX = "$share/"
# A str of at most this many code points is at most MAX_TOPIC_BYTES in UTF-8 (4 bytes each),
# so the common case skips encoding.
_SHORT_ENOUGH = MAX_TOPIC_BYTES // 4


def check_utf8_string(kind: str, text: object, reason_code: int) -> str:
    """Check the MQTT UTF-8 string rules shared by topic names and filters; return `text`."""
    if not isinstance(text, str):
        raise TopicError(
            f"{kind} must be a str, got {type(text).__name__}",
            value=text,
            reason_code=reason_code,
        )
    if not text:
        raise TopicError(
            f"{kind} is empty; MQTT requires at least one character",
            value=text,
            reason_code=reason_code,
        )
    nul = text.find("\x00")
    if nul >= 0:
        raise TopicError(
            f"{kind} {shown(text)} contains U+0000 at index {nul}, which MQTT forbids",
            value=text,
            reason_code=reason_code,
        )
    if len(text) > _SHORT_ENOUGH or not text.isascii():
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise TopicError(
                f"{kind} {shown(text)} is not valid UTF-8: lone surrogate at index {exc.start}",
                value=text,
                reason_code=reason_code,
            ) from None
        if size > MAX_TOPIC_BYTES:
            raise TopicError(
                f"{kind} {shown(text)} is {size} bytes in UTF-8; MQTT allows at most "
                f"{MAX_TOPIC_BYTES}",
                value=text,
                reason_code=reason_code,
            )
    return text


def check_topic_name(name: object) -> str:
    """Check the rules of a topic name (what a PUBLISH is sent to) and return it: the MQTT
    UTF-8 string rules and no wildcard. TopicError with the reason otherwise. Topic() checks
    with it; a caller that needs no Topic object (the publish path's per-name cache) calls it
    alone."""
    text = check_utf8_string("topic name", name, TOPIC_NAME_INVALID)
    if "+" in text or "#" in text:
        wildcard = "+" if "+" in text else "#"
        raise TopicError(
            f"topic name {shown(text)} contains the wildcard {wildcard!r}; wildcards are only "
            "allowed in subscription filters, not in the topic a message is published to",
            value=text,
            reason_code=TOPIC_NAME_INVALID,
        )
    return text


def matches_levels(filter_levels: Sequence[str], topic_levels: Sequence[str]) -> bool:
    """True when a (non-shared) filter, split into levels, matches a topic split into levels.

    This is the direct reading of the spec, one level at a time; the Router does the same in a
    trie for all filters at once and is tested against this function.
    """
    if topic_levels[0].startswith("$") and filter_levels[0] in ("+", "#"):
        return False
    count = len(topic_levels)
    for index, level in enumerate(filter_levels):
        if level == "#":
            return True
        if index >= count:
            return False
        if level != "+" and level != topic_levels[index]:
            return False
    return len(filter_levels) == count


class Topic:
    """A validated MQTT topic name (what a PUBLISH is sent to). Immutable and hashable."""

    __slots__ = ("levels", "name")
    name: str
    levels: tuple[str, ...]

    def __init__(self, name: object) -> None:  # checked: TopicError for a non-str too
        text = check_topic_name(name)
        object.__setattr__(self, "name", text)
        object.__setattr__(self, "levels", tuple(text.split("/")))

    @classmethod
    def from_bytes(cls, raw: bytes) -> Topic:
        """Decode a topic name as received on the wire (strict UTF-8)."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TopicError(
                f"topic name is not valid UTF-8 (bad byte at offset {exc.start})",
                value=raw,
                reason_code=TOPIC_NAME_INVALID,
            ) from None
        return cls(text)

    @property
    def is_system(self) -> bool:
        """True for `$`-topics, which leading-wildcard filters do not match."""
        return self.name.startswith("$")

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("Topic is immutable")

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Topic({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topic) and other.name == self.name

    def __hash__(self) -> int:
        return hash((Topic, self.name))


class TopicFilter:
    """A validated MQTT subscription filter, possibly shared. Immutable and hashable.

    - `text`: the filter exactly as subscribed (`$share/g/site/#`); also `str(f)`.
    - `filter`: the underlying filter without the `$share/{group}/` prefix (`site/#`); this is
      what matches topics and names the light queue.
    - `share_group`: the share name (`g`) or None; `is_shared`.
    - `levels`: the levels of `filter`.
    """

    __slots__ = ("filter", "levels", "share_group", "text")
    text: str
    filter: str
    share_group: str | None
    levels: tuple[str, ...]

    def __init__(self, given: object) -> None:  # checked: TopicError for a non-str too
        text = check_utf8_string("topic filter", given, TOPIC_FILTER_INVALID)
        group: str | None = None
        underlying = text
        if text.startswith(SHARE_PREFIX):
            group, slash, underlying = text[len(SHARE_PREFIX) :].partition("/")
            _check_share(text, group, slash, underlying)
        levels = underlying.split("/")
        if "+" in underlying or "#" in underlying:
            _check_wildcards(text, levels)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "filter", underlying)
        object.__setattr__(self, "share_group", group)
        object.__setattr__(self, "levels", tuple(levels))

    @property
    def is_shared(self) -> bool:
        return self.share_group is not None

    @property
    def is_wildcard(self) -> bool:
        return "+" in self.levels or self.levels[-1] == "#"

    def matches(self, topic: str | Topic) -> bool:
        """True when a message published to `topic` is delivered to this filter."""
        name = topic.name if isinstance(topic, Topic) else Topic(topic).name
        return matches_levels(self.levels, name.split("/"))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("TopicFilter is immutable")

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"TopicFilter({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TopicFilter) and other.text == self.text

    def __hash__(self) -> int:
        return hash((TopicFilter, self.text))


def _check_share(text: str, group: str, slash: str, underlying: str) -> None:
    def fail(problem: str) -> TopicError:
        return TopicError(
            f"shared subscription {shown(text)} {problem}; the form is $share/{{group}}/{{filter}}",
            value=text,
            reason_code=TOPIC_FILTER_INVALID,
        )

    if not group:
        raise fail("has an empty share name")
    for bad in ("+", "#"):
        if bad in group:
            raise fail(f"has {bad!r} in its share name {shown(group)}")
    if not slash:
        raise fail("has no topic filter after the share name")
    if not underlying:
        raise fail("has an empty topic filter after the share name")


def _check_wildcards(text: str, levels: list[str]) -> None:
    last = len(levels) - 1
    for index, level in enumerate(levels):
        if level in ("+", "#"):
            if level == "#" and index != last:
                raise TopicError(
                    f"topic filter {shown(text)} has '#' at level {index + 1} of {last + 1}; "
                    "'#' must be the last level (e.g. 'a/b/#')",
                    value=text,
                    reason_code=TOPIC_FILTER_INVALID,
                )
            continue
        for wildcard in ("+", "#"):
            if wildcard in level:
                raise TopicError(
                    f"topic filter {shown(text)} has {wildcard!r} inside level {index + 1} "
                    f"({shown(level)}); a wildcard must be a whole level, e.g. 'a/{wildcard}'",
                    value=text,
                    reason_code=TOPIC_FILTER_INVALID,
                )
