"""PreparedPublish: encode a PUBLISH once, send it to many subscribers.

Fan-out sends the same topic, payload and properties to every subscriber at the same level and
QoS; only the packet identifier and the DUP bit differ. The packet is encoded once and split
around the packet identifier:

    +-------+-----------------------------+-----------+----------------------------+
    | byte1 | remaining length + topic    | packet id | properties + payload       |
    | flags |                             | 2 bytes   | (`_tail`, shared)          |
    +-------+-----------------------------+-----------+----------------------------+
    |<- `_heads[dup]`: one per DUP bit -->|
    |<------------- `_pack`: struct ">{len(head)}s H {len(tail)}s" ------------------>|

`packet(packet_id, dup)` is one call of a struct compiled for this packet's shape: it writes
head, id and tail straight into the new bytes object (one copy of the payload, no re-encoding,
no intermediate two-byte id object and no join tuple). Measured on the fan-out path, that is
~80 ns per packet against ~150-200 ns for `b"".join((head, pack_uint16(id), tail))` and ~110 ns
for a join with a precomputed table of the 65,535 two-byte ids (which would also cost ~2.8 MB
per process). Compiling the struct costs ~0.2 us once per prepared packet.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from gateway.protocol.errors import LocalProtocolError
from gateway.protocol.events import Publish
from gateway.protocol.writers import write_publish


def _no_pack(head: bytes, packet_id: int, tail: bytes) -> bytes:
    raise struct.error("a QoS 0 PUBLISH has no packet id")


class PreparedPublish:
    __slots__ = ("_heads", "_pack", "_tail", "_whole", "level", "qos", "retain", "size", "topic")

    _heads: tuple[bytes, bytes]
    _pack: Callable[[bytes, int, bytes], bytes]

    def __init__(self, level: int, publish: Publish) -> None:
        if level not in (3, 4, 5):
            raise LocalProtocolError(f"unknown protocol level {level}")
        self.level = level
        self.qos = publish.qos
        self.retain = publish.retain
        self.topic = publish.topic
        template = Publish(
            publish.topic,
            publish.payload,
            publish.qos,
            publish.retain,
            False,
            1 if publish.qos else None,
            publish.properties,
        )
        data = write_publish(template, level)
        self.size = len(data)
        self._whole = data
        if not self.qos:
            self._heads = (b"", b"")
            self._tail = b""
            self._pack = _no_pack
            return
        # Skip the variable byte integer, then the topic string; the packet id follows.
        header = 2
        while data[header - 1] & 0x80:
            header += 1
        pid_at = header + 2 + ((data[header] << 8) | data[header + 1])
        middle = data[1:pid_at]
        self._heads = (bytes((data[0] & 0xF7,)) + middle, bytes((data[0] | 0x08,)) + middle)
        self._tail = tail = data[pid_at + 2 :]
        self._pack = struct.Struct(f">{pid_at}sH{len(tail)}s").pack

    def packet(self, packet_id: int | None = None, dup: bool = False) -> bytes:
        """The PUBLISH bytes with `packet_id` and DUP patched in (QoS 0: no id, never DUP)."""
        if packet_id:  # None and 0 are refused below; struct refuses the rest (H: 0..65535)
            try:
                return self._pack(self._heads[dup], packet_id, self._tail)
            except struct.error:
                pass
        elif not self.qos and packet_id is None and not dup:
            return self._whole
        if not self.qos:
            raise LocalProtocolError("a QoS 0 PUBLISH has no packet id and no DUP")
        raise LocalProtocolError(f"packet identifier must be 1..65535, not {packet_id}")
