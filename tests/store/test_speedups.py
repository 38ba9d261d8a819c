"""store/_speedups.c: the same record bytes as store.format.append_record, the same units
and queue ends as store.consumequeue.dispatch, the same CRC as zlib, the record format handed
by store.kernel.configure (none spelled in C), no leaks, a build that matches its source, and
a pure-Python mode that is pure."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import accelerators
from store import append as append_module
from store import consumequeue, kernel
from store import format as fmt
from store.consumequeue import ConsumeQueue

speedups = pytest.importorskip("store._speedups")
kernel.configure(speedups)  # as store.kernel.load does; a pure-Python run skipped that
SOURCE = Path(fmt.__file__).with_name("_speedups.c")

offsets = st.integers(0, (1 << 63) - 1)


@given(
    prefix=st.binary(max_size=40),
    room=st.integers(0, 1200),
    queue_offset=offsets,
    physical_offset=offsets,
    born=st.integers(-(1 << 63), (1 << 63) - 1),
    stored=st.integers(0, (1 << 63) - 1),
    body=st.binary(max_size=600),
    topic=st.binary(min_size=1, max_size=127),
    user_props=st.binary(max_size=80),
    inner_head=st.binary(max_size=80),
    light_offsets=st.lists(offsets, max_size=6).map(tuple),
)
def test_c_record_equals_python_record(
    prefix: bytes,
    room: int,
    queue_offset: int,
    physical_offset: int,
    born: int,
    stored: int,
    body: bytes,
    topic: bytes,
    user_props: bytes,
    inner_head: bytes,
    light_offsets: tuple[int, ...],
) -> None:
    args = (
        room, queue_offset, physical_offset, born, stored, body, bytes((len(topic),)) + topic,
        user_props, inner_head, light_offsets,
    )  # fmt: skip
    ours, reference = bytearray(prefix), bytearray(prefix)
    size = speedups.append_record(ours, *args)
    assert size == fmt.append_record(reference, *args)
    assert ours == reference
    if size < 0:
        assert ours == prefix  # nothing appended when it does not fit
    else:
        assert len(ours) == len(prefix) + size


def test_a_record_it_builds_decodes_with_its_properties() -> None:
    buf = bytearray()
    head = fmt.DISPATCH_PREFIX + b"%LMQ%a/+,%LMQ%a/#\x02" + fmt.QOFFSET_PREFIX
    size = speedups.append_record(
        buf, 10_000, 7, 0, 1_700_000_000_000, 1_700_000_000_001, b"payload", b"\x01a",
        b"k\x01v\x02", head, (3, 12_345_678_901),
    )  # fmt: skip
    assert size == len(buf)
    message, decoded_size = fmt.decode_record(buf, 0)
    assert isinstance(message, fmt.DecodedRecord) and decoded_size == size
    assert message.body == b"payload" and message.topic == "a"
    assert (message.queue_offset, message.born_timestamp) == (7, 1_700_000_000_000)
    assert message.properties["k"] == "v"
    assert message.properties[fmt.PROP_MULTI_DISPATCH] == "%LMQ%a/+,%LMQ%a/#"
    assert message.properties[fmt.PROP_MULTI_QUEUE_OFFSET] == "3,12345678901"


def _queues(spec: list[tuple[int, int]]) -> list[ConsumeQueue]:
    out = []
    for k, (flushed, pending) in enumerate(spec):
        cq = ConsumeQueue(f"q{k}", f"/nowhere/q{k}", 0, flushed)
        cq.pending = bytearray(b"u" * fmt.CQ_UNIT_SIZE * pending)
        cq.max_offset = flushed + pending
        out.append(cq)
    return out


@given(
    spec=st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 3)), min_size=1, max_size=5),
    picks=st.lists(st.lists(st.integers(0, 4), max_size=6), max_size=6),
    unit=st.binary(min_size=fmt.CQ_UNIT_SIZE, max_size=fmt.CQ_UNIT_SIZE),
)
def test_c_dispatch_equals_python_dispatch(
    spec: list[tuple[int, int]], picks: list[list[int]], unit: bytes
) -> None:
    """consumequeue.dispatch and its C twin (write_run dispatches with it) leave the same
    units, queue ends and dirty marks, the same queue named twice included."""
    states = []
    for run in (speedups.dispatch, consumequeue.dispatch):
        queues = _queues(spec)
        dirty: dict[str, ConsumeQueue] = {}
        for pick in picks:
            run(tuple(queues[i % len(queues)] for i in pick), unit, dirty)
        states.append(
            (
                [(q.name, bytes(q.pending), q.max_offset) for q in queues],
                [(name, queues.index(cq)) for name, cq in dirty.items()],
            )
        )
    assert states[0] == states[1]


@given(st.binary(max_size=2000))
def test_crc32_is_zlibs(data: bytes) -> None:
    assert speedups.crc32(data) == zlib.crc32(data)


def test_bad_arguments_raise_instead_of_writing() -> None:
    buf = bytearray(b"keep")
    good = (100, 0, 0, 0, 0, b"b", b"\x01t", b"", b"", ())
    with pytest.raises(TypeError):
        speedups.append_record(bytes(buf), *good)
    with pytest.raises(TypeError):
        speedups.append_record(buf, *good[:-1])
    with pytest.raises(ValueError, match="negative"):
        speedups.append_record(buf, *good[:-1], (1, -1))
    with pytest.raises(OverflowError):
        speedups.append_record(buf, 100, 1 << 64, *good[2:])
    with pytest.raises(ValueError, match="too long"):
        speedups.append_record(buf, 1 << 20, 0, 0, 0, 0, b"", b"\x01t", bytes(70_000), b"", ())
    assert buf == b"keep"


def test_no_reference_or_memory_leak() -> None:
    body, topic, props, head = b"x" * 64, b"\x05topic", b"k\x01v\x02", b"H\x01q\x02O\x01"
    lights = (1, 2, 3)
    counts = [sys.getrefcount(o) for o in (body, topic, props, head, lights)]
    tracemalloc.start()
    try:
        speedups.append_record(bytearray(), 1000, 0, 0, 0, 0, body, topic, props, head, lights)
        before = tracemalloc.get_traced_memory()[0]
        for i in range(30_000):
            buf = bytearray()
            speedups.append_record(buf, 1000, i, i, 0, 0, body, topic, props, head, lights)
            speedups.append_record(buf, 10, i, i, 0, 0, body, topic, props, head, lights)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(o) for o in (body, topic, props, head, lights)] == counts
    assert grown < 64 * 1024, f"{grown} bytes kept after 60,000 calls"


PURE = os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0")


@pytest.mark.skipif(PURE, reason="LMQTT_PURE_PYTHON is set: the store runs the reference")
def test_the_store_uses_it() -> None:
    assert append_module.SPEEDUPS and append_module._append_record is speedups.append_record


def test_the_format_comes_from_python() -> None:
    """The C module spells no property key of the format; it is handed them by configure,
    which refuses a layout it cannot write, and it writes nothing before configure ran."""
    source = SOURCE.read_text()
    for key in (fmt.PROP_MULTI_DISPATCH, fmt.PROP_MULTI_QUEUE_OFFSET, fmt.PROP_CRC32):
        assert key not in source
    good = (fmt.MAGIC, fmt.CRC_MASK, fmt.CRC_PREFIX, fmt.HEADER_SIZE, kernel.WRITTEN_FIELDS)
    with pytest.raises(ValueError, match="outside the header"):
        speedups.configure(*good[:3], 60, good[4], fmt.CQ_UNIT_SIZE)
    with pytest.raises(ValueError, match="cannot write"):
        speedups.configure(*good, 24)
    with pytest.raises(ValueError, match="one offset per"):
        speedups.configure(*good[:4], good[4][:-1], fmt.CQ_UNIT_SIZE)
    unconfigured = subprocess.run(
        [sys.executable, "-c", "import store._speedups as k; "
         "k.append_record(bytearray(), 999, 0, 0, 0, 0, b'', b'\\x01t', b'', b'', ())"],
        env={**os.environ, "LMQTT_PURE_PYTHON": "1"}, capture_output=True, text=True,
    )  # fmt: skip
    assert "is not configured" in unconfigured.stderr  # the store's import configured none
    buf = bytearray()
    speedups.append_record(buf, 999, 0, 0, 0, 0, b"", b"\x01t", b"", b"", ())  # still configured
    assert fmt.check_record(buf, 0, len(buf)) == len(buf)


def test_the_build_matches_the_source() -> None:
    digest = accelerators.source_digest(SOURCE)
    assert digest == speedups.SOURCE_SHA256, "stale build: run `make .venv/.installed-dev`"


def test_pure_python_mode_writes_the_same_log(tmp_path: Path) -> None:
    """The same puts through the C and the pure-Python store give byte-identical segments
    (the clock frozen); 8 KiB segments, so records also roll over segment ends."""
    code = """
import sys
from pathlib import Path
from store import append as s
from store import MessageStore, StoreConfig
s._time = lambda: 1_700_000_000.0
st = MessageStore.open(StoreConfig(data_dir=sys.argv[1], segment_size=8192))
props = st.encode_properties({"k": "v"})
for i in range(300):
    lights = ("%LMQ%a/+", "%LMQ%a/#") if i % 3 else ()
    st.append_encoded([("a", lights, bytes([i % 256]) * (i % 97), props)])
st.close()
print(s.SPEEDUPS)
"""
    outputs = {}
    for mode, env_value in (("c", "0"), ("py", "1")):
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / mode)],
            env={**os.environ, "LMQTT_PURE_PYTHON": env_value},
            capture_output=True,
            text=True,
            check=True,
        )
        outputs[mode] = out.stdout.strip()
    assert outputs == {"c": "True", "py": "False"}
    logs = {mode: sorted((tmp_path / mode / "commitlog").iterdir()) for mode in ("c", "py")}
    assert [p.name for p in logs["c"]] == [p.name for p in logs["py"]]
    assert len(logs["c"]) > 3
    for c_file, py_file in zip(logs["c"], logs["py"], strict=True):
        assert c_file.read_bytes() == py_file.read_bytes()
