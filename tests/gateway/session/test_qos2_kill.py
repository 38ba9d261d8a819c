"""QoS 2 outbound across a SIGKILL of the gateway: a message is never delivered twice.

The subscriber is a raw client that follows the receiver's rules of MQTT 4.3.3 (method B, the
one the spec draws): it takes a QoS 2 message the first time a packet id carries it and answers
PUBREC; until that id's PUBREL it treats any PUBLISH with the same id as a duplicate (not taken
again); at PUBREL it forgets the id and answers PUBCOMP. A message it takes twice, under any ids,
is a duplicate delivery. The gateway is killed at each point of the flow, with no barrier: what
the gateway told the client must be on record before it said it.

    PUBLISH ─► (kill: PUBLISH again, same packet id, DUP)
    ◄─ PUBREC
    PUBREL ─►  (kill: PUBREL again, never the PUBLISH)
    ◄─ PUBCOMP (kill: nothing again)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.protocol import (
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    encode,
)
from store import read_state_records
from tests.crash.gateway_proc import GatewayProcess
from tests.gateway.conftest import RawClient

pytestmark = pytest.mark.slow

SEGMENT = 1 << 20
EXPIRY = Properties(session_expiry_interval=3600)


class Gateway:
    """One data directory shared by the module's tests; ``restart_killed()`` SIGKILLs the
    process and starts a new one on it."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.proc = GatewayProcess(data, flush="sync", segment_size=SEGMENT)

    @property
    def port(self) -> int:
        return self.proc.port

    def restart_killed(self) -> None:
        self.proc.kill()
        self.proc = GatewayProcess(self.data, flush="sync", segment_size=SEGMENT)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = Gateway(tmp_path_factory.mktemp("qos2kill") / "data")
    try:
        yield g
    finally:
        g.proc.terminate()


class Receiver:
    """A QoS 2 receiver by the rules of MQTT 4.3.3 (module docstring) on a raw connection."""

    def __init__(self, client_id: str, level: int) -> None:
        self.client_id = client_id
        self.level = level
        self.raw: RawClient | None = None
        self.taken: list[bytes] = []  # messages delivered to the application, in order
        self.unreleased: set[int] = set()  # packet ids PUBREC'd, awaiting PUBREL

    def connect(self, port: int, *, subscribe: str | None = None) -> bool:
        """Connect with the persistent session; returns session present. A new session
        subscribes to `subscribe` at QoS 2."""
        self.raw = RawClient(port, level=self.level)
        props = EXPIRY if self.level == 5 else None
        ack = self.raw.connect(self.client_id, clean=False, properties=props)
        assert ack.reason_code == 0
        if subscribe is not None:
            self.raw.send(Subscribe(1, [Subscription(subscribe, 2)]))
            ev = self.raw.recv()
            assert isinstance(ev, SubAck) and ev.reason_codes == [2], ev
        return bool(ack.session_present)

    def next_packet(self) -> object:
        assert self.raw is not None
        ev = self.raw.recv(20)
        assert ev is not None, "connection closed"
        return ev

    def take(self, pub: Publish) -> None:
        """A QoS 2 PUBLISH arrived: taken unless its packet id is unreleased; no PUBREC."""
        assert pub.qos == 2 and pub.packet_id is not None, pub
        if pub.packet_id not in self.unreleased:
            self.taken.append(pub.payload)
            self.unreleased.add(pub.packet_id)

    def drain(self, port: int, probe_topic: str) -> None:
        """Complete every flow by the rules up to a probe published now on `probe_topic`:
        delivery is in order, so the probe's arrival proves nothing else is coming."""
        p = RawClient(port)
        p.connect(f"probe-{self.client_id}", clean=True)
        p.send(Publish(probe_topic, b"probe", qos=1, packet_id=1))
        assert isinstance(p.recv(), PubAck)
        p.close()
        assert self.raw is not None
        deadline = time.monotonic() + 20
        while True:
            ev = self.raw.recv(max(0.01, deadline - time.monotonic()))
            assert ev is not None, "connection closed"
            if isinstance(ev, PubRel):
                self.unreleased.discard(ev.packet_id)
                self.raw.send(PubComp(ev.packet_id))
            elif isinstance(ev, Publish):
                if ev.payload == b"probe":
                    return
                self.take(ev)
                self.raw.send(PubRec(ev.packet_id or 0))

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()


def _publish(port: int, topic: str, payload: bytes) -> None:
    """Publish `payload` at QoS 2 (its PUBREC comes once it is stored, durable in sync flush
    mode)."""
    p = RawClient(port)
    p.connect("q2kill-pub", clean=True)
    p.send(Publish(topic, payload, qos=2, packet_id=1))
    assert isinstance(p.recv(), PubRec)
    p.send(PubRel(1))
    assert isinstance(p.recv(), PubComp)
    p.close()


def _first_publish(sub: Receiver) -> Publish:
    ev = sub.next_packet()
    assert isinstance(ev, Publish) and ev.qos == 2 and not ev.dup, ev
    sub.take(ev)
    return ev


