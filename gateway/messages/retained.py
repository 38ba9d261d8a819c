"""Durable retained messages: an in-memory topic trie backed by the CommitLog.

Theory of operation
-------------------
The CommitLog stays the only truth. Every retained PUBLISH is appended once to the store with
the light queue ``%RETAIN%`` among its dispatch queues, so an acknowledged retained publish is
on disk exactly like any other message. The index is a materialised view of that queue:

    RetainedIndex state  =  snapshot (state records, covers %RETAIN% offsets < N)
                            + replay of %RETAIN% from offset N to its end

``open()`` loads the snapshot and replays the queue; a crash between snapshots therefore loses
nothing, it only makes the next replay longer. ``snapshot()`` first catches up with the queue,
then appends to the state log (gateway/storage/port.py) one record per topic changed since the
last snapshot (payload included, so store retention may delete the segments that hold old
retained messages; a DELETE record when the topic has none any more) and the queue offset
covered, in one batch. It runs periodically (``snapshot_periodically``) and on ``close()``.
Limit: a retained publish made after the last snapshot whose segment retention deletes before
the next snapshot is lost (and logged); the snapshot period (default 60 s) keeps that window
far below any sensible retention setting.

At run time the gateway calls ``apply(msg)`` right after the store accepted the publish, so the
message is visible to the next SUBSCRIBE without reading the store. Two writers (apply and the
log catch-up) could reorder changes to one topic, so every change carries a version:

- ``msg.offset`` is the message's offset in ``%RETAIN%`` (``put_result.light_offsets[QUEUE]``);
  a change is applied only if its offset is newer than the topic's current version, deletions
  included (tombstones), so the last writer in log order wins whatever the call order.
- ``apply(msg)`` without an offset (callers that do not have one) first catches up with the
  log; if the log has already shown a change to this topic that no apply() has confirmed yet,
  the log is ahead of the caller and the call is only a confirmation. Otherwise it is applied.

``match()`` also catches up first, so records another writer put in ``%RETAIN%`` are never
missed. Matching happens on SUBSCRIBE, never on the publish path: a trie over topic levels
walks ``+`` (one child level) and ``#`` (a whole subtree, the parent level included) and
applies the ``$`` rule (a filter starting with a wildcard never matches a ``$`` topic). Expired
messages (MQTT 5 message expiry interval) are skipped and dropped when met.

Snapshot records (the newest record per key wins)::

    "retained/<topic>"  -> {"topic": "a/b", "payload": "<base64>", "qos": 1, "properties": {...},
                            "stored_at_ms": T, "expiry": null | seconds, "offset": null | int}
    "meta/retained"     -> {"queue": "%RETAIN%", "next_offset": N, "saved_at_ms": T}

A snapshot may also be the file ``config/retained.json`` ({"version": 1, "queue",
"next_offset", "saved_at_ms", "messages": [the records' values]}), the on-disk form before the
state log: it is read while no "meta/retained" record exists, and the first snapshot turns it
into records.

Not thread-safe: used from the gateway's event loop only.
"""

from __future__ import annotations

import asyncio
import binascii
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.clock import now_ms as _now_ms
from gateway.messages.message_json import (
    message_from_json,
    message_to_json,
    optional_int,
    record_properties_from_json,
)
from gateway.messages.records import read_record
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import DISPATCH_KEY, DISPATCH_OFFSETS_KEY

if TYPE_CHECKING:
    from gateway.storage.port import Storage as MessageStore
    from gateway.storage.port import StoredMessage

__all__ = ["RetainedIndex", "RetainedMessage", "RetainedTrie"]

log = logging.getLogger("lmqtt.retained")

SNAPSHOT_NAME = "retained.json"  # the snapshot as a file, read when no records exist
SNAPSHOT_VERSION = 1
# State records (gateway/storage/port.py): one per retained topic, its message as JSON
# (RetainedMessage.to_json; a DELETE when it went), and the offset of %RETAIN% they cover.
RECORD_PREFIX = "retained/"
CURSOR_KEY = "meta/retained"  # {"queue": "%RETAIN%", "next_offset": N, "saved_at_ms": T}
REPLAY_BATCH = 256
# Properties the store adds to a record, which say nothing about the MQTT message: its dispatch
# properties and the CRC property a record ends with.
_INTERNAL_PROPERTIES = frozenset({DISPATCH_KEY, DISPATCH_OFFSETS_KEY, "__CRC32#"})


