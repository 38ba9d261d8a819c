"""Consumer offsets: ``(group, queue) -> next offset to consume``, persisted atomically.

File ``config/consumer_offsets.json`` (UTF-8 JSON, replaced atomically)::

    {"version": 1, "offsets": {"<group>": {"<queue>": <offset>, ...}, ...}}

Analytics may read it with :func:`read_offsets_file`. Thread-safe (one lock).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Final

from store.atomicfile import write_atomic
from store.errors import CorruptStoreError

OFFSETS_FILE: Final = "consumer_offsets.json"
OFFSETS_VERSION: Final = 1


def read_offsets_file(path: Path) -> dict[tuple[str, str], int]:
    """Parse a consumer-offsets file; a missing file is empty, a damaged one an error."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(raw)
        out: dict[tuple[str, str], int] = {}
        for group, queues in doc["offsets"].items():
            for queue, off in queues.items():
                if not isinstance(off, int) or isinstance(off, bool) or off < 0:
                    raise ValueError(f"bad offset {off!r}")
                out[(str(group), str(queue))] = off
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptStoreError(str(path), f"unreadable consumer offsets: {e}") from e


def encode_offsets(offsets: dict[tuple[str, str], int]) -> bytes:
    doc: dict[str, dict[str, int]] = {}
    for (group, queue), off in sorted(offsets.items()):
        doc.setdefault(group, {})[queue] = off
    return json.dumps({"version": OFFSETS_VERSION, "offsets": doc}, indent=1).encode()


class ConsumerOffsets:
    """In-memory table, written on :meth:`persist` (the store calls it on flush and close)."""

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self._lock = threading.Lock()
        self._offsets = read_offsets_file(path)
        # Positions that need not survive a restart (a gateway's clean sessions, which end with
        # their connection): kept for get()/all() but never written, so that 10,000 devices'
        # command subscriptions do not make every flush re-encode 10,000 entries.
        self._volatile: dict[tuple[str, str], int] = {}
        self._dirty = False

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None:
        """Set the position; ``durable=False``: in memory only (unless already durable)."""
        if offset < 0:
            raise ValueError("offset must be >= 0")
        key = (group, queue)
        with self._lock:
            if not durable and key not in self._offsets:
                self._volatile[key] = offset
                return
            if self._offsets.get(key) != offset:
                self._offsets[key] = offset
                self._dirty = True
            if self._volatile:
                self._volatile.pop(key, None)

    def get(self, group: str, queue: str) -> int | None:
        key = (group, queue)
        with self._lock:
            found = self._offsets.get(key)
            return self._volatile.get(key) if found is None else found

    def remove(self, group: str, queue: str) -> None:
        with self._lock:
            self._volatile.pop((group, queue), None)
            if self._offsets.pop((group, queue), None) is not None:
                self._dirty = True

    def all(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return {**self._volatile, **self._offsets}

    def persist(self) -> bool:
        """Write the table if it changed; returns whether it wrote."""
        if self.read_only:
            return False
        with self._lock:
            if not self._dirty:
                return False
            # Encoded outside the lock: commit() is called from the event loop.
            snapshot = dict(self._offsets)
            self._dirty = False
        data = encode_offsets(snapshot)
        try:
            write_atomic(self.path, data)
        except BaseException:
            with self._lock:
                self._dirty = True
            raise
        return True
