"""The recorded workload: QoS 1 + QoS 2 flood, persistent sessions, retained messages.

Every acknowledgement is timed on the client side with time.monotonic_ns() (CLOCK_MONOTONIC,
the clock the shim stamps its records with), when the client has read the packet: later than
its arrival, so the promise checked ("acknowledged before the cut") is never stricter than the
one the gateway made.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from gateway.protocol import (
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
)
from tests.gateway.conftest import RawClient

KEEPER = "keeper"  # subscribed to everything before the flood, offline during it
KEEPER_FILTER = "crash/#"
QOS2_CLIENT = "pub2"  # persistent session: its QoS 2 state must survive


@dataclass
class Sent:
    client: str
    packet_id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    t_sent: int
    t_ack: int | None = None  # PUBACK / PUBREC read
    t_comp: int | None = None  # PUBCOMP read (QoS 2)


@dataclass
class Subscribed:
    client: str
    topic_filter: str
    qos: int
    t_ack: int


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)
    subscribed: list[Subscribed] = field(default_factory=list)
    t_start: int = 0  # before the first client connected: the gateway's start is before it
    t_end: int = 0

    def acked_by(self, t: int) -> list[Sent]:
        return [s for s in self.sent if s.t_ack is not None and s.t_ack < t]


def _subscribe(port: int, client: str, topic_filter: str, qos: int) -> Subscribed:
    c = RawClient(port)
    try:
        assert c.connect(client, clean=False).reason_code == 0
        c.send(Subscribe(1, [Subscription(topic_filter, qos)]))
        ack = c.recv()
        t = time.monotonic_ns()
        assert isinstance(ack, SubAck) and ack.reason_codes == [qos], ack
        return Subscribed(client, topic_filter, qos, t)
    finally:
        c.close()


def flood(
    port: int, *, messages: int, window: int = 16, seed: int = 7, pause_s: float = 0.0
) -> Run:
    """``messages`` QoS 1 and as many QoS 2 publishes, ``window`` of each in flight; a new
    persistent subscriber every 150 messages; every 20th QoS 1 message retained. ``pause_s``
    paces the windows, so that a run spans several of the store's flush intervals."""
    rnd = random.Random(seed)
    run = Run(t_start=time.monotonic_ns())
    run.subscribed.append(_subscribe(port, KEEPER, KEEPER_FILTER, 2))
    p1 = RawClient(port)
    p2 = RawClient(port)
    try:
        assert p1.connect("pub1", clean=True).reason_code == 0
        assert p2.connect(QOS2_CLIENT, clean=False).reason_code == 0
        i = 0
        while i < messages:
            if pause_s and i:
                time.sleep(pause_s)
            batch1: dict[int, Sent] = {}
            batch2: dict[int, Sent] = {}
            for _ in range(min(window, messages - i)):
                i += 1
                pad = bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 160)))
                retain = i % 20 == 0
                topic = f"crash/ret/{i % 3}" if retain else f"crash/d{i % 5}/q1"
                s1 = Sent("pub1", i, topic, b"pub1:%d:" % i + pad, 1, retain, time.monotonic_ns())
                p1.send(Publish(topic, s1.payload, qos=1, retain=retain, packet_id=i))
                batch1[i] = s1
                s2 = Sent(QOS2_CLIENT, i, f"crash/d{i % 5}/q2", b"pub2:%d:" % i + pad, 2, False,
                          time.monotonic_ns())  # fmt: skip
                p2.send(Publish(s2.topic, s2.payload, qos=2, packet_id=i))
                batch2[i] = s2
                run.sent += [s1, s2]
            while any(s.t_ack is None for s in batch1.values()):
                ev = p1.recv()
                assert isinstance(ev, PubAck), ev
                batch1[ev.packet_id].t_ack = time.monotonic_ns()
            while any(s.t_comp is None for s in batch2.values()):
                ev = p2.recv()
                if isinstance(ev, PubRec):
                    batch2[ev.packet_id].t_ack = time.monotonic_ns()
                    p2.send(PubRel(ev.packet_id))
                else:
                    assert isinstance(ev, PubComp), ev
                    batch2[ev.packet_id].t_comp = time.monotonic_ns()
            if i % 150 < window:
                k = i // 150
                run.subscribed.append(_subscribe(port, f"late{k}", f"crash/d{k % 5}/+", 1))
        # The last window stays unanswered on purpose: in flight when the process is killed.
        for j in range(i + 1, i + 1 + window):
            p1.send(Publish("crash/d0/q1", b"pub1:%d:tail" % j, qos=1, packet_id=j))
            run.sent.append(Sent("pub1", j, "crash/d0/q1", b"pub1:%d:tail" % j, 1, False,
                                 time.monotonic_ns()))  # fmt: skip
            p2.send(Publish("crash/d0/q2", b"pub2:%d:tail" % j, qos=2, packet_id=j))
            run.sent.append(Sent(QOS2_CLIENT, j, "crash/d0/q2", b"pub2:%d:tail" % j, 2, False,
                                 time.monotonic_ns()))  # fmt: skip
        run.t_end = time.monotonic_ns()
    finally:
        p1.close()
        p2.close()
    return run
