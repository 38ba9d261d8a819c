"""store/_speedups.c, loaded through the one loader and handed the record format it writes."""

from __future__ import annotations

from types import ModuleType

import accelerators
from store.format import (
    CQ_UNIT_SIZE,
    CRC_MASK,
    CRC_PREFIX,
    HEADER_SIZE,
    MAGIC,
    OFF_BODYCRC,
    OFF_BODYLENGTH,
    OFF_BORNTIMESTAMP,
    OFF_MAGIC,
    OFF_PHYSICALOFFSET,
    OFF_QUEUEOFFSET,
    OFF_STORETIMESTAMP,
    OFF_TOTALSIZE,
)

#: Offsets of the header fields the record step sets (the others are zeros), in the order the
#: C module's ``configure`` takes them.
WRITTEN_FIELDS = (
    OFF_TOTALSIZE, OFF_MAGIC, OFF_BODYCRC, OFF_QUEUEOFFSET, OFF_PHYSICALOFFSET,
    OFF_BORNTIMESTAMP, OFF_STORETIMESTAMP, OFF_BODYLENGTH,
)  # fmt: skip


def configure(kernel: ModuleType) -> None:
    """Hand the C module the record format of store/format.py (it spells none of it)."""
    kernel.configure(MAGIC, CRC_MASK, CRC_PREFIX, HEADER_SIZE, WRITTEN_FIELDS, CQ_UNIT_SIZE)


def load(switch: str | None = None) -> ModuleType | None:
    """store._speedups, configured; None when it was not built or a switch keeps the
    references (accelerators.load: LMQTT_PURE_PYTHON, or ``switch``)."""
    kernel = accelerators.load("store._speedups", switch)
    if kernel is not None:
        configure(kernel)
    return kernel
