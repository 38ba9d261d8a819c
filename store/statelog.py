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
      00000000000000000009.log.tmp        a generation being started (deleted at open)

State = the newest ``.snapshot`` (if any), then every ``.log`` of a generation >= its own,
applied in order. Files older than the newest snapshot are leftovers of a compaction that
crashed after its rename; open() deletes them.

Every file starts with the 8-byte magic ``STATE_MAGIC``, then records. A generation's log is
written as ``G.log.tmp`` with the magic, fsynced, renamed to ``G.log`` and the directory fsynced
(store/atomicfile.py), so no log appears without its magic; one shorter than the magic (what
a cut could leave when logs were created in place) holds nothing and is deleted at open::

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

The zero tail (``preallocate=True``: the store's state log in sync flush mode, where an fsync
waits for each acknowledgement): the log being appended to is kept allocated
(``posix_fallocate``) at least ``PREALLOCATE_BYTES`` ahead of its appends, so the fsync of
an append does not also commit a new file size (ext4), which made each one cost more system
time. The space past the appends reads as zeros, and a zero head is no record
(``size`` 0 < 3), so to every reader a zero tail is the end of the log::

    | magic | record | record | ... | record | 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 |
                                             ^ appends go here    allocated end ^

The tail is cut off (``ftruncate``, then the fsync) before a log is sealed: at a compaction's
roll, before the next generation starts, and at close, before CLEAN records the size. Only a
crash leaves one, always on the last log, and open() cuts it like a torn tail (a torn record
in front of zeros is a torn tail followed by the zero tail: ``truncated_bytes`` counts the
torn part, ``zero_tail_bytes`` the zeros). Zeros in a sealed log are damage.

Writes: ``append(records)`` encodes a batch and writes it with one ``os.pwrite`` (a process
crash loses nothing written); ``sync(position)`` fsyncs, and concurrent callers share one
fsync (group commit). Recovery: a record cut short or failing its CRC at the end of the last
``.log`` is a torn write of a crash: the file is truncated there. Damage anywhere else raises
CorruptStoreError (those files were fsynced before the next one started).

Compaction (``compact()``, blocking, run it in a thread): roll to a new generation G, read
the snapshot and logs below G twice (the index of each key's newest record, then those
records, copied undecoded: memory for the keys only), write ``G.snapshot.tmp``, fsync,
rename to ``G.snapshot`` (the atomic step), fsync the directory, delete the files below G. A
crash before the rename leaves the old files authoritative. ``needs_compaction()`` says when the
logs since the snapshot outweigh it, which bounds recovery to about twice the live state.
``compact(child=True)`` has a child process write ``G.snapshot.tmp`` (the reads and the
writes, all of the compaction's CPU) and does the rest: a process serving an event loop
compacts without its threads taking turns for the GIL with the loop.

An in-process compaction never holds the GIL long, so the process's event loop keeps its
pace: its Python loops are interrupted by the switch interval anyway, but one C call over
the whole index is not (growing a dict of a million keys copies it whole; freeing it frees a
million strings). So the index is split in INDEX_SHARDS dicts by the key's hash (each grows
and is freed in small steps), and every COMPACT_STEP records the compaction calls its `step`
hook, which by default gives the GIL away (``time.sleep(0)``) to whichever thread waits.
Short holds still cost a loop that takes the GIL back at every callback (uvloop does) a wait
each, up to the switch interval: that is what ``child=True`` removes.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from store.atomicfile import (
    TMP_SUFFIX,
    create_with_header,
    make_dirs,
    replace_durably,
    unlink_durably,
    write_atomic,
)
from store.errors import CorruptStoreError, ReadOnlyStoreError, StoreClosedError, StoreError

