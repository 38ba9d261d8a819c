"""Messages on a RocketMQ broker: properties, the stored record a pull returns, message ids.

A PULL_MESSAGE answer's body is the broker's CommitLog records back to back, exactly as stored
(``MessageDecoder.decode``; ``transferMsgByHeap`` copies them)::

    offset size field
       0    4  TOTALSIZE                  whole record, this field included
       4    4  MAGICCODE                  0xDAA320A7 (v1) or 0xDAA320AB (v2: 2-byte topic length)
       8    4  BODYCRC                    crc32(body) & 0x7FFFFFFF
      12    4  QUEUEID                    queue in the parent topic (not the light queue)
      16    4  FLAG                       producer's flag
      20    8  QUEUEOFFSET                offset in the parent topic's queue
      28    8  PHYSICALOFFSET             offset of this record in the broker's CommitLog
      36    4  SYSFLAG                    0x1 compressed, 0x10 born host v6, 0x20 store host v6
      40    8  BORNTIMESTAMP              ms, producer's clock
      48  8|20 BORNHOST                   IPv4 4 + port 4, or IPv6 16 + port 4
       .    8  STORETIMESTAMP             ms, broker's clock
       .  8|20 STOREHOST
       .    4  RECONSUMETIMES
       .    8  PREPAREDTRANSACTIONOFFSET
       .    4  BODYLENGTH + BODY
       .  1|2  TOPICLENGTH + TOPIC        2 bytes in v2
       .    2  PROPERTIESLENGTH + PROPERTIES   k \\x01 v \\x02 ...

This package reads the records itself instead of using lmqtt's ``store.format``: the store's
reader accepts only the records lmqtt writes (v1 magic, IPv4 zero hosts, a ``__CRC32#`` trailer
always present), while a broker hands back whatever its producers sent (v2 magic for long topic
names, IPv6 hosts, no CRC trailer unless ``enabledAppendPropCRC``), and the import contracts keep
this package free of the project's packages so it can be used (and tested) on its own.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import zlib
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

import accelerators
from rocketmq_remoting.codes import LMQ_DISPATCH_SEPARATOR
from rocketmq_remoting.errors import ProtocolError

MAGIC_V1: Final = 0xDAA320A7  # MessageDecoder.MESSAGE_MAGIC_CODE = -626843481
MAGIC_V2: Final = 0xDAA320AB  # MESSAGE_MAGIC_CODE_V2 = -626843477
BLANK_MAGIC: Final = 0xCBD43194  # BLANK_MAGIC_CODE = -875286124

SYSFLAG_COMPRESSED: Final = 0x1
SYSFLAG_BORNHOST_V6: Final = 0x1 << 4
SYSFLAG_STOREHOST_V6: Final = 0x1 << 5

NAME_VALUE_SEPARATOR: Final = "\x01"
PROPERTY_SEPARATOR: Final = "\x02"

#: ``MessageConst.java`` property names this package reads or writes.
PROPERTY_INNER_MULTI_DISPATCH: Final = "INNER_MULTI_DISPATCH"
PROPERTY_INNER_MULTI_QUEUE_OFFSET: Final = "INNER_MULTI_QUEUE_OFFSET"
PROPERTY_WAIT_STORE_MSG_OK: Final = "WAIT"
PROPERTY_KEYS: Final = "KEYS"
PROPERTY_TAGS: Final = "TAGS"
PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX: Final = "UNIQ_KEY"
PROPERTY_CRC32: Final = "__CRC32#"
#: A timer message's delivery time, epoch ms (MessageConst.PROPERTY_TIMER_DELIVER_MS): a broker
#: with timerWheelEnable=true holds it in its timer topic and re-puts it to its topic (light
#: queues included) when due.
PROPERTY_TIMER_DELIVER_MS: Final = "TIMER_DELIVER_MS"
#: The broker's timer topic (TimerMessageStore.TIMER_TOPIC), holding the timer messages not yet
#: due (their own topic in PROPERTY_REAL_TOPIC).
TIMER_TOPIC: Final = "rmq_sys_wheel_timer"
PROPERTY_REAL_TOPIC: Final = "REAL_TOPIC"
PROPERTY_PRODUCER_GROUP: Final = "PGROUP"
#: Properties a broker adds to (or a sender sets for) a stored message, besides the sender's
#: own: ``MessageConst`` names a reader of the message's properties leaves out.
BROKER_PROPERTIES: Final = frozenset(
    {
        PROPERTY_INNER_MULTI_DISPATCH,
        PROPERTY_INNER_MULTI_QUEUE_OFFSET,
        PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX,
        PROPERTY_WAIT_STORE_MSG_OK,
        "CLUSTER",
        "MSG_REGION",
        "TRACE_ON",
        PROPERTY_CRC32,
        "CONSUME_START_TIME",
        "MIN_OFFSET",
        "MAX_OFFSET",
    }
)
#: Every name ``MessageConst.STRING_HASH_SET`` of 5.3.3 holds (the names a Java producer's
#: ``putUserProperty`` refuses), and the other ``MessageConst`` names a client or broker sets:
#: what is left of a message's properties is its sender's user properties.
SYSTEM_PROPERTIES: Final = frozenset(
    {
        "1ST_POP_TIME", "ARRIVE_TIME", "BORN_TIMESTAMP", "BUYER_ID", "CLUSTER",
        "CONSUME_START_TIME", "CORRECTION_FLAG", "CORRELATION_ID", "DELAY",
        "DLQ_ORIGIN_MESSAGE_ID", "DLQ_ORIGIN_TOPIC", "DUP_INFO", "EXTEND_UNIQ_INFO",
        "INNER_MULTI_QUEUE_OFFSET", "INSTANCE_ID", "KEYS", "MAX_OFFSET", "MAX_RECONSUME_TIMES",
        "MIN_OFFSET", "MQ2_FLAG", "MSG_REGION", "MSG_TYPE", "ORIGIN_MESSAGE_ID", "PGROUP",
        "POP_CK", "POP_CK_OFFSET", "PUSH_REPLY_TIME", "REAL_QID", "REAL_TOPIC",
        "RECONSUME_TIME", "REPLY_TO_CLIENT", "RETRY_TOPIC", "TAGS", "TIMER_DELAY_LEVEL",
        "TIMER_DELAY_MS", "TIMER_DELAY_SEC", "TIMER_DELIVER_MS", "TIMER_DEL_UNIQKEY",
        "TIMER_DEQUEUE_MS", "TIMER_ENQUEUE_MS", "TIMER_OUT_MS", "TIMER_ROLL_TIMES", "TRACE_ON",
        "TRANSFER_FLAG", "TRAN_MSG", "TRAN_PREPARED_QUEUE_OFFSET", "TTL", "UNIQ_KEY", "WAIT",
        "__BORNHOST", "__CRC32#",
        # not in STRING_HASH_SET, still set by clients or brokers
        "INNER_MULTI_DISPATCH", "INNER_NUM", "INNER_BASE", "__transactionId__",
        "TRANSACTION_CHECK_TIMES", "CHECK_IMMUNITY_TIME_IN_SECONDS", "__SHARDINGKEY",
        "PROPERTY_FORWARD_QUEUE_ID", "REDIRECT", "TRACE_CONTEXT",
    }
)  # fmt: skip
#: ``MessageConst.PROPERTY_TRANSIENT_PREFIX``: broker-internal names, never a sender's.
TRANSIENT_PREFIX: Final = "__RMQ.TRANSIENT."


def user_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """The sender's own properties of a message (``Message.putUserProperty``'s), in order."""
    return {
        k: v
        for k, v in properties.items()
        if k not in SYSTEM_PROPERTIES and not k.startswith(TRANSIENT_PREFIX)
    }


#: The broker refuses a record whose properties exceed ``Short.MAX_VALUE`` bytes
#: (``CommitLog.handlePropertiesForLmqMsg``: PROPERTIES_SIZE_EXCEEDED -> MESSAGE_ILLEGAL), and
#: the light-queue offsets it adds count too: this caps the fan-out of one message.
MAX_PROPERTIES_BYTES: Final = 32767

_FIXED_HEAD: Final = struct.Struct(">iIIiiqqiq")  # up to BORNTIMESTAMP, 48 bytes
_I32: Final = struct.Struct(">i")
_I16: Final = struct.Struct(">h")
#: How INNER_MULTI_DISPATCH starts in a record's properties, and the separators, as bytes: the
#: scan of `decode_records(wanted=...)` reads them without decoding the properties.
_DISPATCH_KEY: Final = (PROPERTY_INNER_MULTI_DISPATCH + NAME_VALUE_SEPARATOR).encode()
_PROPERTY_SEPARATOR_BYTES: Final = PROPERTY_SEPARATOR.encode()
_PROPERTY_SEPARATOR_BYTE: Final = _PROPERTY_SEPARATOR_BYTES[0]
_DISPATCH_SEPARATOR_BYTES: Final = LMQ_DISPATCH_SEPARATOR.encode()


def encode_properties(properties: Mapping[str, str]) -> str:
    """``MessageDecoder.messageProperties2String``: ``k\\x01v\\x02`` per entry."""
    return "".join(
        f"{k}{NAME_VALUE_SEPARATOR}{v}{PROPERTY_SEPARATOR}" for k, v in properties.items()
    )


def decode_properties(raw: str) -> dict[str, str]:
    """``MessageDecoder.string2messageProperties``."""
    out: dict[str, str] = {}
    for item in raw.split(PROPERTY_SEPARATOR):
        name, sep, value = item.partition(NAME_VALUE_SEPARATOR)
        if sep and name:
            out[name] = value
    return out


def dispatch_property(queues: list[str]) -> str:
    """The INNER_MULTI_DISPATCH value naming the light queues a message is also indexed in.

    The broker (``LmqDispatch.wrapLmqDispatch``) splits it on ``,``, looks up the next offset of
    each ``%LMQ%`` name and stores them, same order, in INNER_MULTI_QUEUE_OFFSET; names that do
    not start with ``%LMQ%`` get the offset ``null``, and names containing ``/`` are skipped by
    the consume-queue dispatch (``ConsumeQueue.multiDispatchLmqQueue``). So both are refused
    here rather than silently lost.
    """
    for q in queues:
        if not q.startswith("%LMQ%") or "/" in q or LMQ_DISPATCH_SEPARATOR in q:
            raise ValueError(f"not a usable light queue name: {q!r}")
    return LMQ_DISPATCH_SEPARATOR.join(queues)


@dataclass(slots=True)
class MessageRecord:
    """One stored message as a pull returns it."""

    topic: str
    body: bytes
    queue_id: int
    queue_offset: int
    commitlog_offset: int
    sys_flag: int
    flag: int
    born_timestamp: int
    store_timestamp: int
    born_host: tuple[str, int]
    store_host: tuple[str, int]
    reconsume_times: int
    properties: dict[str, str] = field(default_factory=dict)
    store_size: int = 0

    def light_queue_offsets(self) -> dict[str, int]:
        """Light queue name -> this message's offset in it (INNER_MULTI_DISPATCH/QUEUE_OFFSET)."""
        names = self.properties.get(PROPERTY_INNER_MULTI_DISPATCH)
        offsets = self.properties.get(PROPERTY_INNER_MULTI_QUEUE_OFFSET)
        if not names or not offsets:
            return {}
        out: dict[str, int] = {}
        for name, off in zip(
            names.split(LMQ_DISPATCH_SEPARATOR), offsets.split(LMQ_DISPATCH_SEPARATOR), strict=False
        ):
            # Java's Long.toString: '-'? and ASCII digits; anything else ("null") is no offset.
            digits = off[1:] if off[:1] == "-" else off
            if digits.isascii() and digits.isdigit():
                out[name] = int(off)
        return out

    @property
    def msg_id(self) -> str:
        """The broker's offset message id (``MessageDecoder.createMessageId``)."""
        return encode_message_id(self.store_host, self.commitlog_offset)


