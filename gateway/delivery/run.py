"""The plain delivery run: a batch of one subscription's stored messages of the canonical shape
straight to PUBLISH bytes, in one call (gateway/delivery/send.py `Sender._deliver_run` calls
it per run of messages it takes).

`plain_run_py` is the reference; gateway/delivery/_run.c `plain_run` is its C twin, which must
do exactly the same (tests/gateway/delivery/test_delivery_plain_run.py). The delivery rule
both apply is gateway/delivery/rules.py `decide` for one subscription without identifier and a
message without expiry; neither spells its parts, both take them from rules.py: the tables
`QOS_TABLE` and `RETAIN_TABLE` (read here at import, handed to the C code at load time by
`configure` with the record schema's key names from topicmap/record.py) and, per call, the
publisher whose messages the subscription passes over (`rules.passed_over`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import MISSING
from types import ModuleType

import accelerators
from gateway.delivery.rules import QOS_TABLE, RETAIN_TABLE
from gateway.protocol import PreparedPublish, Publish
from gateway.session.model import Inflight
from gateway.storage.port import StoredMessage
from topicmap.record import CLIENT, EXPIRY, QOS, RETAIN, TOPIC, V5_KEYS

__all__ = ["PLAIN_RUN", "PlainRun", "configured", "plain_run_py", "record_layout"]

# QOS_TABLE by granted QoS: _QOS_BY_GRANTED[granted][message QoS] -> delivered QoS.
_QOS_BY_GRANTED = tuple(zip(*QOS_TABLE, strict=True))


def plain_run_py(
    messages: list[StoredMessage],
    i: int,
    state: list[int],
    others: Mapping[str, object] | None,
    window: int,
    level: int,
    sub_qos: int,
    rap: bool,
    passed_over: str | None,
    queue: str,
    inflight: dict[int, Inflight],
    pending: dict[int, int],
    inflight_new: Callable[[int, str, int, int], Inflight],
    topics: dict[str, bytes],
    outbound: dict[int, int],
    receive_maximum: int,
    unacked: int,
    batch: list[bytes],
) -> tuple[int, bool]:
    """The plain send path (`Sender._deliver` -> `decide` -> `Connection.send_prepared`) over
    `messages[i:]` for one subscription, for records of the canonical shape, until a message
    it does not take: the reference of `plain_run` in gateway/delivery/_run.c, which must do
    exactly this without the RecordedPublish and the PreparedPublish (the same dict changes,
    the same bytes; tests/gateway/delivery/test_delivery_plain_run.py compares them).

    Stops without touching the message at `i` (the general path takes it, with every rule)
    unless one subscription covers it (`others` is None: the session has one; or it is in
    one queue; or none of its other queues is a key of `others`, the session's subscriptions
    by queue, so that overlap.py `covering` answers "this one alone"), its QOS is "0", "1" or "2"
    (or absent), it has no EXPIRY and at level 5 none of V5_KEYS, its topic
    is in the writers' encoded-topic cache `topics` (valid, encoded), its body is bytes, and
    for QoS > 0 the next packet id is free (in flight, or in the codec's `outbound`) and the
    codec's Receive Maximum not reached. Stops with `full` = True when it needs a window slot
    and none is free. The subscription is granted `sub_qos` (0..2), with retain-as-published
    `rap`, and passes over the messages of the client `passed_over` (None: of none). `state`
    is [next offset, next packet id, packets sent, index of the last message passed] and is
    written back on every exit, errors included. Returns (index of the first message not
    taken, full)."""
    next_offset, next_pid, sent, moved = state
    delivered_qos = _QOS_BY_GRANTED[sub_qos]
    v5, rap = level == 5, bool(rap)
    retain_if = RETAIN_TABLE[True][v5][rap]  # the RETAIN of a message published retained
    retain_else = RETAIN_TABLE[False][v5][rap]  # and of one not
    read_retain = retain_if != retain_else  # whether the message's own flag matters
    n = len(messages)
    full = False
    try:
        while i < n:
            msg = messages[i]
            off = msg[3]
            if off < next_offset:
                i += 1
                continue
            props = msg[2]
            queues = msg[8]
            if others is not None and any(q != queue and q in others for q in queues):
                break
            qos_text = props.get(QOS, "0")
            if type(qos_text) is not str or qos_text not in ("0", "1", "2"):
                break
            if EXPIRY in props or (v5 and any(k in props for k in V5_KEYS)):
                break
            topic = props.get(TOPIC, msg[0])
            if type(topic) is not str or topic not in topics or type(msg[1]) is not bytes:
                break
            if passed_over is None or props.get(CLIENT, "") != passed_over:
                qos = delivered_qos[int(qos_text)]
                if qos > 0 and window - len(inflight) <= 0:
                    full = True
                    break
                retain = retain_else
                if read_retain and props.get(RETAIN) == "1":
                    retain = retain_if
                pid = None
                if qos > 0:
                    pid = next_pid
                    if pid in inflight or pid in outbound or len(outbound) >= receive_maximum:
                        break
                packet = PreparedPublish(level, Publish(topic, msg[1], qos, retain)).packet(pid)
                if pid is not None:
                    outbound[pid] = unacked
                    next_pid = pid % 65535 + 1
                    inflight[pid] = inflight_new(pid, queue, off, qos)
                    pending[off] = pid
                batch.append(packet)
                sent += 1
            next_offset = off + 1
            moved = i
            i += 1
    finally:
        state[:] = (next_offset, next_pid, sent, moved)
    return i, full


PlainRun = Callable[..., tuple[int, bool]]


def configured(kernel: ModuleType) -> PlainRun:
    """The `plain_run` of the C kernel `kernel` (gateway.delivery._run), handed the record
    schema's key names it reads and the delivery rule's tables it applies."""
    kernel.configure(TOPIC, QOS, RETAIN, CLIENT, EXPIRY, V5_KEYS, QOS_TABLE, RETAIN_TABLE)
    kernel.configure_record(Inflight, *record_layout(Inflight))
    return kernel.plain_run


def record_layout(cls: type) -> tuple[tuple[object, ...], tuple[object, ...], tuple[bool, ...]]:
    """What the C kernel needs to build a record of the slotted dataclass `cls` without its
    Python __init__, as `cls(a, b, c, d)` would: the fields' member descriptors in field order,
    and for each field after the first four (which have no default) its default, or its
    default factory (flagged True: called per record)."""
    fields = dataclasses.fields(cls)
    with_default = [f.default is not MISSING or f.default_factory is not MISSING for f in fields]
    if "__slots__" not in vars(cls) or any(with_default[:4]) or not all(with_default[4:]):
        raise TypeError(f"{cls.__name__}: not slotted, four fields without default, then defaults")
    rest = fields[4:]
    return (
        tuple(cls.__dict__[f.name] for f in fields),
        tuple(f.default if f.default_factory is MISSING else f.default_factory for f in rest),
        tuple(f.default_factory is not MISSING for f in rest),
    )


def _load_plain_run() -> PlainRun:
    """The C `plain_run` (gateway/delivery/_run.c) when it was built, else the reference;
    LMQTT_PURE_PYTHON_DELIVERY (this path's switch, for A/B runs) keeps the reference."""
    kernel = accelerators.load("gateway.delivery._run", "LMQTT_PURE_PYTHON_DELIVERY")
    return plain_run_py if kernel is None else configured(kernel)


PLAIN_RUN: PlainRun = _load_plain_run()
