"""Accelerators: whether a C loop or its pure-Python reference runs, decided in one place.

Every C loop of the project (the protocol codec, the delivery run, the publish batch, the
store's append and read loops) is an implementation detail of one Python function: it sits
beside that function's pure-Python reference, in the package that owns the rule, and is handed
the names and rule inputs it needs by Python at start (a `configure` call). This module is the
one loader and the one switch rule, for the store and the gateway alike (neither imports the
other's internals; both may import this standard-library-only package).

The switch: LMQTT_PURE_PYTHON keeps every reference; one path's own switch keeps that path's
(LMQTT_PURE_PYTHON_READ, _DELIVERY, _APPEND; _COMPILED for the mypyc group, compiled.py) for
A/B runs and timers. Any value but "" and "0" sets it.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path
from types import ModuleType

ALL = "LMQTT_PURE_PYTHON"
#: What every kernel includes (lmqtt_module, lmqtt_slot_offsets); setup.py's include path.
KERNEL_HEADER = Path(__file__).with_name("kernel.h")


def pure_python(switch: str | None = None) -> bool:
    """True when LMQTT_PURE_PYTHON or `switch` is set: run the reference, not the C code."""
    return any(os.environ.get(name, "") not in ("", "0") for name in (ALL, switch) if name)


def source_digest(source: Path | str) -> str:
    """The SHA-256 a kernel built from `source` reports as SOURCE_SHA256: of the shared
    header and the file, so a build older than either is caught as stale."""
    return hashlib.sha256(KERNEL_HEADER.read_bytes() + Path(source).read_bytes()).hexdigest()


def load(module: str, switch: str | None = None) -> ModuleType | None:
    """The built C extension `module`, or None: not built, or the switch keeps the reference."""
    if pure_python(switch):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