STATE_DIR: Final = "state"
STATE_MAGIC: Final = b"LMQSTAT1"
LOG_SUFFIX: Final = ".log"
SNAPSHOT_SUFFIX: Final = ".snapshot"
#: Written by a clean close: "<last log's name> <its size>"; open() trusts that log unread.
CLEAN_FILE: Final = "CLEAN"
KIND_PUT: Final = 1
KIND_DELETE: Final = 2
_HEAD = struct.Struct(">IIBH")  # crc32, size, kind, klen
HEAD_SIZE: Final = _HEAD.size  # 11
_SIZE_AND_REST = struct.Struct(">IBH")  # what the CRC covers starts at size
MAX_KEY_BYTES: Final = 0xFFFF
#: How far ahead of its appends the current log is allocated (the zero tail, see above).
PREALLOCATE_BYTES: Final = 1024 * 1024
_NO_TAIL: Final = 1 << 62  # `_allocated` without preallocation: no append reaches it
#: Compact when the logs since the snapshot exceed both this and the snapshot's size.
COMPACT_MIN_BYTES: Final = 64 * 1024 * 1024
#: ... or when this many logs accumulated (one per open).
COMPACT_MAX_LOGS: Final = 16
_READ_CHUNK = 4 * 1024 * 1024
#: Compaction: the key index in this many dicts (by hash), and a `step` call every this many
#: records read (see the module docstring).
INDEX_SHARDS: Final = 256
COMPACT_STEP: Final = 2000

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


def give_way() -> None:
    """Release the GIL for a moment: a thread waiting for it (the event loop) runs now."""
    time.sleep(0)


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
    """(end position, record) of every whole record of one file (_frames, decoded)."""
    for pos, data, start, end, kind, klen in _frames(path, tail_ok=tail_ok):
        k = start + HEAD_SIZE + klen
        yield pos, (data[start + HEAD_SIZE : k].decode(), data[k:end] if kind == KIND_PUT else None)


#: One whole record of a file as _frames finds it: (its end position in the file, a buffer,
#: start, end, kind, key length). The record is buffer[start:end], CRC checked; its key is
#: the klen bytes after the head, its value (a put's) the rest.
_Frame = tuple[int, bytes, int, int, int, int]


def _frames(path: Path, *, tail_ok: bool) -> Iterator[_Frame]:
    """Every whole record of one file, undecoded. A bad record ends the scan when `tail_ok`
    (the caller truncates there), else raises CorruptStoreError. A log shorter than its
    header is empty, wherever it is (see _is_unwritten)."""
    with open(path, "rb", buffering=0) as f:
        magic = f.read(len(STATE_MAGIC))
        if magic != STATE_MAGIC:
            if (tail_ok or path.name.endswith(LOG_SUFFIX)) and _is_unwritten(magic):
                return
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
            pos += end - i
            start, i = i, end
            yield pos, data, start, end, kind, klen


def _is_unwritten(head: bytes) -> bool:
    """Whether a file's first bytes are those of a log created but not yet durably started:
    shorter than the magic, and a prefix of it or zeros (size extended, data not written). A
    cut leaves one where a log was created in place (the create durable, the magic not: how
    older versions started a generation); it never held a record, so it reads as empty."""
    return len(head) < len(STATE_MAGIC) and (STATE_MAGIC.startswith(head) or not head.strip(b"\0"))


