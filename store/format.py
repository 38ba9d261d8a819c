"""On-disk formats of the store: CommitLog records, consume-queue units, file names.

Pure module: no I/O, no side effects on import, standard library only. The analytics package
reads CommitLog segments with nothing but this module, so everything a reader needs to
interpret the files lives here (the files themselves are read by store.commitlog's and
store.consumequeue's readers).

The layouts are drawn next to their constants below; every struct that reads or writes a
record header is derived from one field table (HEADER_LAYOUT), and the record reader (check,
decode, walk, dispatch fields) lives here beside the writer (append_record).

File names::

    <data_dir>/commitlog/<20-digit start byte offset>
    <data_dir>/consumequeue/<encoded queue name>/0/<20-digit start byte offset in the queue>

A consume-queue file holds at most ``units_per_file`` units (300,000 in RocketMQ) and grows on
demand instead of being preallocated.
"""

from __future__ import annotations

import itertools
import mmap
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

# ---------------------------------------------------------------------------------------------
# Record constants
# ---------------------------------------------------------------------------------------------
# CommitLog record (RocketMQ message layout v1, IPv4 hosts, big-endian)::
#
#     offset size field
#        0    4  TOTALSIZE                 whole record, this field included
#        4    4  MAGICCODE                 0xDAA320A7 (MAGIC)
#        8    4  BODYCRC                   crc32(body) & 0x7FFFFFFF
#       12    4  QUEUEID                   always 0: one queue per parent topic
#       16    4  FLAG                      0
#       20    8  QUEUEOFFSET               offset of the message in its parent queue
#       28    8  PHYSICALOFFSET            offset of this record in the CommitLog
#       36    4  SYSFLAG                   0 (IPv4 hosts, uncompressed)
#       40    8  BORNTIMESTAMP             ms since the epoch, given by the producer
#       48    8  BORNHOST                  IPv4 4 + port 4 (zeros: the gateway keeps the client id)
#       56    8  STORETIMESTAMP            ms since the epoch, taken under the append lock
#       64    8  STOREHOST                 IPv4 4 + port 4 (zeros)
#       72    4  RECONSUMETIMES            0
#       76    8  PREPAREDTRANSACTIONOFFSET 0
#       84    4  BODYLENGTH  + BODY
#        .    1  TOPICLENGTH + TOPIC       UTF-8, at most 127 bytes
#        .    2  PROPERTIESLENGTH + PROPERTIES
#
#     PROPERTIES = key \x01 value \x02  key \x01 value \x02 ... "__CRC32#" \x01 dddddddddd \x02
#                                                               '-------- CRC_TRAILER: 20 bytes --'
#     The final property is always __CRC32#, ten zero-padded decimal digits of
#     crc32(record[0 : TOTALSIZE - 20]) & 0x7FFFFFFF, as RocketMQ 5.x writes it with
#     enabledAppendPropCRC, so a torn record is detected wherever the tear is.
#     INNER_MULTI_DISPATCH     = comma-separated light queue names the message was dispatched to
#     INNER_MULTI_QUEUE_OFFSET = the message's offset in each of them, same order
#
# Blank filler, written when a record (plus 8 bytes) does not fit at the end of a segment::
#
#     +----------------------+----------------------+- - - - - - - - - - -+
#     | remaining bytes (4)  | BLANK_MAGIC (4)      |  unused to segment end |
#     +----------------------+----------------------+- - - - - - - - - - -+
MAGIC: Final = 0xDAA320A7
BLANK_MAGIC: Final = 0xCBD43194

