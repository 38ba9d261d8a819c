"""Gateway queue names as RocketMQ light queues, in the namespace of one deployment.

A gateway queue name (the router's `%LMQ%site.%2b`, or `%RETAIN%`) becomes a RocketMQ light
queue within the namespace of the deployment's parent topic (`rocketmq_topic`, default
`lmqtt`), so several gateways' deployments share a cluster without seeing each other's queues:

    %LMQ% <encoded topic> _0 [_2 if the name does not start with %LMQ%] <encoded rest>
    encoded: A-Z a-z 0-9 - %  as is;  .  -> _1;  _  -> _3;  | -> _4;  other bytes -> _x + 2 hex
    longer than MAX_LMQ_NAME:  %LMQ% <encoded topic> _5 <sha256 hex, 40 digits>
                               (reverse: the name table of the process that named it)

e.g. `%LMQ%site.%2b` -> `%LMQ%lmqtt_0site_1%2b`, `%RETAIN%` -> `%LMQ%lmqtt_0_2%RETAIN%`.
RocketMQ topic names allow only [%|a-zA-Z0-9_-] (TopicValidator), and a `/` would make the
broker skip the dispatch silently (docs/rocketmq.md quirk 4). Each `_` starts an escape of a
known length, so the mapping is injective; `_9` is left for the probe queue. Consumer groups
(a client id, `$share/<group>`) are named the same way.
"""

from __future__ import annotations

import hashlib

LMQ_PREFIX = "%LMQ%"
#: A light queue no gateway queue maps to (`_9` follows no namespace in an encoded name): the
#: start-up probe that the broker really indexes light queues.
PROBE_QUEUE = "%LMQ%lmqtt_9probe"
MAX_LMQ_NAME = 200
_KEEP = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-%")


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
    escapes = {"1": b".", "3": b"_", "4": b"|"}
    while i < len(rest):
        ch = rest[i]
        if ch != "_":
            out += ch.encode()
            i += 1
            continue
        code = rest[i + 1 : i + 2]
        if code in escapes:
            out += escapes[code]
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


#: Names remembered per direction before the memo starts over (bounded memory under
#: subscription churn: every queue ever used would stay otherwise).
NAME_MEMO = 65_536


class LightQueueNames:
    """Gateway queue <-> light queue, both ways, memoized (encoding is per message and queue
    on the send path). A hashed name cannot be decoded: its queue is kept in `_hashed` until
    `forget` (the queue is not read any more), whatever the memo drops."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._to_lmq: dict[str, str] = {}
        self._to_queue: dict[str, str] = {}
        self._hashed: dict[str, str] = {}  # hashed light queue name -> gateway queue

    def lmq(self, queue: str) -> str:
        name = self._to_lmq.get(queue)
        if name is None:
            if len(self._to_lmq) >= NAME_MEMO:
                self._to_lmq.clear()
            name = self._to_lmq[queue] = encode_lmq(queue, self.namespace)
            if decode_lmq(name, self.namespace) is None:
                self._hashed[name] = queue
                self._to_queue.pop(name, None)  # it may have been read as unknown
        return name

    def forget(self, queue: str) -> None:
        """`queue` is not read any more: drop what is remembered of it."""
        name = self._to_lmq.pop(queue, None) or encode_lmq(queue, self.namespace)
        self._to_queue.pop(name, None)
        self._hashed.pop(name, None)

    def queue(self, lmq: str) -> str:
        queue = self._to_queue.get(lmq)
        if queue is None:
            if len(self._to_queue) >= NAME_MEMO:
                self._to_queue.clear()
            queue = self._hashed.get(lmq) or decode_lmq(lmq, self.namespace) or lmq
            self._to_queue[lmq] = queue
        return queue

    def __len__(self) -> int:
        """Names remembered (memo and hashed ones)."""
        return len(self._to_lmq) + len(self._to_queue) + len(self._hashed)
