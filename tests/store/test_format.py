"""The record codec and file naming of store/format.py, including malformed input."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import format as fmt

names = st.text(min_size=1, max_size=60).filter(lambda s: "\x00" not in s)
prop_text = st.text(
    alphabet=st.characters(blacklist_characters="\x01\x02", blacklist_categories=["Cs"]),
    max_size=20,
)


def test_record_layout_matches_rocketmq_v1() -> None:
    rec = fmt.encode_record(
        topic="site", body=b"hello", properties={"k": "v"}, queues=["%LMQ%a", "%LMQ%b"],
        queue_offsets=[3, 9], queue_offset=7, physical_offset=4096, born_timestamp=11,
        store_timestamp=12,
    )  # fmt: skip
    assert fmt.HEADER_SIZE == 88 and fmt.FIXED_OVERHEAD == 91 and fmt.CQ_UNIT_SIZE == 20
    total, magic, bodycrc = struct.unpack_from(">iII", rec, 0)
    assert total == len(rec) and magic == 0xDAA320A7
    assert bodycrc == zlib.crc32(b"hello") & 0x7FFFFFFF
    assert struct.unpack_from(">q", rec, 20)[0] == 7  # QUEUEOFFSET
    assert struct.unpack_from(">q", rec, 28)[0] == 4096  # PHYSICALOFFSET
    assert struct.unpack_from(">q", rec, 56)[0] == 12  # STORETIMESTAMP
    assert struct.unpack_from(">i", rec, 84)[0] == 5 and rec[88:93] == b"hello"
    assert rec[93] == 4 and rec[94:98] == b"site"
    plen = struct.unpack_from(">H", rec, 98)[0]
    props = rec[100 : 100 + plen]
    assert 100 + plen == len(rec)
    assert props.startswith(b"k\x01v\x02INNER_MULTI_DISPATCH\x01%LMQ%a,%LMQ%b\x02")
    assert b"INNER_MULTI_QUEUE_OFFSET\x013,9\x02" in props
    trailer = rec[-20:]
    assert trailer[:9] == b"__CRC32#\x01" and trailer[-1:] == b"\x02"
    assert int(trailer[9:19]) == zlib.crc32(rec[:-20]) & 0x7FFFFFFF


@given(
    topic=st.text(min_size=1, max_size=30).filter(lambda t: len(t.encode()) <= 127),
    body=st.binary(max_size=300),
    # Keys the store writes itself are refused by MessageStore.put, never stored as user's.
    props=st.dictionaries(
        prop_text.filter(lambda k: bool(k) and k not in fmt.RESERVED_PROPERTIES),
        prop_text,
        max_size=5,
    ),
    queues=st.lists(st.text(alphabet="abc%LMQ/+", min_size=1, max_size=10), max_size=4),
    qoff=st.integers(0, 2**62),
)
def test_round_trip(
    topic: str, body: bytes, props: dict[str, str], queues: list[str], qoff: int
) -> None:
    offsets = list(range(len(queues)))
    rec = fmt.encode_record(
        topic=topic, body=body, properties=props, queues=queues, queue_offsets=offsets,
        queue_offset=qoff, physical_offset=qoff // 2, born_timestamp=1, store_timestamp=2,
    )  # fmt: skip
    decoded, size = fmt.decode_record(rec, 0)
    assert isinstance(decoded, fmt.DecodedRecord) and size == len(rec)
    assert (decoded.topic, decoded.body, decoded.queue_offset) == (topic, body, qoff)
    assert decoded.physical_offset == qoff // 2
    user = {k: v for k, v in decoded.properties.items() if k not in fmt.RESERVED_PROPERTIES}
    assert user == props
    assert decoded.queues == queues and decoded.queue_offsets == offsets
    assert fmt.dispatch_info(rec, 0) == (topic, qoff, queues, offsets)
    assert list(fmt.iter_records(rec + bytes(64))) == [decoded]


def test_inner_pair_parse() -> None:
    """The one INNER_* parser: the store's own order, another writer's order, a user value
    that holds the key's text, and a dispatch pair without offsets."""
    k, d, q = "k\x01v\x02", fmt.PROP_MULTI_DISPATCH, fmt.PROP_MULTI_QUEUE_OFFSET
    cases = [
        (k + f"{d}\x01a,b\x02{q}\x013,9\x02", b"a,b", [b"3", b"9"]),
        (f"{q}\x013,9\x02" + k + f"{d}\x01a,b\x02", b"a,b", [b"3", b"9"]),
        (f"x\x01{d}\x01a\x02{d}\x01c\x02{q}\x017\x02", b"c", [b"7"]),
    ]
    for props, names, offsets in cases:
        raw = props.encode()
        at, found = fmt.inner_dispatch(raw, 0, len(raw))
        assert found == names and raw[at - 1 : at] in (b"", b"\x02")
        assert fmt.inner_offsets(raw, at, found, 0, len(raw)) == offsets
    assert fmt.inner_dispatch(b"x\x01" + d.encode() + b"\x01a\x02", 0, 100) == (-1, b"")
    raw = f"{d}\x01a\x02".encode()
    with pytest.raises(ValueError, match="without"):
        fmt.inner_offsets(raw, 0, b"a", 0, len(raw))


