"""Consume queues: per-queue arrays of 20-byte units pointing into the CommitLog.

A queue's units live in files of ``units_per_file`` units named by their start byte offset
(``consumequeue/<encoded name>/0/<20 digits>``); file k holds units ``[k*upf, (k+1)*upf)``.
Files grow by appending; nothing is preallocated. Units appended by dispatch are buffered in
``ConsumeQueue.pending`` and written by :meth:`ConsumeQueueTable.write_pending` (on flush);
reads see both. Queue states are kept in a bounded LRU: an evicted queue writes its pending
units first and is reloaded from its files when touched again, so memory does not grow with
the number of queues. Not thread-safe: MessageStore calls everything under its lock.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from pathlib import Path

from store.atomicfile import fsync_dir, unlink_durably
from store.filehandles import FileHandles
from store.format import (
    CQ_UNIT,
    CQ_UNIT_SIZE,
    QUEUE_ID,
    decode_queue_dir,
    encode_queue_dir,
    offset_file_name,
    parse_offset_file_name,
)

log = logging.getLogger("lmqtt.store.consumequeue")


class ConsumeQueue:
    """State of one queue: units ``[min_offset, flushed)`` on disk, then ``pending``."""

    __slots__ = ("dir", "dir_ready", "flushed", "max_offset", "min_offset", "name", "pending")

    def __init__(self, name: str, directory: str, min_offset: int, flushed: int) -> None:
        self.name = name
        self.dir = directory  # .../consumequeue/<encoded>/0
        self.min_offset = min_offset
        self.flushed = flushed
        self.max_offset = flushed  # next offset to assign
        self.pending = bytearray()
        #: The directory is known to exist (saves a stat per queue on every flush).
        self.dir_ready = False


def dispatch(queues: Sequence[ConsumeQueue], unit: bytes, dirty: dict[str, ConsumeQueue]) -> None:
    """The dispatch rule: ``unit`` becomes the next unit of every queue in ``queues``.

    A record joins its parent queue and each of its light queues, one 20-byte unit each, at
    the offsets the record carries (QUEUEOFFSET, and for light queues the dispatch offsets
    property of store/format.py): the writer gives it each queue's next offset and dispatches
    in the same critical section; recovery calls this when the recorded offset is the queue's
    next. Units wait in ``pending`` (a queue's first one marks it in ``dirty``, the table's)
    until ConsumeQueueTable.write_pending.
    store/_speedups.c ``dispatch`` is its twin (write_run dispatches with it;
    tests/store/test_speedups.py).
    """
    for cq in queues:
        if not cq.pending:
            dirty[cq.name] = cq
        cq.pending += unit
        cq.max_offset += 1


MAX_ABSENT = 1 << 20  # names ConsumeQueueTable.absent holds at most


class ConsumeQueueTable:
    """All consume queues of a store, loaded on demand."""

    def __init__(
        self,
        root: Path,
        *,
        units_per_file: int,
        max_open_files: int,
        max_cached_queues: int,
        read_only: bool = False,
    ) -> None:
        self.root = root
        self.upf = units_per_file
        self.file_bytes = units_per_file * CQ_UNIT_SIZE
        self.read_only = read_only
        self.files = FileHandles(max_open_files, read_only=read_only)
        self.max_cached = max_cached_queues
        # Insertion-ordered; eviction is FIFO among states without pending units. True LRU
        # bookkeeping (move_to_end on every access) costs more on the put path than the
        # occasional reload of a hot queue it would save.
        self.states: dict[str, ConsumeQueue] = {}
        self.dirty: dict[str, ConsumeQueue] = {}
        #: Queues a writable store looked up and found on no disk: a device fleet's command
        #: queues are read (max_offset) long before anything is dispatched to them, and each
        #: look-up listed a directory. Only this process creates queues (the store's lock), and
        #: get_or_create forgets the name, so the answer stays true. Cleared when it is full.
        self.absent: set[str] = set()
        #: Whether a queue may have a directory, answered without listing it: the hashes of
        #: the directory names under the root when a writable store first looks up a queue it
        #: does not hold (one listing, sorted: 8 bytes a queue), and of every queue it created
        #: since (get_or_create; only this process creates queues). A name in neither has no
        #: directory: a device fleet's new command queues are told so without one failed
        #: directory listing each. A hash collision costs the listing it saved. None: not
        #: listed yet (and always, read-only: a live writer creates queues meanwhile).
        self._listed: array[int] | None = None
        self._created: set[int] = set()
        #: Bumped whenever a state leaves ``states``: holders of ConsumeQueue objects (the
        #: store's route cache) re-resolve them when it changed, so they never append to a
        #: state that was written out and replaced by a fresh copy.
        self.generation = 0
        #: CommitLog's first offset; units below it were removed by retention.
        self.log_min_offset = 0

    # -- paths -------------------------------------------------------------------------------
    def dir_of(self, name: str) -> str:
        return f"{self.root}/{encode_queue_dir(name)}/{QUEUE_ID}"

    def file_of(self, cq: ConsumeQueue, unit: int) -> str:
        return f"{cq.dir}/{offset_file_name(unit // self.upf * self.file_bytes)}"

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, name: str) -> ConsumeQueue | None:
        cq = self.states.get(name)
        if cq is not None:
            return cq
        if name in self.absent:
            return None
        cq = self._load(name) if self._may_exist(name) else None
        if cq is not None:
            self._insert(cq)
        elif not self.read_only:
            if len(self.absent) >= MAX_ABSENT:
                self.absent.clear()
            self.absent.add(name)
        return cq

    def get_or_create(self, name: str) -> ConsumeQueue:
        cq = self.states.get(name)
        if cq is not None:
            return cq
        self.absent.discard(name)
        cq = self._load(name) if self._may_exist(name) else None
        if cq is None:
            cq = ConsumeQueue(name, self.dir_of(name), 0, 0)
            if self._listed is not None:
                self._note_created(hash(encode_queue_dir(name)))
        self._insert(cq)
        return cq

    def _may_exist(self, name: str) -> bool:
        """False: `name` has no directory (see `_listed`); True: it may have one (look)."""
        if self.read_only:
            return True
        listed = self._listed
        if listed is None:
            try:
                entries = os.listdir(self.root)
            except FileNotFoundError:
                entries = []
            listed = self._listed = array("q", sorted(hash(e) for e in entries))
        key = hash(encode_queue_dir(name))
        i = bisect_left(listed, key)
        return (i < len(listed) and listed[i] == key) or key in self._created

    def _note_created(self, key: int) -> None:
        """A queue was created: its hash joins `_created`, merged into the sorted `_listed` once
        it holds a quarter as many (8 bytes a queue rather than a set entry's ~60)."""
        created = self._created
        created.add(key)
        listed = self._listed
        if listed is not None and len(created) >= max(1024, len(listed) // 4):
            self._listed = array("q", sorted([*listed, *created]))
            created.clear()

    def cached(self) -> Iterator[ConsumeQueue]:
        return iter(list(self.states.values()))

    def _insert(self, cq: ConsumeQueue) -> None:
        self.states[cq.name] = cq

    def evict_overflow(self) -> None:
        """Drop least recently used states beyond the bound, writing their pending units.

        Called at the end of a critical section, never in the middle of one, so a state a
        caller still holds is never replaced by a second copy loaded from disk.
        """
        cache = self.states
        excess = len(cache) - self.max_cached
        if excess <= 0:
            return
        # Evict a tenth more than needed so this does not run on every put at the bound.
        excess += self.max_cached // 10
        victims = []
        for name in cache:
            victims.append(name)
            if len(victims) >= excess:
                break
        self.generation += 1
        for name in victims:
            old = cache.pop(name)
            if old.pending:
                self._write(old)
                self.dirty.pop(name, None)

    def _files(self, directory: str) -> list[tuple[int, int]]:
        """``(first unit, size in bytes)`` of the queue's files (:func:`queue_files`), in order."""
        return self._files_or_none(directory) or []

    def _files_or_none(self, directory: str) -> list[tuple[int, int]] | None:
        """_files(); None when the queue has no directory."""
        listed = _queue_files(directory)
        if listed is None:
            return None
        files = []
        for start, size in listed:
            if start % self.file_bytes:
                log.warning("ignoring misplaced file %s/%s", directory, offset_file_name(start))
                continue
            files.append((start // CQ_UNIT_SIZE, size))
        return files

    def _list_files(self, directory: str) -> list[int]:
        return [start for start, _ in self._files(directory)]

    def _load(self, name: str) -> ConsumeQueue | None:
        directory = self.dir_of(name)
        files = self._files_or_none(directory)
        if files is None:
            return None  # never created (a new subscription's queue: the usual case)
        starts = [start for start, _ in files]
        if not starts:
            return None if self.read_only else ConsumeQueue(name, directory, 0, 0)
        # Use the contiguous run of files that ends with the newest one.
        first = len(starts) - 1
        while first > 0 and starts[first - 1] == starts[first] - self.upf:
            first -= 1
        if first:
            log.error("queue %r: files missing before unit %d", name, starts[first])
        last, size = files[-1]
        flushed = last + size // CQ_UNIT_SIZE
        cq = ConsumeQueue(name, directory, starts[first], flushed)
        if self.log_min_offset:
            self.correct_min_offset(cq)
        return cq

    def has_gap(self, name: str) -> bool:
        """True if the queue's files are not contiguous or end in a partial unit."""
        files = self._files(self.dir_of(name))
        for (a, _), (b, _) in itertools.pairwise(files):
            if b != a + self.upf:
                return True
        return any(size != self.file_bytes for _, size in files[:-1])

    def disk_names(self) -> Iterator[str]:
        """Names of queues with a directory on disk."""
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return
        for e in entries:
            name = decode_queue_dir(e)
            if name is None:
                log.warning("ignoring foreign entry %s/%s", self.root, e)
                continue
            yield name

    def names(self) -> list[str]:
        seen = dict.fromkeys(self.disk_names())
        for n in self.states:
            seen[n] = None
        return list(seen)

    # -- writing -----------------------------------------------------------------------------
    def _write(self, cq: ConsumeQueue) -> list[str]:
        """Write ``cq.pending`` to its files; returns the paths written (to fsync).

        The paths include every directory that gained an entry (a new queue's directories, a
        new file's directory): an fsync of a new file does not promise its name, so the
        checkpoint that counts its units must come after the directory's fsync too.
        """
        data = memoryview(bytes(cq.pending))
        unit = cq.flushed
        written = []
        while data:
            path = self.file_of(cq, unit)
            room = self.upf - unit % self.upf
            chunk = data[: room * CQ_UNIT_SIZE]
            if not cq.dir_ready:
                written += self._make_dirs(cq.dir)
                cq.dir_ready = True
            if unit % self.upf == 0:
                written.append(cq.dir)  # the file is created by this write
            self.files.pwrite(path, chunk, (unit % self.upf) * CQ_UNIT_SIZE)
            written.append(path)
            unit += len(chunk) // CQ_UNIT_SIZE
            data = data[len(chunk) :]
        cq.flushed = unit
        cq.pending = bytearray()
        return written

    def _make_dirs(self, directory: str) -> list[str]:
        """Create ``directory`` and missing parents; returns the parents that gained an entry."""
        if os.path.isdir(directory):
            return []
        parent = os.path.dirname(directory)
        changed = self._make_dirs(parent) if parent != str(self.root) else []
        try:
            os.mkdir(directory)
        except FileExistsError:
            return changed
        return [*changed, parent]

    def write_pending(self) -> list[str]:
        """Write every queue's buffered units; returns the files written (to fsync)."""
        written: list[str] = []
        for cq in self.dirty.values():
            if cq.pending:
                written += self._write(cq)
        self.dirty.clear()
        return written

    # -- reading -----------------------------------------------------------------------------
    def read_units(self, cq: ConsumeQueue, offset: int, count: int) -> bytes:
        """Units ``[offset, offset + count)`` clipped to the queue end and one file."""
        count = min(count, cq.max_offset - offset)
        if count <= 0:
            return b""
        if offset >= cq.flushed:
            p = (offset - cq.flushed) * CQ_UNIT_SIZE
            return bytes(cq.pending[p : p + count * CQ_UNIT_SIZE])
        in_file = min(count, cq.flushed - offset, self.upf - offset % self.upf)
        data = self.files.pread(
            self.file_of(cq, offset), in_file * CQ_UNIT_SIZE, (offset % self.upf) * CQ_UNIT_SIZE
        )
        if in_file < count and offset + in_file == cq.flushed and len(data) == in_file * 20:
            data += cq.pending[: (count - in_file) * CQ_UNIT_SIZE]
        return data

    def unit_at(self, cq: ConsumeQueue, offset: int) -> tuple[int, int] | None:
        data = self.read_units(cq, offset, 1)
        if len(data) < CQ_UNIT_SIZE:
            return None
        phys, size, _tag = CQ_UNIT.unpack(data)
        return phys, size

    def first_unit_at_or_after(self, cq: ConsumeQueue, lo: int, hi: int, phys: int) -> int:
        """Smallest offset in ``[lo, hi)`` whose unit points at or past ``phys`` (else hi)."""
        while lo < hi:
            mid = (lo + hi) // 2
            u = self.unit_at(cq, mid)
            if u is not None and u[0] >= phys:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def correct_min_offset(self, cq: ConsumeQueue) -> None:
        """Move ``min_offset`` past units whose messages retention deleted."""
        u = self.unit_at(cq, cq.min_offset)
        if u is not None and u[0] < self.log_min_offset:
            cq.min_offset = self.first_unit_at_or_after(
                cq, cq.min_offset, cq.max_offset, self.log_min_offset
            )

    # -- truncation (recovery, retention) ------------------------------------------------------
    def truncate(self, cq: ConsumeQueue, offset: int) -> None:
        """Drop units ``[offset, max_offset)``."""
        if offset >= cq.max_offset:
            return
        if offset >= cq.flushed:
            del cq.pending[(offset - cq.flushed) * CQ_UNIT_SIZE :]
        else:
            cq.pending = bytearray()
            self.dirty.pop(cq.name, None)
            kept = False
            gone: list[str] = []
            for start in self._list_files(cq.dir):
                path = f"{cq.dir}/{offset_file_name(start * CQ_UNIT_SIZE)}"
                if start + self.upf <= offset:
                    kept = True
                    continue
                self.files.forget(path)
                if start < offset or (start == offset and not kept):
                    # Keep the file holding the cut (an empty one at a boundary), so a reload
                    # still knows where the queue ends.
                    os.truncate(path, (offset - start) * CQ_UNIT_SIZE)
                    kept = True
                else:
                    gone.append(path)
            unlink_durably(gone)
            cq.flushed = offset
        cq.max_offset = offset
        cq.min_offset = min(cq.min_offset, offset)

    def truncate_past(self, cq: ConsumeQueue, phys_end: int) -> int:
        """Drop units pointing at or beyond ``phys_end``; returns how many were dropped."""
        cut = self.first_unit_at_or_after(cq, cq.min_offset, cq.max_offset, phys_end)
        dropped = cq.max_offset - cut
        self.truncate(cq, cut)
        return dropped

    def reset(self, cq: ConsumeQueue, offset: int) -> None:
        """Empty the queue so that its next unit is ``offset`` (rebuild after a gap)."""
        self.files.forget_under(cq.dir + "/")
        if os.path.isdir(cq.dir):
            shutil.rmtree(cq.dir, ignore_errors=True)
            fsync_dir(os.path.dirname(cq.dir))  # gone for good before the rebuild writes
        cq.dir_ready = False
        self.dirty.pop(cq.name, None)
        cq.pending = bytearray()
        cq.min_offset = cq.flushed = cq.max_offset = offset

    def delete_files_below(self, cq: ConsumeQueue, log_min: int) -> int:
        """Retention: delete whole files whose every unit points below ``log_min``."""
        gone: list[str] = []
        for start in self._list_files(cq.dir)[:-1]:
            path = f"{cq.dir}/{offset_file_name(start * CQ_UNIT_SIZE)}"
            u = self.unit_at(cq, min(start + self.upf, cq.flushed) - 1)
            if u is None or u[0] >= log_min:
                break
            self.files.forget(path)
            gone.append(path)
            cq.min_offset = max(cq.min_offset, start + self.upf)
        return unlink_durably(gone)

    def close(self) -> None:
        self.files.close()


# -- readers of the files, for tools that do not open a store (analytics) -------------------
def queue_files(directory: str | Path) -> list[tuple[int, int]]:
    """``(start byte offset, size)`` of a queue's files (``consumequeue/<name>/0``), in order.

    Entries not named by a 20-digit offset are left out.
    """
    return _queue_files(directory) or []


def _queue_files(directory: str | Path) -> list[tuple[int, int]] | None:
    """queue_files(), None when the directory does not exist (one system call says so)."""
    files = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in entries:
        start = parse_offset_file_name(entry.name)
        if start is not None and entry.is_file():
            try:
                files.append((start, entry.stat().st_size))
            except FileNotFoundError:  # deleted since the listing (retention)
                continue
    files.sort()
    return files


def queue_extents(root: str | Path) -> Iterator[tuple[str, int, int]]:
    """``(queue, min offset, end offset)`` of every queue with files under ``root`` (the
    consumequeue directory), from the names and sizes of its files."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    for entry in entries:
        name = decode_queue_dir(entry.name)
        if name is None or not entry.is_dir():
            continue
        files = queue_files(f"{entry.path}/{QUEUE_ID}")
        if files:
            (first, _), (last, size) = files[0], files[-1]
            yield name, first // CQ_UNIT_SIZE, (last + size) // CQ_UNIT_SIZE


def read_unit(root: str | Path, queue: str, offset: int) -> tuple[int, int] | None:
    """``(CommitLog offset, size)`` of unit ``offset`` of ``queue`` under ``root`` (the
    consumequeue directory); None if no file holds the whole unit."""
    try:
        directory = f"{root}/{encode_queue_dir(queue)}/{QUEUE_ID}"
    except ValueError:
        return None
    at = offset * CQ_UNIT_SIZE
    holder = None
    for start, _size in queue_files(directory):
        if start <= at:
            holder = start
    if holder is None:
        return None
    try:
        with open(f"{directory}/{offset_file_name(holder)}", "rb") as f:
            f.seek(at - holder)
            unit = f.read(CQ_UNIT_SIZE)
    except OSError:
        return None
    if len(unit) < CQ_UNIT_SIZE:
        return None
    phys, size, _tag = CQ_UNIT.unpack(unit)
    return phys, size
