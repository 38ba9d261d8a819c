"""One follower's held pulls of one queue, sent one after another without a coroutine.

A follower of a queue's end (the parent topic's tail, gateway/storage/rocketmq/tail.py) sends
a held PULL_MESSAGE, and on its answer the next from the answer's nextBeginOffset, hundreds of
times a second under load. :class:`HeldPull` keeps what is the same from one pull to the next
so that a pull costs only its offset and opaque:

    frame      the reader's PullFrames template (pull_frames.py), made once
    answer     one bound method registered per pull (Connection.expect), no closure
    deadline   one timer for all the pulls: each pull moves the deadline (loop.time() + the
               held pull's wait), and the timer, when it fires, expires the pull that is
               waiting if its deadline has passed or re-arms itself for it. Pulls are answered
               far inside their wait, so the timer fires about once per wait, not per pull
               (a call_later and its cancel per pull were the tail's largest fixed cost)

`send(offset)` writes the pull on the broker's open connection and returns False, nothing sent,
when there is none (the caller then pulls with `RemotingClient.pull`, which opens one).
`answered` gets, once per pull sent, its PullResult or the RemotingError that ended it
(OffsetMovedError included, the connection lost, no answer in time). At most one pull is in
flight: `send` is called again only after its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container
from typing import Generic, TypeVar

from rocketmq_remoting.codes import RequestCode
from rocketmq_remoting.command import RemotingCommand
from rocketmq_remoting.connection import Connection
from rocketmq_remoting.connections import Connections
from rocketmq_remoting.errors import RemotingError
from rocketmq_remoting.pull_frames import PullFrames

#: A parsed answer (client.PullResult).
R = TypeVar("R")


class HeldPull(Generic[R]):
    """The held pulls of one reader of one queue (see the module docstring). Made by
    `RemotingClient.held_pull`, which hands it `pull_result` as `parse`."""

    __slots__ = (
        "_addr",
        "_answered",
        "_client",
        "_conn",
        "_deadline",
        "_frames",
        "_loop",
        "_opaque",
        "_parse",
        "_timer",
        "_wait",
        "_wanted",
    )

    def __init__(
        self,
        client: Connections,
        broker_addr: str,
        frames: PullFrames,
        answered: Callable[[R | RemotingError], None],
        wait: float,
        wanted: Container[str] | None,
        parse: Callable[[RemotingCommand, str, Container[str] | None, bool], R],
    ) -> None:
        self._client = client
        self._addr = broker_addr
        self._frames = frames
        self._answered = answered
        self._wait = wait  # how long a pull is waited for (its hold, then the request timeout)
        self._wanted = wanted
        self._parse = parse
        self._loop = asyncio.get_running_loop()
        self._conn: Connection | None = None  # where the pull in flight went (None: none)
        self._opaque = 0
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> bool:
        """Whether a pull is in flight (sent, not answered yet)."""
        return self._conn is not None

    def send(self, offset: int) -> bool:
        """The held pull from `offset`, written now on the broker's open connection; False,
        nothing sent, when there is none."""
        conn = self._client.open_broker_connection(self._addr)
        if conn is None:
            return False
        self._opaque = opaque = conn.next_opaque()
        conn.expect(opaque, self._on_answer)
        conn.write(self._frames.frame(opaque, offset))
        self._conn = conn
        self._client.held_pulls += 1
        self._deadline = deadline = self._loop.time() + self._wait
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._check)
        return True

    def close(self) -> None:
        """Stop the deadline's timer (a pull in flight is still answered, or ended by the
        connection's close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        conn = self._conn
        if conn is None:
            return  # nothing in flight: the next `send` arms the timer again
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check)
            return
        # Ends the pull through `_on_answer` with a RemotingTimeoutError.
        conn.expire((self._opaque,), RequestCode.PULL_MESSAGE, self._wait)

    def _on_answer(self, _opaque: int, answer: RemotingCommand | RemotingError) -> None:
        self._conn = None
        self._client.held_pulls -= 1
        if isinstance(answer, RemotingError):
            self._answered(answer)
            return
        try:
            result = self._parse(answer, self._addr, self._wanted, True)
        except RemotingError as exc:
            self._answered(exc)
            return
        self._answered(result)