@settings(max_examples=300)
@given(data=st.binary(max_size=400), pos=st.integers(0, 50))
def test_decode_never_raises_on_garbage(data: bytes, pos: int) -> None:
    rec, size = fmt.decode_record(data, pos)
    assert rec is None or rec is fmt.BLANK or isinstance(rec, fmt.DecodedRecord)
    assert size >= 0
    list(fmt.iter_records(data))


@settings(max_examples=300)
@given(index=st.integers(0, 10_000), xor=st.integers(1, 255), cut=st.integers(1, 10_000))
def test_any_flipped_byte_or_tear_is_detected(index: int, xor: int, cut: int) -> None:
    rec = fmt.encode_record(topic="t", body=b"payload" * 5, properties={"a": "b"})
    buf = bytearray(rec + bytes(100))
    i = index % len(rec)
    buf[i] ^= xor
    got, _ = fmt.decode_record(buf, 0)
    assert got is None
    torn = bytearray(rec[: cut % len(rec)]) + bytes(len(rec))
    got, _ = fmt.decode_record(torn, 0)
    assert not isinstance(got, fmt.DecodedRecord)


def test_blank_filler_and_unwritten_space() -> None:
    buf = bytearray(64)
    struct.pack_into(">iI", buf, 16, 48, fmt.BLANK_MAGIC)
    assert fmt.decode_record(buf, 16) == (fmt.BLANK, 48)
    assert fmt.decode_record(buf, 0)[0] is fmt.BLANK  # zeros: end of data
    struct.pack_into(">iI", buf, 16, 40, fmt.BLANK_MAGIC)  # blank not reaching the end
    assert fmt.decode_record(buf, 16) == (None, 0)


@given(name=names)
def test_queue_dir_names_are_reversible_and_safe(name: str) -> None:
    try:
        enc = fmt.encode_queue_dir(name)
    except ValueError:
        return
    assert "/" not in enc and enc not in (".", "..") and "\x00" not in enc
    assert len(enc.encode()) <= 255
    assert fmt.decode_queue_dir(enc) == name


def _queue_dir_byte_by_byte(name: str) -> str:
    """encode_queue_dir's rule spelled out one UTF-8 byte at a time (the on-disk format)."""
    safe = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.%"
    out = [chr(b) if chr(b) in safe else f"+{b:02X}" for b in name.encode("utf-8", "surrogatepass")]
    if not name.strip("."):
        out[0] = "+2E"
    return "".join(out)


@given(name=names | st.text(alphabet="ab/+.%-_\x00\u00e9\u20ac\U0001f600", min_size=1))
def test_queue_dir_names_are_the_bytes_escaped(name: str) -> None:
    try:
        enc = fmt.encode_queue_dir(name)
    except ValueError:
        return
    assert enc == _queue_dir_byte_by_byte(name)


def test_queue_dir_names_keep_rocketmq_style_names_readable() -> None:
    assert fmt.encode_queue_dir("%LMQ%site%2F7") == "%LMQ%site%2F7"
    assert fmt.encode_queue_dir("%RETAIN%") == "%RETAIN%"
    assert fmt.encode_queue_dir("a/b") != fmt.encode_queue_dir("a+2Fb")
    assert fmt.encode_queue_dir("..") == "+2E."
    assert fmt.decode_queue_dir("+zz") is None


def test_file_names() -> None:
    assert fmt.commitlog_path(1073741824) == "commitlog/00000000001073741824"
    assert fmt.consumequeue_path("%LMQ%x", 300_000) == "consumequeue/%LMQ%x/0/00000000000006000000"
    assert fmt.parse_offset_file_name("00000000000000000020") == 20
    assert fmt.parse_offset_file_name("0000000000000000002x") is None


@given(raw=st.binary(max_size=80))
def test_parse_properties_rejects_or_parses(raw: bytes) -> None:
    try:
        out = fmt.parse_properties(raw)
    except ValueError:
        return
    for k, v in out.items():
        assert k and "\x01" not in k + v and "\x02" not in k + v
    if len(out) == raw.count(b"\x02"):  # no duplicate keys: exact round trip
        assert fmt.encode_properties(out) == raw
