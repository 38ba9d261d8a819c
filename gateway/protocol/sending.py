"""ConnectionSending: the sending side's state of one MQTT connection (the base of Connection,
gateway/protocol/connection.py) and the sends that need nothing else of it.

The state: whether CONNACK was sent, whether sending is closed (our DISCONNECT, a refusing
CONNACK, an error answer), the client's Maximum Packet Size, and the level an error is answered
at (known from the CONNECT bytes even when they are malformed). The sends: a delivery run's
prepared PUBLISHes (`prepared_outbound`, `send_prepared`) and the answer to a protocol error
(`error_packet`). `Connection.send` applies the general sending rules on the same state.
"""

from __future__ import annotations

from gateway.protocol import packet_types as pt
from gateway.protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from gateway.protocol.events import ConnAck, Disconnect
from gateway.protocol.packet_ids import UNACKED, ConnectionPacketIds
from gateway.protocol.prepared import PreparedPublish
from gateway.protocol.reason_codes import ALLOWED_REASON_CODES, ReasonCode
from gateway.protocol.writers import write_connack, write_disconnect

PACKET_TOO_LARGE = ReasonCode.PACKET_TOO_LARGE
# The only refusals a 3.1.1 CONNACK can carry (MQTT-3.2.2-5), as return codes 1 and 2.
CONNACK_311_CODES = (
    ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
    ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
)


class ConnectionSending(ConnectionPacketIds):
    """The sending side's state, and the sends made outside `Connection.send`."""

    __slots__ = ("_answer_level", "_connack_sent", "_sending_closed", "client_max_packet_size")

    # Set from the CONNECT by Connection (its slot): the level both directions use.
    protocol_level: int | None

    def __init__(self) -> None:
        super().__init__()
        self._answer_level: int | None = None
        self._connack_sent = False
        self._sending_closed = False  # we sent DISCONNECT, a refusing CONNACK or an error answer
        self.client_max_packet_size: int | None = None

    def prepared_outbound(self) -> tuple[dict[int, int], int] | None:
        """For a run of `send_prepared` calls done outside it (gateway/delivery/loop.py PLAIN_RUN):
        (the outbound packet-id map, the value of an id in flight), or None unless every
        check of send_prepared that is not per packet passes (open, CONNACK sent, no maximum
        packet size). Per packet the runner checks the level, the id (not in the map) and the
        client's Receive Maximum (the map's size), and adds the id to the map."""
        if (
            self._sending_closed
            or not self._connack_sent
            or self.client_max_packet_size is not None
        ):
            return None
        return self._packet_ids().outbound, UNACKED

    def send_prepared(
        self, prepared: PreparedPublish, packet_id: int | None = None, dup: bool = False
    ) -> bytes:
        """`prepared.packet(packet_id, dup)`, recording the id as outbound in flight."""
        if prepared.level != self.protocol_level:
            raise LocalProtocolError(
                f"PUBLISH prepared for level {prepared.level} on a level "
                f"{self.protocol_level} connection"
            )
        if self._sending_closed or not self._connack_sent:
            raise LocalProtocolError("cannot send PUBLISH: connection is not open")
        limit = self.client_max_packet_size
        if limit is not None and prepared.size > limit:
            raise LocalProtocolError(
                f"PUBLISH of {prepared.size} bytes exceeds the client's maximum {limit}",
                PACKET_TOO_LARGE,
            )
        data = prepared.packet(packet_id, dup)
        if packet_id is not None:
            self._packet_ids().publish_sent(packet_id, dup, self.client_receive_maximum)
        return data

    def error_packet(self, err: ProtocolError) -> bytes:
        """What to send before closing after `err` (b"" when the answer is to just close)."""
        if not isinstance(err, RemoteProtocolError):
            return b""
        level = self._answer_level
        if level is None or self._sending_closed:
            return b""
        self._sending_closed = True
        if err.send_connack and not self._connack_sent:
            self._connack_sent = True
            code = err.reason_code
            if code not in ALLOWED_REASON_CODES[pt.CONNACK]:
                code = ReasonCode.PROTOCOL_ERROR
            if level == 5:
                return write_connack(ConnAck(False, code), 5)
            if code in CONNACK_311_CODES:
                return write_connack(ConnAck(False, code), 4)
            return b""
        if (err.send_connack or err.send_disconnect) and level == 5:
            code = err.reason_code
            if code not in ALLOWED_REASON_CODES[pt.DISCONNECT]:
                code = ReasonCode.PROTOCOL_ERROR
            return write_disconnect(Disconnect(code), 5)
        return b""
