"""FsyncThread: a thread that fdatasyncs one file on request and says so through an eventfd.

GroupCommit (group_commit.py) hands it the state log's file (a duplicate descriptor, owned
here) and the log position to make durable; the event loop watches `fileno()` (an eventfd)
with `add_reader` and calls `collect()` when it is readable:

    loop thread                              fsync thread
    set_fd(dup of the log's fd)
    request(written) ------------------->    fdatasync(fd)       (no GIL in the C version)
    ... serves other clients ...             synced = written
    <-- eventfd readable ----------------    write(eventfd, 1)
    collect() -> (synced, fsyncs, errno)

The thread runs one fdatasync at a time, each for the highest position requested when it
starts. A position is durable once `synced` reaches it; an fsync that failed leaves `synced`
where it was and reports its errno once (the next request tries again).

fdatasync, not fsync: it writes the data and whatever metadata reading it back needs (the
file's size), so an acknowledged append survives a power cut; it skips the timestamps.

The C version (_fsync.c, `accelerators.load("gateway.storage._fsync")`) is this class's
twin: same methods, same answers (tests/gateway/storage/test_fsync_thread.py checks both),
and its thread never takes the GIL, so a busy event loop does not hand the GIL over and back
twice per fsync. `new_fsync_thread()` picks the C version when it is built.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Protocol

import accelerators

__all__ = ["FsyncThreadLike", "PyFsyncThread", "new_fsync_thread"]

#: Keeps the reference here (A/B runs): any value but "" and "0".
PURE_PYTHON_SWITCH = "LMQTT_PURE_PYTHON_FSYNC"


class FsyncThreadLike(Protocol):
    """What GroupCommit uses of an fsync thread (PyFsyncThread or the C FsyncThread)."""

    def fileno(self) -> int:
        """The eventfd the loop watches: readable once an fsync ended (-1 after stop)."""

    def set_fd(self, fd: int) -> None:
        """Sync `fd` from now on; the thread owns it (closes it when replaced or stopped)."""

    def request(self, upto: int) -> None:
        """Make the file durable up to position `upto` (starts the thread at the first)."""

    def collect(self) -> tuple[int, int, int]:
        """(synced position, fsyncs since the last collect, errno of a failed one or 0);
        empties the eventfd."""

    def stop(self) -> None:
        """End the thread (after the fsync it runs) and close the descriptors."""


class PyFsyncThread:
    """The reference (see the module docstring): a threading.Thread, the same answers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fd = -1
        self._using = -1  # the fd an fsync in progress uses
        self._retired = -1  # replaced while in use: closed by the thread after that fsync
        self._requested = 0
        self._started_upto = 0  # the position the last fsync started for
        self._synced = 0
        self._fsyncs = 0
        self._error = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self._efd

    def set_fd(self, fd: int) -> None:
        if fd < 0:
            raise ValueError("set_fd: not a file descriptor")
        with self._cond:
            old, self._fd = self._fd, fd
            if old >= 0 and old == self._using:
                self._retired, old = old, -1
        if old >= 0:
            os.close(old)

    def request(self, upto: int) -> None:
        with self._cond:
            if self._stopping:
                return
            if upto > self._requested:
                self._requested = upto
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmqtt-fsync", daemon=True)
                self._thread.start()
            self._cond.notify()

    def collect(self) -> tuple[int, int, int]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._cond:
            answer = (self._synced, self._fsyncs, self._error)
            self._fsyncs = self._error = 0
        return answer

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        for fd in (self._fd, self._retired, self._efd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._retired = self._efd = -1

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._stopping and self._requested <= self._started_upto:
                    cond.wait()
                if self._stopping:
                    return
                upto = self._started_upto = self._requested
                fd = self._using = self._fd
            error = 0
            try:
                if fd < 0:
                    error = errno.EBADF  # no file to sync
                else:
                    os.fdatasync(fd)
            except OSError as exc:
                error = exc.errno or errno.EIO
            with cond:
                self._using = -1
                if self._retired >= 0:
                    os.close(self._retired)
                    self._retired = -1
                if error:
                    self._error = error
                    # Nothing pending: the next request (a higher position) tries again.
                    self._requested = self._started_upto = self._synced
                elif upto > self._synced:
                    self._synced = upto
                self._fsyncs += 1
            os.eventfd_write(self._efd, 1)


def new_fsync_thread() -> FsyncThreadLike:
    """The C FsyncThread when built (and not switched off), else the reference."""
    module = accelerators.load("gateway.storage._fsync", PURE_PYTHON_SWITCH)
    if module is None:
        return PyFsyncThread()
    thread: FsyncThreadLike = module.FsyncThread()
    return thread
