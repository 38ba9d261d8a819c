"""Which acknowledgements wait for the state log's fsync in sync mode (docs/durability.md, "Not
promised": the rule): a SUBACK of a persistent session does, a new session's CONNACK does not.
A real gateway (`flush="sync"`), real MQTT clients, the state log's own fsync counter."""

from __future__ import annotations

from pathlib import Path

from gateway.protocol import (
    Disconnect,
    PingReq,
    PingResp,
    SubAck,
    Subscribe,
    Subscription,
    encode,
)
from tests.gateway.conftest import GatewayHarness, RawClient

SESSIONS = 20


def test_suback_waits_for_its_fsync_and_a_new_sessions_connack_does_not(tmp_path: Path) -> None:
    h = GatewayHarness(tmp_path / "data", flush="sync").start()
    clients: list[RawClient] = []
    try:
        gw = h.gw
        assert gw is not None
        state = gw.store.state  # type: ignore[attr-defined]
        before = h.call(lambda: state.fsyncs)
        # New persistent sessions one after another: none waits for an fsync (each would
        # make its own: the previous one was answered before the next CONNECT).
        for i in range(SESSIONS):
            c = RawClient(h.port, level=4)
            ack = c.connect(f"dev-{i}", clean=False)
            assert ack.reason_code == 0 and not ack.session_present
            clients.append(c)
        after_connacks = h.call(lambda: state.fsyncs)
        # The periodic full flush may fsync the housekeeping pass's appends meanwhile.
        assert after_connacks - before <= 3, after_connacks - before
        # SUBSCRIBEs one after another: each SUBACK comes once the record holding the
        # subscription is durable, so each needs an fsync of its own.
        for i, c in enumerate(clients):
            written = h.call(lambda: state.written)
            c.send(Subscribe(1, [Subscription(f"dev/{i}/cmd", 1)]))
            assert c.recv().reason_codes == [1]
            assert h.call(lambda: state.synced) > written  # its record is in the durable part
        assert h.call(lambda: state.fsyncs) - after_connacks >= SESSIONS
    finally:
        for c in clients:
            c.close()
        h.stop()


def test_what_follows_a_subscribe_is_answered_after_its_suback(tmp_path: Path) -> None:
    """A SUBSCRIBE is handled in the read callback and its SUBACK sent from its record's
    fsync: the connection holds the rest of its input until then. Packets written in one
    go come back in order, each SUBACK with its record durable; a connection closed while
    its SUBACK waits leaves its subscription saved."""
    h = GatewayHarness(tmp_path / "data", flush="sync").start()
    try:
        gw = h.gw
        assert gw is not None
        state = gw.store.state  # type: ignore[attr-defined]
        c = RawClient(h.port, level=4)
        assert c.connect("pipe", clean=False).reason_code == 0
        written = h.call(lambda: state.written)
        c.send_bytes(
            b"".join(
                encode(ev, 4)
                for ev in (
                    Subscribe(1, [Subscription("a/1", 1)]),
                    PingReq(),
                    Subscribe(2, [Subscription("a/2", 0)]),
                    PingReq(),
                    Disconnect(),
                )
            )
        )
        first = c.recv()
        assert isinstance(first, SubAck) and first.packet_id == 1
        assert h.call(lambda: state.synced) > written
        assert isinstance(c.recv(), PingResp)
        second = c.recv()
        assert isinstance(second, SubAck) and second.packet_id == 2
        assert isinstance(c.recv(), PingResp)
        assert c.is_closed()
        c.close()

        # Closed right after its SUBSCRIBE (no SUBACK read): the subscription stays.
        c = RawClient(h.port, level=4)
        assert c.connect("gone", clean=False).reason_code == 0
        c.send(Subscribe(1, [Subscription("b/1", 1)]))
        c.close()
        c = RawClient(h.port, level=4)
        ack = c.connect("gone", clean=False)
        assert ack.reason_code == 0 and ack.session_present
        c.close()
        c = RawClient(h.port, level=4)
        assert c.connect("pipe", clean=False).session_present
        c.close()
        registry = gw.sessions.sessions
        sessions = h.call(lambda: {cid: sorted(registry[cid].subscriptions) for cid in registry})
        assert sessions["pipe"] == ["a/1", "a/2"] and sessions["gone"] == ["b/1"]
    finally:
        h.stop()
