"""The delivery account: a durable, append-only record of how far each subscription got.

Why it lives in the store: the records hold only opaque strings (queue names, subscriber
names), queue offsets, a QoS number and times, nothing of MQTT, and both the writer (the
gateway) and the reader (analytics, which must never import the gateway) need the one format.
Keeping format, writer and reader together here gives the format exactly one home.

Files, under ``<data_dir>/account/``::

    names       append-only name table: one entry per distinct string, written before the
                first range record that uses it
    ranges      append-only fixed-size range records (RECORD_SIZE bytes each): the first file
    ranges.0000000001, ranges.0000000002, ...
                the files after it: the writer starts the next one once the current one holds
                ROLL_BYTES, so that retention can delete whole old files (store/retention.py:
                a file whose newest record is older than the oldest message the CommitLog
                still holds speaks only of deleted messages). Read in sequence order.

Name entry (big-endian)::

    +-----------+-----------+----------------------+-----------+
    | id (u32)  | len (u16) | UTF-8 bytes (len)    | crc (u32) |   crc32 of id, len and bytes
    +-----------+-----------+----------------------+-----------+

Range record, RECORD_SIZE = 64 bytes, big-endian::

    offset size field
       0    4  MAGIC          0x4C444131 ("LDA1")
       4    1  FLAGS          bit 0 FLAG_CLEAN: the session ends with its connection
                              bit 1 FLAG_SHARED: a shared group ($share/<group>), counted once
                              bit 2 FLAG_CLOSED: the subscription ended at this record
       5    1  QOS            the subscription's maximum QoS (delivered QoS = min(publish, this))
       6    2  reserved       0
       8    4  SUBSCRIBER     name id: the session's client id, or "$share/<group>"
      12    4  QUEUE          name id: the light queue read
      16    8  START          first queue offset the subscription covers (queue end when made)
      24    8  ACKED          every offset in [START, ACKED) is done: acknowledged (QoS 1/2)
                              or sent (QoS 0); the committed offset
      32    8  SENT           the read position: offsets below it were sent or passed over
      40    8  QUEUE_END      the queue's end when written: ACKED..QUEUE_END is the lag; with
                              FLAG_CLOSED, the subscription saw exactly [START, QUEUE_END)
      48    8  TIME_MS        epoch ms when written
      56    4  CRC            crc32(bytes 0..56) of this record
      60    4  reserved       0

Records are cumulative: the newest record of a (subscriber, queue, start) key holds its whole
state, earlier ones are the history (lag over time). A reader skips a record whose CRC does not
match (a torn tail after a crash) or whose names are unknown; the writer truncates a torn tail
when it opens the files again.
"""

from __future__ import annotations

import array
import os
import struct
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ACCOUNT_DIR: Final = "account"
NAMES_FILE: Final = "names"
RANGES_FILE: Final = "ranges"  # sequence 0; then ranges.<10-digit sequence>
ROLL_BYTES: Final = 64 << 20  # a ranges file holds up to 1,048,576 records

MAGIC: Final = 0x4C444131
RECORD: Final = struct.Struct(">IBBHIIqqqqqII")
RECORD_SIZE: Final = RECORD.size  # 64
RECORD_HEAD: Final = struct.Struct(">IBBHIIqqqqq")  # the fields the CRC covers
CRC_SPAN: Final = RECORD_HEAD.size  # 56
NAME_HEAD: Final = struct.Struct(">IH")
NAME_CRC: Final = struct.Struct(">I")

_TAIL: Final = struct.Struct(">II")  # CRC, reserved
FLAG_CLEAN: Final = 1
FLAG_SHARED: Final = 2
FLAG_CLOSED: Final = 4

assert RECORD_SIZE == 64


@dataclass(frozen=True, slots=True)
class AccountRecord:
    """One range record (see the module docstring for the fields)."""

    subscriber: str
    queue: str
    flags: int
    qos: int
    start: int
    acked: int
    sent: int
    queue_end: int
    time_ms: int


