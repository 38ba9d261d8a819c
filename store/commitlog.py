"""The CommitLog: an ordered list of segments named by their 20-digit start offset.

Invariants (checked at load): segments are contiguous (each starts where the previous one
ends), all have the same size, and ``write_pos`` lies in the last one. Offsets are absolute
byte positions in the log. Not thread-safe: MessageStore holds its lock around every call
except :meth:`fsync_to`, which only touches file descriptors of live segments.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from store.atomicfile import fsync_dir, unlink_durably
from store.errors import CorruptStoreError, MessageTooLargeError
from store.format import (
    BLANK_MAGIC,
    END_FILE_MIN_BLANK_LENGTH,
    MAGIC,
    MIN_RECORD_SIZE,
    SIZE_MAGIC,
    STORE_TIMESTAMP,
    offset_file_name,
    parse_offset_file_name,
)
from store.segment import Segment

log = logging.getLogger("lmqtt.store.commitlog")


class CommitLog:
    """Append-only record log over fixed-size memory-mapped segments."""

    def __init__(self, directory: Path, segment_size: int, *, read_only: bool = False) -> None:
        self.dir = directory
        self.segment_size = segment_size
        self.read_only = read_only
        self.segments: list[Segment] = []
        #: Next byte to write; also the end of valid data once recovery has run.
        self.write_pos = 0
        #: Everything below this offset has been fsynced.
        self.flushed_pos = 0
        #: fsync calls made (group commit shows as far fewer fsyncs than sync puts).
        self.fsync_count = 0
        self._writer = BatchWriter(self)

    # -- loading ---------------------------------------------------------------------------
    def load(self) -> None:
        """Open existing segments, checking names, sizes and contiguity."""
        if not self.read_only:
            self.dir.mkdir(parents=True, exist_ok=True)
        if not self.dir.is_dir():
            return
        starts: list[int] = []
        for entry in os.scandir(self.dir):
            start = parse_offset_file_name(entry.name)
            if start is None or not entry.is_file():
                if entry.name.endswith(".tmp"):
                    continue
                raise CorruptStoreError(str(entry.path), "foreign file in the commitlog directory")
            starts.append(start)
        starts.sort()
        if not starts:
            return
        sizes = [os.path.getsize(self.dir / offset_file_name(s)) for s in starts]
        # The names tell the segment size (the distance between two starts), not the files'
        # sizes: a power cut soon after a segment's creation leaves it 0 bytes (its growth to
        # full size not yet synced) or holding only what was written into it, and in async
        # mode (or within one group commit) the next segment's name can reach the disk before
        # the previous segment's size does. A lone segment is at least the configured size.
        size = starts[1] - starts[0] if len(starts) > 1 else max(sizes[0], self.segment_size)
        if size != self.segment_size:
            log.warning(
                "segments are %d bytes, not the configured %d: keeping %d",
                size, self.segment_size, size,
            )  # fmt: skip
            self.segment_size = size
        for i, start in enumerate(starts):
            path = self.dir / offset_file_name(start)
            if start % self.segment_size:
                raise CorruptStoreError(str(path), "start offset is not a multiple of the size")
            if i and start != starts[i - 1] + self.segment_size:
                raise CorruptStoreError(str(path), "gap before this segment")
            fsize = sizes[i]
            if fsize != self.segment_size:
                if self.read_only or fsize > self.segment_size:
                    raise CorruptStoreError(str(path), f"size {fsize} != {self.segment_size}")
                # Cut while being created or before its tail was synced: grow it back. What
                # was not synced reads as zeros, and recovery ends the log there (deleting
                # later segments: nothing in them was acknowledged before this one's fsync).
                log.warning(
                    "segment %s is %d bytes, not %d (a crash before it was synced): growing it",
                    path, fsize, self.segment_size,
                )  # fmt: skip
                with open(path, "r+b") as f:
                    f.truncate(self.segment_size)
                    os.fsync(f.fileno())
            self.segments.append(
                Segment(path, start, self.segment_size, create=False, read_only=self.read_only)
            )
        self.write_pos = self.segments[0].start
        self.flushed_pos = self.write_pos

    @property
    def min_offset(self) -> int:
        return self.segments[0].start if self.segments else self.write_pos

    def segment_for(self, offset: int) -> Segment | None:
        """The segment containing ``offset`` (None if deleted or not yet written)."""
        segs = self.segments
        if not segs:
            return None
        i = (offset - segs[0].start) // self.segment_size
        if 0 <= i < len(segs):
            return segs[i]
        return None

    # -- writing -----------------------------------------------------------------------------
    def _roll(self) -> Segment:
        start = self.segments[-1].end if self.segments else self.write_pos
        seg = Segment(
            self.dir / offset_file_name(start), start, self.segment_size,
            create=True, read_only=False,
        )  # fmt: skip
        # The new file's name must be durable before any record in it is acknowledged: an
        # fsync of the file alone does not promise its directory entry (ext4's default
        # ordering happens to save it, other file systems need not).
        fsync_dir(self.dir)
        self.segments.append(seg)
        self.write_pos = start
        return seg

    def max_record_size(self) -> int:
        return self.segment_size - END_FILE_MIN_BLANK_LENGTH

    def segment_with_room(self, size: int) -> Segment:
        """The segment the next ``size``-byte record starts in, at ``write_pos``.

        Writes a blank filler and rolls to a new segment when the record plus 8 bytes does
        not fit; ``write_pos`` then moves to the new segment's start. Does not advance past
        the record: batch writers place several records before moving ``write_pos``.
        """
        if size > self.segment_size - END_FILE_MIN_BLANK_LENGTH:
            raise MessageTooLargeError(size, self.segment_size - END_FILE_MIN_BLANK_LENGTH)
        segs = self.segments
        seg = segs[-1] if segs else self._roll()
        rel = self.write_pos - seg.start
        if rel + size + END_FILE_MIN_BLANK_LENGTH > seg.size:
            if rel + END_FILE_MIN_BLANK_LENGTH <= seg.size:
                SIZE_MAGIC.pack_into(seg.view, rel, seg.size - rel, BLANK_MAGIC)
            seg = self._roll()
        return seg

    def batch(self) -> BatchWriter:
        """The writer of the next records, placed from ``write_pos`` on (see BatchWriter).

        One writer per log, reset here: a put of one message should not pay for building
        one (the caller holds the store lock, so batches never overlap)."""
        segs = self.segments
        seg = segs[-1] if segs else self.segment_with_room(0)
        w = self._writer  # BatchWriter.reset, inlined: once per put
        w.seg = seg
        w.start = self.write_pos
        w.limit = seg.start + seg.size - END_FILE_MIN_BLANK_LENGTH
        return w

    def fsync_to(self, end: int) -> None:
        """fsync every segment holding bytes in ``[flushed_pos, end)``."""
        if end <= self.flushed_pos:
            return
        start = self.flushed_pos
        for seg in list(self.segments):
            if seg.end > start and seg.start < end:
                seg.fsync()
                self.fsync_count += 1
        self.flushed_pos = end

    def release_mapped(self, end: int) -> None:
        """Unmap (RSS only, see Segment.release) every page of the log below ``end``."""
        for seg in self.segments:
            if seg.start >= end:
                break
            seg.release(end - seg.start)

    def truncate(self, offset: int) -> None:
        """Drop everything from ``offset`` on: zero the rest of its segment, delete later ones."""
        gone = []
        while self.segments and self.segments[-1].start > offset:
            seg = self.segments.pop()
            seg.close()
            gone.append(seg.path)
        # Durably gone before anything is written past the cut: a deleted segment that came
        # back after a second crash would bring records the cut discarded.
        unlink_durably(gone)
        last = self.segment_for(offset) if self.segments else None
        if last is not None:
            last.zero_from(offset - last.start)
            last.fsync()
        self.write_pos = offset
        self.flushed_pos = min(self.flushed_pos, offset)

    def delete_oldest(self) -> Segment:
        """Remove the first segment (retention); never the one being written."""
        seg = self.segments.pop(0)
        seg.close()
        unlink_durably([seg.path])
        return seg

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
        self.segments.clear()


class BatchWriter:
    """A batch of records for the end of the log, built in one buffer and written once.

    The caller appends each record to ``buf`` with the record step (format.append_record, or
    its C twin in store/_speedups.c) given ``room = limit - phys``, where ``phys`` (starting
    at ``start``) is the next record's offset. A step answering -1 did not fit before the
    segment's last 8 bytes: :meth:`roll` writes what is built, the CommitLog writes the blank
    filler and starts the next segment, and the step is retried there. :meth:`finish` writes
    the rest and moves ``write_pos``; readers see nothing of the batch before. Building in
    one bytes buffer and copying it to the mapping once beats a write per record on CPython.
    """

    __slots__ = ("buf", "limit", "log", "seg", "start")

    def __init__(self, log: CommitLog) -> None:
        self.log = log
        self.seg: Segment | None = None
        #: Offset of ``buf[0]`` in the log.
        self.start = 0
        #: A record must end before this offset (8 bytes before the segment end: room for a
        #: blank filler).
        self.limit = 0
        self.buf = bytearray()

    def reset(self, seg: Segment) -> None:
        """Start a batch at the log's ``write_pos``, in ``seg``."""
        self.seg = seg
        self.start = self.log.write_pos
        self.limit = seg.start + seg.size - END_FILE_MIN_BLANK_LENGTH
        self.buf = bytearray()

    def roll(self, end: int, size: int) -> int:
        """Write the records built up to ``end`` and move to a segment with room for a
        ``size``-byte record; returns the offset the next record starts at."""
        self.finish(end)
        self.reset(self.log.segment_with_room(size))
        return self.start

    def finish(self, end: int) -> None:
        """Write the records built, which end at ``end``, and make them the log's end."""
        if self.buf:
            assert self.seg is not None
            self.seg.write(self.start - self.seg.start, self.buf)
            self.buf = bytearray()  # the writer outlives the batch: do not keep its bytes
        self.log.write_pos = end


# -- readers of the files, for tools that do not open a store (analytics) -------------------
def segment_files(directory: Path) -> list[tuple[int, Path]]:
    """``(start offset, path)`` of every segment in a CommitLog directory, oldest first.

    Entries not named by a 20-digit offset are left out; :meth:`CommitLog.load` refuses them.
    """
    found = []
    for entry in os.scandir(directory):
        start = parse_offset_file_name(entry.name)
        if start is not None and entry.is_file():
            found.append((start, Path(entry.path)))
    found.sort()
    return found


def first_store_timestamp(path: str | Path) -> int | None:
    """STORETIMESTAMP (ms) of a segment's first record; None if it has none to read (an empty
    or unwritten segment, a filler, damage) or the file is gone (retention)."""
    try:
        with open(path, "rb") as f:
            head = f.read(STORE_TIMESTAMP.size)
    except FileNotFoundError:
        return None
    if len(head) < STORE_TIMESTAMP.size:
        return None
    size, magic = SIZE_MAGIC.unpack_from(head)
    if magic != MAGIC or size < MIN_RECORD_SIZE:
        return None
    return int(STORE_TIMESTAMP.unpack_from(head)[0])
