"""Sessions on any node of the cluster, and retained messages set through another node:
cluster mode's session part (gateway/cluster/node.py).

Every node writes its sessions' records to the one %STATE% light queue, each batch stamped with
its writer (gateway/storage/rocketmq/state.py NODE_PROPERTY), and tails the others' (follow_state).
A session record another node wrote replaces this node's copy (`SessionRegistry.adopt`): the
session's filters are referenced here too, an expiry timer runs only while the record says the
session is disconnected, and nothing is written back.

    client X on node A            state log (%STATE%)                 node B
    SUBSCRIBE, SUBACK  --------->  session/X {subs, positions}        (tail: adopt)
    DISCONNECT         --------->  session/X {disconnected_at_ms}     (tail: adopt)
                                                                      CONNECT X
                                                                        tail caught up to the
                                                                        queue's end NOW
                                                                        claim X (takeover) and
                                   session/X {connected} <----------    write the record, then
                                                                        CONNACK (session
                                                                        present, backlog from
                                                                        the record's positions,
                                                                        in-flight resent DUP)
    (tail: adopt -> A's copy
     loses its expiry timer)

Ordering rules this relies on:
- B catches the tail up to the state queue's end *as asked after the CONNECT arrived*, before
  it answers CONNACK: a record A had stored (SEND_OK) before is applied (the broker's dispatch
  to the light queue lags SEND_OK by milliseconds, docs/rocketmq.md quirk 3).
- A node writes a session's record at once when its connection ends (`connection_ended`) and
  then not again at progress passes (`SessionRegistry.settle`): a later rewrite of an older
  copy would undo what the node that resumed the session wrote meanwhile. A connection closed
  because another node took the session over (gateway/cluster/takeover.py) writes nothing: the
  taker's record is the session's. B writes the record at once on CONNECT, before CONNACK.
- Retained: before a SUBSCRIBE's retained messages are matched, %RETAIN%'s mirror is brought
  to the broker's end (`retained_caught_up`); a retained PUBLISH is acknowledged only after
  its %RETAIN% offset was read back (put_async), so it is dispatched by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from gateway.cluster.bus import Record
from gateway.cluster.handover import Handover
from gateway.session.model import Session
from gateway.session.registry import SESSION_KEY_PREFIX, SessionRegistry
from gateway.storage.port import StateRecord, StoreError

log = logging.getLogger("lmqtt.cluster")

RETAIN_QUEUE = "%RETAIN%"
#: A CONNECT waits this long at most for the state log's tail (a broker that does not answer):
#: then it is answered with the session as this node knows it.
CATCH_UP_TIMEOUT_S = 10.0


class SharedState(Protocol):
    """What the session part needs of storage (RocketMqStorage has it)."""

    async def catch_up_state(self) -> None:
        """Return once every state batch stored before the call was applied here."""
        ...

    async def catch_up_queue(self, queue: str) -> None: ...

    async def prefetch(self, queue: str, offsets: Iterable[int]) -> None: ...

    def close_queue(self, queue: str) -> None: ...


class Filters(Protocol):
    """The filter registry of this node's publishes (gateway/messages/publishing.py PublishPath)."""

    def add_filter(self, tf: str) -> str: ...

    def remove_filter(self, text: str) -> bool:
        """True when it was the filter's last subscriber."""
        ...


class Counted(Protocol):
    subscriptions: int