def _host(buf: bytes | memoryview, pos: int, v6: bool) -> tuple[tuple[str, int], int]:
    n = 16 if v6 else 4
    raw = bytes(buf[pos : pos + n])
    # inet_ntoa: the same text as ipaddress for IPv4, at a tenth of the cost (twice a record).
    addr = str(ipaddress.ip_address(raw)) if v6 else socket.inet_ntoa(raw)
    (port,) = struct.unpack_from(">i", buf, pos + n)
    return (addr, port), pos + n + 4


def decode_records(
    body: bytes | memoryview, check_crc: bool = True, wanted: Container[str] | None = None
) -> Iterator[MessageRecord]:
    """The records of a pull answer's body, in order (all read before the first is returned: a
    bad record anywhere raises ProtocolError here).

    With `wanted`, only the records dispatched to at least one light queue in it (a name of
    their INNER_MULTI_DISPATCH): the others are passed over from their properties alone, their
    body neither copied nor checked (a reader of the parent topic that mirrors a few of its
    light queues; `scan_records` also says how far the answer went).
    """
    return iter(records(body, check_crc, wanted)[0])


def scan_records(
    body: bytes | memoryview, wanted: Container[str], check_crc: bool = True
) -> tuple[list[MessageRecord], int]:
    """`decode_records` with `wanted`, and the CommitLog offset of the answer's last record
    (-1 if it had none): a reader that passes records over still learns how far the log goes."""
    return records(body, check_crc, wanted)


