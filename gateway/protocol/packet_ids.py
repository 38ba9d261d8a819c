"""Packet identifiers in flight, in both directions, and the Receive Maximum quotas.

    inbound   PUBLISH QoS 1 --------------------------> [qos1]     --our PUBACK-->   free
              PUBLISH QoS 2 ----> [qos2] --PUBREL--> [released]   --our PUBCOMP-->  free
                                     \\--our PUBREC >= 0x80 (refused) ------------> free
    outbound  our PUBLISH QoS 1/2 --> [UNACKED] --PUBACK / PUBREC >= 0x80--------> free
                                               --PUBREC--> [RELEASED] --PUBCOMP--> free

Inbound ids count against the Receive Maximum we announced (0x93 when exceeded); outbound
ids against the client's. A QoS 2 PUBLISH whose id is still in [qos2] is a resend (the client
did not get our PUBREC), reported as DUP so the gateway does not store it twice. Acks for ids
we do not know are not errors: a resumed session knows more than this connection, and its
ids come back through `restore_inbound_qos2` / `restore_outbound`.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.protocol.errors import LocalProtocolError, RemoteProtocolError

UNACKED, RELEASED = 1, 2
PACKET_IDENTIFIER_IN_USE = 0x91
RECEIVE_MAXIMUM_EXCEEDED = 0x93


class PacketIds:
    """The packet-id bookkeeping of one connection. Sets are public for the hot path."""

    __slots__ = ("_next", "inbound_qos1", "inbound_qos2", "inbound_released", "outbound")

    def __init__(self) -> None:
        self.inbound_qos1: set[int] = set()
        # QoS 2 is rare among devices: its sets (216 bytes each) are made on first use.
        self.inbound_qos2: set[int] | None = None
        self.inbound_released: set[int] | None = None
        self.outbound: dict[int, int] = {}
        self._next = 1

    # inbound ------------------------------------------------------------------------

    def inbound_in_flight(self) -> int:
        n = len(self.inbound_qos1)
        if self.inbound_qos2:
            n += len(self.inbound_qos2)
        if self.inbound_released:
            n += len(self.inbound_released)
        return n

    def _qos2(self) -> set[int]:
        ids = self.inbound_qos2
        if ids is None:
            ids = self.inbound_qos2 = set()
        return ids

    def publish_received(self, qos: int, packet_id: int, receive_maximum: int) -> bool:
        """Record an inbound QoS 1/2 PUBLISH; True if it is a QoS 2 resend (DUP)."""
        if qos == 1:
            if packet_id not in self.inbound_qos1:
                self._check_quota(receive_maximum)
                self.inbound_qos1.add(packet_id)
            return False
        qos2 = self._qos2()
        if packet_id in qos2:
            return True
        self._check_quota(receive_maximum)
        qos2.add(packet_id)
        return False

    def _check_quota(self, receive_maximum: int) -> None:
        if self.inbound_in_flight() >= receive_maximum:
            raise RemoteProtocolError(
                RECEIVE_MAXIMUM_EXCEEDED, f"more than {receive_maximum} QoS 1/2 in flight"
            )

    def pubrel_received(self, packet_id: int) -> None:
        if self.inbound_qos2:
            self.inbound_qos2.discard(packet_id)
        if self.inbound_released is None:
            self.inbound_released = set()
        self.inbound_released.add(packet_id)

    def puback_sent(self, packet_id: int) -> None:
        self.inbound_qos1.discard(packet_id)

    def pubrec_sent(self, packet_id: int, reason_code: int) -> None:
        if reason_code >= 0x80 and self.inbound_qos2:
            self.inbound_qos2.discard(packet_id)  # refused: the flow ends here

    def pubcomp_sent(self, packet_id: int) -> None:
        if self.inbound_released:
            self.inbound_released.discard(packet_id)
        if self.inbound_qos2:
            self.inbound_qos2.discard(packet_id)

    # outbound -----------------------------------------------------------------------

    def publish_sent(self, packet_id: int, dup: bool, client_receive_maximum: int) -> None:
        outbound = self.outbound
        if packet_id in outbound:
            if not dup:
                raise LocalProtocolError(
                    f"packet identifier {packet_id} is in use", PACKET_IDENTIFIER_IN_USE
                )
            return  # a retransmission
        if len(outbound) >= client_receive_maximum:
            raise LocalProtocolError(
                f"client Receive Maximum {client_receive_maximum} reached",
                RECEIVE_MAXIMUM_EXCEEDED,
            )
        outbound[packet_id] = UNACKED

    def puback_received(self, packet_id: int) -> None:
        self.outbound.pop(packet_id, None)

    def pubrec_received(self, packet_id: int, reason_code: int) -> None:
        if reason_code >= 0x80:
            self.outbound.pop(packet_id, None)
        else:
            self.outbound[packet_id] = RELEASED

    def pubrel_sent(self, packet_id: int) -> None:
        self.outbound[packet_id] = RELEASED

    def pubcomp_received(self, packet_id: int) -> None:
        self.outbound.pop(packet_id, None)

    def allocate(self) -> int:
        """An id not in flight outbound, round robin over 1..65535."""
        outbound = self.outbound
        if len(outbound) >= 0xFFFF:
            raise LocalProtocolError("all packet identifiers are in use", PACKET_IDENTIFIER_IN_USE)
        candidate = self._next
        while candidate in outbound:
            candidate = candidate % 0xFFFF + 1
        self._next = candidate % 0xFFFF + 1
        return candidate

    # resumed sessions ---------------------------------------------------------------

    def restore_inbound_qos2(self, packet_ids: Iterable[int]) -> None:
        ids = list(packet_ids)
        if ids:
            self._qos2().update(ids)

    def restore_outbound(self, unacknowledged: Iterable[int], released: Iterable[int]) -> None:
        for packet_id in unacknowledged:
            self.outbound[packet_id] = UNACKED
        for packet_id in released:
            self.outbound[packet_id] = RELEASED


class ConnectionPacketIds:
    """A connection's packet identifiers as it presents them (the base of Connection,
    gateway/protocol/connection.py): its PacketIds, made by the first QoS 1/2 packet or
    restore_* (most devices' connections never need the outbound side), and the client's
    Receive Maximum that bounds what is sent to it."""

    __slots__ = ("_ids", "client_receive_maximum")

    def __init__(self) -> None:
        self._ids: PacketIds | None = None
        self.client_receive_maximum = 65535

    def _packet_ids(self) -> PacketIds:
        ids = self._ids
        if ids is None:
            ids = self._ids = PacketIds()
        return ids

    def kernel_ids(self) -> tuple[set[int] | None, dict[int, int] | None, int]:
        """What the read kernels (gateway/protocol/fast_decoder.py scan, take_plain) are handed
        of the packet ids: the inbound QoS 1 set, the outbound map, and how many other inbound
        ids (QoS 2) are in flight; None, None, 0 before the first QoS 1/2 packet."""
        ids = self._ids
        if ids is None:
            return None, None, 0
        qos1 = ids.inbound_qos1
        others = (
            ids.inbound_in_flight() - len(qos1) if ids.inbound_qos2 or ids.inbound_released else 0
        )
        return qos1, ids.outbound, others

    @property
    def outbound_in_flight(self) -> int:
        ids = self._ids
        return len(ids.outbound) if ids is not None else 0

    @property
    def outbound_quota(self) -> int:
        """How many more QoS 1/2 PUBLISH packets the client's Receive Maximum allows now."""
        return max(0, self.client_receive_maximum - self.outbound_in_flight)

    def allocate_packet_id(self) -> int:
        """A packet identifier not in flight outbound (1..65535, round robin).

        Raises LocalProtocolError when all 65535 are in use. The caller may also use its own
        (persistent) allocator; `send` checks whatever id it gets.
        """
        return self._packet_ids().allocate()

    def outbound_packet_ids(self) -> frozenset[int]:
        ids = self._ids
        return frozenset(ids.outbound) if ids is not None else frozenset()

    def inbound_qos2_ids(self) -> frozenset[int]:
        """Inbound QoS 2 ids whose PUBREL has not arrived yet."""
        ids = self._ids
        return frozenset(ids.inbound_qos2 or ()) if ids is not None else frozenset()

    def restore_inbound_qos2(self, packet_ids: Iterable[int]) -> None:
        """A resumed session had these QoS 2 ids received and waiting for PUBREL."""
        self._packet_ids().restore_inbound_qos2(packet_ids)

    def restore_outbound(
        self, unacknowledged: Iterable[int] = (), released: Iterable[int] = ()
    ) -> None:
        """A resumed session had these outbound PUBLISH ids unacknowledged (waiting for
        PUBACK/PUBREC) and these PUBREL ids waiting for PUBCOMP."""
        self._packet_ids().restore_outbound(unacknowledged, released)

    def forget_outbound(self, packet_id: int) -> None:
        """A restored outbound PUBLISH that will not be re-sent (the gateway dropped it): its
        id no longer counts against the client's Receive Maximum and may be used again."""
        self._packet_ids().puback_received(packet_id)