#: The fixed part of a record (the table above), field by field: name and struct code. Every
#: struct that reads or writes a header is derived from this one table by :func:`header_struct`.
HEADER_LAYOUT: Final = (
    ("TOTALSIZE", "i"), ("MAGICCODE", "I"), ("BODYCRC", "I"), ("QUEUEID", "i"), ("FLAG", "i"),
    ("QUEUEOFFSET", "q"), ("PHYSICALOFFSET", "q"), ("SYSFLAG", "i"), ("BORNTIMESTAMP", "q"),
    ("BORNHOST", "I"), ("BORNPORT", "i"), ("STORETIMESTAMP", "q"), ("STOREHOST", "I"),
    ("STOREPORT", "i"), ("RECONSUMETIMES", "i"), ("PREPAREDTRANSACTIONOFFSET", "q"),
    ("BODYLENGTH", "i"),
)  # fmt: skip
_FIELD_AT: Final = dict(
    zip(
        (name for name, _ in HEADER_LAYOUT),
        itertools.accumulate((struct.calcsize(">" + c) for _, c in HEADER_LAYOUT), initial=0),
        strict=False,
    )
)


def header_struct(*names: str) -> struct.Struct:
    """A struct over the record header that reads (or writes) only ``names``, in layout order.

    The other fields up to the last one named are pad bytes: skipped when unpacking, zeros when
    packing. One struct call then fetches exactly the fields a reader needs.
    """
    unknown = set(names) - _FIELD_AT.keys()
    if unknown:
        raise ValueError(f"not header fields: {sorted(unknown)}")
    last = max(_FIELD_AT[n] for n in names)
    parts = []
    for name, code in HEADER_LAYOUT:
        if _FIELD_AT[name] > last:
            break
        parts.append(code if name in names else f"{struct.calcsize('>' + code)}x")
    return struct.Struct(">" + "".join(parts))


#: Offsets of the fields readers need without decoding the whole header.
OFF_TOTALSIZE: Final = _FIELD_AT["TOTALSIZE"]  # 0
OFF_MAGIC: Final = _FIELD_AT["MAGICCODE"]  # 4
OFF_BODYCRC: Final = _FIELD_AT["BODYCRC"]  # 8
OFF_QUEUEOFFSET: Final = _FIELD_AT["QUEUEOFFSET"]  # 20
OFF_PHYSICALOFFSET: Final = _FIELD_AT["PHYSICALOFFSET"]  # 28
OFF_BORNTIMESTAMP: Final = _FIELD_AT["BORNTIMESTAMP"]  # 40
OFF_STORETIMESTAMP: Final = _FIELD_AT["STORETIMESTAMP"]  # 56
OFF_BODYLENGTH: Final = _FIELD_AT["BODYLENGTH"]  # 84

# The struct set: every reader and writer of records uses these, and only these.
#: The whole fixed part, all 17 fields (decode_record).
HEADER: Final = header_struct(*_FIELD_AT)
HEADER_SIZE: Final = HEADER.size  # 88
OFF_BODY: Final = HEADER_SIZE  # BODY follows BODYLENGTH; TOPICLENGTH follows the body
#: The writer's header: the always-zero fields (QUEUEID, FLAG, SYSFLAG, hosts, RECONSUMETIMES,
#: PREPAREDTRANSACTIONOFFSET) are pad bytes, 8 arguments to convert instead of 17 on the hot
#: path of every append (append_record; store/_speedups.c writes the same bytes).
RECORD_HEAD: Final = header_struct(
    "TOTALSIZE", "MAGICCODE", "BODYCRC", "QUEUEOFFSET", "PHYSICALOFFSET", "BORNTIMESTAMP",
    "STORETIMESTAMP", "BODYLENGTH",
)  # fmt: skip
#: TOTALSIZE + MAGICCODE: how a walk finds the next record; also the blank filler.
SIZE_MAGIC: Final = header_struct("TOTALSIZE", "MAGICCODE")
#: What validation needs to check a record's lengths (scan_records, check_record).
SCAN_FIELDS: Final = header_struct("TOTALSIZE", "MAGICCODE", "BODYLENGTH")
#: What dispatch needs: size, magic, the parent queue offset and where the topic starts.
DISPATCH_FIELDS: Final = header_struct("TOTALSIZE", "MAGICCODE", "QUEUEOFFSET", "BODYLENGTH")
#: What a read of a queue returns besides body, topic and properties (MessageStore.get).
READ_FIELDS: Final = header_struct("QUEUEOFFSET", "BORNTIMESTAMP", "STORETIMESTAMP", "BODYLENGTH")
#: The store timestamp alone (offset_by_time bisects on it).
STORE_TIMESTAMP: Final = header_struct("STORETIMESTAMP")
#: The variable part's length fields.
TOPIC_LEN: Final = struct.Struct(">B")
PROPS_LEN: Final = struct.Struct(">H")

