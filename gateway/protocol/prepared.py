"""PreparedPublish: encode a PUBLISH once, send it to many subscribers.

Fan-out sends the same topic, payload and properties to every subscriber at the same level and
QoS; only the packet identifier and the DUP bit differ. A QoS 1/2 packet is kept in pieces
around the packet identifier:

    +-------+-----------+-----------------+-----------+------------+---------+
    | byte1 | remaining | topic           | packet id | properties | payload |
    | flags | length    | (length, UTF-8) | 2 bytes   | (MQTT 5)   |         |
    +-------+-----------+-----------------+-----------+------------+---------+
    |<-- `_heads[dup]`, one per DUP bit ->|           |  `_block`  |`_payload`|

    `_pack`: struct ">{len(head)}s H {len(block)}s {len(payload)}s", one per shape

`packet(packet_id, dup)` is one call of that struct: it writes head, id, property block and
payload straight into the new bytes object (one copy of the payload, no re-encoding, no
intermediate two-byte id object, no join tuple), which is cheaper per packet than joining
head, id and tail, even with the ids taken from a table. Compiling a struct costs more than
many packets do, so the packers are kept per shape (head, block and payload lengths) in a
small bounded cache: a run of messages of one size on one topic compiles once. The payload
is not copied when the PreparedPublish is made; QoS 0 packets are encoded whole, once.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from gateway.protocol.errors import LocalProtocolError
from gateway.protocol.events import Publish
from gateway.protocol.writers import (
    publish_fixed_header,
    publish_topic_and_properties,
    write_publish,
)

_Pack = Callable[[bytes, int, bytes, bytes], bytes]

# (head length, property block length, payload length) -> packer. Cleared when full: shapes
# are few in steady traffic, and a miss only costs a compile.
_PACKERS: dict[tuple[int, int, int], _Pack] = {}
_PACKERS_SIZE = 1024


def _packer(head: int, block: int, payload: int) -> _Pack:
    key = (head, block, payload)
    pack = _PACKERS.get(key)
    if pack is None:
        if len(_PACKERS) >= _PACKERS_SIZE:
            _PACKERS.clear()
        pack = _PACKERS[key] = struct.Struct(f">{head}sH{block}s{payload}s").pack
    return pack


def _no_pack(head: bytes, packet_id: int, block: bytes, payload: bytes) -> bytes:
    raise struct.error("a QoS 0 PUBLISH has no packet id")


class PreparedPublish:
    __slots__ = (
        "_block",
        "_heads",
        "_pack",
        "_payload",
        "_whole",
        "level",
        "qos",
        "retain",
        "size",
        "topic",
    )

    _heads: tuple[bytes, bytes]
    _pack: _Pack

    def __init__(self, level: int, publish: Publish) -> None:
        if level not in (3, 4, 5):
            raise LocalProtocolError(f"unknown protocol level {level}")
        qos = publish.qos
        self.level = level
        self.qos = qos
        self.retain = publish.retain
        self.topic = publish.topic
        payload = publish.payload
        if not qos:
            if publish.dup or publish.packet_id is not None:  # neither belongs to the template
                publish = Publish(
                    publish.topic, payload, 0, publish.retain, False, None, publish.properties
                )
            self._whole = write_publish(publish, level)
            self.size = len(self._whole)
            self._heads = (b"", b"")
            self._block = self._payload = b""
            self._pack = _no_pack
            return
        if qos != 1 and qos != 2:
            raise LocalProtocolError(f"QoS must be 0, 1 or 2, not {qos}")
        if type(payload) is not bytes:  # struct's "s" takes bytes (or bytearray), not views
            payload = bytes(payload)
        encoded, block = publish_topic_and_properties(publish, level)
        flags = qos << 1 | (1 if publish.retain else 0)
        length = len(encoded) + 2 + len(block) + len(payload)
        head = publish_fixed_header(flags, length) + encoded
        self._heads = (head, bytes((head[0] | 0x08,)) + head[1:])
        self._block = block
        self._payload = payload
        self._whole = b""
        self.size = len(head) + length - len(encoded)
        self._pack = _packer(len(head), len(block), len(payload))

    def packet(self, packet_id: int | None = None, dup: bool = False) -> bytes:
        """The PUBLISH bytes with `packet_id` and DUP patched in (QoS 0: no id, never DUP)."""
        if packet_id:  # None and 0 are refused below; struct refuses the rest (H: 0..65535)
            try:
                return self._pack(self._heads[dup], packet_id, self._block, self._payload)
            except struct.error:
                pass
        elif not self.qos and packet_id is None and not dup:
            return self._whole
        if not self.qos:
            raise LocalProtocolError("a QoS 0 PUBLISH has no packet id and no DUP")
        raise LocalProtocolError(f"packet identifier must be 1..65535, not {packet_id}")
