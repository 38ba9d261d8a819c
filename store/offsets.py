"""Consumer offsets: ``(group, queue) -> next offset to consume``, kept in a compacted log.

Directory ``offsets/`` of the data dir: a state log (store/statelog.py) of its own, one
record per (group, queue), so a commit costs one small append however many there are::

    key    <group> \\x00 <queue>          (UTF-8; neither may contain NUL)
    value  u64 big-endian next offset     (a DELETE record: the offset was removed)

:meth:`ConsumerOffsets.persist` (the store calls it on every full flush and at close) appends
the entries changed since the last call, with one write and one fsync, and compacts the log in
a background thread when its history outweighs the live table.

Earlier versions rewrote ``config/consumer_offsets.json`` whole (UTF-8 JSON)::

    {"version": 1, "offsets": {"<group>": {"<queue>": <offset>, ...}, ...}}

It is imported once (its entries under the log's, then renamed ``consumer_offsets.json.imported``).
Readers (inspect, analytics): :func:`read_committed_offsets`. Thread-safe (one lock).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Final

from store.atomicfile import replace_durably
from store.errors import CorruptStoreError
from store.statelog import LOG_SUFFIX, SNAPSHOT_SUFFIX, StateLog, StateRecord, read_state

log = logging.getLogger("lmqtt.store")

OFFSETS_FILE: Final = "consumer_offsets.json"
OFFSETS_VERSION: Final = 1
OFFSETS_DIR: Final = "offsets"
_SEP: Final = "\x00"
_VALUE = struct.Struct(">Q")


def read_offsets_file(path: Path) -> dict[tuple[str, str], int]:
    """Parse a consumer-offsets JSON file (older versions); missing is empty, damaged an error."""
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


def _has_log(directory: Path) -> bool:
    try:
        return any(n.endswith((LOG_SUFFIX, SNAPSHOT_SUFFIX)) for n in os.listdir(directory))
    except FileNotFoundError:
        return False


def read_offsets_log(directory: Path) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for key, value in read_state(directory).items():
        group, sep, queue = key.partition(_SEP)
        if not sep or len(value) != _VALUE.size:
            raise CorruptStoreError(str(directory), f"bad consumer offset record {key!r}")
        out[(group, queue)] = _VALUE.unpack(value)[0]
    return out


def read_committed_offsets(data_dir: Path) -> dict[tuple[str, str], int]:
    """Every committed offset of a data directory (the log, else an older version's JSON)."""
    directory = Path(data_dir) / OFFSETS_DIR
    if _has_log(directory):
        return read_offsets_log(directory)
    return read_offsets_file(Path(data_dir) / "config" / OFFSETS_FILE)


class ConsumerOffsets:
    """Committed offsets; changes reach the log on :meth:`persist`.

    The table is read from the log on the first read (get, all), not at open: a gateway with a
    million subscriptions commits offsets but reads its own positions from its sessions, and
    the table would cost it ~260 MB for nothing. Commits are recorded either way.
    """

    def __init__(self, directory: Path, legacy_path: Path, *, read_only: bool = False) -> None:
        self.directory = directory
        self.path = legacy_path
        self.read_only = read_only
        self._lock = threading.Lock()
        self._offsets: dict[tuple[str, str], int] | None = None  # None: not read yet
        self._changed: dict[tuple[str, str], int | None] = {}
        self._log: StateLog | None = None
        self._compaction: threading.Thread | None = None
        self._imported = False
        # Positions that need not survive a restart (a gateway's clean sessions, which end with
        # their connection): kept for get()/all() but never written, so that 10,000 devices'
        # command subscriptions do not each cost a log record per delivery.
        self._unsaved: dict[tuple[str, str], int] = {}

    def load(self) -> None:
        """Open the log (a writable store: after taking its lock, recovering it) and import an
        older version's file, until that import has been persisted (then it is renamed)."""
        if not self.read_only:
            self._log = StateLog.open(self.directory)
        legacy = read_offsets_file(self.path)
        if legacy:
            with self._lock:
                table = self._table()
                if not self.read_only:
                    self._imported = True
                    self._changed = {k: v for k, v in legacy.items() if k not in table}
                self._offsets = legacy | table

    def _table(self) -> dict[tuple[str, str], int]:
        """The table, read on first use: the log, then the changes not yet in it (lock held)."""
        if self._offsets is None:
            table = read_offsets_log(self.directory)
            for key, off in self._changed.items():
                if off is None:
                    table.pop(key, None)
                else:
                    table[key] = off
            self._offsets = table
        return self._offsets

    def commit(self, group: str, queue: str, offset: int, *, durable: bool = True) -> None:
        """Set the position; ``durable=False``: in memory only (unless already durable)."""
        if offset < 0:
            raise ValueError("offset must be >= 0")
        key = (group, queue)
        with self._lock:
            table = self._offsets
            if not durable and key not in self._changed and (table is None or key not in table):
                self._unsaved[key] = offset
                return
            if self._unsaved:
                self._unsaved.pop(key, None)
            if table is not None:
                if table.get(key) == offset:
                    return
                table[key] = offset
            self._changed[key] = offset

    def get(self, group: str, queue: str) -> int | None:
        key = (group, queue)
        with self._lock:
            found = self._table().get(key)
            return self._unsaved.get(key) if found is None else found

    def remove(self, group: str, queue: str) -> None:
        key = (group, queue)
        with self._lock:
            self._unsaved.pop(key, None)
            if self._offsets is not None and self._offsets.pop(key, None) is None:
                return
            self._changed[key] = None

    def all(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return {**self._unsaved, **self._table()}

    def persist(self) -> bool:
        """Append the changed entries and fsync them; returns whether it wrote."""
        if self.read_only or self._log is None:
            return False
        with self._lock:
            changed, self._changed = self._changed, {}
            if changed:
                records: list[StateRecord] = [
                    (g + _SEP + q, None if off is None else _VALUE.pack(off))
                    for (g, q), off in changed.items()
                ]
                try:
                    # Under the lock: a first read then finds them in the log or in _changed.
                    self._log.append(records)
                except BaseException:
                    self._changed = changed | self._changed  # newer changes win
                    raise
        if not changed:
            if self._imported:
                self._imported = False
                replace_durably(self.path, self.path.with_name(self.path.name + ".imported"))
            return False
        self._log.sync()
        if self._imported:
            self._imported = False
            replace_durably(self.path, self.path.with_name(self.path.name + ".imported"))
        if self._log.needs_compaction() and (
            self._compaction is None or not self._compaction.is_alive()
        ):
            # Not in the caller's thread: it is the store's flusher.
            self._compaction = threading.Thread(
                target=self._compact, name="lmqtt-offsets-compaction", daemon=True
            )
            self._compaction.start()
        return True

    def _compact(self) -> None:
        assert self._log is not None
        try:
            self._log.compact()
        except Exception:
            log.exception("compacting the consumer offsets log failed (it keeps growing)")

    def close(self) -> None:
        if self._compaction is not None:
            self._compaction.join()
        if self._log is not None:
            self._log.close()
