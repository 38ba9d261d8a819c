"""The fsync thread of group commit (gateway/storage/fsync_thread.py): the C FsyncThread and
its pure-Python reference give the same answers to the same calls, on real files."""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import accelerators
from gateway.storage import fsync_thread
from gateway.storage.fsync_thread import FsyncThreadLike, PyFsyncThread

C_MODULE = accelerators.load("gateway.storage._fsync")
needs_c = pytest.mark.skipif(C_MODULE is None, reason="the C extension is not built")


def _c_thread() -> FsyncThreadLike:
    assert C_MODULE is not None
    thread: FsyncThreadLike = C_MODULE.FsyncThread()
    return thread


KINDS: list[Callable[[], FsyncThreadLike]] = [PyFsyncThread]
if C_MODULE is not None:
    KINDS.append(_c_thread)


def _signalled(thread: FsyncThreadLike, deadline_s: float = 10.0) -> tuple[int, int, int]:
    """Wait (with a deadline) until the eventfd says an fsync ended, then collect."""
    readable, _, _ = select.select([thread.fileno()], [], [], deadline_s)
    assert readable, "the fsync thread never signalled"
    return thread.collect()


def _script(make: Callable[[], FsyncThreadLike], tmp_path: Path) -> list[object]:
    """One scripted conversation; what each step answered."""
    out: list[object] = []
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    thread = make()
    try:
        out.append(thread.collect())  # nothing yet: (0, 0, 0)
        # No file handed over: the fsync fails with EBADF, nothing becomes durable.
        thread.request(10)
        out.append(_signalled(thread))
        # A file: positions become durable, each fsync for the highest one requested.
        os.write(fd, b"x" * 10)
        thread.set_fd(os.dup(fd))
        thread.request(10)
        out.append(_signalled(thread))
        os.write(fd, b"y" * 5)
        thread.request(12)
        thread.request(15)  # the highest wins (one or two fsyncs: count left out)
        deadline = time.monotonic() + 10
        synced = 0
        while synced < 15 and time.monotonic() < deadline:
            synced = _signalled(thread)[0]
        out.append(synced)
        # A lower request than what is durable starts nothing.
        thread.request(3)
        readable, _, _ = select.select([thread.fileno()], [], [], 0.2)
        out.append(bool(readable))
        with pytest.raises(ValueError):
            thread.set_fd(-1)
        # Replacing the file closes the one handed over before (the thread is idle).
        first = os.dup(fd)
        thread.set_fd(first)
        thread.set_fd(os.dup(fd))
        with pytest.raises(OSError) as closed:
            os.fstat(first)
        out.append(closed.value.errno)
    finally:
        thread.stop()
        os.close(fd)
    # Stopped: the eventfd is closed and requests are ignored.
    out.append(thread.fileno())
    thread.request(100)
    return out


@pytest.mark.parametrize("make", KINDS, ids=lambda k: "python" if k is PyFsyncThread else "c")
def test_the_scripted_answers(make: Callable[[], FsyncThreadLike], tmp_path: Path) -> None:
    assert _script(make, tmp_path) == [
        (0, 0, 0),
        (0, 1, errno.EBADF),
        (10, 1, 0),
        15,
        False,
        errno.EBADF,
        -1,
    ]


@needs_c
def test_the_c_thread_and_the_reference_agree(tmp_path: Path) -> None:
    (tmp_path / "py").mkdir()
    (tmp_path / "c").mkdir()
    assert _script(_c_thread, tmp_path / "c") == _script(PyFsyncThread, tmp_path / "py")


@needs_c
@pytest.mark.skipif(
    accelerators.pure_python(fsync_thread.PURE_PYTHON_SWITCH),
    reason="a LMQTT_PURE_PYTHON switch is set: the gateway runs the reference",
)
def test_the_gateway_uses_the_c_thread() -> None:
    assert C_MODULE is not None
    assert isinstance(fsync_thread.new_fsync_thread(), C_MODULE.FsyncThread)


@needs_c
def test_the_build_matches_the_source() -> None:
    """A .so compiled from an older _fsync.c would test old code."""
    assert C_MODULE is not None
    source = Path(fsync_thread.__file__).with_name("_fsync.c")
    digest = accelerators.source_digest(source)
    assert digest == C_MODULE.SOURCE_SHA256, "stale build: run `make .venv/.installed-dev`"