def records_py(
    body: bytes | memoryview, check_crc: bool, wanted: Container[str] | None
) -> tuple[list[MessageRecord], int]:
    """The records of `body` (those dispatched to a light queue in `wanted`, unless None) and
    the CommitLog offset of its last record, passed over or not (-1 if none): the reference of
    the C kernel `_speedups.records`, which must return exactly the same."""
    last = [-1]
    return list(_records(body, check_crc, wanted, last)), last[0]


def _dispatched_to(props: bytes, wanted: Container[str]) -> bool:
    """Whether the properties `props` (``k \\x01 v \\x02 ...``) name a light queue in `wanted`
    in their INNER_MULTI_DISPATCH, read without decoding the other properties."""
    at = props.find(_DISPATCH_KEY)
    while at > 0 and props[at - 1] != _PROPERTY_SEPARATOR_BYTE:  # a value's text, not a key
        at = props.find(_DISPATCH_KEY, at + 1)
    if at < 0:
        return False
    start = at + len(_DISPATCH_KEY)
    end = props.find(_PROPERTY_SEPARATOR_BYTES, start)
    names = props[start : end if end >= 0 else len(props)]
    return any(
        name.decode("utf-8", "surrogateescape") in wanted
        for name in names.split(_DISPATCH_SEPARATOR_BYTES)
    )


