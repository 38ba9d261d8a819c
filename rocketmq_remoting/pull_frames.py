"""PULL_MESSAGE frames made from a template: what a tail or a mirror sends per pull, fast.

A reader following one queue sends the same PULL_MESSAGE header each time but for two values:
the opaque and ``queueOffset``. :class:`PullFrames` encodes the rest once (binary header, the
fields in java.util.HashMap order) and, per pull, joins it with those two. Its bytes equal
``RemotingCommand(code=PULL_MESSAGE, ext_fields=headers.pull_message(...),
serialize_type=ROCKETMQ).encode()`` for the same values (tests/rocketmq_remoting/test_codec.py
checks it), so the broker reads exactly what the generic encoder would send; the binary header
also spares it a JSON parse per pull. Layout (``RocketMQSerializable``, command.py)::

    +-----------+-----------+------------+------------+----------+-----------+--------------+
    | code i16  | lang i8   | version i16| opaque i32 | flag i32 | remark 0  | fields len   |
    | 11        | PYTHON    | 479        | per frame  | 0        | i32       | i32          |
    +-----------+-----------+------------+------------+----------+-----------+--------------+
    then per field, in java.util.HashMap order:  key len i16 | key | value len i32 | value
    (``queueOffset`` per frame, the others constant)
"""

from __future__ import annotations

import struct
from typing import Final

from rocketmq_remoting import headers
from rocketmq_remoting.codes import VERSION_5_3_3, LanguageCode, RequestCode, SerializeType
from rocketmq_remoting.command import hashmap_order

_INT: Final = struct.Struct(">i")
_FRAME_START: Final = struct.Struct(">ii")  # frame length, serialize type | header length
#: opaque, flag 0, remark length 0, the fields' length.
_OPAQUE_FLAG_REMARK: Final = struct.Struct(">iiii")
#: The header's bytes before its fields: code, language, version, opaque, flag, remark length
#: and the fields' length.
_BEFORE_FIELDS: Final = 2 + 1 + 2 + 4 + 4 + 4 + 4
_SHORT: Final = struct.Struct(">h")
#: The header field that changes from one pull to the next.
_VARIABLE: Final = "queueOffset"


class PullFrames:
    """Encodes the PULL_MESSAGE frames of one reader (group, queue, batch, flags, hold)."""

    __slots__ = ("_after", "_fixed", "_head", "_serialize", "_to_offset")

    def __init__(
        self,
        *,
        consumer_group: str,
        topic: str,
        queue_id: int,
        max_msg_nums: int,
        sys_flag: int,
        suspend_timeout_millis: int,
        subscription: str = "*",
        language: str = "PYTHON",
        version: int = VERSION_5_3_3,
    ) -> None:
        fields = headers.pull_message(
            consumer_group=consumer_group,
            topic=topic,
            queue_id=queue_id,
            queue_offset=0,
            max_msg_nums=max_msg_nums,
            sys_flag=sys_flag,
            commit_offset=0,
            suspend_timeout_millis=suspend_timeout_millis,
            subscription=subscription,
        )
        # Two constant pieces around the variable value: up to its length, and after it.
        pieces: list[bytes] = []
        cur = b""
        for key in hashmap_order(tuple(fields)):
            kb = key.encode()
            cur += _SHORT.pack(len(kb)) + kb
            if key == _VARIABLE:
                pieces.append(cur)
                cur = b""
                continue
            vb = fields[key].encode()
            cur += _INT.pack(len(vb)) + vb
        pieces.append(cur)
        self._to_offset, self._after = pieces
        self._head = struct.pack(">hbh", RequestCode.PULL_MESSAGE, LanguageCode[language], version)
        self._serialize = SerializeType.ROCKETMQ << 24
        #: The header's length but for the offset's text: what comes before the fields, and
        #: the fields but for the value (its 4-byte length included).
        self._fixed = _BEFORE_FIELDS + len(self._to_offset) + 4 + len(self._after)

    def frame(self, opaque: int, queue_offset: int) -> bytes:
        """The whole frame (length prefix included) of the pull from `queue_offset`."""
        value = b"%d" % queue_offset
        n = len(value)
        header_len = self._fixed + n
        return b"".join(
            (
                _FRAME_START.pack(4 + header_len, self._serialize | header_len),
                self._head,
                _OPAQUE_FLAG_REMARK.pack(opaque, 0, 0, header_len - _BEFORE_FIELDS),
                self._to_offset,
                _INT.pack(n),
                value,
                self._after,
            )
        )