#: Bytes of a record besides body, topic and properties (RocketMQ's "91 bytes" for IPv4).
FIXED_OVERHEAD: Final = HEADER_SIZE + TOPIC_LEN.size + PROPS_LEN.size
#: The __CRC32# trailer, formatted with ``crc32(record[0 : TOTALSIZE - 20]) & CRC_MASK``.
CRC_TRAILER_FORMAT: Final = b"__CRC32#\x01%010d\x02"

#: A segment always keeps room for a blank filler header (RocketMQ END_FILE_MIN_BLANK_LENGTH).
END_FILE_MIN_BLANK_LENGTH: Final = 8
MAX_TOPIC_BYTES: Final = 127  # TOPICLENGTH is a (signed, in Java) byte
MAX_PROPERTIES_BYTES: Final = 32767  # PROPERTIESLENGTH is a (signed, in Java) short

# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------
NAME_VALUE_SEPARATOR: Final = "\x01"
PROPERTY_SEPARATOR: Final = "\x02"
PROP_MULTI_DISPATCH: Final = "INNER_MULTI_DISPATCH"
PROP_MULTI_QUEUE_OFFSET: Final = "INNER_MULTI_QUEUE_OFFSET"
PROP_CRC32: Final = "__CRC32#"
MULTI_DISPATCH_SEPARATOR: Final = ","
#: Keys the store writes itself; callers may not set them.
RESERVED_PROPERTIES: Final = frozenset({PROP_MULTI_DISPATCH, PROP_MULTI_QUEUE_OFFSET, PROP_CRC32})

CRC_PREFIX: Final = (PROP_CRC32 + NAME_VALUE_SEPARATOR).encode()
#: "__CRC32#" \x01 + 10 digits + \x02
CRC_TRAILER_SIZE: Final = len(CRC_PREFIX) + 10 + 1  # 20
#: The smallest record: empty body, a 1-byte topic, no properties but the __CRC32# trailer.
MIN_RECORD_SIZE: Final = FIXED_OVERHEAD + 1 + CRC_TRAILER_SIZE
CRC_MASK: Final = 0x7FFFFFFF  # RocketMQ's UtilAll.crc32 masks the sign bit

DISPATCH_PREFIX: Final = (PROP_MULTI_DISPATCH + NAME_VALUE_SEPARATOR).encode()
QOFFSET_PREFIX: Final = (PROP_MULTI_QUEUE_OFFSET + NAME_VALUE_SEPARATOR).encode()

# ---------------------------------------------------------------------------------------------
# Consume-queue unit
# ---------------------------------------------------------------------------------------------
# Consume-queue unit (20 bytes, big-endian); queue offset N is unit N::
#
#     +---------------------------+----------------+---------------------------+
#     | CommitLog offset (int64)  | size (int32)   | tag hash (int64, always 0) |
#     +---------------------------+----------------+---------------------------+
CQ_UNIT: Final = struct.Struct(">qiq")
CQ_UNIT_SIZE: Final = CQ_UNIT.size  # 20
CQ_UNITS_PER_FILE: Final = 300_000
QUEUE_ID: Final = 0  # every queue, parent or light, is queue 0 of its name

# ---------------------------------------------------------------------------------------------
# Directory and file names
# ---------------------------------------------------------------------------------------------
COMMITLOG_DIR: Final = "commitlog"
CONSUMEQUEUE_DIR: Final = "consumequeue"
CONFIG_DIR: Final = "config"
CHECKPOINT_FILE: Final = "checkpoint"
ABORT_FILE: Final = "abort"
LOCK_FILE: Final = "lock"
FILE_NAME_DIGITS: Final = 20
#: Longest encoded queue directory name; file systems allow 255 bytes per component.
MAX_ENCODED_NAME: Final = 240

