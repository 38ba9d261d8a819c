"""Checks on crash images: what the store recovers, and what the real gateway serves.

The expectations come from the client side (what was acknowledged, and when) and from the
full recorded run (where each message ended up: queue and offset), never from the image's own
bookkeeping.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.protocol import PubAck, PubComp, Publish, PubRec, PubRel, Subscribe, Subscription
from gateway.session.registry import SESSION_KEY_PREFIX
from store import GetStatus, MessageStore, StoreConfig
from store.statelog import fold_records
from tests.crash import statework
from tests.crash.gateway_proc import GatewayProcess
from tests.crash.workload import KEEPER, QOS2_CLIENT, Run, Sent, Subscribed
from tests.gateway.conftest import RawClient

#: body -> {queue: offset} in the complete recorded store
Placement = dict[bytes, dict[str, int]]


def read_queue(store: MessageStore, queue: str) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    off = store.min_offset(queue)
    while True:
        g = store.get(queue, off, 256)
        if g.status is not GetStatus.FOUND:
            return out
        out += [(m.queue_offset, m.body) for m in g.messages]
        off = g.next_offset


def placement(
    data_dir: Path, segment_size: int, parent: str = "crash"
) -> tuple[Placement, dict[bytes, int], dict[bytes, int]]:
    """Where every message of the finished run is (the oracle): its queues and offsets, how
    often the topics' parent queue holds it (a QoS 2 message stored twice shows there), and
    its CommitLog offset."""
    place: Placement = {}
    counts: dict[bytes, int] = {}
    phys: dict[bytes, int] = {}
    store = MessageStore.open(StoreConfig(data_dir=data_dir, segment_size=segment_size))
    try:
        for q in store.queues():
            for off, body in read_queue(store, q):
                place.setdefault(body, {})[q] = off
                if q == parent:
                    counts[body] = counts.get(body, 0) + 1
                    phys[body] = store.get(q, off, 1).messages[0].physical_offset
    finally:
        store.close()
    return place, counts, phys


@dataclass
class ImageResult:
    lost: list[str] = field(default_factory=list)  # acknowledged, missing or moved
    foreign: list[bytes] = field(default_factory=list)  # served bodies nobody sent
    error: str = ""
    open_s: float = 0.0


def check_store(
    image: Path,
    segment_size: int,
    acked: list[Sent],
    place: Placement,
    sent_bodies: set[bytes],
    scan_parents: bool,
    subscribed: Sequence[Subscribed] = (),
) -> ImageResult:
    """Recover ``image`` through the store's public API and check every acknowledged message
    is at its offset in each queue it was dispatched to (every queue is read in full, by the
    store's get). With ``scan_parents`` each body a parent queue serves must also be one that
    was sent: nothing corrupt is served. The state log is read as a restart reads it, and
    each session of ``subscribed`` (SUBACKed before the cut) must hold its subscription."""
    res = ImageResult()
    t0 = time.monotonic()
    try:
        store = MessageStore.open(StoreConfig(data_dir=image, segment_size=segment_size))
    except Exception as e:  # recovery must never fail: report it as the finding it is
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.open_s = time.monotonic() - t0
    try:
        try:
            state = fold_records(store.state_records(), SESSION_KEY_PREFIX)
            store.offsets.all()  # the consumer offsets log, read as inspect reads it
        except Exception as e:
            res.error = f"state unreadable: {type(e).__name__}: {e}"
            return res
        for sub in subscribed:
            session = json.loads(state.get(sub.client, b"{}"))
            filters = {d["filter"] for d in session.get("subscriptions", [])}
            if sub.topic_filter not in filters:
                res.lost.append(f"session {sub.client}: subscription {sub.topic_filter} gone")
        queues: dict[str, dict[int, bytes]] = {}
        for q in store.queues():
            queues[q] = dict(read_queue(store, q))
        for s in acked:
            for q, off in place[s.payload].items():
                if queues.get(q, {}).get(off) != s.payload:
                    res.lost.append(f"{s.client}#{s.packet_id} (qos {s.qos}) {q}@{off}")
        if scan_parents:
            for q, msgs in queues.items():
                if not q.startswith("%LMQ%"):
                    res.foreign += [b for b in msgs.values() if b not in sent_bodies]
    finally:
        store.close()
    return res


def check_state(image: Path, acked_round: int, rounds: int) -> str:
    """Recover the store of a tests/crash/statework.py image (twice: a restart after a
    restart) and compare its state with the rounds: every round acknowledged before the cut
    is there, nothing past the last round written is. Returns the finding ("" if none)."""
    for _restart in range(2):
        try:
            store = MessageStore.open(StoreConfig(data_dir=image, segment_size=64 * 1024))
        except Exception as e:
            return f"recovery failed: {type(e).__name__}: {e}"
        try:
            state = fold_records(store.state_records())
        except Exception as e:
            return f"state unreadable: {type(e).__name__}: {e}"
        finally:
            store.close()
        # Rounds are applied whole or not at all (one write each), in order.
        matches = [n for n in range(acked_round, rounds + 1) if state == statework.expected(n)]
        if not matches:
            return f"state is no round's at or after {acked_round}: {sorted(state)[:12]}"
    return ""


def _drain_until_probe(c: RawClient, probe: bytes, deadline: float) -> list[bytes]:
    """Receive (and acknowledge, QoS 1 and 2) until ``probe`` arrives; the bodies received."""
    got: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"probe not delivered; {len(got)} messages before the deadline")
        ev = c.recv(left)
        if ev is None:
            raise ConnectionError("gateway closed the connection")
        if isinstance(ev, Publish):
            if ev.qos == 1:
                c.send(PubAck(ev.packet_id or 0))
            elif ev.qos == 2:
                c.send(PubRec(ev.packet_id or 0))
            got.append(ev.payload)
            if ev.payload == probe:
                return got
        elif isinstance(ev, PubRel):
            c.send(PubComp(ev.packet_id))


@dataclass
class GatewayResult:
    problems: list[str] = field(default_factory=list)
    #: QoS 2 publishes unanswered at the cut, stored twice once resent (must stay empty)
    resent_twice: list[str] = field(default_factory=list)
    resent: int = 0


def check_gateway(
    image: Path, run: Run, t_cut: int, segment_size: int, flush: str
) -> GatewayResult:
    """Start the real gateway on ``image`` and check, as clients see it, what the cut must not
    have taken: persistent sessions and their subscriptions acknowledged before the cut, the
    QoS 2 exchanges (PUBREC'd ones are completed by PUBREL and stored once; unanswered ones
    resent with DUP are stored once), every acknowledged message delivered to the subscriber
    that was subscribed to everything, QoS 2 ones exactly once."""
    result = GatewayResult()
    problems = result.problems
    t0 = time.monotonic()
    gw = GatewayProcess(image, flush=flush, segment_size=segment_size, start_timeout=30)
    try:
        deadline = time.monotonic() + 60
        subs = [s for s in run.subscribed if s.t_ack < t_cut]
        # The QoS 2 publisher resumes its session.
        p2 = [s for s in run.sent if s.client == QOS2_CLIENT and s.t_sent < t_cut]
        recd = [s for s in p2 if s.t_ack is not None and s.t_ack < t_cut]
        open_recd = [s for s in recd if s.t_comp is None or s.t_comp >= t_cut]
        unanswered = [s for s in p2 if s.t_ack is None or s.t_ack >= t_cut]
        c = RawClient(gw.port)
        ack = c.connect(QOS2_CLIENT, clean=False)
        if recd and not ack.session_present:
            problems.append(f"{QOS2_CLIENT}: session lost after {len(recd)} PUBRECs")
        for s in open_recd:
            c.send(PubRel(s.packet_id))
            ev = c.recv_until(PubComp, max(0.1, deadline - time.monotonic()))
            if not isinstance(ev, PubComp) or ev.packet_id != s.packet_id or ev.reason_code:
                problems.append(f"PUBREL {s.packet_id} after the cut: {ev}")
        for s in unanswered:
            c.send(Publish(s.topic, s.payload, qos=2, dup=True, packet_id=s.packet_id))
            ev = c.recv_until(PubRec, max(0.1, deadline - time.monotonic()))
            if not isinstance(ev, PubRec) or ev.packet_id != s.packet_id:
                problems.append(f"resent QoS 2 {s.packet_id}: {ev}")
                continue
            c.send(PubRel(s.packet_id))
            c.recv_until(PubComp, max(0.1, deadline - time.monotonic()))
        c.close()
        problems += _check_retained(gw.port, run, t_cut, deadline)
        # One probe after everything: a subscriber that has it has had all that came before.
        probe = b"probe:%d" % t_cut
        pub = RawClient(gw.port)
        pub.connect("prober", clean=True)
        for sub in subs:
            pub.send(Publish(_probe_topic(sub.topic_filter), probe, qos=1, packet_id=1))
            pub.recv_until(PubAck, max(0.1, deadline - time.monotonic()))
        pub.close()
        for sub in subs:
            c = RawClient(gw.port)
            ack = c.connect(sub.client, clean=False)
            if not ack.session_present:
                problems.append(f"{sub.client}: SUBACKed before the cut, session gone")
                c.close()
                continue
            try:
                got = _drain_until_probe(c, probe, deadline)
            except (TimeoutError, ConnectionError) as e:
                problems.append(f"{sub.client} ({sub.topic_filter}): subscription lost? {e}")
                c.close()
                continue
            c.close()
            if sub.client != KEEPER:
                continue
            counts: dict[bytes, int] = {}
            for b in got:
                counts[b] = counts.get(b, 0) + 1
            for m in run.acked_by(t_cut):
                n = counts.get(m.payload, 0)
                if n == 0:
                    problems.append(f"{m.client}#{m.packet_id} acknowledged, not delivered")
                elif m.qos == 2 and n > 1:
                    problems.append(f"{m.client}#{m.packet_id} (QoS 2) delivered {n} times")
            result.resent = len(unanswered)
            for m in unanswered:
                if counts.get(m.payload, 0) > 1:
                    result.resent_twice.append(f"{m.client}#{m.packet_id}")
    except Exception as e:
        problems.append(f"gateway check failed: {type(e).__name__}: {e}\n{gw.log_tail()}")
    finally:
        gw.terminate()
    if time.monotonic() - t0 > 90:
        problems.append("gateway check took over 90 s (a hang?)")
    return result


def _check_retained(port: int, run: Run, t_cut: int, deadline: float) -> list[str]:
    """A new subscriber gets, per retained topic, the last retained message acknowledged before
    the cut or one sent after it (sent, maybe stored, not yet acknowledged): never an older
    one, never none."""
    allowed: dict[str, list[bytes]] = {}
    for s in run.sent:
        if not s.retain:
            continue
        if s.t_ack is not None and s.t_ack < t_cut:
            allowed[s.topic] = [s.payload]  # the newest acknowledged so far (publish order)
        elif s.topic in allowed:
            allowed[s.topic].append(s.payload)
    if not allowed:
        return []
    problems: list[str] = []
    c = RawClient(port)
    try:
        c.connect("retained-check", clean=True)
        c.send(Subscribe(1, [Subscription("crash/ret/#", 1)]))
        got: dict[str, bytes] = {}
        # Retained copies follow the SUBACK at once: 10 s without them is a finding.
        deadline = min(deadline, time.monotonic() + 10)
        while len(got) < len(allowed) and time.monotonic() < deadline:
            try:
                ev = c.recv(max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
            if isinstance(ev, Publish) and ev.retain:
                got[ev.topic] = ev.payload
                if ev.qos:
                    c.send(PubAck(ev.packet_id or 0))
        for topic, ok in allowed.items():
            if topic not in got:
                problems.append(f"retained {topic}: none after the cut")
            elif got[topic] not in ok:
                problems.append(f"retained {topic}: {got[topic][:12]!r}, older than acknowledged")
    finally:
        c.close()
    return problems


def _probe_topic(topic_filter: str) -> str:
    """A topic the filter matches: '+' and '#' levels filled in."""
    return "/".join("probe" if lv in ("+", "#") else lv for lv in topic_filter.split("/"))
