"""The C twin of the delivery loop's plain run (`plain_run` in gateway/protocol/_speedups.c)
against its Python reference (gateway/delivery.py `plain_run_py`): for the same batch of
stored messages and the same session state, the same return value, the same bytes in the
pass's batch, and the same packet ids, in-flight entries, pending offsets, codec outbound
map, decoded-record cache and encoded-packet cache afterwards; and when a callable raises
half-way, the same exception and the same state written back.

Each case builds two copies of everything (real RecentMessages, PreparedCache, Inflight,
read_record and _prepare) and runs one copy through each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import delivery
from gateway.protocol import PreparedPublish
from gateway.recent import PreparedCache, RecentMessages
from gateway.records import read_record
from gateway.session import Inflight
from gateway.storage import StoredMessage

speedups = pytest.importorskip("gateway.protocol._speedups")
C_RUN = speedups.plain_run

CLIENT = "me"


def _props(qos: str, retain: str, client: str, expiry: str | None, mqtt: bool) -> dict[str, str]:
    if not mqtt:
        return {"other": "x"}  # not written by an MQTT publish: read_record still reads it
    p = {"mqtt.topic": "t/x", "mqtt.qos": qos, "mqtt.retain": retain, "mqtt.client": client}
    if expiry is not None:
        p["mqtt.expiry"] = expiry
    return p


props = st.builds(
    _props,
    qos=st.sampled_from(["0", "1", "2", "1", "bad"]),  # "bad": read_record returns None
    retain=st.sampled_from(["0", "1"]),
    client=st.sampled_from([CLIENT, "other"]),
    expiry=st.sampled_from([None, None, None, "60"]),
    mqtt=st.booleans(),
)


@st.composite
def batches(draw: st.DrawFn) -> list[StoredMessage]:
    n = draw(st.integers(0, 12))
    offset = draw(st.integers(0, 5))
    phys = draw(st.sampled_from([0, 1000]))  # 1000: the records of another run, uncached
    out = []
    for _ in range(n):
        offset += draw(st.sampled_from([1, 1, 1, 0, 2]))
        phys += draw(st.integers(1, 300))
        queues = tuple(draw(st.sampled_from([["q"], ["q", "r"], ["a", "q", "r"]])))
        body = draw(st.binary(max_size=40))
        p = draw(props)
        out.append(StoredMessage("t", body, p, offset, phys, 1234, 1234, offset, queues))
    return out


@dataclass
class Side:
    """One copy of everything a run reads and changes."""

    inflight: dict[int, Inflight]
    outbound: dict[int, int]
    pending: dict[int, int] = field(default_factory=dict)
    recent: RecentMessages = field(default_factory=RecentMessages)
    prepared: PreparedCache = field(default_factory=PreparedCache)
    batch: list[bytes] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)


def _side(busy_ids: list[int], outbound_ids: list[int], cached: list[StoredMessage]) -> Side:
    side = Side(
        inflight={pid: Inflight(pid, "q", 0, 1) for pid in busy_ids},
        outbound=dict.fromkeys(outbound_ids, 1),
    )
    for msg in cached:  # records a fan-out already decoded for another subscriber
        side.recent.record(msg)
    return side


def _run(run: Any, side: Side, messages: list[StoredMessage], args: dict[str, Any]) -> Any:
    state = [args["next_offset"], args["next_pid"], 0, -1]
    fail_at = args["fail_at"]

    def prepare(*a: Any) -> PreparedPublish:
        side.calls.append("prepare")
        if len(side.calls) == fail_at:
            raise RuntimeError("prepare failed")
        return delivery._prepare(*a)

    def record(msg: StoredMessage) -> Any:
        side.calls.append(f"record {msg.physical_offset}")
        return side.recent.record(msg)

    def read(*a: Any) -> Any:
        side.calls.append("read")
        return read_record(*a)

    try:
        result: Any = run(
            messages, args["start"], state, args["shared"], args["single"], args["window"],
            args["level"], args["sub_qos"], args["no_local"], args["rap"], CLIENT, "q",
            side.inflight, side.pending, Inflight, side.recent.decoded, record, read,
            side.prepared.entries, side.prepared.put, prepare, side.outbound,
            args["receive_maximum"], 1, side.batch,
        )  # fmt: skip
    except RuntimeError as err:
        result = ("raised", str(err))
    return result, state


def _observed(side: Side) -> dict[str, Any]:
    return {
        "batch": side.batch,
        "calls": side.calls,
        "inflight": [(k, v.packet_id, v.queue, v.offset, v.qos) for k, v in side.inflight.items()],
        "pending": list(side.pending.items()),
        "outbound": list(side.outbound.items()),
        "records": list(side.recent.decoded.items()),
        "prepared": [
            (k, v.packet(7) if v.qos else v.packet()) for k, v in side.prepared.entries.items()
        ],
    }


@settings(max_examples=400, deadline=None)
@given(
    messages=batches(),
    start=st.integers(0, 3),
    next_offset=st.integers(0, 8),
    next_pid=st.sampled_from([1, 2, 65535]),
    busy_ids=st.lists(st.sampled_from([1, 2, 3, 65535]), max_size=2),
    outbound_ids=st.lists(st.sampled_from([1, 2, 3, 4]), max_size=2),
    receive_maximum=st.sampled_from([65535, 3, 1]),
    window=st.sampled_from([65535, 4, 1]),
    shared=st.booleans(),
    single=st.booleans(),
    level=st.sampled_from([3, 4, 5]),
    sub_qos=st.sampled_from([0, 1, 2]),
    no_local=st.booleans(),
    rap=st.booleans(),
    cached=st.integers(0, 4),
    fail_at=st.sampled_from([0, 0, 0, 1, 3, 5]),
)
def test_plain_run_matches_reference(
    messages: list[StoredMessage], cached: int, busy_ids: list[int], outbound_ids: list[int],
    **args: Any,
) -> None:  # fmt: skip
    start = min(args["start"], len(messages))
    args["start"] = start
    sides = [_side(busy_ids, outbound_ids, messages[:cached]) for _ in range(2)]
    got = [
        _run(run, side, messages, args)
        for run, side in zip((C_RUN, delivery.plain_run_py), sides, strict=True)
    ]
    assert got[0] == got[1]
    assert _observed(sides[0]) == _observed(sides[1])


def test_plain_run_takes_a_fan_out() -> None:
    """Not vacuous: a plain fan-out batch is sent whole, packet ids 1.. in order."""
    p = _props("1", "0", "other", None, True)
    messages = [
        StoredMessage("t", b"m%d" % i, p, i, 100 * i + 1, 5, 5, i, ("q", "r")) for i in range(5)
    ]
    args = dict(start=0, next_offset=0, next_pid=1, shared=False, single=True, window=100,
                level=4, sub_qos=1, no_local=False, rap=False, receive_maximum=100,
                fail_at=0)  # fmt: skip
    for run in (C_RUN, delivery.plain_run_py):
        side = _side([], [], [])
        result, state = _run(run, side, messages, args)
        assert result == (5, False)
        assert state == [5, 6, 5, 4]
        assert list(side.pending.items()) == [(i, i + 1) for i in range(5)]
        assert [b[-2:] for b in side.batch] == [b"m%d" % i for i in range(5)]
