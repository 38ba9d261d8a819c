"""The recorder: build the fsrecord.c shim, run a process under it, parse its log.

The shim is compiled at test time with the system C compiler into a temporary directory (no
binary is ever committed). Its log format is drawn at the top of fsrecord.c.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

SHIM_SOURCE = Path(__file__).with_name("fsrecord.c")

#: magic, type, seq, t_ns, a, b, len(path), len(path2), len(data)
HEADER = struct.Struct("<IIQqqqIIQ")
MAGIC = 0x31525343  # "CSR1"

CREATE, TRUNC, WRITE, MKDIR, RENAME, UNLINK, RMDIR, SYNC = range(1, 9)
O_TRUNC = 0o1000


@dataclass(frozen=True, slots=True)
class Op:
    """One recorded file-system call (paths relative to the recorded root)."""

    kind: int
    seq: int
    t_ns: int  # CLOCK_MONOTONIC, the clock of Python's time.monotonic_ns()
    a: int  # CREATE: open flags; TRUNC: size; WRITE: offset; SYNC: durable up to this seq
    path: str
    path2: str = ""
    data: bytes = b""


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build_shim(out_dir: Path) -> Path:
    """Compile the shim into ``out_dir``; returns the .so path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    so = out_dir / "fsrecord.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(SHIM_SOURCE), "-ldl", "-lpthread"],
        check=True,
        capture_output=True,
    )
    return so


def parse(log: bytes, root: str) -> list[Op]:
    """The records of a shim log, paths made relative to ``root`` ("" is the root itself)."""
    ops: list[Op] = []
    pos = 0
    prefix = root.rstrip("/")

    def rel(p: bytes) -> str:
        s = p.decode()
        if s == prefix:
            return ""
        assert s.startswith(prefix + "/"), s
        return s[len(prefix) + 1 :]

    while pos < len(log):
        magic, kind, seq, t_ns, a, _b, l1, l2, dl = HEADER.unpack_from(log, pos)
        if magic != MAGIC:
            raise ValueError(f"bad record at {pos}")
        pos += HEADER.size
        p1 = log[pos : pos + l1]
        p2 = log[pos + l1 : pos + l1 + l2]
        data = log[pos + l1 + l2 : pos + l1 + l2 + dl]
        pos += l1 + l2 + dl
        ops.append(Op(kind, seq, t_ns, a, rel(p1), rel(p2) if l2 else "", bytes(data)))
    ops.sort(key=lambda o: o.seq)
    return ops
