"""The plain delivery run: a batch of one subscription's stored messages of the canonical shape
straight to PUBLISH bytes, in one call (gateway/delivery/send.py `Sender._deliver_run` calls
it per run of messages it takes).

`plain_run_py` is the reference; gateway/delivery/_run.c `plain_run` is its C twin, which must
do exactly the same (tests/gateway/delivery/test_delivery_plain_run.py). The C code is handed the
record schema's key names (topicmap/record.py) at load time by `configure`. The delivery rule
both apply is gateway/delivery/rules.py `decide` for one subscription without identifier and a
message without expiry.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import accelerators
from gateway.protocol import PreparedPublish, Publish
from gateway.session.model import Inflight
from gateway.storage.port import StoredMessage
from topicmap.record import CLIENT, EXPIRY, QOS, RETAIN, TOPIC, V5_KEYS

__all__ = ["PLAIN_RUN", "PlainRun", "configured", "plain_run_py"]


def plain_run_py(
    messages: list[StoredMessage],
    i: int,
    state: list[int],
    single: bool,
    window: int,
    level: int,
    sub_qos: int,
    no_local: bool,
    rap: bool,
    client_id: str,
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
    unless one subscription covers it (`single`, or one queue), its QOS is "0", "1" or "2"
    (or absent), it has no EXPIRY and at level 5 none of V5_KEYS, its topic
    is in the writers' encoded-topic cache `topics` (valid, encoded), its body is bytes, and
    for QoS > 0 the next packet id is free (in flight, or in the codec's `outbound`) and the
    codec's Receive Maximum not reached. Stops with `full` = True when it needs a window slot
    and none is free. `state` is [next offset, next packet id, packets sent, index of the
    last message passed] and is written back on every exit, errors included. Returns (index
    of the first message not taken, full)."""
    next_offset, next_pid, sent, moved = state
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
            if not single and len(msg[8]) > 1:
                break
            qos_text = props.get(QOS, "0")
            if type(qos_text) is not str or qos_text not in ("0", "1", "2"):
                break
            if EXPIRY in props or (level == 5 and any(k in props for k in V5_KEYS)):
                break
            topic = props.get(TOPIC, msg[0])
            if type(topic) is not str or topic not in topics or type(msg[1]) is not bytes:
                break
            if not (no_local and props.get(CLIENT, "") == client_id):
                qos = int(qos_text)
                if sub_qos < qos:
                    qos = sub_qos
                if qos > 0 and window - len(inflight) <= 0:
                    full = True
                    break
                retain = level == 5 and rap and props.get(RETAIN) == "1"
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
    schema's key names it reads."""
    kernel.configure(TOPIC, QOS, RETAIN, CLIENT, EXPIRY, V5_KEYS)
    return kernel.plain_run


def _load_plain_run() -> PlainRun:
    """The C `plain_run` (gateway/delivery/_run.c) when it was built, else the reference;
    LMQTT_PURE_PYTHON_DELIVERY (this path's switch, for A/B runs) keeps the reference."""
    kernel = accelerators.load("gateway.delivery._run", "LMQTT_PURE_PYTHON_DELIVERY")
    return plain_run_py if kernel is None else configured(kernel)


PLAIN_RUN: PlainRun = _load_plain_run()
