"""The state log: a compacted key/value log for the durable state of the store's users.

The gateway keeps its sessions (with their subscriptions and wills) here, one record per key;
the newest record of a key wins and a DELETE record (tombstone) removes it, as Kafka keeps
consumer offsets in a compacted topic. It lives in its own directory, ``<data_dir>/state/``,
apart from the message CommitLog, so CommitLog retention never deletes state.

Files (generation numbers increase; every name is 20 decimal digits plus a suffix)::

    state/
      00000000000000000007.snapshot   every live record of the generations < 7
      00000000000000000007.log        records appended since, in order
      00000000000000000008.log        (a new generation starts at each open and compaction)
      00000000000000000009.snapshot.tmp   a compaction being written (deleted at open)

State = the newest ``.snapshot`` (if any), then every ``.log`` of a generation >= its own,
applied in order. Files older than the newest snapshot are leftovers of a compaction that
crashed after its rename; open() deletes them.

Every file starts with the 8-byte magic ``STATE_MAGIC``, then records::

    0       4       8      9       11            11+klen
    +-------+-------+------+-------+-------------+------------------+
    | crc32 | size  | kind | klen  | key (UTF-8) | value            |
    +-------+-------+------+-------+-------------+------------------+
      u32     u32     u8     u16                   size - 3 - klen bytes
    (big-endian; size = bytes after the size field; crc32 = zlib.crc32 of size..value)

    kind 1 = PUT: the key's value is now `value` (opaque to the store)
    kind 2 = DELETE: the key is gone (`value` empty)

A clean close leaves ``CLEAN`` ("<last log's name> <size>"): open() then skips scanning that
log for a torn tail (the reader validates every record anyway); open() deletes it.

Writes: ``append(records)`` encodes a batch and writes it with one ``os.write`` (a process
crash loses nothing written); ``sync(position)`` fsyncs, and concurrent callers share one
fsync (group commit). Recovery: a record cut short or failing its CRC at the end of the last
``.log`` is a torn write of a crash: the file is truncated there. Damage anywhere else raises
CorruptStoreError (those files were fsynced before the next one started).

Compaction (``compact()``, blocking, run it in a thread): roll to a new generation G, read
the snapshot and logs below G twice (the index of each key's newest record, then those
records: memory for the keys only), write ``G.snapshot.tmp``, fsync, rename to
``G.snapshot`` (the atomic step), fsync the directory, delete the files below G. A crash
before the rename leaves the old files authoritative. ``needs_compaction()`` says when the
logs since the snapshot outweigh it, which bounds recovery to about twice the live state.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from store.errors import CorruptStoreError, ReadOnlyStoreError, StoreClosedError
from store.segment import fsync_dir

STATE_DIR: Final = "state"
STATE_MAGIC: Final = b"LMQSTAT1"
LOG_SUFFIX: Final = ".log"
SNAPSHOT_SUFFIX: Final = ".snapshot"
TMP_SUFFIX: Final = ".tmp"
#: Written by a clean close: "<last log's name> <its size>"; open() trusts that log unread.
CLEAN_FILE: Final = "CLEAN"
KIND_PUT: Final = 1
KIND_DELETE: Final = 2
_HEAD = struct.Struct(">IIBH")  # crc32, size, kind, klen
HEAD_SIZE: Final = _HEAD.size  # 11
_SIZE_AND_REST = struct.Struct(">IBH")  # what the CRC covers starts at size
MAX_KEY_BYTES: Final = 0xFFFF
#: Compact when the logs since the snapshot exceed both this and the snapshot's size.
COMPACT_MIN_BYTES: Final = 64 * 1024 * 1024
#: ... or when this many logs accumulated (one per open).
COMPACT_MAX_LOGS: Final = 16
_READ_CHUNK = 4 * 1024 * 1024

#: One change: (key, value) puts, (key, None) deletes.
StateRecord = tuple[str, bytes | None]


def encode_record(key: str, value: bytes | None) -> bytes:
    k = key.encode()
    if len(k) > MAX_KEY_BYTES:
        raise ValueError(f"state key of {len(k)} bytes exceeds {MAX_KEY_BYTES}")
    if value is None:
        body = _SIZE_AND_REST.pack(3 + len(k), KIND_DELETE, len(k)) + k
    else:
        body = _SIZE_AND_REST.pack(3 + len(k) + len(value), KIND_PUT, len(k)) + k + value
    return struct.pack(">I", zlib.crc32(body)) + body


def _name(generation: int, suffix: str) -> str:
    return f"{generation:020d}{suffix}"


def _files(directory: Path) -> tuple[int | None, list[tuple[int, Path]]]:
    """(generation of the newest snapshot, logs of that generation or later, oldest first)."""
    snaps: list[int] = []
    logs: list[tuple[int, Path]] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return None, []
    for e in entries:
        stem, _dot, suffix = e.name.partition(".")
        if not stem.isdigit() or len(stem) != 20:
            continue
        if "." + suffix == SNAPSHOT_SUFFIX:
            snaps.append(int(stem))
        elif "." + suffix == LOG_SUFFIX:
            logs.append((int(stem), Path(e.path)))
    snap = max(snaps) if snaps else None
    logs.sort()
    if snap is not None:
        logs = [(g, p) for g, p in logs if g >= snap]
    return snap, logs


def _scan(path: Path, *, tail_ok: bool) -> Iterator[tuple[int, StateRecord]]:
    """(end position, record) of every whole record of one file. A bad record ends the scan
    when `tail_ok` (the caller truncates there), else raises CorruptStoreError."""
    with open(path, "rb", buffering=0) as f:
        magic = f.read(len(STATE_MAGIC))
        if magic != STATE_MAGIC:
            if tail_ok and STATE_MAGIC.startswith(magic):
                return  # created, header not yet (fully) written
            raise CorruptStoreError(str(path), "not a state log file (bad magic)")
        pos = len(STATE_MAGIC)
        data = b""
        i = 0
        eof = False

        def fill(need: int) -> None:
            # Keep the unread part and read on until `need` bytes are buffered (or EOF).
            nonlocal data, i, eof
            parts = [data[i:]]
            have = len(parts[0])
            while have < need and not eof:
                chunk = f.read(max(_READ_CHUNK, need - have))
                if not chunk:
                    eof = True
                    break
                parts.append(chunk)
                have += len(chunk)
            data = b"".join(parts)
            i = 0

        while True:
            if len(data) - i < HEAD_SIZE:
                fill(HEAD_SIZE)
                if len(data) - i < HEAD_SIZE:
                    if len(data) - i and not tail_ok:
                        raise CorruptStoreError(str(path), f"record cut short at {pos}")
                    return
            crc, size, kind, klen = _HEAD.unpack_from(data, i)
            if len(data) - i < 8 + size:
                fill(8 + size)
            end = i + 8 + size
            if (
                end > len(data)
                or size < 3 + klen
                or kind not in (KIND_PUT, KIND_DELETE)
                or zlib.crc32(memoryview(data)[i + 4 : end]) != crc
            ):
                if tail_ok:
                    return
                raise CorruptStoreError(str(path), f"bad record at {pos}")
            key = data[i + HEAD_SIZE : i + HEAD_SIZE + klen].decode()
            value = data[i + HEAD_SIZE + klen : end] if kind == KIND_PUT else None
            pos += end - i
            i = end
            yield pos, (key, value)


def read_state_records(directory: Path) -> Iterator[StateRecord]:
    """Every record of the state log in `directory`, oldest first (the snapshot's, then the
    logs'); the last of a key wins. Read-only and safe while a writer appends: a partly
    written tail record ends the read. The one reader of the files, for every user."""
    snap, logs = _files(directory)
    if snap is not None:
        for _, rec in _scan(directory / _name(snap, SNAPSHOT_SUFFIX), tail_ok=False):
            yield rec
    for n, (_, path) in enumerate(logs):
        for _, rec in _scan(path, tail_ok=n == len(logs) - 1):
            yield rec


def has_state_log(directory: Path) -> bool:
    """Whether `directory` holds a state log (a snapshot or a log file), even an empty one."""
    snap, logs = _files(directory)
    return snap is not None or bool(logs)


def read_state(directory: Path, prefix: str = "") -> dict[str, bytes]:
    """The live state: key -> newest value (deleted keys absent). With `prefix`, only the
    keys that start with it, the prefix cut off (one kind of record)."""
    return fold_records(read_state_records(directory), prefix)


def fold_records(records: Iterable[StateRecord], prefix: str = "") -> dict[str, bytes]:
    """Newest value per key of a record stream (see read_state)."""
    state: dict[str, bytes] = {}
    n = len(prefix)
    for key, value in records:
        if not key.startswith(prefix):
            continue
        if value is None:
            state.pop(key[n:], None)
        else:
            state[key[n:]] = value
    return state


class StateLog:
    """The writer (one per directory: the store's lock covers it). Thread-safe."""

    def __init__(self, directory: Path, *, read_only: bool = False) -> None:
        self.directory = directory
        self.read_only = read_only
        self._lock = threading.Lock()  # file switch and the written counter
        self._sync_lock = threading.Lock()  # one fsync at a time: the others ride on it
        self._compact_lock = threading.Lock()
        self._fd: int | None = None
        self._generation = 0
        self._written = 0  # bytes appended by this process (positions for sync)
        self._synced = 0
        self.fsyncs = 0  # fsyncs sync() made (group commit: fewer than its callers)
        self._snapshot_bytes = 0
        self._log_bytes = 0  # in the logs since the snapshot
        self._logs = 0
        self._closed = False
        self.recovered_records = 0
        self.truncated_bytes = 0  # torn tail cut at open

    @classmethod
    def open(cls, directory: Path, *, read_only: bool = False) -> StateLog:
        """Recover `directory` (created if missing) and start a new generation for appends."""
        log = cls(directory, read_only=read_only)
        if not read_only:
            directory.mkdir(parents=True, exist_ok=True)
            log._recover()
        return log

    def _recover(self) -> None:
        d = self.directory
        for p in d.glob("*" + TMP_SUFFIX):
            p.unlink()  # a compaction cut short: the files it read are still authoritative
        snap, logs = _files(d)
        keep = {_name(snap, SNAPSHOT_SUFFIX)} if snap is not None else set()
        keep.update(p.name for _, p in logs)
        for p in d.iterdir():
            if p.name not in keep and p.name[:20].isdigit():
                p.unlink()  # superseded by the newest snapshot (its compaction crashed)
        if snap is not None:
            self._snapshot_bytes = (d / _name(snap, SNAPSHOT_SUFFIX)).stat().st_size
        # A clean close vouches for its last log: no scan of it (a restart reads it anyway).
        clean: tuple[str, int] | None = None
        try:
            name, size_text = (d / CLEAN_FILE).read_text().split()
            clean = (name, int(size_text))
            (d / CLEAN_FILE).unlink()
        except (FileNotFoundError, ValueError):
            pass
        last = snap if snap is not None else -1
        for n, (gen, path) in enumerate(logs):
            end = len(STATE_MAGIC)
            tail = n == len(logs) - 1
            size = path.stat().st_size
            last = gen
            if not tail or clean == (path.name, size):
                # Sealed logs were fsynced whole before the next one started.
                self._log_bytes += size
                continue
            for pos, _ in _scan(path, tail_ok=tail):
                self.recovered_records += 1
                end = pos
            size = path.stat().st_size
            if tail and size > end:
                self.truncated_bytes = size - end
                with open(path, "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
            self._log_bytes += min(size, end)
        self._logs = len(logs)
        self._open_generation(last + 1)

    def _open_generation(self, generation: int) -> None:
        """Start `generation`'s log (the caller holds the lock or is single-threaded)."""
        path = self.directory / _name(generation, LOG_SUFFIX)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, STATE_MAGIC)
        os.fsync(fd)
        fsync_dir(self.directory)
        self._fd = fd
        self._generation = generation
        self._logs += 1

    # -- writes -------------------------------------------------------------------------------

    def append(self, records: Iterable[StateRecord]) -> int:
        """Append a batch with one write; returns the position to pass to sync()."""
        data = b"".join(encode_record(k, v) for k, v in records)
        with self._lock:
            if self._closed or self._fd is None:
                raise (
                    ReadOnlyStoreError("state log is read-only")
                    if self.read_only
                    else (StoreClosedError("state log is closed"))
                )
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            self._written += len(data)
            self._log_bytes += len(data)
            return self._written

    @property
    def written(self) -> int:
        return self._written

    @property
    def synced(self) -> int:
        return self._synced

    def sync(self, position: int | None = None) -> None:
        """Return once everything appended up to `position` (default: now) is on disk."""
        target = self._written if position is None else position
        if self._synced >= target:
            return
        with self._sync_lock:
            if self._synced >= target:
                return  # an fsync that started after our append covered it
            with self._lock:
                fd = self._fd
                upto = self._written
            if fd is not None:
                os.fsync(fd)
                self.fsyncs += 1
            self._synced = max(self._synced, upto)

    # -- compaction ---------------------------------------------------------------------------

    def needs_compaction(self) -> bool:
        return self._log_bytes > max(COMPACT_MIN_BYTES, self._snapshot_bytes) or (
            self._logs > COMPACT_MAX_LOGS
        )

    def compact(self) -> None:
        """Rewrite the live state as a snapshot and drop the files it covers (blocking)."""
        with self._compact_lock:
            # The sync lock first (the order sync() takes them in): no fsync of a closed fd.
            with self._sync_lock, self._lock:
                if self._closed or self._fd is None:
                    return
                old_fd = self._fd
                os.fsync(old_fd)
                self._synced = max(self._synced, self._written)
                os.close(old_fd)
                self._fd = None
                generation = self._generation + 1
                self._logs = 0
                self._open_generation(generation)
                log_bytes_before = self._log_bytes
                self._log_bytes = 0
            d = self.directory
            snap, logs = _files(d)
            covered = [d / _name(snap, SNAPSHOT_SUFFIX)] if snap is not None else []
            covered += [p for g, p in logs if g < generation]
            try:
                # Two passes, so only the keys are held, not every value: the index of each
                # key's newest record, then the records that are their key's newest (puts).
                newest: dict[str, int] = {}
                for i, (key, _) in enumerate(read_state_records_of(covered)):
                    newest[key] = i
                live = (
                    (key, value)
                    for i, (key, value) in enumerate(read_state_records_of(covered))
                    if value is not None and newest[key] == i
                )
                tmp = d / (_name(generation, SNAPSHOT_SUFFIX) + TMP_SUFFIX)
                size = self._write_file(tmp, live)
                del newest
            except BaseException:
                with self._lock:
                    self._log_bytes += log_bytes_before
                raise
            os.replace(tmp, d / _name(generation, SNAPSHOT_SUFFIX))
            fsync_dir(d)
            for p in covered:
                p.unlink(missing_ok=True)
            fsync_dir(d)
            self._snapshot_bytes = size

    @staticmethod
    def _write_file(path: Path, records: Iterable[tuple[str, bytes]]) -> int:
        with open(path, "wb", buffering=_READ_CHUNK) as f:
            f.write(STATE_MAGIC)
            size = len(STATE_MAGIC)
            for key, value in records:
                rec = encode_record(key, value)
                f.write(rec)
                size += len(rec)
            f.flush()
            os.fsync(f.fileno())
        return size

    def close(self) -> None:
        with self._sync_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            fd, self._fd = self._fd, None
        if fd is not None:
            os.fsync(fd)
            size = os.fstat(fd).st_size
            os.close(fd)
            self._synced = self._written
            path = self.directory / _name(self._generation, LOG_SUFFIX)
            tmp = self.directory / (CLEAN_FILE + TMP_SUFFIX)
            tmp.write_text(f"{path.name} {size}\n")
            os.replace(tmp, self.directory / CLEAN_FILE)
            fsync_dir(self.directory)


def read_state_records_of(paths: Sequence[Path]) -> Iterator[StateRecord]:
    """Records of these files in order (a snapshot first, then sealed logs)."""
    for path in paths:
        for _, rec in _scan(path, tail_ok=False):
            yield rec