def _records(
    body: bytes | memoryview,
    check_crc: bool,
    wanted: Container[str] | None,
    last: list[int] | None,
) -> Iterator[MessageRecord]:
    buf = memoryview(body)
    pos = 0
    end = len(buf)
    while pos < end:
        if end - pos < _FIXED_HEAD.size:
            raise ProtocolError(f"truncated record at {pos}")
        (size, magic, body_crc, queue_id, flag, queue_offset, phys, sys_flag, born_ts) = (
            _FIXED_HEAD.unpack_from(buf, pos)
        )
        if magic == BLANK_MAGIC:
            return
        if magic not in (MAGIC_V1, MAGIC_V2) or size <= 0 or pos + size > end:
            raise ProtocolError(f"bad record at {pos}: magic {magic:#x}, size {size}")
        if last is not None:
            last[0] = phys
        p = pos + _FIXED_HEAD.size
        if wanted is not None:
            # Straight to the properties: hosts, timestamps and body by their lengths only.
            q = p + (20 if sys_flag & SYSFLAG_BORNHOST_V6 else 8) + 8
            q += (20 if sys_flag & SYSFLAG_STOREHOST_V6 else 8) + 4 + 8
            (body_len,) = _I32.unpack_from(buf, q)
            q += 4 + body_len
            if magic == MAGIC_V2:
                (topic_len,) = _I16.unpack_from(buf, q)
                q += 2 + topic_len
            else:
                q += 1 + buf[q]
            (props_len,) = _I16.unpack_from(buf, q)
            if props_len <= 0 or not _dispatched_to(bytes(buf[q + 2 : q + 2 + props_len]), wanted):
                pos += size
                continue
        born_host, p = _host(buf, p, bool(sys_flag & SYSFLAG_BORNHOST_V6))
        (store_ts,) = struct.unpack_from(">q", buf, p)
        store_host, p = _host(buf, p + 8, bool(sys_flag & SYSFLAG_STOREHOST_V6))
        reconsume, _prepared, body_len = struct.unpack_from(">iqi", buf, p)
        p += 16
        payload = bytes(buf[p : p + body_len])
        p += body_len
        if check_crc and zlib.crc32(payload) & 0x7FFFFFFF != body_crc:
            raise ProtocolError(f"body CRC mismatch in record at commitlog offset {phys}")
        if magic == MAGIC_V2:
            (topic_len,) = struct.unpack_from(">h", buf, p)
            p += 2
        else:
            topic_len = buf[p]
            p += 1
        topic = bytes(buf[p : p + topic_len]).decode()
        p += topic_len
        (props_len,) = struct.unpack_from(">h", buf, p)
        p += 2
        # surrogateescape: a sender's bytes that are not UTF-8 stay visible (as lone surrogates)
        # to a reader that checks them, instead of failing the whole pull.
        raw = bytes(buf[p : p + props_len]).decode("utf-8", "surrogateescape")
        props = decode_properties(raw) if props_len > 0 else {}
        yield MessageRecord(
            topic=topic,
            body=payload,
            queue_id=queue_id,
            queue_offset=queue_offset,
            commitlog_offset=phys,
            sys_flag=sys_flag,
            flag=flag,
            born_timestamp=born_ts,
            store_timestamp=store_ts,
            born_host=born_host,
            store_host=store_host,
            reconsume_times=reconsume,
            properties=props,
            store_size=size,
        )
        pos += size