@pytest.mark.parametrize("level", [4, 5])
def test_killed_right_after_pubcomp_nothing_comes_again(gw: Gateway, level: int) -> None:
    """The flow completed (PUBCOMP sent, the client forgot the id): after the restart the
    gateway may resend the PUBREL, which the client answers, never the message."""
    sub = Receiver(f"q2-done-{level}", level)
    assert not sub.connect(gw.port, subscribe=f"q2k/done/{level}")
    _publish(gw.port, f"q2k/done/{level}", b"once")
    first = _first_publish(sub)
    assert sub.raw is not None
    sub.raw.send(PubRec(first.packet_id or 0))
    rel = sub.next_packet()
    assert isinstance(rel, PubRel) and rel.packet_id == first.packet_id, rel
    sub.unreleased.discard(rel.packet_id)
    sub.raw.send(PubComp(rel.packet_id))
    gw.restart_killed()
    sub.close()
    assert sub.connect(gw.port)
    sub.drain(gw.port, f"q2k/done/{level}")
    sub.close()
    assert sub.taken == [b"once"]


def test_killed_after_pubrel_the_pubrel_comes_again(gw: Gateway) -> None:
    """PUBREC answered with PUBREL, no PUBCOMP yet: after the restart the first thing the
    client gets is that PUBREL (same packet id), never the PUBLISH [MQTT-4.4.0-1]."""
    sub = Receiver("q2-rel", 4)
    assert not sub.connect(gw.port, subscribe="q2k/rel")
    _publish(gw.port, "q2k/rel", b"released")
    first = _first_publish(sub)
    assert sub.raw is not None
    sub.raw.send(PubRec(first.packet_id or 0))
    rel = sub.next_packet()
    assert isinstance(rel, PubRel) and rel.packet_id == first.packet_id, rel
    gw.restart_killed()
    sub.close()
    assert sub.connect(gw.port)
    again = sub.next_packet()
    assert isinstance(again, PubRel) and again.packet_id == first.packet_id, again
    sub.drain(gw.port, "q2k/rel")  # answers it (PUBCOMP), then takes whatever else comes
    sub.close()
    assert sub.taken == [b"released"]


def test_killed_before_pubrec_the_publish_comes_again_with_dup_and_its_id(gw: Gateway) -> None:
    """PUBLISH sent, not PUBREC'd yet: after the restart it comes again with DUP and the same
    packet id, so the client recognises it ([MQTT-4.3.3-9])."""
    sub = Receiver("q2-pub", 5)
    assert not sub.connect(gw.port, subscribe="q2k/pub")
    _publish(gw.port, "q2k/pub", b"sent")
    first = _first_publish(sub)
    gw.restart_killed()
    sub.close()
    assert sub.connect(gw.port)
    again = sub.next_packet()
    assert isinstance(again, Publish) and again.payload == b"sent", again
    assert again.packet_id == first.packet_id and again.dup, again
    sub.take(again)
    assert sub.raw is not None
    sub.raw.send(PubRec(again.packet_id or 0))
    sub.drain(gw.port, "q2k/pub")
    sub.close()
    assert sub.taken == [b"sent"]


def _session_records(gw: Gateway, client_id: str) -> int:
    """How many records of `client_id`'s session the state log holds (read from its files)."""
    key = "session/" + client_id
    return sum(1 for k, _ in read_state_records(gw.data / "state") if k == key)


def test_the_pubrecs_of_one_read_share_one_save(gw: Gateway) -> None:
    """The cost of the record before PUBREL: PUBRECs that arrive together are recorded with
    one state record (one fsync), not one each; their PUBRELs all follow it."""
    n = 20
    sub = Receiver("q2-batch", 4)
    assert not sub.connect(gw.port, subscribe="q2k/batch")
    p = RawClient(gw.port)
    p.connect("q2kill-batch-pub", clean=True)
    p.send_bytes(
        b"".join(
            encode(Publish("q2k/batch", b"%d" % i, qos=2, packet_id=i + 1), 4) for i in range(n)
        )
    )
    for _ in range(n):
        assert isinstance(p.recv_until(PubRec), PubRec)
    p.send_bytes(b"".join(encode(PubRel(i + 1), 4) for i in range(n)))
    for _ in range(n):
        assert isinstance(p.recv_until(PubComp), PubComp)
    p.close()
    pids = [_first_publish(sub).packet_id or 0 for _ in range(n)]
    before = _session_records(gw, "q2-batch")
    assert sub.raw is not None
    sub.raw.send_bytes(b"".join(encode(PubRec(pid), 4) for pid in pids))
    rels = [sub.next_packet() for _ in range(n)]
    assert all(isinstance(r, PubRel) for r in rels)
    assert [r.packet_id for r in rels if isinstance(r, PubRel)] == pids
    # One save for the read (a housekeeping pass may add one of its own meanwhile).
    assert _session_records(gw, "q2-batch") - before <= 2
    for pid in pids:
        sub.raw.send(PubComp(pid))
    sub.unreleased.clear()
    sub.drain(gw.port, "q2k/batch")
    sub.close()
    assert sub.taken == [b"%d" % i for i in range(n)]