def _read_only(store: MessageStore) -> bool:
    config = getattr(store, "config", None)
    return bool(getattr(store, "read_only", False) or getattr(config, "read_only", False))


def _dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def _fold(records: Iterable[tuple[str, bytes | None]]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for key, value in records:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@dataclass(slots=True)
class RetainedMessage:
    topic: str
    payload: bytes
    qos: int
    properties: dict[str, str] = field(default_factory=dict)  # as stored in the record
    stored_at_ms: int = field(default_factory=_now_ms)
    expiry_interval_s: int | None = None  # MQTT 5 message expiry interval
    offset: int | None = None  # offset in %RETAIN% (versions changes); None if unknown

    @classmethod
    def from_stored(cls, m: StoredMessage) -> RetainedMessage | None:
        """Rebuild from a %RETAIN% record (properties as the gateway wrote them), read by the
        record decoder every reader shares (gateway/messages/records.py read_record): None,
        logged there, when its QoS or expiry is not a number."""
        rec = read_record(m.topic, bytes(m.body), m.properties, m.store_timestamp)
        if rec is None:
            return None
        return cls(
            topic=rec.topic,
            payload=rec.payload,
            qos=rec.qos,
            properties={k: v for k, v in rec.props.items() if k not in _INTERNAL_PROPERTIES},
            stored_at_ms=rec.stored_at_ms,
            # An expiry interval of 0 read back from the log means none.
            expiry_interval_s=rec.expiry or None,
        )

    def expires_at_ms(self) -> int | None:
        if self.expiry_interval_s is None:
            return None
        return self.stored_at_ms + self.expiry_interval_s * 1000

    def expired(self, now_ms: int | None = None) -> bool:
        deadline = self.expires_at_ms()
        return deadline is not None and (now_ms if now_ms is not None else _now_ms()) >= deadline

    def remaining_expiry_s(self, now_ms: int | None = None) -> int | None:
        """The Message Expiry Interval to send now (MQTT 5 3.3.2.3.3: the time left)."""
        deadline = self.expires_at_ms()
        if deadline is None:
            return None
        left_ms = deadline - (now_ms if now_ms is not None else _now_ms())
        return max(0, -(-left_ms // 1000))  # round up: never send 0 for a live message

    def to_json(self) -> dict[str, Any]:
        """The snapshot record's JSON (gateway/messages/message_json.py)."""
        return message_to_json(
            self.topic,
            self.payload,
            self.qos,
            properties=self.properties,
            stored_at_ms=self.stored_at_ms,
            expiry=self.expiry_interval_s,
            offset=self.offset,
        )

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RetainedMessage:
        """The message of a snapshot record; a payload that is not strict base64 is refused
        (binascii.Error): the snapshot is then ignored and the log replayed."""
        topic, payload, qos = message_from_json(doc, validate=True)
        return cls(
            topic=topic,
            payload=payload,
            qos=qos,
            properties=record_properties_from_json(doc.get("properties")),
            stored_at_ms=int(doc["stored_at_ms"]),
            expiry_interval_s=optional_int(doc.get("expiry")),
            offset=optional_int(doc.get("offset")),
        )


class _Node:
    __slots__ = ("children", "message")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.message: RetainedMessage | None = None


class RetainedTrie:
    """Topic levels -> retained message, matched against filters with MQTT wildcard rules."""

    def __init__(self) -> None:
        self._root = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def get(self, topic: str) -> RetainedMessage | None:
        node: _Node | None = self._root
        for level in topic.split("/"):
            node = node.children.get(level) if node is not None else None
        return node.message if node is not None else None

    def set(self, msg: RetainedMessage) -> None:
        node = self._root
        for level in msg.topic.split("/"):
            node = node.children.setdefault(level, _Node())
        if node.message is None:
            self._count += 1
        node.message = msg

    def delete(self, topic: str) -> bool:
        path = [self._root]
        levels = topic.split("/")
        for level in levels:
            child = path[-1].children.get(level)
            if child is None:
                return False
            path.append(child)
        if path[-1].message is None:
            return False
        path[-1].message = None
        self._count -= 1
        # Prune empty branches so deleted topics do not leak memory.
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.message is None and not node.children:
                del path[depth - 1].children[levels[depth - 1]]
            else:
                break
        return True

    def __iter__(self) -> Iterator[RetainedMessage]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.message is not None:
                yield node.message
            stack.extend(node.children.values())

    def match(self, topic_filter: str) -> list[RetainedMessage]:
        levels = topic_filter.split("/")
        out: list[RetainedMessage] = []
        self._walk(self._root, levels, 0, out)
        return out

    def _walk(self, node: _Node, levels: list[str], i: int, out: list[RetainedMessage]) -> None:
        if i == len(levels):
            if node.message is not None:
                out.append(node.message)
            return
        level = levels[i]
        # The $ rule (MQTT 4.7.2): at the first level, wildcards skip topics starting with $.
        if level == "#":
            # "#" matches the parent level too: "a/#" matches "a".
            if node.message is not None and i > 0:
                out.append(node.message)
            for name, child in node.children.items():
                if i == 0 and name.startswith("$"):
                    continue
                self._collect(child, out)
        elif level == "+":
            for name, child in node.children.items():
                if i == 0 and name.startswith("$"):
                    continue
                self._walk(child, levels, i + 1, out)
        else:
            exact = node.children.get(level)
            if exact is not None:
                self._walk(exact, levels, i + 1, out)

    @staticmethod
    def _collect(node: _Node, out: list[RetainedMessage]) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.message is not None:
                out.append(n.message)
            stack.extend(n.children.values())


class RetainedIndex:
    QUEUE = "%RETAIN%"

    def __init__(self, store: MessageStore | None = None) -> None:
        self._store = store
        self._trie = RetainedTrie()
        # Version (offset in QUEUE) of the last change per topic, deletions included, for changes
        # whose offset is known. Tombstones below _next_offset are pruned at snapshot time.
        self._versions: dict[str, int] = {}
        # Changes read from the log per topic that no offset-less apply() has confirmed yet.
        self._unconfirmed: dict[str, int] = {}
        self._next_offset = 0  # everything in QUEUE below this is reflected in the trie
        self._dirty = False
        # Topics changed since the last snapshot (their records are rewritten by the next one),
        # and record keys to delete whatever (left by an unusable snapshot).
        self._changed: set[str] = set()
        self._stale: set[str] = set()
        # None until the first apply(): True when the caller passes offsets (then the log
        # catch-up need not count confirmations), False when it does not.
        self._caller_passes_offsets: bool | None = None
        self.replayed = 0  # messages replayed from the log by the last open() (for logs/tests)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def open(cls, store: MessageStore, records: Mapping[str, bytes] | None = None) -> RetainedIndex:
        """Load the snapshot (state records; `records`: the state's records already read, key
        -> value) and replay %RETAIN% from its offset. Read-only: works on a store opened
        with read_only=True (lmqtt inspect)."""
        index = cls(store)
        if records is None:
            records = _fold(
                (k, v)
                for k, v in store.state_records()
                if k.startswith(RECORD_PREFIX) or k == CURSOR_KEY
            )
        doc = index._read_records(records)
        if doc is None and CURSOR_KEY not in records:
            doc = index._read_snapshot()  # config/retained.json
            if doc is not None:
                index._changed.update(str(m["topic"]) for m in doc["messages"])
        if doc is not None:
            for item in doc["messages"]:
                msg = RetainedMessage.from_json(item)
                index._trie.set(msg)
                if msg.offset is not None:
                    index._versions[msg.topic] = msg.offset
            index._next_offset = int(doc["next_offset"])
            end = store.max_offset(cls.QUEUE)
            if index._next_offset > end:
                # The snapshot is fsynced, but an async-flush crash can cut the log's tail: the
                # snapshot covers records the log no longer has. Keep the messages, and re-read
                # from the log's real end, or new records would land on offsets we skip.
                log.warning(
                    "retained snapshot covers %%RETAIN%% up to offset %d but the log ends at %d;"
                    " resuming replay at %d",
                    index._next_offset,
                    end,
                    end,
                )
                index._next_offset = end
                if not _read_only(store):
                    # Fix the claim on disk now: after another crash it would hide new records.
                    index.snapshot()
        before = index._next_offset
        index.replayed = index._catch_up(confirmable=False)
        if index.replayed:
            log.info(
                "retained: replayed %d message(s) of %s from offset %d",
                index.replayed,
                cls.QUEUE,
                before,
            )
        index._dirty = index.replayed > 0
        return index

    def close(self) -> None:
        """Write a final snapshot (skipped on a read-only store)."""
        if self._store is not None and not _read_only(self._store):
            self.snapshot()

    async def snapshot_periodically(self, interval: float) -> None:
        """Snapshot every `interval` seconds while something changed; cancel to stop."""
        while True:
            await asyncio.sleep(interval)
            if self._dirty:
                try:
                    self.snapshot()
                except Exception:  # keep serving: the log still holds everything
                    log.exception("retained: periodic snapshot failed")

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._trie)

    def __iter__(self) -> Iterator[RetainedMessage]:
        return iter(self._trie)

    @property
    def next_offset(self) -> int:
        """The %RETAIN% offset up to which the log has been applied."""
        return self._next_offset

    def get(self, topic: str) -> RetainedMessage | None:
        msg = self._trie.get(topic)
        if msg is not None and msg.expired():
            self._trie.delete(topic)
            self._dirty = True
            self._changed.add(topic)
            return None
        return msg

    def match(self, topic_filter: str) -> list[RetainedMessage]:
        """Live retained messages whose topic matches `topic_filter` (MQTT wildcards and the
        `$` rule). Shared subscriptions (`$share/g/f`) get none (MQTT 5 4.8.2)."""
        if topic_filter.startswith("$share/"):
            return []
        # Records another writer put in %RETAIN% without telling us become visible here.
        self._catch_up(confirmable=True)
        if "+" in topic_filter or "#" in topic_filter:
            found = self._trie.match(topic_filter)
        else:
            # An exact filter (a device's own topic, the common case): one path down the trie.
            exact = self._trie.get(topic_filter)
            if exact is None:
                return []
            found = [exact]
        now = _now_ms()
        live = []
        for msg in found:
            if msg.expired(now):
                self._trie.delete(msg.topic)
                self._dirty = True
                self._changed.add(msg.topic)
            else:
                live.append(msg)
        return live

    # ------------------------------------------------------------------ changes
    def apply(self, msg: RetainedMessage) -> None:
        """Set `msg.topic`'s retained message; an empty payload deletes it. Pass
        `offset=put_result.light_offsets[RetainedIndex.QUEUE]` for exact log ordering."""
        if msg.offset is not None:
            self._caller_passes_offsets = True
            self._unconfirmed.clear()
            self._apply_versioned(msg)
            return
        self._caller_passes_offsets = False
        if self._store is not None:
            self._catch_up(confirmable=True)
            pending = self._unconfirmed.get(msg.topic, 0)
            if pending:
                # The log has already shown us this change (or a later one): confirm only.
                if pending == 1:
                    del self._unconfirmed[msg.topic]
                else:
                    self._unconfirmed[msg.topic] = pending - 1
                return
        self._set(msg)

    def _apply_versioned(self, msg: RetainedMessage) -> None:
        assert msg.offset is not None
        if msg.offset < self._next_offset or msg.offset <= self._versions.get(msg.topic, -1):
            return  # the log already gave us this change or a newer one
        self._versions[msg.topic] = msg.offset
        self._set(msg)

    def _set(self, msg: RetainedMessage) -> None:
        if msg.payload:
            if not msg.expired():
                self._trie.set(msg)
            else:
                self._trie.delete(msg.topic)
        else:
            self._trie.delete(msg.topic)
        self._dirty = True
        self._changed.add(msg.topic)

    def _catch_up(self, confirmable: bool) -> int:
        """Apply %RETAIN% records from _next_offset to the queue's end; returns how many."""
        store = self._store
        if store is None:
            return 0
        offset = self._next_offset
        if store.max_offset(self.QUEUE) == offset:
            return 0  # nothing new (every SUBSCRIBE asks: no cursor, no read)
        cursor = QueueCursor(store)
        applied = 0
        while True:
            messages, start, next_offset = cursor.read(self.QUEUE, offset, REPLAY_BATCH)
            if start > offset:
                log.warning(
                    "retained: %s offsets %d..%d were deleted by retention before a snapshot"
                    " covered them; their retained messages are lost",
                    self.QUEUE,
                    offset,
                    start - 1,
                )
                offset = start
            if not messages:
                break
            for stored in messages:
                msg = RetainedMessage.from_stored(stored)
                if msg is None:
                    continue  # not readable as an MQTT message (logged)
                msg.offset = stored.queue_offset
                before = self._versions.get(msg.topic, -1)
                if msg.offset > before:
                    self._versions[msg.topic] = msg.offset
                    self._set(msg)
                    if confirmable and not self._caller_passes_offsets:
                        self._unconfirmed[msg.topic] = self._unconfirmed.get(msg.topic, 0) + 1
                applied += 1
            if next_offset <= offset:
                break  # defensive: never spin on a store that does not advance
            offset = next_offset
        self._next_offset = offset
        return applied

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> None:
        """Catch up with the log, then append the records of the topics changed since the
        last snapshot and the queue offset covered (one batch: the offset never lands without
        the records it covers)."""
        store = self._store
        if store is None:
            return
        self._catch_up(confirmable=True)
        now = _now_ms()
        records: list[tuple[str, bytes | None]] = []
        for topic in self._changed | self._stale:
            msg = self._trie.get(topic)
            live = msg is not None and not msg.expired(now)
            value = _dumps(msg.to_json()).encode() if live and msg is not None else None
            records.append((RECORD_PREFIX + topic, value))
        cursor = {"queue": self.QUEUE, "next_offset": self._next_offset, "saved_at_ms": now}
        records.append((CURSOR_KEY, _dumps(cursor).encode()))
        store.append_state(records)
        self._changed.clear()
        self._stale.clear()
        # Tombstones below the covered offset can never be contradicted again.
        self._versions = {
            t: v
            for t, v in self._versions.items()
            if self._trie.get(t) is not None or v >= self._next_offset
        }
        self._dirty = False
        log.debug("retained: snapshot of %d change(s) at offset %d", len(records) - 1, now)

    def _read_records(self, records: Mapping[str, bytes]) -> dict[str, Any] | None:
        """The snapshot held in state records, in the form of the old file; None when there
        is none or it is unusable (then every record of it is deleted by the next one)."""
        raw = records.get(CURSOR_KEY)
        if raw is None:
            return None
        try:
            cursor = json.loads(raw)
            next_offset = int(cursor["next_offset"])
            messages = []
            for key, value in records.items():
                if key.startswith(RECORD_PREFIX):
                    messages.append(json.loads(value))
                    RetainedMessage.from_json(messages[-1])
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            log.error("retained: ignoring an unusable snapshot (%s); replaying the log", exc)
            self._stale.update(k[len(RECORD_PREFIX) :] for k in records if k != CURSOR_KEY)
            return None
        return {"next_offset": next_offset, "messages": messages}

    def _read_snapshot(self) -> dict[str, Any] | None:
        store = self._store
        assert store is not None
        path = f"config/{SNAPSHOT_NAME}"
        raw = store.read_config(SNAPSHOT_NAME)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"unsupported version {doc.get('version')!r}")
            int(doc["next_offset"])
            if not isinstance(doc["messages"], list):
                raise ValueError("messages is not a list")
            for item in doc["messages"]:
                RetainedMessage.from_json(item)
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            # write_config is atomic, so this is damage or a foreign file: replay everything
            # the log still has instead of serving a wrong view.
            log.error("retained: ignoring unusable snapshot %s (%s); replaying the log", path, exc)
            return None
        return doc