def encode_message_id(store_host: tuple[str, int], commitlog_offset: int) -> str:
    """Host address, port and CommitLog offset in hex (``MessageDecoder.createMessageId``)."""
    packed = ipaddress.ip_address(store_host[0]).packed
    return (packed + struct.pack(">iq", store_host[1], commitlog_offset)).hex().upper()


def message_id_offset(msg_id: str) -> int:
    """The CommitLog offset of an offset message id (its last 8 bytes): decode_message_id's
    offset without parsing the host."""
    if len(msg_id) not in (32, 56):
        raise ValueError(f"not an offset message id: {msg_id!r}")
    offset = int(msg_id[-16:], 16)
    return offset - (1 << 64) if offset >= 1 << 63 else offset


def decode_message_id(msg_id: str) -> tuple[tuple[str, int], int]:
    """The inverse of :func:`encode_message_id`: ``((host, port), commitlog_offset)``."""
    raw = bytes.fromhex(msg_id)
    n = len(raw) - 12
    if n not in (4, 16):
        raise ValueError(f"not an offset message id: {msg_id!r}")
    port, offset = struct.unpack_from(">iq", raw, n)
    return (str(ipaddress.ip_address(raw[:n])), port), offset


def _host_v6(raw: bytes) -> str:
    return str(ipaddress.ip_address(raw))


#: The C kernel of `records_py` (rocketmq_remoting/_speedups.c), unless it is not built or
#: LMQTT_PURE_PYTHON(_READ) keeps the reference: handed the layout's names and constants here.
_kernel = accelerators.load("rocketmq_remoting._speedups", "LMQTT_PURE_PYTHON_READ")
if _kernel is not None:
    _kernel.configure(
        MessageRecord,
        ProtocolError,
        zlib.crc32,
        _host_v6,
        _DISPATCH_KEY,
        NAME_VALUE_SEPARATOR,
        PROPERTY_SEPARATOR,
        LMQ_DISPATCH_SEPARATOR,
        MAGIC_V1,
        MAGIC_V2,
        BLANK_MAGIC,
        SYSFLAG_BORNHOST_V6,
        SYSFLAG_STOREHOST_V6,
    )
#: A pull answer's records: the kernel's, else the reference.
records = records_py if _kernel is None else _kernel.records
