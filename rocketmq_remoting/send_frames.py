"""SEND_MESSAGE_V2 frames made from a template: what a producer sends per message, fast.

A producer of one group sending to one topic/queue sends the same header each time but for
three values: the opaque, ``g`` (born timestamp) and ``i`` (the properties). :class:`SendFrames`
encodes the constant part once and, per message, joins it with those three and the body. Its
bytes equal ``RemotingCommand(code=SEND_MESSAGE_V2, ext_fields=headers.send_message_v2(...))
.encode()`` for the same values (tests/rocketmq_remoting/test_codec.py checks both serialize
types), so the broker sees exactly what the generic encoder would send.

ROCKETMQ (binary) header of a send, as ``RocketMQSerializable.rocketMQProtocolEncode`` writes
it (command.py draws the general layout)::

    +-----------+-----------+------------+------------+----------+-----------+--------------+
    | code i16  | lang i8   | version i16| opaque i32 | flag i32 | remark 0  | fields len   |
    | 310       | PYTHON    | 479        | per frame  | 0        | i32       | i32          |
    +-----------+-----------+------------+------------+----------+-----------+--------------+
    then per field, in java.util.HashMap order:  key len i16 | key | value len i32 | value
    (``g`` and ``i`` per frame, the others constant)

A producer's batch (the sends of one loop turn) is :meth:`SendFrames.frames`: every frame of it,
consecutive opaques, one bytes object, built in one C call (rocketmq_remoting/_speedups.c
`send_frames`, binary header; reference :meth:`SendFrames.frames_py`, the frames of `frame`
joined; tests/rocketmq_remoting/test_codec.py checks they agree).

The broker decodes either serialize type into the same ``SendMessageRequestHeaderV2``
(``RemotingCommand.decode`` reads the type from the frame's mark byte) and answers in its own
configured type (JSON unless started with ``rocketmq.serialize.type=ROCKETMQ``); the binary
header spares the broker a JSON parse per message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import accelerators
from rocketmq_remoting import headers
from rocketmq_remoting.codes import VERSION_5_3_3, LanguageCode, RequestCode, SerializeType
from rocketmq_remoting.command import FRAME_MAX, hashmap_order, json_string
from rocketmq_remoting.errors import ProtocolError

#: The C kernel of `SendFrames.frames_py` (its ProtocolError is configured by message.py).
_kernel = accelerators.load("rocketmq_remoting._speedups", "LMQTT_PURE_PYTHON_READ")
if _kernel is not None:
    import rocketmq_remoting.message  # noqa: F401  (configures the kernel's error class)

_INT: Final = struct.Struct(">i")
_TWO_INTS: Final = struct.Struct(">ii")
_SHORT: Final = struct.Struct(">h")
#: The header fields that change from one message to the next.
_VARIABLE: Final = ("g", "i")


class SendFrames:
    """Encodes SEND_MESSAGE_V2 frames of `producer_group` to `topic`/`queue_id`."""

    def __init__(
        self,
        producer_group: str,
        topic: str,
        *,
        queue_id: int = 0,
        flag: int = 0,
        serialize_type: SerializeType = SerializeType.ROCKETMQ,
        language: str = "PYTHON",
        version: int = VERSION_5_3_3,
    ) -> None:
        self.serialize_type = serialize_type
        fields = headers.send_message_v2(
            producer_group=producer_group,
            topic=topic,
            queue_id=queue_id,
            born_timestamp=0,
            properties="",
            flag=flag,
        )
        order = hashmap_order(tuple(fields))
        if tuple(k for k in order if k in _VARIABLE) != _VARIABLE:
            raise AssertionError("the send header's variable fields are not in g, i order")
        # Three constant pieces around the two variable values: [0] up to g's value,
        # [1] between g's and i's, [2] after i's (to the header's end for JSON).
        pieces: list[bytes] = []
        binary = serialize_type is SerializeType.ROCKETMQ
        cur = b""
        first = True
        for key in order:
            if binary:
                kb = key.encode()
                cur += _SHORT.pack(len(kb)) + kb
            else:
                cur += ("" if first else ",").encode() + f"{json_string(key)}:".encode()
            first = False
            if key in _VARIABLE:
                pieces.append(cur)
                cur = b""
                continue
            if binary:
                vb = fields[key].encode()
                cur += _INT.pack(len(vb)) + vb
            else:
                cur += json_string(fields[key]).encode()
        pieces.append(cur)
        self._to_g, self._g_to_i, self._after_i = pieces
        code = RequestCode.SEND_MESSAGE_V2
        if binary:
            self._head = struct.pack(">hbh", code, LanguageCode[language], version)
            # flag 0, remark absent (length 0)
            self._after_opaque = _TWO_INTS.pack(0, 0)
            #: What the C kernel builds a batch's frames from (send_frames in _speedups.c).
            self.pieces = (
                self._head,
                self._after_opaque,
                self._to_g,
                self._g_to_i,
                self._after_i,
                serialize_type << 24,
                FRAME_MAX,
            )
            if _kernel is not None:
                self.frames = self._frames_c  # type: ignore[method-assign]
        else:
            self._json_head = f'{{"code":{code},"extFields":{{'.encode()
            self._json_mid = f'}},"flag":0,"language":"{language}","opaque":'.encode()
            self._json_tail = f',"serializeTypeCurrentRPC":"JSON","version":{version}}}'.encode()

    def frame(self, opaque: int, born_ms: int, properties: bytes, body: bytes) -> bytes:
        """The whole frame (length prefix included) of one message; `properties` is the
        encoded property string (``name \\x01 value \\x02`` pairs, UTF-8)."""
        g = str(born_ms).encode()
        if self.serialize_type is SerializeType.ROCKETMQ:
            fields = b"".join(
                (
                    self._to_g,
                    _INT.pack(len(g)),
                    g,
                    self._g_to_i,
                    _INT.pack(len(properties)),
                    properties,
                    self._after_i,
                )
            )
            header = b"".join(
                (self._head, _INT.pack(opaque), self._after_opaque, _INT.pack(len(fields)), fields)
            )
        else:
            value = json_string(properties.decode()).encode()
            header = b"".join(
                (
                    self._json_head,
                    self._to_g,
                    b'"',
                    g,
                    b'"',
                    self._g_to_i,
                    value,
                    self._after_i,
                    self._json_mid,
                    str(opaque).encode(),
                    self._json_tail,
                )
            )
        length = 4 + len(header) + len(body)
        if length > FRAME_MAX:
            raise ProtocolError(f"frame of {length} bytes exceeds {FRAME_MAX}")
        return _TWO_INTS.pack(length, (self.serialize_type << 24) | len(header)) + header + body

    def frames_py(
        self, first_opaque: int, born_ms: int, messages: Sequence[tuple[bytes, bytes]]
    ) -> bytes:
        """The frames of `messages` ((properties, body) pairs), opaques `first_opaque` on, one
        after the other: the reference of the C kernel's `send_frames`."""
        frame = self.frame
        return b"".join(
            frame(first_opaque + i, born_ms, properties, body)
            for i, (properties, body) in enumerate(messages)
        )

    #: The frames of a batch (binary header: the C kernel when built, else the reference).
    frames = frames_py

    def _frames_c(
        self, first_opaque: int, born_ms: int, messages: Sequence[tuple[bytes, bytes]]
    ) -> bytes:
        assert _kernel is not None
        frames: bytes = _kernel.send_frames(
            self.pieces,
            first_opaque,
            born_ms,
            messages if type(messages) is list else list(messages),
        )
        return frames
