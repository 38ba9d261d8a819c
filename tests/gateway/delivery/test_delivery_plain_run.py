"""The C twin of the delivery loop's plain run (`plain_run` in gateway/delivery/_run.c)
against its Python reference (gateway/delivery/run.py `plain_run_py`, which encodes with
PreparedPublish): for the same batch of stored messages and the same session state, the same
return value, the same PUBLISH bytes in the pass's batch, and the same packet ids, in-flight
entries, pending offsets and codec outbound map afterwards; and when building an in-flight
entry raises half-way, the same exception and the same state written back.

Each case builds two copies of the state and runs one copy through each; the records are of
every shape read_record meets (canonical or not: the run must leave the others alone)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import accelerators
from gateway.delivery import run as delivery
from gateway.delivery.rules import decide, passed_over
from gateway.delivery.send import _prepare
from gateway.messages.records import read_record
from gateway.protocol import ENCODED_TOPICS, Publish, encode
from gateway.session.model import NO_INFLIGHT, NO_PENDING, Inflight, SubscriptionState
from gateway.storage.port import StoredMessage
from topicmap import record

speedups = pytest.importorskip("gateway.delivery._run")
C_RUN = delivery.configured(speedups)  # as the loader hands it over

CLIENT = "me"
TOPICS = ["t/x", "t/é", "u/" + "l" * 200, "t/uncached", ""]


def _encode_topics() -> None:
    """What the writers cache once they encoded a topic (other tests may have cleared it)."""
    for name in TOPICS[:3]:
        encode(Publish(name, b"", 0), 4)
    ENCODED_TOPICS.pop("t/uncached", None)  # the oracle below encodes it: uncached again


def _props(qos: str | None, retain: str | None, client: str | None, extra: str | None,
           topic: str | None) -> dict[str, str]:  # fmt: skip
    p = {}
    for key, value in (("mqtt.qos", qos), ("mqtt.retain", retain), ("mqtt.client", client),
                       ("mqtt.topic", topic)):  # fmt: skip
        if value is not None:
            p[key] = value
    if extra is not None:
        p[extra] = "1"
    return p


props = st.builds(
    _props,
    qos=st.sampled_from(["0", "1", "2", "1", "1", None, "3", " 1", "x"]),
    retain=st.sampled_from(["0", "1", None, "true"]),
    client=st.sampled_from([CLIENT, "other", None, ""]),
    extra=st.sampled_from(
        [
            None,
            None,
            None,
            None,
            "mqtt.expiry",
            "mqtt.pfi",
            "mqtt.ct",
            "mqtt.rt",
            "mqtt.cd",
            "mqtt.up",
            "mqtt.pid",
        ]
    ),
    topic=st.sampled_from([*TOPICS, None]),
)


@st.composite
def batches(draw: st.DrawFn) -> list[StoredMessage]:
    n = draw(st.integers(0, 12))
    offset = draw(st.integers(0, 5))
    out = []
    for k in range(n):
        offset += draw(st.sampled_from([1, 1, 1, 0, 2]))
        queues = tuple(draw(st.sampled_from([["q"], ["q", "r"], ["a", "q", "r"]])))
        body = draw(st.binary(max_size=300))
        p = draw(props)
        stored_topic = draw(st.sampled_from(TOPICS))
        out.append(StoredMessage(stored_topic, body, p, offset, 100 * k, 5, 5, offset, queues))
    return out


@dataclass
class Side:
    """One copy of everything a run reads and changes."""

    inflight: dict[int, Inflight]
    outbound: dict[int, int]
    pending: dict[int, int] = field(default_factory=dict)
    batch: list[bytes] = field(default_factory=list)


def _run(run: Any, side: Side, messages: list[StoredMessage], args: dict[str, Any]) -> Any:
    state = [args["next_offset"], args["next_pid"], 0, -1]
    made = []

    def inflight_new(*a: Any) -> Inflight:
        made.append(a)
        if len(made) == args["fail_at"]:
            raise RuntimeError("no memory")
        return Inflight(*a)

    try:
        result: Any = run(
            messages, args["start"], state, args["others"], args["window"], args["level"],
            args["sub_qos"], args["rap"], passed_over(args["no_local"], CLIENT), "q",
            side.inflight, side.pending, inflight_new, ENCODED_TOPICS, side.outbound,
            args["receive_maximum"], 1, side.batch,
        )  # fmt: skip
    except RuntimeError as err:
        result = ("raised", str(err))
    return result, state, made


def _observed(side: Side) -> dict[str, Any]:
    return {
        "batch": side.batch,
        "inflight": [(k, v.packet_id, v.queue, v.offset, v.qos) for k, v in side.inflight.items()],
        "pending": list(side.pending.items()),
        "outbound": list(side.outbound.items()),
    }


@settings(max_examples=500, deadline=None)
@given(
    messages=batches(),
    start=st.integers(0, 3),
    next_offset=st.integers(0, 8),
    next_pid=st.sampled_from([1, 2, 65535]),
    busy_ids=st.lists(st.sampled_from([1, 2, 3, 65535]), max_size=2),
    outbound_ids=st.lists(st.sampled_from([1, 2, 3, 4]), max_size=2),
    receive_maximum=st.sampled_from([65535, 3, 1]),
    window=st.sampled_from([65535, 4, 1]),
    # The session's subscriptions by queue (None: one): "r" and "a" are queues of the drawn
    # messages, so with them the run must stop where overlap.py decides.
    others=st.sampled_from([None, {"q": 0}, {"q": 0, "r": 0}, {"a": 0, "q": 0}, {"z": 0}]),
    level=st.sampled_from([3, 4, 5]),
    sub_qos=st.sampled_from([0, 1, 2]),
    no_local=st.booleans(),
    rap=st.booleans(),
    fail_at=st.sampled_from([0, 0, 0, 1, 3]),
)
def test_plain_run_matches_reference(
    messages: list[StoredMessage], busy_ids: list[int], outbound_ids: list[int], **args: Any
) -> None:
    args["start"] = min(args["start"], len(messages))
    _encode_topics()
    sides = [
        Side(
            inflight={pid: Inflight(pid, "q", 0, 1) for pid in busy_ids},
            outbound=dict.fromkeys(outbound_ids, 1),
        )
        for _ in range(2)
    ]
    got = [
        _run(run, side, messages, args)
        for run, side in zip((C_RUN, delivery.plain_run_py), sides, strict=True)
    ]
    assert got[0] == got[1]
    assert _observed(sides[0]) == _observed(sides[1])
    if got[0][0][0] != "raised":
        assert sides[0].batch == _general(messages, got[0][0][0], args)


def _general(messages: list[StoredMessage], stop: int, args: dict[str, Any]) -> list[bytes]:
    """What the general path (read_record, the delivery rule `decide`, _prepare) sends for
    the messages a run took: the run must not take one it would send differently."""
    out = []
    next_offset, pid = args["next_offset"], args["next_pid"]
    level = args["level"]
    sub = SubscriptionState(
        "t/#", "q", None, args["sub_qos"], no_local=args["no_local"],
        retain_as_published=args["rap"],
    )  # fmt: skip
    for msg in messages[args["start"] : stop]:
        if msg.queue_offset < next_offset:
            continue
        next_offset = msg.queue_offset + 1
        rec = read_record(msg.topic, msg.body, msg.properties, msg.store_timestamp)
        assert rec is not None and rec.expiry is None
        assert level != 5 or rec.mqtt5_properties([], None) is None
        decided = decide(rec, sub, CLIENT, level)
        if decided is None:
            continue
        assert decided.sub_ids == [] and decided.expiry_left is None
        qos, retain = decided.qos, decided.retain
        prepared = _prepare(rec, level, qos, retain, rec.topic, None, [], None)
        out.append(prepared.packet(pid if qos else None))
        if qos:
            pid = pid % 65535 + 1
    return out


def test_plain_run_takes_a_canonical_batch() -> None:
    """Not vacuous: a canonical batch is sent whole, packet ids 1.. in order, and the first
    record of another shape stops the run."""
    _encode_topics()
    p = _props("1", "0", "other", None, "t/x")
    messages = [
        StoredMessage("t", b"m%d" % i, p, i, 100 * i, 5, 5, i, ("q", "r")) for i in range(5)
    ]
    messages.append(messages[0]._replace(properties={**p, "mqtt.expiry": "9"}, queue_offset=5))
    args = dict(start=0, next_offset=0, next_pid=1, others=None, window=100, level=4,
                sub_qos=1, no_local=False, rap=False, receive_maximum=100, fail_at=0)  # fmt: skip
    for run in (C_RUN, delivery.plain_run_py):
        side = Side(inflight={}, outbound={})
        result, state, _ = _run(run, side, messages, args)
        assert result == (5, False)
        assert state == [5, 6, 5, 4]
        assert list(side.pending.items()) == [(i, i + 1) for i in range(5)]
        assert side.batch == [
            encode(Publish("t/x", b"m%d" % i, 1, packet_id=i + 1), 4) for i in range(5)
        ]


def test_neither_run_writes_into_the_shared_empty_dicts() -> None:
    """A session's in-flight dict and a subscription's pending dict are one shared read-only
    empty dict until the delivery loop gives them their own: a QoS 1 run handed one raises
    (TypeError) in the C run as in the reference, and the shared ones stay empty."""
    _encode_topics()
    p = _props("1", "0", "other", None, "t/x")
    messages = [StoredMessage("t", b"m", p, 0, 100, 5, 5, 0, ("q",))]
    args = dict(start=0, next_offset=0, next_pid=1, others=None, window=100, level=4,
                sub_qos=1, no_local=False, rap=False, receive_maximum=100, fail_at=0)  # fmt: skip
    for run in (C_RUN, delivery.plain_run_py):
        for side in (
            Side(inflight=NO_INFLIGHT, outbound={}),
            Side(inflight={}, outbound={}, pending=NO_PENDING),
        ):
            with pytest.raises(TypeError):
                _run(run, side, messages, args)
    assert not NO_INFLIGHT and not NO_PENDING


def test_plain_run_takes_messages_other_queues_of_the_session_do_not_hold() -> None:
    """A message in several queues is the run's when none of its other queues is one of the
    session's (a backend's exact filter beside other clients' wildcards); the run stops at
    one another subscription of the session also holds (overlap.py decides that one)."""
    _encode_topics()
    p = _props("0", "0", "other", None, "t/x")
    messages = [StoredMessage("t", b"m", p, i, 100 * i, 5, 5, i, ("a", "q", "r")) for i in range(3)]
    args = dict(start=0, next_offset=0, next_pid=1, window=100, level=4, sub_qos=0,
                no_local=False, rap=False, receive_maximum=100, fail_at=0)  # fmt: skip
    for run in (C_RUN, delivery.plain_run_py):
        taken = _run(run, Side(inflight={}, outbound={}), messages, {**args, "others": {"q": 0}})
        assert taken[0] == (3, False)
        held = _run(
            run, Side(inflight={}, outbound={}), messages, {**args, "others": {"q": 0, "r": 0}}
        )
        assert held[0] == (0, False)


@pytest.mark.skipif(
    any(
        os.environ.get(n, "") not in ("", "0")
        for n in ("LMQTT_PURE_PYTHON", "LMQTT_PURE_PYTHON_DELIVERY")
    ),
    reason="a LMQTT_PURE_PYTHON switch is set: the gateway runs the reference",
)
def test_the_gateway_uses_the_c_run() -> None:
    assert delivery.PLAIN_RUN is C_RUN


def test_the_build_matches_the_source() -> None:
    """A .so compiled from an older _run.c would test old code."""
    source = Path(delivery.__file__).with_name("_run.c")
    digest = accelerators.source_digest(source)
    assert digest == speedups.SOURCE_SHA256, "stale build: run `make .venv/.installed-dev`"


def test_the_c_run_applies_the_rule_tables_it_is_handed() -> None:
    """The C run spells no part of the delivery rule: handed other tables by configure, it
    sends by them (here: the message's QoS whatever was granted, RETAIN as published at every
    level), and a table of the wrong shape is refused, the tables in use kept."""
    _encode_topics()
    p = _props("2", "1", "other", None, "t/x")
    messages = [StoredMessage("t", b"m", p, 0, 0, 5, 5, 0, ("q",))]
    args = dict(start=0, next_offset=0, next_pid=1, others=None, window=100, level=4,
                sub_qos=0, no_local=False, rap=False, receive_maximum=100, fail_at=0)  # fmt: skip
    names = (record.TOPIC, record.QOS, record.RETAIN, record.CLIENT, record.EXPIRY)
    as_published = tuple(((r, r), (r, r)) for r in (False, True))
    message_qos = tuple((m, m, m) for m in range(3))
    try:
        speedups.configure(*names, record.V5_KEYS, message_qos, as_published)
        side = Side(inflight={}, outbound={})
        assert _run(C_RUN, side, messages, args)[0] == (1, False)
        assert side.batch == [encode(Publish("t/x", b"m", 2, True, packet_id=1), 4)]
        with pytest.raises(ValueError):
            speedups.configure(*names, record.V5_KEYS, message_qos[:2], as_published)
        with pytest.raises(ValueError):
            speedups.configure(*names, record.V5_KEYS, ((3, 3, 3),) * 3, as_published)
        side = Side(inflight={}, outbound={})
        assert _run(C_RUN, side, messages, args)[0] == (1, False)
        assert side.batch == [encode(Publish("t/x", b"m", 2, True, packet_id=1), 4)]
    finally:
        delivery.configured(speedups)  # the rule's own tables again
    side = Side(inflight={}, outbound={})
    assert _run(C_RUN, side, messages, args)[0] == (1, False)
    assert side.batch == [encode(Publish("t/x", b"m", 0, False), 4)]


def test_the_c_run_spells_no_record_key() -> None:
    """The record schema's names come from Python (configure), not from the C source."""
    assert "mqtt." not in Path(delivery.__file__).with_name("_run.c").read_text()


