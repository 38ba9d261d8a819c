"""Gateway queue names as RocketMQ light queues, in the namespace of one deployment: the
name memo of the send and arrival paths.

The encoding itself (`encode_lmq`/`decode_lmq`, drawn in topicmap/rocketmq.py) has its home
in topicmap, because the fan-out report reads the same names from the broker and cannot
import the gateway. Consumer groups (a client id, `$share/<group>`) are named the same way.
"""

from __future__ import annotations

from topicmap.rocketmq import decode_lmq, encode_lmq

#: A light queue no gateway queue maps to (`_9` follows no namespace in an encoded name): the
#: start-up probe that the broker really indexes light queues.
PROBE_QUEUE = "%LMQ%lmqtt_9probe"

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
