"""The optional C accelerator (_speedups.c): same bytes and same errors as the Python writer,
no leaks, a build that matches its source, and a pure-Python mode that really is pure.

Where the module was not built (no compiler), only the pure-Python checks run; CI builds it
(`make test` installs the project, which compiles setup.py's extension).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import accelerators
from gateway.protocol import LocalProtocolError, Properties, Publish, SubAck, writers

speedups = pytest.importorskip("gateway.protocol._speedups")
SOURCE = Path(writers.__file__).with_name("_speedups.c")
# As writers does on import; also under LMQTT_PURE_PYTHON=1, where writers leaves it alone.
speedups.configure(Publish, writers._ENCODED_TOPICS, writers._encode_py)

# Values of every field, valid and not: wrong types, out-of-range ids, a bool as QoS, ...
# The C path must return the Python writer's bytes or let the Python writer raise.
any_topic = st.one_of(
    st.sampled_from(["a/b", "sensors/7/temp", "", "bad/+", "bad/#", "caf\u00e9/\u00fc"]),
    st.text(st.characters(blacklist_categories=["Cs"]), max_size=12),
)
any_payload = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=40).map(bytearray),
    st.binary(max_size=40).map(lambda b: memoryview(b)),
    st.sampled_from([bytes(16383), bytes(16384), bytes(2_097_200)]),
)
any_int = st.one_of(st.integers(-2, 3), st.integers(0xFFFE, 0x10001), st.just(2**70), st.just(True))
any_flag = st.one_of(st.booleans(), st.integers(0, 2), st.none())
any_packet_id = st.one_of(st.none(), any_int, st.just(5.0))
any_properties = st.sampled_from([None, Properties(), Properties(user_properties=[("k", "v")])])
any_level = st.sampled_from([3, 4, 5, 5, 6, 0, True])


def outcome(fn: Any, event: Any, level: Any) -> tuple[str, Any]:
    try:
        return "bytes", fn(event, level)
    except Exception as exc:  # the comparison is of the exception itself
        return type(exc).__name__, str(exc)


@given(
    topic=any_topic,
    payload=any_payload,
    qos=any_int,
    retain=any_flag,
    dup=any_flag,
    packet_id=any_packet_id,
    properties=any_properties,
    level=any_level,
)
def test_c_encode_equals_python_encode(
    topic: Any,
    payload: Any,
    qos: Any,
    retain: Any,
    dup: Any,
    packet_id: Any,
    properties: Any,
    level: Any,
) -> None:
    event = Publish(topic, payload, qos, retain, dup, packet_id, properties)
    # C first (the topic may be uncached: the fallback runs and may cache it), then Python,
    # then C again, which now finds a valid topic in the cache and takes the C path.
    first = outcome(speedups.encode, event, level)
    expected = outcome(writers._encode_py, event, level)
    assert first == expected
    assert outcome(speedups.encode, event, level) == expected


PURE = os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0")


@pytest.mark.skipif(PURE, reason="LMQTT_PURE_PYTHON is set: the gateway runs the Python writer")
def test_the_module_is_in_use_and_takes_the_c_path() -> None:
    assert writers.SPEEDUPS and writers.encode is speedups.encode
    assert writers.write_publish is speedups.encode
    assert writers.WRITERS[Publish] is speedups.encode
    event = Publish("speedups/path", b"payload", 1, packet_id=7)
    writers._encode_py(event, 5)  # caches the topic
    calls: list[object] = []

    def spy(ev: Any, level: int) -> bytes:
        calls.append(ev)
        return writers._encode_py(ev, level)

    speedups.configure(Publish, writers._ENCODED_TOPICS, spy)
    try:
        assert speedups.encode(event, 5) == writers._encode_py(event, 5)
        assert calls == []  # the fast shape never reached Python
        # A bytearray payload (typed bytes): a shape the C path leaves to Python.
        speedups.encode(Publish("speedups/path", bytearray(b"p")), 4)  # type: ignore[arg-type]
        speedups.encode(SubAck(1, [0]), 4)
        assert len(calls) == 2  # what C does not handle goes to the fallback
    finally:
        speedups.configure(Publish, writers._ENCODED_TOPICS, writers._encode_py)


def test_errors_come_from_the_python_writer() -> None:
    writers._encode_py(Publish("speedups/err", b""), 4)
    with pytest.raises(LocalProtocolError, match="packet identifier"):
        speedups.encode(Publish("speedups/err", b"", 1, packet_id=0), 4)
    with pytest.raises(LocalProtocolError, match="wildcard"):
        speedups.encode(Publish("speedups/+", b"", 0), 4)
    with pytest.raises(LocalProtocolError, match="unknown protocol level"):
        speedups.encode(Publish("speedups/err", b"", 0), 7)
    with pytest.raises(TypeError):
        speedups.encode(Publish("speedups/err", b""))


def test_unset_slot_raises_attribute_error_not_a_crash() -> None:
    event = Publish("speedups/slot", b"x")
    writers._encode_py(event, 4)
    del event.payload
    with pytest.raises(AttributeError):
        speedups.encode(event, 4)


def test_configure_refuses_a_class_without_plain_slots() -> None:
    class NotSlotted:
        topic = payload = qos = retain = dup = packet_id = properties = None

    with pytest.raises(TypeError, match="not a plain object slot"):
        speedups.configure(NotSlotted, {}, writers._encode_py)
    # The refused call left the working configuration alone.
    writers._encode_py(Publish("speedups/cfg", b"x"), 4)
    assert speedups.encode(Publish("speedups/cfg", b"x"), 4) == b"\x30\x0f\x00\x0cspeedups/cfgx"


def test_no_reference_or_memory_leak() -> None:
    payload = b"p" * 64
    topic = "speedups/leak"
    events = [
        Publish(topic, payload, 0),
        Publish(topic, payload, 1, packet_id=9),
        Publish(topic, payload, 2, True, True, 65535),
    ]
    writers._encode_py(events[0], 5)
    encoded_topic = writers._ENCODED_TOPICS[topic]
    counts = [sys.getrefcount(o) for o in (payload, topic, encoded_topic, events[1])]
    for _ in range(20_000):
        for event in events:
            for level in (4, 5):
                speedups.encode(event, level)
    assert [sys.getrefcount(o) for o in (payload, topic, encoded_topic, events[1])] == counts

    tracemalloc.start()
    try:
        for event in events:
            speedups.encode(event, 5)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(50_000):
            for event in events:
                speedups.encode(event, 5)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 150,000 encodes"


def test_the_build_matches_the_source() -> None:
    """A .so compiled from an older _speedups.c would test old code: `make` re-installs when
    the .c file changes, and this catches a build that did not happen."""
    digest = accelerators.source_digest(SOURCE)
    assert digest == speedups.SOURCE_SHA256, "stale build: run `make .venv/.installed-dev`"


@pytest.mark.parametrize("value", ["1", "yes"])
def test_pure_python_mode_ignores_the_build(value: str) -> None:
    code = (
        "from gateway.protocol import writers, Publish, encode;"
        "assert not writers.SPEEDUPS and encode is writers._encode_py;"
        "print(encode(Publish('a/b', b'x', 1, packet_id=2), 5).hex())"
    )
    env = {**os.environ, "LMQTT_PURE_PYTHON": value}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert bytes.fromhex(out.stdout.strip()) == b"\x32\x09\x00\x03a/b\x00\x02\x00x"