def _nonzero_extent(path: Path, start: int, end: int) -> int:
    """How many bytes of `path` from `start` reach up to the last non-zero byte before `end`
    (what a crash left past the last whole record, without the zero tail behind it)."""
    extent = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        pos = start
        while pos < end:
            chunk = f.read(min(_READ_CHUNK, end - pos))
            if not chunk:
                break
            kept = len(chunk.rstrip(b"\0"))
            if kept:
                extent = pos + kept - start
            pos += len(chunk)
    return extent


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

    def __init__(
        self, directory: Path, *, read_only: bool = False, preallocate: bool = False
    ) -> None:
        self.directory = directory
        self.read_only = read_only
        self._ahead = PREALLOCATE_BYTES if preallocate else 0  # the zero tail's length
        self._lock = threading.Lock()  # file switch and the written counter
        self._sync_lock = threading.Lock()  # one fsync at a time: the others ride on it
        self._compact_lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None  # a compaction's snapshot child
        self._fd: int | None = None
        self._generation = 0
        self._end = 0  # the current log's end of appends (its size but for the zero tail)
        self._allocated = 0  # where its zero tail ends (the next preallocation's start)
        self._written = 0  # bytes appended by this process (positions for sync)
        self._synced = 0
        self.fsyncs = 0  # fsyncs sync() made (group commit: fewer than its callers)
        self._snapshot_bytes = 0
        self._log_bytes = 0  # in the logs since the snapshot
        self._logs = 0
        self._closed = False
        self.recovered_records = 0
        self.truncated_bytes = 0  # torn tail cut at open
        self.zero_tail_bytes = 0  # zero tail (of a crash) cut at open

    @classmethod
    def open(
        cls, directory: Path, *, read_only: bool = False, preallocate: bool = False
    ) -> StateLog:
        """Recover `directory` (created if missing) and start a new generation for appends;
        with `preallocate`, keep a zero tail ahead of them (see the module docstring)."""
        log = cls(directory, read_only=read_only, preallocate=preallocate)
        if not read_only:
            make_dirs(directory)
            log._recover()
        return log

    def _recover(self) -> None:
        d = self.directory
        # A compaction or a generation's start cut short (their files are not in use yet),
        # and files the newest snapshot supersedes (its compaction was cut before deleting
        # them). Gone durably before anything new is written: none may come back.
        snap, logs = _files(d)
        keep = {_name(snap, SNAPSHOT_SUFFIX)} if snap is not None else set()
        keep.update(p.name for _, p in logs)
        unlink_durably(
            [
                p
                for p in d.iterdir()
                if p.name.endswith(TMP_SUFFIX) or (p.name not in keep and p.name[:20].isdigit())
            ]
        )
        if snap is not None:
            self._snapshot_bytes = (d / _name(snap, SNAPSHOT_SUFFIX)).stat().st_size
        # A clean close vouches for its last log: no scan of it (a restart reads it anyway).
        clean: tuple[str, int] | None = None
        try:
            name, size_text = (d / CLEAN_FILE).read_text().split()
            clean = (name, int(size_text))
        except (FileNotFoundError, ValueError):
            pass
        # Gone before this run appends: a CLEAN that came back would vouch for a log unread.
        unlink_durably([d / CLEAN_FILE])
        last = max([snap if snap is not None else -1, *(g for g, _ in logs)])
        # Logs never started (shorter than the magic, see _is_unwritten) hold nothing: gone.
        short = [p for _, p in logs if p.stat().st_size < len(STATE_MAGIC)]
        unlink_durably(short)
        logs = [(g, p) for g, p in logs if p not in short]
        for n, (_gen, path) in enumerate(logs):
            end = len(STATE_MAGIC)
            tail = n == len(logs) - 1
            size = path.stat().st_size
            if not tail or clean == (path.name, size):
                # Sealed logs were fsynced whole before the next one started.
                self._log_bytes += size
                continue
            for pos, _ in _scan(path, tail_ok=tail):
                self.recovered_records += 1
                end = pos
            size = path.stat().st_size
            if tail and size > end:
                torn = _nonzero_extent(path, end, size)
                self.truncated_bytes = torn
                self.zero_tail_bytes = size - end - torn
                with open(path, "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
            self._log_bytes += min(size, end)
        self._logs = len(logs)
        self._open_generation(last + 1)

    def _open_generation(self, generation: int) -> None:
        """Start `generation`'s log (the caller holds the lock or is single-threaded): it
        appears under its name with its magic, durably, or not at all."""
        fd = create_with_header(self.directory / _name(generation, LOG_SUFFIX), STATE_MAGIC)
        self._fd = fd
        self._generation = generation
        self._logs += 1
        self._end = self._allocated = len(STATE_MAGIC)
        if self._ahead:
            self._preallocate(fd, self._end)
        else:
            self._allocated = _NO_TAIL

    def _preallocate(self, fd: int, need: int) -> None:
        """Extend the zero tail to PREALLOCATE_BYTES past `need` (the caller holds the lock
        or is single-threaded). Where the file system cannot (full, or no fallocate), the
        appends grow the file as they would without: only the next chunk tries again."""
        start, self._allocated = self._allocated, need + self._ahead
        try:
            os.posix_fallocate(fd, start, self._allocated - start)
        except OSError:
            pass

    def _cut_zero_tail(self, fd: int) -> None:
        """Before the current log is sealed (the caller holds the lock): the file ends at
        its last append again."""
        if self._ahead and self._allocated > self._end:
            os.ftruncate(fd, self._end)
            self._allocated = self._end

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
            at = self._end
            end = at + len(data)
            if end > self._allocated:
                self._preallocate(self._fd, end)
            # At the log's own end, not the file position's: after a write that failed half
            # done, the next batch writes over its bytes (what close() keeps ends at _end).
            view = memoryview(data)
            while view:
                n = os.pwrite(self._fd, view, at)
                view = view[n:]
                at += n
            self._end = end
            self._written += len(data)
            self._log_bytes += len(data)
            return self._written

    @property
    def written(self) -> int:
        return self._written

    @property
    def synced(self) -> int:
        return self._synced

    @property
    def generation(self) -> int:
        """The generation appends go to (it changes at a compaction's roll)."""
        return self._generation

    def dup_for_sync(self) -> tuple[int, int]:
        """(a duplicate of the current log's descriptor, its generation), taken together
        under the lock, for a thread that fsyncs it (gateway/storage/fsync_thread.py): a
        compaction's roll fsyncs the old log before it closes it, so an fsync of the
        duplicate vouches for every position appended before the roll. The caller owns and
        closes the duplicate."""
        with self._lock:
            if self._closed or self._fd is None:
                raise StoreClosedError("state log is closed")
            return os.dup(self._fd), self._generation

    def note_synced(self, position: int, fsyncs: int) -> None:
        """`fsyncs` fsyncs made outside sync() (an fsync thread) made everything up to
        `position` durable. Unlocked: racing sync()'s own update can only leave `synced`
        lower than it could be (a waiter then waits for one more fsync), never higher."""
        self.fsyncs += fsyncs
        if position > self._synced:
            self._synced = position

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

    def compact(self, step: Callable[[], object] = give_way, *, child: bool = False) -> None:
        """Rewrite the live state as a snapshot and drop the files it covers (blocking).
        `step` is called every COMPACT_STEP records (default: give the GIL away); with
        `child`, a child process writes the snapshot (start_snapshot_child) and this
        thread only waits for it."""
        with self._compact_lock:
            # The sync lock first (the order sync() takes them in): no fsync of a closed fd.
            with self._sync_lock, self._lock:
                if self._closed or self._fd is None:
                    return
                old_fd = self._fd
                self._cut_zero_tail(old_fd)
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
            tmp = d / (_name(generation, SNAPSHOT_SUFFIX) + TMP_SUFFIX)
            try:
                if child:
                    size = self._snapshot_in_child(covered, tmp)
                else:
                    size = write_snapshot(covered, tmp, step)
            except BaseException:
                with self._lock:
                    self._log_bytes += log_bytes_before
                raise
            replace_durably(tmp, d / _name(generation, SNAPSHOT_SUFFIX))
            unlink_durably(covered)
            self._snapshot_bytes = size

    def _snapshot_in_child(self, covered: Sequence[Path], tmp: Path) -> int:
        """write_snapshot in a child process that close() kills (a stop does not wait for a
        background compaction at nice 19)."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("state log is closed")
            child = self._child = start_snapshot_child(covered, tmp)
        try:
            return finish_snapshot_child(child, tmp)
        finally:
            with self._lock:
                self._child = None

    def close(self) -> None:
        with self._sync_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            if self._child is not None:
                self._child.kill()  # its compaction fails; the old files stay authoritative
            fd, self._fd = self._fd, None
            if fd is not None:
                self._cut_zero_tail(fd)
        if fd is not None:
            os.fsync(fd)
            size = os.fstat(fd).st_size
            os.close(fd)
            self._synced = self._written
            path = self.directory / _name(self._generation, LOG_SUFFIX)
            write_atomic(self.directory / CLEAN_FILE, f"{path.name} {size}\n".encode())


def write_snapshot(covered: Sequence[Path], tmp: Path, step: Callable[[], object]) -> int:
    """Every live record of `covered` (a snapshot first, then sealed logs, in order) into
    `tmp`, fsynced; returns its size. Two passes, so only the keys are held, not every value:
    the index of each key's newest record, then the records that are their key's newest
    (puts), copied as they were read: a record's bytes are the same in every file of the log,
    so none is decoded or encoded again. `step` is called every COMPACT_STEP records read and
    per index shard freed."""
    shards: list[dict[bytes, int]] = [{} for _ in range(INDEX_SHARDS)]
    mask = INDEX_SHARDS - 1
    for n, (_, data, start, _end, _kind, klen) in enumerate(_frames_of(covered)):
        key = data[start + HEAD_SIZE : start + HEAD_SIZE + klen]
        shards[hash(key) & mask][key] = n
        if n % COMPACT_STEP == 0:
            step()

    def live() -> Iterator[bytes]:
        for n, (_, data, start, end, kind, klen) in enumerate(_frames_of(covered)):
            if n % COMPACT_STEP == 0:
                step()
            if kind == KIND_PUT:
                key = data[start + HEAD_SIZE : start + HEAD_SIZE + klen]
                if shards[hash(key) & mask][key] == n:
                    yield data[start:end]

    size = _write_file(tmp, live())
    while shards:
        shards.pop()  # one small dict freed at a time
        step()
    return size


def _write_file(path: Path, records: Iterable[bytes]) -> int:
    """A state file of `records` (encoded), fsynced; its size."""
    with open(path, "wb", buffering=_READ_CHUNK) as f:
        f.write(STATE_MAGIC)
        size = len(STATE_MAGIC)
        for rec in records:
            f.write(rec)
            size += len(rec)
        f.flush()
        os.fsync(f.fileno())
    return size


class _ParentWatch:
    """The `step` of a child writing a snapshot: it has no event loop to give way to, and it
    ends (exit 1, the .tmp left to the next open) once its parent is gone (a gateway killed
    mid-compaction leaves no orphan reading its files and burning CPU)."""

    def __init__(self, parent: int) -> None:
        self.parent = parent

    def __call__(self) -> None:
        if os.getppid() != self.parent:
            os._exit(1)


#: The child's program: its arguments are the parent's pid, the snapshot's temporary path,
#: then `covered`.
_CHILD_PROGRAM: Final = (
    "import sys; from store.statelog import snapshot_main; snapshot_main(sys.argv[1:])"
)


def start_snapshot_child(covered: Sequence[Path], tmp: Path) -> subprocess.Popen[bytes]:
    """Start write_snapshot in a child process (finish_snapshot_child waits for it), so the
    reading, decoding and encoding of every record run beside this process's threads instead
    of taking turns with them for the GIL (an event loop waits for the GIL at each callback
    while a thread of its own process compacts). The files it reads are sealed and the
    snapshot is only made live by the caller's rename, so a child that dies leaves the old
    files authoritative, as a crash does."""
    root = str(Path(__file__).resolve().parent.parent)  # where `store` is importable from
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD_PROGRAM, str(os.getpid()), str(tmp)]
        + [str(p) for p in covered],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish_snapshot_child(child: subprocess.Popen[bytes], tmp: Path) -> int:
    """Wait for a snapshot child; the snapshot's size, or StoreError (its .tmp removed) when
    the child failed or was killed."""
    # Its one pipe, read to the end, then the wait: what communicate() does (whose stub types
    # the stdout it returns as bytes: None here, which a compiled build would refuse).
    assert child.stderr is not None
    err = child.stderr.read()
    child.wait()
    if child.returncode != 0:
        tmp.unlink(missing_ok=True)
        reason = err.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise StoreError(f"state snapshot child exited {child.returncode}: {reason[0]}")
    return tmp.stat().st_size


def snapshot_main(argv: Sequence[str]) -> None:
    """The child of start_snapshot_child: `argv` = [parent pid, tmp, *covered].
    Background work at the lowest priority (batch scheduling, nice 19, out of a real-time
    class its parent may run in): it takes the CPU the event loop leaves, not the loop's
    share of a busy host; only the next compaction and a stop wait for it."""
    if hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass
    os.nice(19)
    write_snapshot([Path(p) for p in argv[2:]], Path(argv[1]), _ParentWatch(int(argv[0])))


def read_state_records_of(paths: Sequence[Path]) -> Iterator[StateRecord]:
    """Records of these files in order (a snapshot first, then sealed logs)."""
    for path in paths:
        for _, rec in _scan(path, tail_ok=False):
            yield rec


def _frames_of(paths: Sequence[Path]) -> Iterator[_Frame]:
    """read_state_records_of, undecoded (_frames)."""
    for path in paths:
        yield from _frames(path, tail_ok=False)
