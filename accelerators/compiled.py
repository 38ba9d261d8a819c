"""The modules compiled with mypyc: the session path's Python, run as C without a line of C.

lmqtt's cost is interpreter work between its C kernels (docs/benchmarks.md). The modules listed
in MODULES are compiled by mypyc (setup.py) from their own source, which stays the reference:
the same file runs as Python when no compiled build is there, when LMQTT_PURE_PYTHON is set,
or when any of them changed since the build. They compile as one group (one shared library):
compiled code calls the group's other functions and classes natively, so the group runs
compiled or as source as a whole, never half and half (a class would exist twice).

What the build leaves beside this file (generated, not committed): BUILT_DIGESTS, the SHA-256
of every listed source as it was compiled. Importing this module (each package holding a listed
module does it before anything else) calls `install()`, which compares them with the sources:
when they differ (a module edited after the build, say in a checkout whose `make` has not run
again), every listed module is imported from its source, and the first import logs why.

A listed module must be one mypyc compiles, and that runs the same compiled (the group's own
tests run both ways; what else differs is in docs/benchmarks.md, "mypyc"):
- no class of it subclassed by an unlisted module, nor subclassing an unlisted one with
  __slots__;
- no class whose instances get a method replaced (the metrics wrapper times the store's
  appends that way: store/store.py and its adapter stay interpreted), nor one a C kernel
  reads by slot (the kernels' `configure` rejects a compiled class);
- no attribute named like a C keyword once mangled (`_thread`, `_volatile`), no `continue`
  inside try/finally (mypyc refuses both);
- annotations that hold at run time (a compiled build checks them: a value typed `bytes` that
  may be a bytearray fails), and no narrowed attribute read again after a call or an await
  that may assign it (mypy keeps the narrowing; the compiled read checks it). Where the read
  is a check again (`if self.x is None` after an await), mypy finds it unreachable: that is
  an error, in `make lint` and in the build (setup.py);
- no method assigned on an instance (a native class's methods are read-only), no method
  aliased in its class body (`frames = frames_py`), no async generator.
Standard library only, like the package.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from accelerators import pure_python

ROOT = Path(__file__).resolve().parents[1]
#: The sources' digests at build time, written by setup.py (generated; see .gitignore).
BUILT_DIGESTS = Path(__file__).with_name("compiled.json")
#: The group's shared library: the extension module `lmqtt_compiled__mypyc` at the top level.
GROUP = "lmqtt_compiled"
#: Runs the group from its source while the C kernels stay (LMQTT_PURE_PYTHON: both): for
#: A/B runs, and for bench/stages.py, whose timers wrap methods a compiled caller would call
#: past them.
SWITCH = "LMQTT_PURE_PYTHON_COMPILED"

#: The compiled group: the connection, session, subscription and state-log path of a device
#: (CONNECT, SUBSCRIBE, DISCONNECT, the records they leave), the publishes' way into the store
#: (the ingest batch, the publish path, the recent messages) and the delivery loop, with what
#: they call.
MODULES: tuple[str, ...] = (
    "gateway.access.control",
    "gateway.access.flapping",
    "gateway.access.limits",
    "gateway.connection.client",
    "gateway.connection.connect",
    "gateway.connection.ingest",
    "gateway.connection.keep_alive",
    "gateway.connection.reader",
    "gateway.connection.subscribe",
    "gateway.connection.timers",
    "gateway.connection.transport",
    "gateway.delivery.account",
    "gateway.delivery.acks",
    "gateway.delivery.arrivals",
    "gateway.delivery.load",
    "gateway.delivery.loop",
    "gateway.delivery.overlap",
    "gateway.delivery.pacing",
    "gateway.delivery.replay",
    "gateway.delivery.rules",
    "gateway.delivery.send",
    "gateway.delivery.state",
    "gateway.lifecycle.sessions",
    "gateway.lifecycle.subscriptions",
    "gateway.messages.publishing",
    "gateway.messages.recent",
    "gateway.session.expiry",
    "gateway.session.qos2",
    "gateway.session.registry",
    "gateway.session.wills",
    "store.offsets",
    "store.statelog",
    "topicmap.naming",
    "topicmap.router",
    "topicmap.topic",
)

log = logging.getLogger("lmqtt.accelerators")


def source_of(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def sources(modules: Sequence[str] = MODULES) -> list[str]:
    """The listed modules' source files, relative to the project root (the Makefile's)."""
    return [str(source_of(m).relative_to(ROOT)) for m in modules]


def stale_builds() -> list[Path]:
    """Compiled builds of modules no longer in the group (a `.so` beside a `.py` of the same
    name: the C kernels have none), which Python would import before their source."""
    found = []
    for package in ("gateway", "store", "topicmap", "analytics", "rocketmq_remoting", "sim"):
        for built in (ROOT / package).rglob("*.cpython-*.so"):
            source = built.with_name(built.name.split(".", 1)[0] + ".py")
            module = ".".join(source.relative_to(ROOT).with_suffix("").parts)
            if source.exists() and module not in MODULES:
                found.append(built)
    return found


def digests(modules: Sequence[str] = MODULES) -> dict[str, str]:
    """SHA-256 of each module's source, by module name."""
    return {m: hashlib.sha256(source_of(m).read_bytes()).hexdigest() for m in modules}


def built_digests() -> dict[str, str]:
    """The digests the last build wrote ({}: no build, or one without mypyc)."""
    try:
        built = json.loads(BUILT_DIGESTS.read_text())
    except (OSError, ValueError):
        return {}
    return built if isinstance(built, dict) else {}


def why_source() -> str | None:
    """Why the group runs from its source (None: it runs compiled, if it was built)."""
    if pure_python():
        return "LMQTT_PURE_PYTHON is set"
    if pure_python(SWITCH):
        return f"{SWITCH} is set"
    built = built_digests()
    if not built:
        return "not compiled"
    now = digests()
    if built != now:
        changed = sorted(m for m in {*built, *now} if built.get(m) != now.get(m))
        return f"changed since the build: {', '.join(changed)} (make builds it again)"
    return None


class _FromSource(importlib.abc.MetaPathFinder):
    """Imports the group's modules from their .py files, whatever extension sits beside
    them (the modules listed now, and those of the last build if the list changed since)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.told = False
        self.names = {*MODULES, *built_digests()}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names or not source_of(fullname).exists():
            return None
        if not self.told and self.reason.startswith("changed"):  # the others are chosen
            self.told = True
            log.warning("compiled modules not used: %s", self.reason)
        return importlib.util.spec_from_file_location(fullname, source_of(fullname))


_decided = False


def install() -> None:
    """Decide once, before the first listed module is imported, how the group runs."""
    global _decided
    if _decided:
        return
    _decided = True
    reason = why_source()
    if reason is not None:
        sys.meta_path.insert(0, _FromSource(reason))


install()
