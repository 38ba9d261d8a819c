"""QueueCursor: the one way the gateway reads a queue from an offset.

Every path that reads a queue (a session's own subscriptions, a shared group and its cluster
dispatch, a resend after a reconnect, a replay's parent topics, the retained index catching up
with %RETAIN%, the cluster bus tailing %CLUSTER%) reads it here, so the handling of a read's
status (found, nothing yet, deleted by retention, past the end) lives once:

  - the recent cache first (gateway/messages/recent.py RecentMessages: what this gateway just
    appended, decoded once for every reader), the store when the offset is not there;
  - an offset that retention deleted (OFFSET_TOO_SMALL) is read again from the queue's first
    kept offset, and the caller is told where the messages start (`start` > the offset asked);
  - an offset past the queue's end by more than one (OFFSET_OVERFLOW_BADLY: the log lost its
    tail in an async-flush crash) is reported as `start` < the offset asked, with no messages;
  - a single message looked up by offset is the message, GONE (deleted by retention), or None
    (not there yet, or a read the backend completes later).

The cursor holds no position: a subscription's read position is part of the session's state
(persisted with it), a shared group's is the group's. One cursor, over the recent cache,
serves the whole delivery path, which pays one call per read and nothing per message; the
other readers (the retained index, the cluster bus and dispatch, an offline export) make one
over the store alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal

from gateway.storage.port import GetStatus, Storage, StoredMessage

# A recent-messages run: consecutive cached messages of a queue from an offset (empty when the
# first is not cached). RecentMessages.run in gateway/messages/recent.py.
RecentRun = Callable[[str, int, int], list[StoredMessage]]

#: What `QueueCursor.lookup` answers for an offset that retention deleted.
Gone = Literal["gone"]
GONE: Final[Gone] = "gone"

_FOUND = GetStatus.FOUND
_TOO_SMALL = GetStatus.OFFSET_TOO_SMALL
_OVERFLOW_BADLY = GetStatus.OFFSET_OVERFLOW_BADLY


def _nothing_cached(queue: str, offset: int, limit: int) -> list[StoredMessage]:
    return []


class QueueCursor:
    """Reads queues through the recent cache and the storage port (see the module docstring)."""

    __slots__ = ("_get", "_recent", "end")

    def __init__(self, storage: Storage, recent: RecentRun | None = None) -> None:
        # Bound once: the delivery path calls read() per message it is woken for.
        self._get = storage.get
        self._recent = recent if recent is not None else _nothing_cached
        self.end: Callable[[str], int] = storage.max_offset  # the queue's next free offset

    def read(self, queue: str, offset: int, limit: int) -> tuple[list[StoredMessage], int, int]:
        """Up to `limit` consecutive messages of `queue` from `offset`, as
        `(messages, start, next)`: `start` is where they begin (`offset`, or the first kept
        offset when retention deleted `offset`; below `offset`, with no messages, when the
        queue now ends there), `next` the offset after what was looked at (the store may skip
        unreadable units: no messages, `next` > `start`). Nothing new: `([], offset, offset)`.
        """
        messages = self._recent(queue, offset, limit)
        if messages:
            return messages, offset, messages[-1].queue_offset + 1
        got = self._get(queue, offset, limit)
        status = got.status
        if status is _FOUND:
            return got.messages, offset, got.next_offset
        if status is _TOO_SMALL:
            start = got.min_offset
            got = self._get(queue, start, limit)
            if got.status is _FOUND:
                return got.messages, start, got.next_offset
            return [], start, start
        if status is _OVERFLOW_BADLY and got.max_offset < offset:
            return [], got.max_offset, got.max_offset
        return [], offset, offset

    def one(self, queue: str, offset: int) -> StoredMessage | None:
        """The message at `offset` of `queue`, or None (deleted by retention, or never there)."""
        messages = self._recent(queue, offset, 1)
        if messages:
            return messages[0]
        got = self._get(queue, offset, 1)
        if got.status is _FOUND and got.messages:
            return got.messages[0]
        return None

    def lookup(self, queue: str, offset: int) -> StoredMessage | Gone | None:
        """The message at `offset` of `queue`; GONE when retention deleted it; None when the
        queue does not hold it (not yet, or a read the backend completes later)."""
        messages = self._recent(queue, offset, 1)
        if messages:
            return messages[0]
        got = self._get(queue, offset, 1)
        status = got.status
        if status is _FOUND:
            return got.messages[0] if got.messages else None
        return GONE if status is _TOO_SMALL else None
