"""Sessions on any node: several gateway processes on one RocketMQ deployment share sessions
through the state log (issue #18, point 2), and retained messages through %RETAIN% (point 4).

Every node writes its sessions' records to the one %STATE% light queue (gateway/
rocketmq_storage.py, each batch tagged with the writing process's id) and reads the others'
from it (`catch_up_state`). A session record that another node wrote replaces this node's copy
(`SessionRegistry.adopt`): the session's filters are registered here too (a publish on this
node reaches the session's queues), an expiry timer runs only while the record says the
session is disconnected, and nothing is written back.

    client X on node A            state log (%STATE%)                 node B
    SUBSCRIBE, SUBACK  --------->  session/X {subs, positions}
    DISCONNECT         --------->  session/X {disconnected_at_ms}     (tail: adopt, 1 s)
                                                                      CONNECT X
                                                                        catch_up_state() to
                                                                        the queue's end NOW
                                                                        adopt session/X
                                   session/X {connected} <----------    written, then CONNACK
                                                                        (session present,
                                                                        backlog from the
                                                                        record's positions,
                                                                        in-flight resent DUP)
    (tail: adopt -> A's copy
     loses its expiry timer)

Ordering rules this relies on:
- B catches up with the state log up to its end *as asked after the CONNECT arrived*, before
  it answers CONNACK: a record A had stored (SEND_OK) before is seen (the broker's dispatch to
  the light queue lags SEND_OK by milliseconds, docs/rocketmq.md quirk 3).
- A node writes a session's record at once when its connection ends (`connection_ended`) and
  then not again at progress passes (`SessionRegistry.settle`): a later rewrite of an older
  copy would undo what the node that resumed the session wrote meanwhile. B writes the record
  at once on CONNECT (`claimed`), before CONNACK, so the other nodes learn where it went.
- Retained: before a SUBSCRIBE's retained messages are matched, %RETAIN%'s mirror is brought
  to the broker's end (`retained_caught_up`); a retained PUBLISH is acknowledged only after
  its %RETAIN% offset was read back (put_async), so it is dispatched by then.

Not here (issue #18's other points, the cluster core): a session connected on two nodes at
once (takeover across nodes), the no-gap filter registry (a filter subscribed on A is known to
B after B's next catch-up, up to a second later), wills of a dead node's clients, shared
subscriptions across nodes, and membership (a node starting while another runs treats the
other's connected sessions as cut off by a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from gateway.session import SESSION_KEY_PREFIX, Session, SessionRegistry
from gateway.storage import StateRecord, StoreError

log = logging.getLogger("lmqtt.cluster")

#: How often a node reads the other nodes' state records when no CONNECT asks for it (the
#: other nodes' new subscriptions, sessions that moved away, expiries).
TAIL_INTERVAL_S = 1.0
RETAIN_QUEUE = "%RETAIN%"


@runtime_checkable
class SharedState(Protocol):
    """A storage backend whose state log other gateway processes write too (RocketMQ)."""

    async def catch_up_state(self) -> list[StateRecord]: ...

    async def catch_up_queue(self, queue: str) -> None: ...

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None: ...

    def close_queue(self, queue: str) -> None: ...


class Filters(Protocol):
    """The filter registry of this node's publishes (gateway/publishing.py PublishPath)."""

    def add_filter(self, tf: str) -> str: ...

    def remove_filter(self, text: str) -> bool:
        """True when it was the filter's last subscriber."""
        ...


class Counted(Protocol):
    subscriptions: int


