"""A bounded LRU of open file descriptors, so millions of queue files cost no descriptors.

Thread-safe: a lock guards the table; callers use a descriptor only through :meth:`pread`
and :meth:`pwrite`, which hold that lock, so eviction never closes a descriptor in use.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict


class FileHandles:
    """Opens files on demand and keeps at most ``capacity`` of them open."""

    def __init__(self, capacity: int, *, read_only: bool = False) -> None:
        self.capacity = capacity
        self.read_only = read_only
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _fd(self, path: str, create: bool) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        flags = os.O_RDONLY if self.read_only else os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o644)
        self._fds[path] = fd
        while len(self._fds) > self.capacity:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def pread(self, path: str, size: int, pos: int) -> bytes:
        with self._lock:
            try:
                fd = self._fd(path, False)
            except FileNotFoundError:
                return b""
            return os.pread(fd, size, pos)

    def pwrite(self, path: str, data: bytes | bytearray | memoryview, pos: int) -> None:
        with self._lock:
            fd = self._fd(path, True)
            mv = memoryview(data)
            while mv:
                n = os.pwrite(fd, mv, pos)
                mv = mv[n:]
                pos += n

    def forget(self, path: str) -> None:
        """Close ``path`` if open (before deleting or truncating it)."""
        with self._lock:
            fd = self._fds.pop(path, None)
            if fd is not None:
                os.close(fd)

    def forget_under(self, prefix: str) -> None:
        with self._lock:
            for p in [p for p in self._fds if p.startswith(prefix)]:
                os.close(self._fds.pop(p))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