def test_the_c_run_builds_the_inflight_record_as_its_class_does() -> None:
    """Handed the class itself as inflight_new (as the sender does), the C run builds each
    record through the fields' descriptors, not the dataclass's __init__: every field equal to
    what `Inflight(pid, queue, offset, qos)` holds (the reference builds it so), each record
    with its own sub_ids list."""
    _encode_topics()
    p = _props("1", "0", "other", None, "t/x")
    messages = [StoredMessage("t", b"m", p, i, 100 * i, 5, 5, i, ("q",)) for i in range(4)]
    sides = [Side(inflight={}, outbound={}) for _ in range(2)]
    for run, side in zip((C_RUN, delivery.plain_run_py), sides, strict=True):
        state = [0, 65534, 0, -1]
        result = run(
            messages, 0, state, None, 100, 5, 2, False, None, "q", side.inflight, side.pending,
            Inflight, ENCODED_TOPICS, side.outbound, 100, 1, side.batch,
        )  # fmt: skip
        assert result == (4, False)
    c_side, py_side = sides
    assert list(c_side.inflight) == [65534, 65535, 1, 2]
    assert c_side.inflight == py_side.inflight
    for inf in c_side.inflight.values():
        assert type(inf) is Inflight
        assert inf == Inflight(inf.packet_id, "q", inf.offset, 1)
    sub_ids = [id(inf.sub_ids) for inf in c_side.inflight.values()]
    assert len(set(sub_ids)) == len(sub_ids)
    assert _observed(c_side) == _observed(py_side)


def test_the_record_layout_is_refused_unless_the_c_run_can_build_it() -> None:
    """The C run builds only a slotted class whose first four fields have no default and whose
    others all have one; another layout is refused, the configured one kept."""

    @dataclass
    class NoSlots:
        a: int
        b: int
        c: int
        d: int

    @dataclass(slots=True)
    class MissingDefault:
        a: int
        b: int
        c: int
        d: int
        e: int

    for cls in (NoSlots, MissingDefault):
        with pytest.raises(TypeError):
            delivery.record_layout(cls)
    with pytest.raises(TypeError):  # not descriptors
        speedups.configure_record(NoSlots, (1, 2, 3, 4), (), ())
    fields, defaults, factories = delivery.record_layout(Inflight)
    with pytest.raises(TypeError):  # another class's slots: the run writes them by offset
        speedups.configure_record(MissingDefault, fields, defaults, factories)
    with pytest.raises(ValueError):  # a default short
        speedups.configure_record(Inflight, fields, defaults[1:], factories[1:])
    test_the_c_run_builds_the_inflight_record_as_its_class_does()
