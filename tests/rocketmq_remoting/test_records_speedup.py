"""rocketmq_remoting/_speedups.c `records`: exactly what its reference message.records_py
returns (the records kept, every field, the last CommitLog offset) or raises, for v1 and v2
records, IPv4 and IPv6 hosts, any properties and dispatch names, passed over or kept, blank
ends, bad CRCs and truncated answers; a build that matches its source; and the switch that
keeps the reference."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accelerators
from rocketmq_remoting import message
from rocketmq_remoting.errors import ProtocolError
from rocketmq_remoting.message import BLANK_MAGIC, MAGIC_V1, MAGIC_V2

kernel = pytest.importorskip("rocketmq_remoting._speedups")
SOURCE = Path(message.__file__).with_name("_speedups.c")

NAMES = ["%LMQ%a", "%LMQ%b", "%LMQ%c", "%LMQ%é", ""]
text = st.text(st.characters(blacklist_characters="\x01\x02", blacklist_categories=["Cs"]))


@st.composite
def properties(draw: st.DrawFn) -> bytes:
    """A property block: some user properties, maybe INNER_MULTI_DISPATCH (sometimes first,
    sometimes a lookalike inside another value), maybe raw bytes that are not UTF-8."""
    items = draw(st.lists(st.tuples(text, text), max_size=4))
    out = "".join(f"{k}\x01{v}\x02" for k, v in items)
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3))
        dispatch = f"INNER_MULTI_DISPATCH\x01{','.join(names)}\x02"
        offsets = f"INNER_MULTI_QUEUE_OFFSET\x01{','.join('7' for _ in names)}\x02"
        out = dispatch + offsets + out if draw(st.booleans()) else out + offsets + dispatch
    if draw(st.booleans()):
        out = "X\x01INNER_MULTI_DISPATCH\x01%LMQ%a\x02" + out  # a value that merely holds it
    raw = out.encode()
    if draw(st.booleans()):
        raw += b"K\x01\xff\xfe\x02"  # not UTF-8: surrogateescape
    return raw


@st.composite
def record(draw: st.DrawFn) -> bytes:
    magic = draw(st.sampled_from([MAGIC_V1, MAGIC_V2]))
    born6, store6 = draw(st.booleans()), draw(st.booleans())
    sys_flag = (0x10 if born6 else 0) | (0x20 if store6 else 0) | draw(st.sampled_from([0, 1]))
    host = draw(
        st.sampled_from(
            [bytes(16), b"\x00" * 15 + b"\x01", b"\x00" * 10 + b"\xff\xff" + bytes([10, 0, 0, 1])]
        )
    )

    def addr(v6: bool) -> bytes:
        return (host if v6 else draw(st.binary(min_size=4, max_size=4))) + struct.pack(
            ">i", draw(st.integers(-(2**31), 2**31 - 1))
        )

    body = draw(st.binary(max_size=80))
    topic = draw(st.text(min_size=1, max_size=12)).encode()
    if magic == MAGIC_V2 and draw(st.booleans()):
        topic *= 300 // len(topic) + 1  # over a v1 record's 255 bytes
    tlen = struct.pack(">h", len(topic)) if magic == MAGIC_V2 else bytes([len(topic)])
    props = draw(properties())
    i64 = st.integers(-(2**63), 2**63 - 1)
    i32 = st.integers(-(2**31), 2**31 - 1)
    head_rest = struct.pack(
        ">Iiiqqiq",
        zlib.crc32(body) & 0x7FFFFFFF,
        draw(i32),
        draw(i32),
        draw(i64),
        draw(st.integers(0, 2**62)),
        sys_flag,
        draw(i64),
    )
    rest = (
        addr(born6)
        + struct.pack(">q", draw(i64))
        + addr(store6)
        + struct.pack(">iqi", draw(i32), draw(i64), len(body))
        + body
        + tlen
        + topic
        + struct.pack(">h", len(props))
        + props
    )
    size = 8 + len(head_rest) + len(rest)
    return struct.pack(">iI", size, magic) + head_rest + rest


def outcome(fn: object, *args: object) -> object:
    try:
        return fn(*args)  # type: ignore[operator]
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))
    except (UnicodeDecodeError, struct.error, ValueError, IndexError) as exc:
        return ("error", type(exc).__name__)


#: Generating records is slow on a loaded host; the examples still run.
SLOW_OK = settings(suppress_health_check=[HealthCheck.too_slow])


@SLOW_OK
@given(
    records=st.lists(record(), max_size=6),
    wanted=st.one_of(st.none(), st.sets(st.sampled_from(NAMES))),
    blank=st.booleans(),
    check_crc=st.booleans(),
)
def test_records_agree_with_the_reference(
    records: list[bytes], wanted: set[str] | None, blank: bool, check_crc: bool
) -> None:
    body = b"".join(records)
    if blank:
        body += struct.pack(">iI", 8, BLANK_MAGIC) + bytes(60)
    expected = message.records_py(body, check_crc, wanted)
    assert kernel.records(body, check_crc, wanted) == expected
    assert kernel.records(memoryview(body), check_crc, wanted) == expected


@SLOW_OK
@given(records=st.lists(record(), min_size=1, max_size=3), cut=st.integers(1, 400))
def test_bad_answers_raise_like_the_reference(records: list[bytes], cut: int) -> None:
    body = bytearray(b"".join(records))
    first_body = 48 + (20 if body[39] & 0x10 else 8) + 8 + (20 if body[39] & 0x20 else 8) + 16
    if first_body < len(records[0]) - 8 and struct.unpack_from(">i", body, first_body - 4)[0]:
        body[first_body] ^= 0xFF  # the first body's first byte: a CRC mismatch
        for wanted in (None, set(NAMES)):
            expected = outcome(message.records_py, bytes(body), True, wanted)
            assert outcome(kernel.records, bytes(body), True, wanted) == expected
    truncated = bytes(body[: max(0, len(body) - cut)])
    for wanted in (None, set(NAMES), set()):
        expected = outcome(message.records_py, truncated, False, wanted)
        got = outcome(kernel.records, truncated, False, wanted)
        if isinstance(expected, tuple):  # both refuse (the reference's error may be struct's)
            assert isinstance(got, tuple)
        else:
            assert got == expected
    bad_magic = bytes(body[:4]) + b"\x00\x00\x00\x01" + bytes(body[8:])
    assert outcome(kernel.records, bad_magic, True, None) == outcome(
        message.records_py, bad_magic, True, None
    )


def test_the_build_matches_the_source() -> None:
    digest = accelerators.source_digest(SOURCE)
    assert digest == kernel.SOURCE_SHA256, "stale build: run `make .venv/.installed-dev`"


def test_the_read_switch_keeps_the_reference() -> None:
    code = "from rocketmq_remoting import message as m; print(m.records is m.records_py)"
    seen = {}
    for value in ("0", "1"):
        env = {**os.environ, "LMQTT_PURE_PYTHON_READ": value, "LMQTT_PURE_PYTHON": "0"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        seen[value] = out.stdout.strip()
    assert seen == {"0": "False", "1": "True"}
