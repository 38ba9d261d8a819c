"""PreparedPublish: encode a PUBLISH once, send it to many subscribers.

Fan-out sends the same topic, payload and properties to every subscriber at the same level and
QoS; only the packet identifier and the DUP bit differ. The packet is encoded once and split
around the packet identifier:

    +-------+-----------------------------+-----------+----------------------------+
    | byte1 | remaining length + topic    | packet id | properties + payload       |
    | flags |                             | 2 bytes   | (`_tail`, shared)          |
    +-------+-----------------------------+-----------+----------------------------+
    |<- `_heads[dup]`: one per DUP bit -->|

`packet(packet_id, dup)` joins three pieces, one copy of the payload and no re-encoding.
"""

from __future__ import annotations

import struct

from gateway.protocol.errors import LocalProtocolError
from gateway.protocol.events import Publish
from gateway.protocol.writers import write_publish

_pack_uint16 = struct.Struct(">H").pack


class PreparedPublish:
    __slots__ = ("_heads", "_tail", "_whole", "level", "qos", "retain", "size", "topic")

    _heads: tuple[bytes, bytes]

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
            return
        # Skip the variable byte integer, then the topic string; the packet id follows.
        header = 2
        while data[header - 1] & 0x80:
            header += 1
        pid_at = header + 2 + ((data[header] << 8) | data[header + 1])
        middle = data[1:pid_at]
        self._heads = (bytes((data[0] & 0xF7,)) + middle, bytes((data[0] | 0x08,)) + middle)
        self._tail = data[pid_at + 2 :]

    def packet(self, packet_id: int | None = None, dup: bool = False) -> bytes:
        """The PUBLISH bytes with `packet_id` and DUP patched in (QoS 0: no id, never DUP)."""
        if not self.qos:
            if packet_id is not None or dup:
                raise LocalProtocolError("a QoS 0 PUBLISH has no packet id and no DUP")
            return self._whole
        if packet_id is None or not 0 < packet_id < 0x10000:
            raise LocalProtocolError(f"packet identifier must be 1..65535, not {packet_id}")
        return b"".join((self._heads[dup], _pack_uint16(packet_id), self._tail))