#: Characters kept as they are in a queue's directory name. '%' stays so "%LMQ%x" and
#: "%RETAIN%" read as in RocketMQ; '+' is the escape character and is itself escaped.
_SAFE_NAME_CHARS: Final = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.%"
)
#: A name made of _SAFE_NAME_CHARS only (checked in C: every new subscription's queue asks).
_SAFE_NAME: Final = re.compile(r"[A-Za-z0-9_\-.%]+")
#: str.translate table: every byte value outside _SAFE_NAME_CHARS -> "+HH".
_BYTE_ESCAPES: Final = {b: f"+{b:02X}" for b in range(256) if chr(b) not in _SAFE_NAME_CHARS}


def offset_file_name(offset: int) -> str:
    """20-digit zero-padded name of a file starting at ``offset`` (RocketMQ's naming)."""
    return f"{offset:020d}"


def parse_offset_file_name(name: str) -> int | None:
    """Start offset of a file named by :func:`offset_file_name`, or None for any other name."""
    if len(name) != FILE_NAME_DIGITS or not name.isascii() or not name.isdigit():
        return None
    return int(name)


def commitlog_path(start_offset: int) -> str:
    """Path of a CommitLog segment relative to the data directory."""
    return f"{COMMITLOG_DIR}/{offset_file_name(start_offset)}"


def consumequeue_path(queue: str, start_unit: int) -> str:
    """Path of the consume-queue file of ``queue`` holding unit ``start_unit`` first."""
    return (
        f"{CONSUMEQUEUE_DIR}/{encode_queue_dir(queue)}/{QUEUE_ID}/"
        f"{offset_file_name(start_unit * CQ_UNIT_SIZE)}"
    )


def encode_queue_dir(queue: str) -> str:
    """Reversible, collision-free directory name for an opaque queue name.

    Bytes outside ``[A-Za-z0-9_.%-]`` of the UTF-8 form become ``+HH``; a name made only of
    dots gets its first dot escaped so "." and ".." never appear. Raises ValueError for names
    that cannot be a file-name component (empty, or longer than MAX_ENCODED_NAME encoded).
    """
    if not queue:
        raise ValueError("empty queue name")
    if _SAFE_NAME.fullmatch(queue) and queue.strip("."):
        encoded = queue
    else:
        # Each UTF-8 byte as the character of that code point, then the escapes (in C).
        encoded = queue.encode("utf-8", "surrogatepass").decode("latin-1")
        encoded = encoded.translate(_BYTE_ESCAPES)
        if not queue.strip("."):
            encoded = "+2E" + encoded[1:]
    if len(encoded) > MAX_ENCODED_NAME:
        raise ValueError(f"queue name too long for a file name ({len(encoded)} bytes encoded)")
    return encoded


def decode_queue_dir(name: str) -> str | None:
    """Inverse of :func:`encode_queue_dir`; None for a name it never produces."""
    if "+" not in name:
        return name if name and all(c in _SAFE_NAME_CHARS for c in name) else None
    raw = bytearray()
    i, n = 0, len(name)
    while i < n:
        c = name[i]
        if c == "+":
            h = name[i + 1 : i + 3]
            if len(h) != 2 or any(x not in "0123456789ABCDEF" for x in h):
                return None
            raw.append(int(h, 16))
            i += 3
        elif c in _SAFE_NAME_CHARS:
            raw.append(ord(c))
            i += 1
        else:
            return None
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


# ---------------------------------------------------------------------------------------------
# Codec
# ---------------------------------------------------------------------------------------------
def encode_properties(properties: dict[str, str] | None) -> bytes:
    """``key\\x01value\\x02`` pairs (no CRC trailer). Separators inside keys/values are refused."""
    if not properties:
        return b""
    parts = []
    for k, v in properties.items():
        if not k or "\x01" in k or "\x02" in k or "\x01" in v or "\x02" in v:
            raise ValueError(f"property {k!r} contains a separator or is empty")
        parts.append(f"{k}\x01{v}\x02")
    return "".join(parts).encode("utf-8")