class ClusterSessions:
    """This node's side of the sessions shared through the state log (module docstring)."""

    def __init__(
        self, state: SharedState, registry: SessionRegistry, filters: Filters, stats: Counted
    ) -> None:
        self._state = state
        self._registry = registry
        self._filters = filters
        self._stats = stats
        self._tasks: set[asyncio.Task[None]] = set()
        # Catch-ups asked for while one runs share the next one (a fleet connecting at once
        # costs a few reads of the state log, not one per CONNECT).
        self._wanted: asyncio.Future[int] | None = None
        self._runner: asyncio.Task[None] | None = None

    async def catch_up(self) -> int:
        """Apply every session record other nodes wrote up to the state log's end as of
        this call (or later); returns how many were applied by the run that covered it."""
        fut = self._wanted
        if fut is None:
            fut = self._wanted = asyncio.get_running_loop().create_future()
            if self._runner is None or self._runner.done():
                self._runner = asyncio.get_running_loop().create_task(self._run())
        return await asyncio.shield(fut)

    async def _run(self) -> None:
        while self._wanted is not None:
            fut, self._wanted = self._wanted, None
            try:
                n = self.apply(await self._state.catch_up_state())
            except Exception as exc:  # handed to every caller of this run
                fut.set_exception(exc)
                fut.exception()  # retrieved: callers may all have gone
            else:
                fut.set_result(n)

    def apply(self, records: Sequence[StateRecord]) -> int:
        n = len(SESSION_KEY_PREFIX)
        applied = 0
        for key, value in records:
            if key.startswith(SESSION_KEY_PREFIX):
                self._adopt(key[n:], value)
                applied += 1
        return applied

    def _adopt(self, client_id: str, value: bytes | None) -> None:
        registry = self._registry
        mine = registry.sessions.get(client_id)
        if mine is not None and mine.connection is not None:
            # Connected here and written there: a takeover across nodes (the cluster core's);
            # the live connection's session stays.
            log.info("session %r: record from another node while connected here", client_id)
            return
        before = registry.entries(client_id)
        try:
            registry.adopt(client_id, value)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.error("session %r from another node unreadable (%s); ignored", client_id, exc)
            return
        after = registry.entries(client_id)
        for sub in after:
            self._filters.add_filter(sub.topic_filter)
        for sub in before:
            if self._filters.remove_filter(sub.topic_filter):
                self._state.close_queue(sub.queue)  # nothing here reads it any more
        self._stats.subscriptions += len(after) - len(before)

    async def before_connect(self, client_id: str) -> None:
        """A CONNECT arrived: read the state log to its end first (the session may have been
        written by another node a moment ago)."""
        try:
            await self.catch_up()
        except (OSError, StoreError, RuntimeError) as exc:
            # The session as this node knows it (up to a second old) rather than no answer.
            log.warning("%r: state log catch-up failed before CONNACK: %s", client_id, exc)

    async def claimed(self, session: Session) -> None:
        """The session connected here: its record goes out before CONNACK, and the messages
        it has in flight are read (they are re-sent with DUP at once)."""
        by_queue: dict[str, list[int]] = {}
        for inf in session.inflight.values():
            if inf.queue is not None and not inf.pubrel:
                by_queue.setdefault(inf.queue, []).append(inf.offset)
        reads = [self._state.prefetch(q, offsets) for q, offsets in by_queue.items()]
        results = await asyncio.gather(self._registry.save(session), *reads, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                # The record is written again at the next pass; an unread message is
                # forgotten like one deleted by retention: the session still resumes.
                log.warning("session %r: resuming here: %s", session.client_id, res)

    def connection_ended(self, session: Session) -> None:
        """Write the disconnected session's record now, and not again unless it changes here."""
        registry = self._registry
        if registry.sessions.get(session.client_id) is not session:
            return  # ended (its deletion is written by the housekeeping pass)

        async def save() -> None:
            try:
                await registry.save(session)
            except StoreError as exc:
                log.warning("session %r: saving at disconnect failed: %s", session.client_id, exc)
            registry.settle(session.client_id)

        task = asyncio.get_running_loop().create_task(save())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def retained_caught_up(self) -> None:
        """Before matching retained messages: %RETAIN% read to the broker's end."""
        try:
            await self._state.catch_up_queue(RETAIN_QUEUE)
        except (OSError, StoreError, RuntimeError) as exc:
            log.warning("retained catch-up failed: %s", exc)

    async def tail(self) -> None:
        """Apply the other nodes' records every TAIL_INTERVAL_S, until cancelled."""
        while True:
            await asyncio.sleep(TAIL_INTERVAL_S)
            try:
                await self.catch_up()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("state log catch-up failed")

    async def stop(self) -> None:
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