def encode_record(flags: int, qos: int, subscriber_id: int, queue_id: int, start: int,
                  acked: int, sent: int, queue_end: int, time_ms: int) -> bytes:  # fmt: skip
    head = RECORD_HEAD.pack(
        MAGIC, flags, qos, 0, subscriber_id, queue_id, start, acked, sent, queue_end, time_ms
    )
    return head + _TAIL.pack(zlib.crc32(head), 0)


def encode_name(name_id: int, name: str) -> bytes:
    raw = name.encode()
    head = NAME_HEAD.pack(name_id, len(raw)) + raw
    return head + NAME_CRC.pack(zlib.crc32(head))


def decode_names(data: bytes) -> tuple[dict[int, str], int]:
    """The name table, and how many bytes of `data` are whole, valid entries."""
    names: dict[int, str] = {}
    pos = 0
    end = len(data)
    while pos + NAME_HEAD.size + NAME_CRC.size <= end:
        name_id, n = NAME_HEAD.unpack_from(data, pos)
        stop = pos + NAME_HEAD.size + n
        if stop + NAME_CRC.size > end:
            break
        (crc,) = NAME_CRC.unpack_from(data, stop)
        if zlib.crc32(data[pos:stop]) != crc:
            break
        try:
            names[name_id] = data[pos + NAME_HEAD.size : stop].decode()
        except UnicodeDecodeError:
            break
        pos = stop + NAME_CRC.size
    return names, pos


def decode_records(data: bytes, names: dict[int, str]) -> list[AccountRecord]:
    """Every valid record of a ranges file (bad CRC, bad magic or unknown names skipped)."""
    out: list[AccountRecord] = []
    view = memoryview(data)
    unpack = RECORD.unpack_from
    for pos in range(0, len(data) - RECORD_SIZE + 1, RECORD_SIZE):
        magic, flags, qos, _, sid, qid, start, acked, sent, qend, t, crc, _ = unpack(data, pos)
        if magic != MAGIC or zlib.crc32(view[pos : pos + CRC_SPAN]) != crc:
            continue
        subscriber = names.get(sid)
        queue = names.get(qid)
        if subscriber is None or queue is None:
            continue
        out.append(AccountRecord(subscriber, queue, flags, qos, start, acked, sent, qend, t))
    return out


def ranges_name(seq: int) -> str:
    return RANGES_FILE if seq == 0 else f"{RANGES_FILE}.{seq:010d}"


def ranges_files(root: Path) -> list[tuple[int, Path]]:
    """The ranges files of an account directory as (sequence, path), oldest first."""
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        name = entry.name
        if name == RANGES_FILE:
            out.append((0, Path(entry.path)))
        elif name.startswith(RANGES_FILE + ".") and name[len(RANGES_FILE) + 1 :].isdigit():
            out.append((int(name[len(RANGES_FILE) + 1 :]), Path(entry.path)))
    out.sort()
    return out


def read_account(data_dir: str | Path) -> list[AccountRecord]:
    """All valid records of a data directory's account, oldest first ([] when there is none)."""
    root = Path(data_dir) / ACCOUNT_DIR
    try:
        names_data = (root / NAMES_FILE).read_bytes()
    except FileNotFoundError:
        return []
    names, _ = decode_names(names_data)
    out: list[AccountRecord] = []
    for _, path in ranges_files(root):
        try:
            out += decode_records(path.read_bytes(), names)
        except FileNotFoundError:
            continue  # deleted by retention since the listing
    return out


_TIME_AT: Final = 48  # TIME_MS's offset in a record (see the table above)


