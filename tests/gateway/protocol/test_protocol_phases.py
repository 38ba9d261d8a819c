"""The receiving side's phases: every path through the state machine takes a transition of
`TRANSITIONS`, and nothing else moves the phase."""

from __future__ import annotations

import pytest

from gateway.protocol import (
    ConnectionClosed,
    Disconnect,
    LocalProtocolError,
    PingReq,
    RemoteProtocolError,
    encode,
)
from gateway.protocol.connection import TRANSITIONS, Connection, Phase
from tests.gateway.protocol.helpers import connect_packet, open_connection


def _phase(conn: Connection) -> Phase:
    return conn._phase


def test_connect_then_disconnect() -> None:
    conn = Connection()
    assert _phase(conn) is Phase.AWAIT_CONNECT
    conn = open_connection(5)
    assert _phase(conn) is Phase.CONNECTED
    conn.receive_data(encode(Disconnect(0), 5))
    assert isinstance(conn.next_event(), Disconnect)
    assert _phase(conn) is Phase.CLOSED
    conn.receive_data(b"")  # EOF
    assert isinstance(conn.next_event(), ConnectionClosed)
    assert _phase(conn) is Phase.CLOSED


def test_eof_before_connect_closes() -> None:
    conn = Connection()
    conn.receive_data(b"")  # EOF
    assert isinstance(conn.next_event(), ConnectionClosed)
    assert _phase(conn) is Phase.CLOSED


@pytest.mark.parametrize(
    ("prefix", "bad"),
    [
        (b"", encode(PingReq(), 4)),  # a packet before CONNECT
        (connect_packet(4), connect_packet(4)),  # a second CONNECT
        (connect_packet(5) + encode(Disconnect(0), 5), encode(PingReq(), 5)),  # after DISCONNECT
    ],
    ids=["before-connect", "second-connect", "after-disconnect"],
)
def test_protocol_errors_enter_error_from_every_phase(prefix: bytes, bad: bytes) -> None:
    conn = Connection()
    conn.receive_data(prefix + bad)
    with pytest.raises(RemoteProtocolError):
        while True:
            conn.next_event()
    assert _phase(conn) is Phase.ERROR
    with pytest.raises(RemoteProtocolError):  # and it stays failed
        conn.next_event()


def test_a_transition_outside_the_table_is_refused() -> None:
    conn = open_connection(4)
    conn.receive_data(encode(Disconnect(0), 4))
    conn.next_event()
    assert (Phase.CLOSED, Phase.CONNECTED) not in TRANSITIONS
    with pytest.raises(LocalProtocolError, match="closed -> connected"):
        conn._enter(Phase.CONNECTED)
    assert _phase(conn) is Phase.CLOSED


def test_the_table_names_only_phases_and_has_a_cause_for_each() -> None:
    for (a, b), cause in TRANSITIONS.items():
        assert isinstance(a, Phase) and isinstance(b, Phase) and cause
    # CONNECTED is reached only by a CONNECT; nothing leaves ERROR but EOF.
    assert [a for a, b in TRANSITIONS if b is Phase.CONNECTED] == [Phase.AWAIT_CONNECT]
    assert {b for a, b in TRANSITIONS if a is Phase.ERROR} == {Phase.ERROR, Phase.CLOSED}