def inner_head(queues: Sequence[str]) -> bytes:
    """The store's INNER_* properties up to the light-queue offsets (b"" without queues):
    ``INNER_MULTI_DISPATCH \x01 q1,q2 \x02 INNER_MULTI_QUEUE_OFFSET \x01``. Only the offsets
    (then \x02) vary per message, so writers build this once per set of queues."""
    if not queues:
        return b""
    return b"".join((DISPATCH_PREFIX, ",".join(queues).encode("utf-8"), b"\x02", QOFFSET_PREFIX))


def dispatch_properties(queues: Sequence[str], offsets: Sequence[int]) -> bytes:
    """INNER_MULTI_DISPATCH and INNER_MULTI_QUEUE_OFFSET properties for light queues."""
    if not queues:
        return b""
    return b"".join((inner_head(queues), ",".join(map(str, offsets)).encode(), b"\x02"))


_pack_head = RECORD_HEAD.pack
_pack_plen = PROPS_LEN.pack
_crc32 = zlib.crc32


def append_record(
    buf: bytearray,
    room: int,
    queue_offset: int,
    physical_offset: int,
    born: int,
    stored: int,
    body: bytes,
    topic_field: bytes,
    user_props: bytes,
    inner_head: bytes,
    light_offsets: tuple[int, ...],
) -> int:
    """Append one record to ``buf`` and return its size; -1 (nothing appended) if it would
    take more than ``room`` bytes. The append loop's record step (store/append.py).

    ``topic_field`` is TOPICLENGTH + TOPIC; the properties are ``user_props`` then, with light
    queues, ``inner_head`` (INNER_MULTI_DISPATCH pair and the INNER_MULTI_QUEUE_OFFSET key)
    followed by the comma-separated ``light_offsets`` and \x02, then the CRC trailer. This
    is the reference: store/_speedups.c does the same in C and must give the same bytes.
    Built as one bytes object and appended once: on CPython that beats several small writes.
    """
    if light_offsets:
        offsets = b",".join([b"%d" % o for o in light_offsets])
        props = b"".join((user_props, inner_head, offsets, b"\x02"))
    else:
        props = user_props
    blen = len(body)
    plen = len(props) + CRC_TRAILER_SIZE
    size = FIXED_OVERHEAD + blen + len(topic_field) - 1 + plen
    if size > room:
        return -1
    rec = b"".join(
        (
            _pack_head(
                size, MAGIC, _crc32(body) & CRC_MASK, queue_offset, physical_offset, born,
                stored, blen,
            ),
            body, topic_field, _pack_plen(plen), props,
        )
    )  # fmt: skip
    buf += rec
    buf += CRC_TRAILER_FORMAT % (_crc32(rec) & CRC_MASK)
    return size


def encode_record(
    *,
    topic: str,
    body: bytes,
    properties: dict[str, str] | None = None,
    queues: list[str] | tuple[str, ...] = (),
    queue_offsets: list[int] | None = None,
    queue_offset: int = 0,
    physical_offset: int = 0,
    born_timestamp: int = 0,
    store_timestamp: int = 0,
) -> bytes:
    """Encode a complete record (the form of :func:`append_record` for tests and tools)."""
    t = topic.encode("utf-8")
    if not 0 < len(t) <= MAX_TOPIC_BYTES:
        raise ValueError("topic must be 1..127 UTF-8 bytes")
    user = encode_properties(properties)
    offsets = tuple(queue_offsets) if queue_offsets is not None else (0,) * len(queues)
    if len(offsets) != len(queues):
        raise ValueError("queue_offsets and queues differ in length")
    if len(user) + len(dispatch_properties(queues, offsets)) + CRC_TRAILER_SIZE > (
        MAX_PROPERTIES_BYTES
    ):
        raise ValueError("properties too long")
    buf = bytearray()
    append_record(
        buf, 1 << 62, queue_offset, physical_offset, born_timestamp, store_timestamp, body,
        bytes((len(t),)) + t, user, inner_head(queues), offsets,
    )  # fmt: skip
    return bytes(buf)