def newest_time_ms(path: Path) -> int | None:
    """The largest TIME_MS of a ranges file's records (CRCs not checked: a damaged record can
    only make the file look newer, i.e. kept longer); None if it holds no whole record."""
    data = path.read_bytes()
    n = len(data) // RECORD_SIZE
    if not n:
        return None
    words = array.array("q")  # 8-byte words, read in bulk: no loop over the records
    words.frombytes(data[: n * RECORD_SIZE])
    if sys.byteorder == "little":
        words.byteswap()  # the file is big-endian
    return max(words[_TIME_AT // 8 :: RECORD_SIZE // 8])


def expired_ranges(data_dir: str | Path, before_ms: int) -> list[Path]:
    """The ranges files every record of which was written before `before_ms` (the store time
    of the oldest message the store still holds): each record speaks only of messages stored
    before it was written, so these speak only of deleted ones. The newest file (the writer's)
    is never among them."""
    files = ranges_files(Path(data_dir) / ACCOUNT_DIR)
    out = []
    for _, path in files[:-1]:
        try:
            newest = newest_time_ms(path)
        except FileNotFoundError:
            continue
        if newest is None or newest < before_ms:
            out.append(path)
    return out


class AccountWriter:
    """Appends records to a data directory's account; one writer per data directory (the
    gateway holds the store's lock). Not thread-safe. Each `append` is one write per file;
    a ranges file that reached `roll_bytes` is followed by the next before the write."""

    def __init__(
        self, data_dir: str | Path, fsync: bool = False, roll_bytes: int = ROLL_BYTES
    ) -> None:
        self.root = Path(data_dir) / ACCOUNT_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._roll_bytes = max(RECORD_SIZE, roll_bytes - roll_bytes % RECORD_SIZE)
        names_path = self.root / NAMES_FILE
        files = ranges_files(self.root)
        self._seq = files[-1][0] if files else 0
        ranges_path = self.root / ranges_name(self._seq)
        try:
            data = names_path.read_bytes()
        except FileNotFoundError:
            data = b""
        names, good = decode_names(data)
        self._ids = {name: i for i, name in names.items()}
        self._next_id = max(names, default=0) + 1
        self._names = os.open(names_path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._names, good)  # a torn tail from a crash
        os.lseek(self._names, good, os.SEEK_SET)
        self._ranges = os.open(ranges_path, os.O_WRONLY | os.O_CREAT, 0o644)
        size = os.fstat(self._ranges).st_size
        whole = size - size % RECORD_SIZE
        os.ftruncate(self._ranges, whole)
        os.lseek(self._ranges, whole, os.SEEK_SET)
        self._size = whole
        self.records_written = 0

    def append(self, records: Iterable[AccountRecord]) -> int:
        """Write `records` (names first); returns how many."""
        new_names: list[bytes] = []
        body: list[bytes] = []
        ids = self._ids
        for r in records:
            sid = ids.get(r.subscriber)
            if sid is None:
                sid = self._new_name(r.subscriber, new_names)
            qid = ids.get(r.queue)
            if qid is None:
                qid = self._new_name(r.queue, new_names)
            body.append(
                encode_record(
                    r.flags, r.qos, sid, qid, r.start, r.acked, r.sent, r.queue_end, r.time_ms
                )
            )
        if new_names:
            _write_all(self._names, b"".join(new_names))
        if body:
            if self._size >= self._roll_bytes:
                self._roll()
            _write_all(self._ranges, b"".join(body))
            self._size += len(body) * RECORD_SIZE
        self.records_written += len(body)
        return len(body)

    def _roll(self) -> None:
        """Start the next ranges file (the full one is complete: retention may delete it)."""
        if self._fsync:
            os.fsync(self._ranges)
        os.close(self._ranges)
        self._seq += 1
        path = self.root / ranges_name(self._seq)
        self._ranges = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 0

    def _new_name(self, name: str, out: list[bytes]) -> int:
        i = self._ids[name] = self._next_id
        self._next_id += 1
        out.append(encode_name(i, name))
        return i

    def sync(self) -> None:
        os.fsync(self._names)
        os.fsync(self._ranges)

    def close(self) -> None:
        if self._ranges < 0:
            return
        if self._fsync:
            self.sync()
        os.close(self._names)
        os.close(self._ranges)
        self._names = self._ranges = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
