"""Flow control and shutdown: a slow subscriber pauses its own delivery with bounded memory;
graceful stop says 0x8B; QoS 2 outbound state survives a restart."""

from __future__ import annotations

from gateway.connection.client import ClientConnection
from gateway.net.server import WRITE_HIGH_WATER
from gateway.protocol import (
    Disconnect,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Subscribe,
    Subscription,
)
from tests.gateway.conftest import GatewayHarness, RawClient, wait_until


def test_slow_subscriber_pauses_delivery_with_bounded_buffer(gateway: GatewayHarness) -> None:
    slow = RawClient(gateway.port, level=4)
    slow.connect("slow")
    slow.send(Subscribe(1, [Subscription("bulk/t", 0)]))
    slow.recv()
    pub = RawClient(gateway.port, level=4)
    pub.connect("fast")
    payload = b"p" * 8000
    total = 3000  # ~24 MB, far more than the loopback socket buffers hold
    for i in range(total):
        q = 1 if i % 100 == 99 else 0
        pub.send(Publish("bulk/t", payload, qos=q, packet_id=i + 1 if q else None))
    for _ in range(total // 100):
        assert isinstance(pub.recv(), PubAck)
    gw = gateway.gw
    assert gw is not None

    def state() -> tuple[int, int, int]:
        s = gw.sessions.get("slow")
        assert s is not None and isinstance(s.connection, ClientConnection)
        sub = next(iter(s.subscriptions.values()))
        return (
            s.connection.transport.get_write_buffer_size(),
            sub.next_offset,
            gw.store.max_offset(sub.queue),
        )

    wait_until(lambda: not gateway.call(lambda: gw.sessions.get("slow").connection.writable))  # type: ignore[union-attr]
    buffered, read_to, end = gateway.call(state)
    assert end == total
    assert read_to < end  # delivery is paused, the backlog stays in the store
    assert buffered <= WRITE_HIGH_WATER + 32 * 8100  # high-water mark plus one batch
    # Reading drains it all, in order.
    got = 0
    while got < total:
        ev = slow.recv()
        assert isinstance(ev, Publish) and len(ev.payload) == 8000
        got += 1
    slow.close()
    pub.close()


def test_graceful_stop_disconnects_with_0x8b(gateway: GatewayHarness) -> None:
    c = RawClient(gateway.port, level=5)
    c.connect("bye")
    gateway.stop()
    ev = c.recv()
    assert isinstance(ev, Disconnect) and ev.reason_code == 0x8B
    assert c.is_closed()
    c.close()
    gateway.start()  # the fixture stops it again


def test_outbound_qos2_pubrel_state_survives_restart(gateway: GatewayHarness) -> None:
    s = RawClient(gateway.port, level=4)
    s.connect("q2", clean=False)
    s.send(Subscribe(1, [Subscription("q2/t", 2)]))
    s.recv()
    p = RawClient(gateway.port, level=4)
    p.connect("q2p")
    p.send(Publish("q2/t", b"exactly-once", qos=2, packet_id=1))
    assert isinstance(p.recv(), PubRec)
    p.send(PubRel(1))
    assert isinstance(p.recv(), PubComp)
    msg = s.recv()
    assert msg.payload == b"exactly-once"
    s.send(PubRec(msg.packet_id))
    assert s.recv() == PubRel(msg.packet_id)
    s.close()  # PUBCOMP never sent
    p.close()
    gateway.restart()
    s = RawClient(gateway.port, level=4)
    assert s.connect("q2", clean=False).session_present
    assert s.recv() == PubRel(msg.packet_id)  # the release, not the message again
    s.send(PubComp(msg.packet_id))
    p = RawClient(gateway.port, level=4)
    p.connect("q2p")
    p.send(Publish("q2/t", b"next", qos=0))
    nxt = s.recv()
    assert nxt.payload == b"next"
    s.close()
    p.close()


def test_inbound_qos2_dedup_survives_restart(gateway: GatewayHarness) -> None:
    sub = RawClient(gateway.port, level=4)
    sub.connect("watch-in", clean=False)
    sub.send(Subscribe(1, [Subscription("in2/t", 0)]))
    sub.recv()
    sub.close()
    p = RawClient(gateway.port, level=4)
    p.connect("pub-in", clean=False)
    p.send(Publish("in2/t", b"only-once", qos=2, packet_id=5))
    assert p.recv() == PubRec(5)
    p.close()  # crash-like: no PUBREL yet
    gateway.restart()
    p = RawClient(gateway.port, level=4)
    assert p.connect("pub-in", clean=False).session_present
    p.send(Publish("in2/t", b"only-once", qos=2, dup=True, packet_id=5))
    assert p.recv() == PubRec(5)
    p.send(PubRel(5))
    assert p.recv() == PubComp(5)
    p.send(Publish("in2/t", b"marker", qos=0))
    sub = RawClient(gateway.port, level=4)
    sub.connect("watch-in", clean=False)
    got = [sub.recv().payload, sub.recv().payload]
    assert got == [b"only-once", b"marker"]  # stored once
    sub.close()
    p.close()
