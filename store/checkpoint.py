"""The checkpoint: how far the CommitLog and the consume queues are known to be durable.

Layout (big-endian, 60 bytes; the first 40 follow RocketMQ's StoreCheckpoint)::

    offset size field
       0    8  physic_msg_timestamp   store timestamp of the last flushed record (ms)
       8    8  logics_msg_timestamp   same, for the consume queues
      16    8  index_msg_timestamp    unused, 0
      24    8  log_flushed_offset     CommitLog bytes fsynced (a record boundary)
      32    8  queues_flushed_offset  consume-queue units durable for records below this
      40    8  units_total            consume-queue units of all records below queues_flushed
      48    4  magic                  0x4C4D5143 ("LMQC")
      52    4  version                1
      56    4  crc32 of bytes [0, 56)

``units_total`` lets recovery notice deleted consume-queue files: after dropping units at or
past ``queues_flushed_offset``, the queues on disk must hold exactly that many.

Written atomically (temp + fsync + rename). A missing or damaged checkpoint is not an error:
recovery then validates the whole CommitLog.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from store.atomicfile import write_atomic

CHECKPOINT: Final = struct.Struct(">qqqqqqII")
CHECKPOINT_MAGIC: Final = 0x4C4D5143
CHECKPOINT_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Checkpoint:
    log_flushed_offset: int = 0
    queues_flushed_offset: int = 0
    physic_msg_timestamp: int = 0
    logics_msg_timestamp: int = 0
    units_total: int = 0

    def encode(self) -> bytes:
        body = CHECKPOINT.pack(
            self.physic_msg_timestamp, self.logics_msg_timestamp, 0,
            self.log_flushed_offset, self.queues_flushed_offset, self.units_total,
            CHECKPOINT_MAGIC, CHECKPOINT_VERSION,
        )  # fmt: skip
        return body + struct.pack(">I", zlib.crc32(body))

    @classmethod
    def decode(cls, data: bytes) -> Checkpoint | None:
        """None for a truncated, foreign or damaged checkpoint."""
        if len(data) < CHECKPOINT.size + 4:
            return None
        body = data[: CHECKPOINT.size]
        (crc,) = struct.unpack_from(">I", data, CHECKPOINT.size)
        if zlib.crc32(body) != crc:
            return None
        pts, lts, _its, log_off, cq_off, units, magic, version = CHECKPOINT.unpack(body)
        if magic != CHECKPOINT_MAGIC or version != CHECKPOINT_VERSION:
            return None
        if min(log_off, cq_off, units) < 0:
            return None
        return cls(log_off, cq_off, pts, lts, units)


def read_checkpoint(path: Path) -> Checkpoint | None:
    try:
        return Checkpoint.decode(path.read_bytes())
    except FileNotFoundError:
        return None


def write_checkpoint(path: Path, cp: Checkpoint) -> None:
    write_atomic(path, cp.encode())
