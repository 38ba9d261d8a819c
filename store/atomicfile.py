"""Durable name changes: the one home of every create, rename and unlink recovery relies on.

POSIX makes a file's data durable through an fsync of the file, and a name (a create, a
rename, an unlink) durable only through an fsync of the directory holding it. Each helper
here pairs the change with the fsync that makes it durable, so a power cut leaves either the
state before or the state after, never a name without its bytes:

- ``write_atomic``     a whole file replaced: temp file, fsync, rename, directory fsync.
- ``create_with_header``  a new append-only file that appears with its header or not at all:
  ``<name>.tmp`` written and fsynced, renamed into place, directory fsync. (Created in place,
  a cut between the create and the header's fsync leaves a short file.)
- ``replace_durably``  an existing file renamed (over another), directory fsync.
- ``unlink_durably``   files deleted, one fsync per directory touched.
- ``make_dirs``        directories created (with their parents), each name made durable.
- ``fsync_dir``        the directory fsync itself, for callers that batch name changes.

A ``.tmp`` file left by a cut is the owner's to delete at open (nothing relies on it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

TMP_SUFFIX: Final = ".tmp"


def fsync_dir(path: Path | str) -> None:
    """fsync a directory, making the names created, renamed or removed in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p path``, each directory it creates made durable in its parent."""
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a crash leaves either the old or the new content."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    replace_durably(tmp, path)


def create_with_header(path: Path, header: bytes) -> int:
    """Create ``path`` holding ``header``, durably and whole; returns a descriptor positioned
    at its end (not O_APPEND: the caller may allocate space beyond its writes, and they must
    land at its own end, not the file's). ``path`` must not exist (a leftover ``.tmp`` is
    overwritten)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, header)
        os.fsync(fd)
        replace_durably(tmp, path)  # the descriptor follows the file to its new name
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_durably(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` (replacing it) and fsync the directory holding ``dst``."""
    os.replace(src, dst)
    fsync_dir(dst.parent)


def unlink_durably(paths: Iterable[Path | str]) -> int:
    """Delete ``paths`` (missing ones skipped), then fsync each directory touched once;
    returns how many were deleted."""
    dirs: set[str] = set()
    n = 0
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            continue
        dirs.add(os.path.dirname(os.fspath(p)) or ".")
        n += 1
    for d in dirs:
        fsync_dir(d)
    return n
