"""How lmqtt lays its data out on Apache RocketMQ: light-queue names and the state batches.

One home for the layout, because two sides that must not import each other read it: the
gateway writes it (gateway/storage/rocketmq/adapter.py) and the fan-out report reads it straight
from the broker (analytics/rocketmq.py). Standard library only, like the rest of topicmap.

Names. A gateway queue name (the router's `%LMQ%site.%2b`, or `%RETAIN%`) as a RocketMQ light
queue, within the namespace of the deployment's parent topic (`rocketmq_topic`, default
`lmqtt`), so several deployments share a cluster without seeing each other's queues:

    %LMQ% <encoded topic> _0 [_2 if the name does not start with %LMQ%] <encoded rest>
    encoded: A-Z a-z 0-9 - %  as is;  .  -> _1;  _  -> _3;  | -> _4;  other bytes -> _x + 2 hex
    longer than MAX_LMQ_NAME:  %LMQ% <encoded topic> _5 <sha256 hex, 40 digits>
                               (reverse: the name table of the process that named it)

e.g. `%LMQ%site.%2b` -> `%LMQ%lmqtt_0site_1%2b`, `%RETAIN%` -> `%LMQ%lmqtt_0_2%RETAIN%`.
RocketMQ topic names allow only [%|a-zA-Z0-9_-] (TopicValidator), and a `/` would make the
broker skip the dispatch silently (docs/rocketmq.md quirk 4). Each `_` starts an escape of a
known length, so the mapping is injective; `_9` is left for the gateway's probe queue.

State batches. The gateway's state log (sessions, subscriptions, wills, the retained snapshot)
is the STATE_QUEUE light queue: one message per batch, its body the batch's records

    record := u16 key length, key (UTF-8), i32 value length (-1: the key is deleted), value

and the offset committed for the consumer group of STATE_START in it is where a replay starts
(the last compaction's snapshot). The newest record of a key wins.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

LMQ_PREFIX = "%LMQ%"
MAX_LMQ_NAME = 200
#: The gateway's state log and the consumer group whose committed offset in it is where a
#: replay of it starts (gateway queue names, mapped by encode_lmq like any other).
STATE_QUEUE = "%STATE%"
STATE_START = "%STATE-START%"
#: A property of a message whose MQTT payload is empty: a broker cannot store an empty body
#: (docs/rocketmq.md quirk 11), so one byte is sent and the reader takes the body as empty.
EMPTY_BODY_PROPERTY = "lmqtt.empty"
#: The MQTT topic of a message under a name RocketMQ's SQL92 filters can use (their identifiers
#: have no `.`, so `mqtt.topic` cannot be named there): on each message the gateway stores when
#: rocketmq_topic_property is on, and the topic of a message sent to the inbound topic.
TOPIC_PROPERTY = "mqttTopic"

_KEEP = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-%")
_ESCAPES = {"1": b".", "3": b"_", "4": b"|"}


def _escape(text: str) -> str:
    out: list[str] = []
    for ch in text:
        if ch in _KEEP:
            out.append(ch)
        elif ch == ".":
            out.append("_1")
        elif ch == "_":
            out.append("_3")
        elif ch == "|":
            out.append("_4")
        else:
            out.extend(f"_x{b:02x}" for b in ch.encode("utf-8", "surrogatepass"))
    return "".join(out)


def encode_lmq(queue: str, namespace: str = "lmqtt") -> str:
    """The light queue of gateway queue `queue` in `namespace` (see the module docstring)."""
    head = LMQ_PREFIX + _escape(namespace)
    if queue.startswith(LMQ_PREFIX):
        name = head + "_0" + _escape(queue[len(LMQ_PREFIX) :])
    else:
        name = head + "_0_2" + _escape(queue)
    if len(name) > MAX_LMQ_NAME:
        name = head + "_5" + hashlib.sha256(queue.encode("utf-8")).hexdigest()[:40]
    return name


def decode_lmq(name: str, namespace: str = "lmqtt") -> str | None:
    """Inverse of encode_lmq for names not hashed; None for any other name."""
    head = LMQ_PREFIX + _escape(namespace) + "_0"
    if not name.startswith(head):
        return None
    rest = name[len(head) :]
    prefix = LMQ_PREFIX
    if rest.startswith("_2"):
        rest, prefix = rest[2:], ""
    out = bytearray()
    i = 0
    while i < len(rest):
        ch = rest[i]
        if ch != "_":
            out += ch.encode()
            i += 1
            continue
        code = rest[i + 1 : i + 2]
        if code in _ESCAPES:
            out += _ESCAPES[code]
            i += 2
        elif code == "x":
            try:
                out.append(int(rest[i + 2 : i + 4], 16))
            except ValueError:
                return None
            i += 4
        else:
            return None
    try:
        return prefix + out.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


_STATE_KEY = struct.Struct(">H")
_STATE_VALUE = struct.Struct(">i")

StateRecord = tuple[str, bytes | None]


def encode_state(records: Sequence[StateRecord]) -> bytes:
    """One state batch's body (see the module docstring)."""
    out = bytearray()
    for key, value in records:
        raw = key.encode("utf-8")
        out += _STATE_KEY.pack(len(raw))
        out += raw
        if value is None:
            out += _STATE_VALUE.pack(-1)
        else:
            out += _STATE_VALUE.pack(len(value))
            out += value
    return bytes(out)


def decode_state(body: bytes) -> tuple[list[StateRecord], bool]:
    """The records of one state batch, and whether it was whole (False: damaged, the records
    before the damage are returned)."""
    out: list[StateRecord] = []
    pos = 0
    try:
        while pos < len(body):
            (klen,) = _STATE_KEY.unpack_from(body, pos)
            pos += 2
            key = body[pos : pos + klen].decode("utf-8")
            pos += klen
            (vlen,) = _STATE_VALUE.unpack_from(body, pos)
            pos += 4
            if vlen < 0:
                out.append((key, None))
            else:
                if pos + vlen > len(body):
                    return out, False
                out.append((key, body[pos : pos + vlen]))
                pos += vlen
    except (struct.error, UnicodeDecodeError):
        return out, False
    return out, True
