"""Which acknowledgements wait for the state log's fsync in sync mode (docs/durability.md, "Not
promised": the rule): a SUBACK of a persistent session does, a new session's CONNACK does not.
A real gateway (`flush="sync"`), real MQTT clients, the state log's own fsync counter."""

from __future__ import annotations

from pathlib import Path

from gateway.protocol import Subscribe, Subscription
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