@dataclass(frozen=True, slots=True)
class DecodedRecord:
    """One CommitLog record as stored. ``properties`` holds every property except __CRC32#."""

    size: int
    queue_offset: int
    physical_offset: int
    born_timestamp: int
    store_timestamp: int
    topic: str
    body: bytes
    properties: dict[str, str]

    @property
    def queues(self) -> list[str]:
        """Light queues of INNER_MULTI_DISPATCH (empty if none)."""
        v = self.properties.get(PROP_MULTI_DISPATCH)
        return v.split(MULTI_DISPATCH_SEPARATOR) if v else []

    @property
    def queue_offsets(self) -> list[int]:
        """Offsets of INNER_MULTI_QUEUE_OFFSET (empty if none)."""
        v = self.properties.get(PROP_MULTI_QUEUE_OFFSET)
        return [int(x) for x in v.split(MULTI_DISPATCH_SEPARATOR)] if v else []


class _Blank:
    """Marker type of :data:`BLANK`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "BLANK"


#: Returned by :func:`decode_record` for a blank filler: the rest of the segment is unused.
BLANK: Final = _Blank()


def parse_properties(raw: bytes | str) -> dict[str, str]:
    """Parse ``key\\x01value\\x02`` pairs; malformed pairs raise ValueError."""
    s = raw.decode("utf-8") if isinstance(raw, bytes | bytearray | memoryview) else raw
    out: dict[str, str] = {}
    if not s:
        return out
    if not s.endswith("\x02"):
        raise ValueError("properties do not end with a separator")
    for pair in s[:-1].split("\x02"):
        k, sep, v = pair.partition("\x01")
        if not sep or not k or "\x01" in v:
            raise ValueError(f"malformed property {pair!r}")
        out[k] = v
    return out


def check_record(buf: bytes | bytearray | memoryview | object, pos: int, limit: int) -> int:
    """Validate the record at ``pos`` without decoding it.

    Returns the record size (> 0) if magic, length bounds and the __CRC32# trailer check out,
    0 for a blank filler or unwritten space (TOTALSIZE 0), and -1 for anything else (torn or
    corrupt). ``limit`` is the end of readable data (segment end).
    """
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)  # type: ignore[arg-type]
    if pos + 8 > limit:
        return 0 if pos >= limit or not any(mv[pos:limit]) else -1
    size, magic = SIZE_MAGIC.unpack_from(mv, pos)
    if magic == BLANK_MAGIC:
        return 0 if size == limit - pos else -1
    if magic != MAGIC:
        return 0 if size == 0 and magic == 0 else -1
    if size < MIN_RECORD_SIZE or pos + size > limit:
        return -1
    end = pos + size
    trailer = mv[end - CRC_TRAILER_SIZE : end]
    if trailer[:9] != CRC_PREFIX or trailer[19] != 2:
        return -1
    digits = bytes(trailer[9:19])
    if not digits.isdigit():
        return -1
    if zlib.crc32(mv[pos : end - CRC_TRAILER_SIZE]) & CRC_MASK != int(digits):
        return -1
    # Inner lengths must add up exactly, or the CRC matched by accident of a foreign writer.
    blen = SCAN_FIELDS.unpack_from(mv, pos)[2]
    p = pos + HEADER_SIZE + blen
    if blen < 0 or p + 3 > end:
        return -1
    tlen = mv[p]
    p += 1 + tlen
    if p + 2 > end:
        return -1
    plen = PROPS_LEN.unpack_from(mv, p)[0]
    if p + 2 + plen != end:
        return -1
    return int(size)


_SIZE_MAGIC_BLEN = SCAN_FIELDS.unpack_from
_U16 = PROPS_LEN.unpack_from
_CRC_PREFIX_LEN = len(CRC_PREFIX)


def scan_valid(
    mm: bytes | bytearray | mmap.mmap, view: memoryview, rel: int, limit: int
) -> tuple[int, int]:
    """Skip valid records from ``rel``: returns ``(where the first non-record starts, count)``.

    The checks of :func:`check_record` (magic, length bounds, __CRC32# trailer and CRC, inner
    lengths adding up) inlined in one loop, because recovery runs them for every record of
    the log; ``mm`` is the segment (slices of it are bytes), ``view`` a memoryview of it (for
    the CRC, without a copy). Whatever this loop does not accept, it leaves to
    ``check_record`` to classify (blank filler, unwritten space, torn or corrupt).
    """
    crc32 = zlib.crc32
    n = 0
    while rel + HEADER_SIZE <= limit:
        size, magic, blen = _SIZE_MAGIC_BLEN(mm, rel)
        end = rel + size
        if magic != MAGIC or size < MIN_RECORD_SIZE or end > limit:
            break
        crc_at = end - CRC_TRAILER_SIZE
        if mm[crc_at : crc_at + _CRC_PREFIX_LEN] != CRC_PREFIX or mm[end - 1] != 2:
            break
        digits = mm[crc_at + _CRC_PREFIX_LEN : end - 1]
        if not digits.isdigit() or crc32(view[rel:crc_at]) & CRC_MASK != int(digits):
            break
        p = rel + HEADER_SIZE + blen
        if blen < 0 or p + 3 > end:
            break
        p += 1 + mm[p]
        if p + 2 > end or p + 2 + _U16(mm, p)[0] != end:
            break
        rel = end
        n += 1
    return rel, n


def decode_record(
    buf: bytes | bytearray | memoryview, pos: int = 0, limit: int | None = None
) -> tuple[DecodedRecord | _Blank | None, int]:
    """Decode the record at ``pos``.

    Returns ``(record, size)`` for a valid record, ``(BLANK, bytes to segment end)`` for a
    blank filler or unwritten (zero) space, and ``(None, 0)`` for a torn or corrupt record.
    Never raises on malformed input.
    """
    mv = memoryview(buf)
    end_limit = len(mv) if limit is None else min(limit, len(mv))
    size = check_record(mv, pos, end_limit)
    if size == 0:
        return BLANK, max(0, end_limit - pos)
    if size < 0:
        return None, 0
    (
        _size, _magic, _bcrc, _qid, _flag, qoff, phys, _sysflag, born, _bip, _bport,
        store_ts, _sip, _sport, _reconsume, _prep, blen,
    ) = HEADER.unpack_from(mv, pos)  # fmt: skip
    p = pos + HEADER_SIZE
    body = bytes(mv[p : p + blen])
    p += blen
    tlen = mv[p]
    try:
        topic = bytes(mv[p + 1 : p + 1 + tlen]).decode("utf-8")
        p += 1 + tlen
        plen = PROPS_LEN.unpack_from(mv, p)[0]
        props = parse_properties(bytes(mv[p + 2 : p + 2 + plen - CRC_TRAILER_SIZE]))
    except ValueError:  # UnicodeDecodeError included
        return None, 0
    return DecodedRecord(size, qoff, phys, born, store_ts, topic, body, props), size


def iter_records(
    buf: bytes | bytearray | memoryview, start: int = 0, limit: int | None = None
) -> Iterator[DecodedRecord]:
    """Records of one segment buffer from ``start`` up to the first blank, gap or bad record."""
    pos = start
    end = len(buf) if limit is None else limit
    while pos < end:
        rec, size = decode_record(buf, pos, end)
        if not isinstance(rec, DecodedRecord):
            return
        yield rec
        pos += size


_DISPATCH_PREFIX_LEN: Final = len(DISPATCH_PREFIX)
_QOFFSET_PREFIX_LEN: Final = len(QOFFSET_PREFIX)


def inner_dispatch(buf: bytes | mmap.mmap, start: int, end: int) -> tuple[int, bytes]:
    """The store's INNER_MULTI_DISPATCH pair in the properties ``[start, end)`` (CRC trailer
    excluded): ``(where the pair starts, its raw value)``, the value being the light queue
    names joined by commas; ``(-1, b"")`` if the record has none. The store writes its INNER_*
    pair last, so the last match is it, if it starts a pair (a user value may contain the
    text). Every reader of light queues (the read path, recovery, :func:`dispatch_info`)
    finds them with this."""
    d = buf.rfind(DISPATCH_PREFIX, start, end)
    if d < 0 or (d != start and buf[d - 1] != 2):
        return -1, b""
    return d, buf[d + _DISPATCH_PREFIX_LEN : buf.find(b"\x02", d, end)]


def inner_offsets(
    buf: bytes | mmap.mmap, at: int, names: bytes, start: int, end: int
) -> list[bytes]:
    """The raw INNER_MULTI_QUEUE_OFFSET values (one per light queue, same order) of the
    properties ``[start, end)`` whose INNER_MULTI_DISPATCH pair :func:`inner_dispatch` found at
    ``at`` with value ``names``. The store writes the offsets pair right after; another
    writer's may be anywhere a pair starts, and is looked for there. ValueError if there is
    none or it is not terminated."""
    k = at + _DISPATCH_PREFIX_LEN + len(names) + 1
    if buf[k : k + _QOFFSET_PREFIX_LEN] != QOFFSET_PREFIX:
        k = buf.rfind(QOFFSET_PREFIX, start, end)
        if k < 0 or (k != start and buf[k - 1] != 2):
            raise ValueError("INNER_MULTI_DISPATCH without INNER_MULTI_QUEUE_OFFSET")
    k += _QOFFSET_PREFIX_LEN
    m = buf.find(b"\x02", k, end)
    if m < 0:
        raise ValueError("INNER_MULTI_QUEUE_OFFSET is not terminated")
    return buf[k:m].split(b",")


def dispatch_info(
    buf: bytes | bytearray | memoryview, pos: int
) -> tuple[str, int, list[str], list[int]]:
    """``(topic, parent queue offset, light queues, light offsets)`` of a record known valid.

    Cheaper than :func:`decode_record`: the body is skipped and only the INNER_* properties
    are looked at.
    """
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    size, _magic, qoff, blen = DISPATCH_FIELDS.unpack_from(mv, pos)
    p = pos + HEADER_SIZE + blen
    tlen = mv[p]
    topic = str(mv[p + 1 : p + 1 + tlen], "utf-8")
    p += 3 + tlen
    props = bytes(mv[p : pos + size - CRC_TRAILER_SIZE])
    d, names = inner_dispatch(props, 0, len(props))
    if d < 0:
        return topic, qoff, [], []
    queues = names.decode("utf-8").split(MULTI_DISPATCH_SEPARATOR)
    offsets = [int(x) for x in inner_offsets(props, d, names, 0, len(props))]
    if len(offsets) != len(queues):
        raise ValueError("INNER_MULTI_DISPATCH and INNER_MULTI_QUEUE_OFFSET differ in length")
    return topic, qoff, queues, offsets


#: Why :func:`walk_records` stopped (besides having found ``max_records``).
WALK_END: Final = "end"  # blank filler, unwritten (zero) space, or less than 8 bytes left
WALK_BEYOND: Final = "beyond"  # a record that runs past ``limit``: torn, or still being written
WALK_BAD: Final = "bad"  # neither a record nor a filler: damage


def walk_records(
    buf: bytes | bytearray | memoryview | mmap.mmap, pos: int, limit: int, max_records: int
) -> tuple[list[int], int, str | None]:
    """Follow TOTALSIZE from ``pos``: ``(record starts, where the walk stopped, why)``.

    The reader's first pass over a segment: only sizes and magics are looked at (one struct
    call per record), so the records found still need :func:`check_record`'s checks (or a
    bulk equivalent: analytics validates whole batches with numpy). ``why`` is None when
    ``max_records`` were found, else WALK_END, WALK_BEYOND or WALK_BAD.
    """
    starts: list[int] = []
    append = starts.append
    unpack = SIZE_MAGIC.unpack_from
    magic_ok = MAGIC
    min_size = MIN_RECORD_SIZE
    last = limit - SIZE_MAGIC.size
    budget = max_records
    while budget:
        if pos > last:
            return starts, pos, WALK_END
        size, magic = unpack(buf, pos)
        if magic != magic_ok or size < min_size or pos + size > limit:
            if magic == BLANK_MAGIC or (size == 0 and magic == 0):
                return starts, pos, WALK_END
            return starts, pos, WALK_BEYOND if magic == magic_ok and size >= min_size else WALK_BAD
        append(pos)
        pos += size
        budget -= 1
    return starts, pos, None
