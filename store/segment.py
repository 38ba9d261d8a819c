"""One fixed-size, memory-mapped CommitLog file (RocketMQ's MappedFile).

A segment is created at its full size as a sparse file, so unwritten space reads as zeros
and TOTALSIZE 0 marks the end of data. Writes go into the shared mapping; ``fsync`` on the
file descriptor makes them durable (Linux writes back dirty MAP_SHARED pages on fsync).
Not thread-safe: the CommitLog serialises writers and keeps readers away from closed segments.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path


class Segment:
    """A CommitLog segment covering ``[start, start + size)``."""

    __slots__ = ("fd", "mm", "path", "read_only", "size", "start", "view")

    def __init__(self, path: Path, start: int, size: int, *, create: bool, read_only: bool):
        self.path = path
        self.start = start
        self.size = size
        self.read_only = read_only
        flags = os.O_RDONLY if read_only else os.O_RDWR
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        self.fd = os.open(path, flags, 0o644)
        try:
            if create:
                os.ftruncate(self.fd, size)
            access = mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE
            self.mm = mmap.mmap(self.fd, size, access=access)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mm)

    @property
    def end(self) -> int:
        return self.start + self.size

    def fsync(self) -> None:
        os.fsync(self.fd)

    def zero_from(self, rel: int) -> None:
        """Make bytes ``[rel, size)`` zero again (drops pages instead of writing zeros)."""
        if rel >= self.size:
            return
        page = mmap.PAGESIZE
        aligned = (rel + page - 1) // page * page
        if aligned > rel:
            self.view[rel : min(aligned, self.size)] = bytes(min(aligned, self.size) - rel)
        if aligned < self.size:
            # Truncating the file discards its page-cache pages past the cut, including those
            # of our own mapping; growing it again makes them read as zero.
            self.mm.flush()
            os.ftruncate(self.fd, aligned)
            os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        self.view.release()
        self.mm.close()
        os.close(self.fd)
