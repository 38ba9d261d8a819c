"""Crash images: the disk states a power cut after a given recorded operation may leave.

The model is POSIX's promise, not one file system's habits (as ALICE's "abstract persistence
model"):

- A file's data and size become durable only through an fsync of that file: at a SYNC record
  every earlier WRITE / TRUNC of the file (sequence below the one the fsync began at) is durable.
- A name (create, mkdir, rename, unlink, rmdir) becomes durable only through an fsync of the
  directory holding it. Until then the file may be missing, or found under its old name.
- Anything not yet durable at the cut may or may not have reached the disk: each pending write
  independently, possibly torn (only a prefix of it, in 512-byte sectors), in any order; each
  directory's pending name changes as a prefix of them (in the order they were made).

Stores through a shared mapping are seen only when they are synced (the shim diffs the
mapping at fsync), so they are never "persisted early": a slight under-approximation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from tests.crash.oplog import CREATE, MKDIR, O_TRUNC, RENAME, RMDIR, SYNC, TRUNC, UNLINK, WRITE, Op

SECTOR = 512


@dataclass
class Inode:
    is_dir: bool
    durable: bytearray = field(default_factory=bytearray)
    #: (seq, "w", offset, data) or (seq, "t", size, b"")
    pending: list[tuple[int, str, int, bytes]] = field(default_factory=list)


def _apply(content: bytearray, kind: str, a: int, data: bytes) -> None:
    if kind == "t":
        if a < len(content):
            del content[a:]
        else:
            content.extend(bytes(a - len(content)))
    else:
        if a > len(content):
            content.extend(bytes(a - len(content)))
        content[a : a + len(data)] = data


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


class DiskModel:
    """Replays ops in order; :meth:`image` draws one crash state at the current point."""

    def __init__(self) -> None:
        self.inodes: list[Inode] = [Inode(is_dir=True)]  # 0: the root, durable
        self.names: dict[str, int] = {"": 0}  # the namespace as the process sees it
        self.durable_names: dict[str, int] = {"": 0}
        #: per directory path: pending (seq, op, path, path2, inode) name changes
        self.pending_names: dict[str, list[tuple[int, str, str, str, int]]] = {}
        self.applied = 0  # ops replayed

    def _name_op(self, seq: int, op: str, path: str, path2: str, ino: int) -> None:
        d = _parent(path2 if op == "rename" else path)
        self.pending_names.setdefault(d, []).append((seq, op, path, path2, ino))

    def replay(self, op: Op) -> None:
        self.applied += 1
        k = op.kind
        if k == CREATE:
            ino = self.names.get(op.path)
            if ino is None:
                self.inodes.append(Inode(is_dir=False))
                ino = self.names[op.path] = len(self.inodes) - 1
                self._name_op(op.seq, "link", op.path, "", ino)
            if op.a & O_TRUNC:
                self.inodes[ino].pending.append((op.seq, "t", 0, b""))
        elif k == MKDIR:
            self.inodes.append(Inode(is_dir=True))
            ino = self.names[op.path] = len(self.inodes) - 1
            self._name_op(op.seq, "link", op.path, "", ino)
        elif k in (WRITE, TRUNC):
            ino = self.names[op.path]
            if k == WRITE:
                self.inodes[ino].pending.append((op.seq, "w", op.a, op.data))
            else:
                self.inodes[ino].pending.append((op.seq, "t", op.a, b""))
        elif k == RENAME:
            ino = self.names.pop(op.path)
            self.names[op.path2] = ino
            self._name_op(op.seq, "rename", op.path, op.path2, ino)
        elif k in (UNLINK, RMDIR):
            ino = self.names.pop(op.path)
            self._name_op(op.seq, "unlink", op.path, "", ino)
        elif k == SYNC:
            ino = self.names.get(op.path)
            if ino is None:
                return
            node = self.inodes[ino]
            if node.is_dir:
                lst = self.pending_names.get(op.path, [])
                done = [x for x in lst if x[0] <= op.a]
                self.pending_names[op.path] = [x for x in lst if x[0] > op.a]
                for x in done:
                    self._apply_name(self.durable_names, x)
            else:
                keep = []
                for p in node.pending:
                    if p[0] <= op.a:
                        _apply(node.durable, p[1], p[2], p[3])
                    else:
                        keep.append(p)
                node.pending = keep

    @staticmethod
    def _apply_name(names: dict[str, int], x: tuple[int, str, str, str, int]) -> None:
        _seq, op, path, path2, ino = x
        if op == "link":
            names[path] = ino
        elif op == "rename":
            if names.get(path) == ino:
                del names[path]
            names[path2] = ino
        else:
            if names.get(path) == ino:
                del names[path]

    def pending_count(self) -> int:
        return sum(len(n.pending) for n in self.inodes) + sum(
            len(v) for v in self.pending_names.values()
        )

    def image(self, dest: Path, rnd: random.Random | None, keep: float = 0.5) -> None:
        """Write one crash state under ``dest``: durable state, plus (with ``rnd``) a random
        choice of pending writes (some torn) and name changes. ``rnd=None``: durable only."""
        names = dict(self.durable_names)
        if rnd is not None:
            for lst in self.pending_names.values():
                for x in lst[: rnd.randint(0, len(lst))]:
                    self._apply_name(names, x)
        dest.mkdir(parents=True, exist_ok=True)
        # A name whose parent directory is not there cannot be reached: drop it.
        for path in sorted(names, key=lambda p: p.count("/")):
            if not path:
                continue
            if _parent(path) not in names:
                del names[path]
                continue
            node = self.inodes[names[path]]
            target = dest / path
            if node.is_dir:
                target.mkdir(exist_ok=True)
                continue
            content = bytearray(node.durable)
            if rnd is not None:
                for _seq, kind, a, data in node.pending:
                    if rnd.random() >= keep:
                        continue
                    if kind == "w" and rnd.random() < 0.25 and len(data) > SECTOR:
                        # Torn: the first sectors of the write only.
                        first = (a // SECTOR + 1) * SECTOR - a
                        cut = first + SECTOR * rnd.randint(0, (len(data) - first) // SECTOR)
                        data = data[: min(cut, len(data))]
                    _apply(content, kind, a, data)
            with open(target, "wb") as f:
                f.write(content)
