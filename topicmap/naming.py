"""Store names for MQTT topics: parent topics and light-queue names.

The store accepts a name only when it is non-empty and a safe single file-name component. Every
name made here is drawn from `[a-z0-9._%-]` (plus the constant `%LMQ%` prefix), never starts
with `.`, and is at most MAX_STORE_NAME_LENGTH (127) characters, so it is also a valid RocketMQ
topic and fits the record's 1-byte TOPICLENGTH. Names never contain `,`, U+0001 or U+0002, so
they can be listed in the store's dispatch properties unquoted.

Level encoding (one token per UTF-8 byte of the text; injective because every token is
decided by its first character):

    byte of the text            token            example
    a-z 0-9 -                   itself           dev-42      -> dev-42
    /  (level separator)        .                site/7      -> site.7
    A-Z                         _ + lower case   Site        -> _site
    anything else               % + 2 hex (lc)   +  #  %  .  -> %2b %23 %25 %2e
    (incl. _ . % $ + # space and every byte of non-ASCII)   Ü -> %c3%9c

No upper-case letter appears after the prefix, so two names never differ only in case and stay
distinct on case-insensitive file systems. rocketmq-mqtt maps `a/b` and `a%b` to the same queue
(`replace("/", "%")`); here they are `a.b` and `a%25b`.

Light queues: `queue_name(filter)` is `%LMQ%` + encoding of the (underlying, non-shared)
filter, e.g. `site/+/dev/#` -> `%LMQ%site.%2b.dev.%23`. When that would exceed 127 characters
the name becomes hash-based:

    %LMQ% <encoding cut at a token boundary, <= 80 chars> _0 <40 hex: sha256(filter)[:160 bits]>

`_0` never occurs in a direct encoding (`_` is always followed by a letter), so the two forms
cannot collide. A hash-based name is not decodable; `filter_of` resolves it through a NameTable
(the module's default table learns every long filter named in this process; the gateway
persists it, or the Router snapshot, and restores it on start). A NameTable refuses two filters
with one hash-based name, so a 160-bit hash collision is detected, never silently merged.

Parent topics: `parent_topic(topic)` is the encoding of the first level (`site/7/dev` -> `site`,
`Home/x` -> `_home`, `$SYS/x` -> `%24_s_y_s`). The empty first level (`/a/b`) is `_0empty`.
A first level whose encoding exceeds 127 characters becomes `<encoding cut, <= 85 chars>_0<40
hex>`. Parent names never start with `%LMQ%` (`%` is always followed by two lower-case hex
digits there), so parent topics and light queues never share a name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from topicmap.errors import IMPLEMENTATION_SPECIFIC_ERROR, TOPIC_FILTER_INVALID, TopicError, shown
from topicmap.topic import Topic, TopicFilter

LMQ_PREFIX = "%LMQ%"
MAX_STORE_NAME_LENGTH = 127
EMPTY_PARENT = "_0empty"
_HASH_MARK = "_0"
_HASH_HEX_DIGITS = 40
_QUEUE_KEEP = MAX_STORE_NAME_LENGTH - len(LMQ_PREFIX) - len(_HASH_MARK) - _HASH_HEX_DIGITS
_PARENT_KEEP = MAX_STORE_NAME_LENGTH - len(_HASH_MARK) - _HASH_HEX_DIGITS
_STORE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._%-")


def _token(byte: int) -> str:
    char = chr(byte)
    if char == "/":
        return "."
    if char.isascii() and (char.islower() or char.isdigit() or char == "-"):
        return char
    if "A" <= char <= "Z":
        return "_" + char.lower()
    return f"%{byte:02x}"


_TOKENS: tuple[str, ...] = tuple(_token(byte) for byte in range(256))
# The same table for str.translate: an ASCII text's UTF-8 bytes are its characters, so it is
# encoded in one C loop (restoring a million subscriptions names a million queues).
_ASCII_TOKENS: dict[int, str] = {byte: _TOKENS[byte] for byte in range(128)}


def encode_text(text: str) -> str:
    """Encode any str (not only filters) with the token table above. Injective on all str that
    can be UTF-8 encoded."""
    if text.isascii():
        return text.translate(_ASCII_TOKENS)
    tokens = _TOKENS
    return "".join([tokens[byte] for byte in text.encode("utf-8")])


def decode_text(body: str) -> str:
    """Inverse of `encode_text`; raises TopicError unless `body` is a canonical encoding."""
    raw = bytearray()
    index, size = 0, len(body)
    try:
        while index < size:
            char = body[index]
            if char == ".":
                raw.append(0x2F)
                index += 1
            elif char == "_":
                raw += body[index + 1].upper().encode("ascii")
                index += 2
            elif char == "%":
                raw.append(int(body[index + 1 : index + 3], 16))
                index += 3
            else:
                raw += char.encode("ascii")
                index += 1
        text = raw.decode("utf-8")
    except (IndexError, ValueError):
        text = None  # UnicodeDecodeError is a ValueError
    if text is None or encode_text(text) != body:
        raise TopicError(
            f"{shown(body)} is not an encoding made by topicmap",
            value=body,
            reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
        )
    return text


def _cut(body: str, keep: int) -> str:
    """`body[:keep]`, shortened so that no token is split (tokens are 1 to 3 characters)."""
    if len(body) <= keep:
        return body
    if body[keep - 1] in "_%":
        return body[: keep - 1]
    if body[keep - 2] == "%":
        return body[: keep - 2]
    return body[:keep]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:_HASH_HEX_DIGITS]


def is_store_name(name: str) -> bool:
    """The store-name rule every name made here satisfies (documented for the store's checks)."""
    return (
        0 < len(name) <= MAX_STORE_NAME_LENGTH
        and not name.startswith(".")
        and all(char in _STORE_NAME_CHARS for char in name)
    )


def parent_topic(topic: str | Topic) -> str:
    """The store name of the topic's first level (its parent topic); see the module docstring."""
    return parent_of_name(topic.name if isinstance(topic, Topic) else Topic(topic).name)


def parent_of_name(name: str) -> str:
    """parent_topic() of a name already checked (topicmap.topic.check_topic_name)."""
    first = name.partition("/")[0]
    known = _PARENTS.get(first)
    if known is not None:
        return known
    known = _parent_of_level(first)
    if len(first) <= _PARENTS_LEVEL_MAX:
        if len(_PARENTS) >= _PARENTS_SIZE:
            _PARENTS.clear()
        _PARENTS[first] = known
    return known


# First level -> parent topic, for the levels of at most _PARENTS_LEVEL_MAX characters (the
# cache stays under a few MB): a fleet's new topics share a few first levels.
_PARENTS: dict[str, str] = {}
_PARENTS_SIZE = 4096
_PARENTS_LEVEL_MAX = 256


def _parent_of_level(first: str) -> str:
    if not first:
        return EMPTY_PARENT
    body = encode_text(first)
    if len(body) <= MAX_STORE_NAME_LENGTH:
        return body
    return _cut(body, _PARENT_KEEP) + _HASH_MARK + _digest(first)


def _underlying(filter: str | TopicFilter) -> str:
    return (filter if isinstance(filter, TopicFilter) else TopicFilter(filter)).filter


def _queue_name_of_valid(underlying: str) -> tuple[str, bool]:
    """(queue name, is hash-based) of a validated, non-shared filter."""
    body = encode_text(underlying)
    if len(LMQ_PREFIX) + len(body) <= MAX_STORE_NAME_LENGTH:
        return LMQ_PREFIX + body, False
    return LMQ_PREFIX + _cut(body, _QUEUE_KEEP) + _HASH_MARK + _digest(underlying), True


class NameTable:
    """Reverse mapping of hash-based light-queue names to their filters.

    Direct names decode without it. `snapshot()` is a JSON-able dict (name -> filter) to
    persist; `NameTable.restore(snapshot)` checks every entry against the naming scheme.
    """

    __slots__ = ("_filters",)

    def __init__(self) -> None:
        self._filters: dict[str, str] = {}

    def queue_name(self, filter: str | TopicFilter) -> str:
        """The light-queue name of `filter` (shared filters name their underlying filter's
        queue); a hash-based name is remembered here so `filter_of` can reverse it."""
        underlying = _underlying(filter)
        name, hashed = _queue_name_of_valid(underlying)
        if hashed:
            self._remember(name, underlying)
        return name

    def filter_of(self, name: str) -> str:
        """The (underlying) filter whose light queue is `name`."""
        if not isinstance(name, str) or not name.startswith(LMQ_PREFIX):
            raise TopicError(
                f"{shown(str(name))} is not a light-queue name (they start with {LMQ_PREFIX!r})",
                value=name,
                reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
            )
        body = name[len(LMQ_PREFIX) :]
        if _HASH_MARK in body:
            found = self._filters.get(name)
            if found is None:
                raise TopicError(
                    f"light queue {shown(name)} has a hash-based name that is not in the name "
                    "table; restore the NameTable (or Router) snapshot the gateway persisted",
                    value=name,
                    reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
                )
            return found
        text = decode_text(body)
        try:
            parsed = TopicFilter(text)
        except TopicError as exc:
            raise TopicError(
                f"light queue {shown(name)} decodes to an invalid filter: {exc}",
                value=name,
                reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
            ) from None
        if parsed.is_shared or _queue_name_of_valid(text)[1]:
            raise TopicError(
                f"{shown(name)} is not a light-queue name made by topicmap",
                value=name,
                reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
            )
        return text

    def _remember(self, name: str, underlying: str) -> None:
        known = self._filters.setdefault(name, underlying)
        if known != underlying:
            raise TopicError(
                f"hash collision: filters {shown(known)} and {shown(underlying)} both name "
                f"light queue {name!r}",
                value=underlying,
                reason_code=TOPIC_FILTER_INVALID,
            )

    def update(self, entries: object) -> None:
        """Add checked entries (name -> filter), e.g. from another table's snapshot: a
        `Mapping[str, str]`, checked (a snapshot read back may be anything)."""
        if not isinstance(entries, Mapping):
            raise TopicError(
                "a name-table snapshot must be a mapping of queue name to filter",
                value=entries,
                reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
            )
        for name, filter in entries.items():
            if not isinstance(name, str) or not isinstance(filter, str):
                raise TopicError(
                    "a name-table snapshot maps str queue names to str filters",
                    value=(name, filter),
                    reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
                )
            if self.queue_name(filter) != name:
                raise TopicError(
                    f"name-table entry {shown(name)} -> {shown(filter)} does not match the "
                    "naming scheme (corrupt or foreign snapshot)",
                    value=name,
                    reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
                )

    def snapshot(self) -> dict[str, str]:
        return dict(self._filters)

    @classmethod
    def restore(cls, snapshot: object) -> NameTable:
        table = cls()
        table.update(snapshot)
        return table

    def __len__(self) -> int:
        return len(self._filters)

    def __contains__(self, name: object) -> bool:
        return name in self._filters

    def __repr__(self) -> str:
        return f"NameTable({len(self._filters)} hash-based names)"


DEFAULT_NAME_TABLE = NameTable()


def queue_name(filter: str | TopicFilter, table: NameTable | None = None) -> str:
    """`%LMQ%` name of the light queue of `filter` (of its underlying filter when shared)."""
    return (DEFAULT_NAME_TABLE if table is None else table).queue_name(filter)


def filter_of(name: str, table: NameTable | None = None) -> str:
    """The filter of light queue `name`; hash-based names are resolved through `table`
    (default: the module's table, which knows every long filter named in this process)."""
    return (DEFAULT_NAME_TABLE if table is None else table).filter_of(name)