class ClusterSessions:
    """This node's side of the sessions shared through the state log (module docstring)."""

    def __init__(
        self,
        state: SharedState,
        registry: SessionRegistry,
        filters: Filters,
        stats: Counted,
        *,
        newest: Callable[[str], tuple[str | None, bytes | None]],
        cancel_will: Callable[[str], None],
        handover: Handover,
        mine: Callable[[str], bool],
    ) -> None:
        """`newest(client id)`: the writer and value of the session's newest record (None:
        unknown); `cancel_will(client id)`: drop this node's pending will of that client;
        `mine(client id)`: this node wrote the session's newest record."""
        self._state = state
        self._newest = newest
        self._cancel_will = cancel_will
        self._handover = handover
        self._mine = mine
        self._registry = registry
        self._filters = filters
        self._stats = stats
        self._tasks: set[asyncio.Task[None]] = set()
        # Taken over by another node: write nothing at the end (the claim that took it: its
        # node may want the session handed over, gateway/cluster/handover.py).
        self._moved: dict[str, Record] = {}
        # The claim a connection's end handed the session to last: when the takeover's close
        # ends the connection at once, `claimed_elsewhere` reads the same claim right after and
        # must not hand it again (from the copy re-adopted from this node's last record, which
        # lags what was acknowledged since).
        self._handed: Record | None = None
        # Catch-ups asked for while one runs share the next one (a fleet connecting at once
        # costs a few reads of the state log, not one per CONNECT).
        self._wanted: asyncio.Future[None] | None = None
        self._runner: asyncio.Task[None] | None = None

    def observe(self, node: str, records: Sequence[StateRecord]) -> None:
        """A state batch another node wrote, as the tail reads it (add_state_observer)."""
        n = len(SESSION_KEY_PREFIX)
        for key, value in records:
            if key.startswith(SESSION_KEY_PREFIX):
                self.adopt(key[n:], value)

    def adopt(self, client_id: str, value: bytes | None) -> None:
        """Another node's record of `client_id` replaces ours (None: it ended the session).
        A claim that took the session from a connection here is kept: that connection may
        not have ended yet (or not begun: a CONNECT here superseded while it waited for a
        hand-over), and its end hands the session on."""
        registry = self._registry
        mine = registry.sessions.get(client_id)
        if mine is not None and mine.connection is not None:
            # Connected here and written there: the takeover (gateway/cluster/takeover.py) closes
            # whichever connection claimed the id first; the live one's session stays.
            log.info("session %r: record from another node while connected here", client_id)
            return
        # The session is the other node's now: a will this node still had pending for an
        # earlier connection here is not published (the client came back there), and the
        # copy's will is the writer's to publish (or, if it dies, the leader's: node_wills).
        self._cancel_will(client_id)
        before = registry.entries(client_id)
        try:
            session = registry.adopt(client_id, value)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.error("session %r from another node unreadable (%s); ignored", client_id, exc)
            return
        if session is not None:
            session.will = None
            session.will_due_ms = None
        after = registry.entries(client_id)
        for sub in after:
            self._filters.add_filter(sub.topic_filter)
        for sub in before:
            if self._filters.remove_filter(sub.topic_filter):
                self._state.close_queue(sub.queue)  # nothing here reads it any more
        self._stats.subscriptions += len(after) - len(before)

    async def catch_up(self) -> None:
        """Every session record other nodes stored up to the state log's end as of this call
        (or later) applied here."""
        fut = self._wanted
        if fut is None:
            fut = self._wanted = asyncio.get_running_loop().create_future()
            if self._runner is None or self._runner.done():
                self._runner = asyncio.get_running_loop().create_task(self._run())
        await asyncio.wait_for(asyncio.shield(fut), CATCH_UP_TIMEOUT_S)

    async def _run(self) -> None:
        while self._wanted is not None:
            fut, self._wanted = self._wanted, None
            try:
                await self._state.catch_up_state()
            except Exception as exc:  # handed to every caller of this run
                fut.set_exception(exc)
                fut.exception()  # retrieved: callers may all have gone
            else:
                fut.set_result(None)

    async def before_connect(self, client_id: str) -> None:
        """A CONNECT arrived: the state log applied to its end first (the session may have
        been written by another node a moment ago)."""
        try:
            await self.catch_up()
        except (OSError, StoreError, RuntimeError) as exc:
            # The session as this node's tail knows it rather than no answer.
            log.warning("%r: state log catch-up failed before CONNACK: %s", client_id, exc)

    async def claimed(self, session: Session, *, superseded: bool = False) -> None:
        """The session connected here: its record goes out before CONNACK, and the messages
        it has in flight are read (they are re-sent with DUP at once). `superseded`: a newer
        claim was read already (the connection closes after CONNACK and hands it on)."""
        if not superseded:
            self._moved.pop(session.client_id, None)
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

    def mark_behind(self, client_id: str) -> None:
        """The copy of `client_id` is the record of a node that crashed with it connected (or
        did not hand it over): its positions may lag (gateway/session/model.py `behind`)."""
        session = self._registry.get(client_id)
        if session is not None and session.connection is None:
            session.behind = True

    def taken_over(self, client_id: str, claim: Record) -> None:
        """Another node's connection took `client_id` over (its `claim`,
        gateway/cluster/takeover.py): its record is the session's. The connection here is closing;
        its end hands the session over if the claim asked for it (connection_ended)."""
        self._moved[client_id] = claim

    def claimed_elsewhere(self, claim: Record) -> None:
        """A "conn" record (after takeover.py's handler): a claim by another node that wants
        the session handed over, of a session not connected here whose newest record this
        node wrote, gets it now (one connected here is handed at its end, one whose record
        another node wrote is that node's to hand)."""
        cid = claim.get("c")
        if not claim.get("h") or not isinstance(cid, str) or self._moved.get(cid) is claim:
            return
        if self._handed is claim:
            self._handed = None
            return  # handed at its connection's end already (connection_ended)
        if not self._mine(cid):
            return  # another node's record: that node hands it over
        session = self._registry.get(cid)  # a dormant one is built: unchanged, but here
        if session is not None and session.connection is not None:
            return  # connected here by a newer claim: that claim's connection wins
        doc = session.to_json() if session is not None else None  # None: ended here
        self._handover.give(cid, claim["n"], claim["i"], doc)

    def connection_ended(self, session: Session) -> None:
        """Write the disconnected session's record now, and not again unless it changes here."""
        registry = self._registry
        cid = session.client_id
        claim = self._moved.pop(cid, None)
        if claim is not None:
            if claim.get("h"):
                # The session as it stands, exactly (None: it ended with the connection).
                doc = session.to_json() if registry.sessions.get(cid) is session else None
                self._handover.give(cid, claim["n"], claim["i"], doc)
                self._handed = claim
            # The taker's record is the session's: adopt it now if the tail read it while the
            # connection here was still open (adopt skips connected sessions), else it comes.
            registry.drop_changes(cid)
            writer, value = self._newest(cid)
            if writer is not None:
                self.adopt(cid, value)
            return
        if registry.sessions.get(cid) is not session:
            return  # ended (its deletion is written by the housekeeping pass)

        async def save() -> None:
            try:
                await registry.save(session)
            except StoreError as exc:
                log.warning("session %r: saving at disconnect failed: %s", cid, exc)
            registry.settle(cid)

        task = asyncio.get_running_loop().create_task(save())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def retained_caught_up(self) -> None:
        """Before matching retained messages: %RETAIN% read to the broker's end."""
        try:
            await self._state.catch_up_queue(RETAIN_QUEUE)
        except (OSError, StoreError, RuntimeError) as exc:
            log.warning("retained catch-up failed: %s", exc)

    async def stop(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
