"""The session lifecycle: create, resume, take over, end and expire sessions.

    CONNECT, no session       -> created (`connect`)
    CONNECT, session exists   -> its live connection (if any) is taken over (DISCONNECT 0x8E),
                                 then with Clean Start it ends and a new one is created, else
                                 it resumes: its delayed will and its expiry are cancelled
    connection ends           -> a clean session ends (its will, if any, is published now); a
                                 persistent one starts its expiry timer and its will delay
                                 (`connection_ended`)
    expiry / Clean Start      -> ended (`end`): subscriptions removed, a delayed will
                                 published now, the record deleted
    restart                   -> every saved session is rebuilt from the state log (`restore`)
    CONNECT of a session from a crashed node's record -> the committed offsets where they are
                                 fresher than its positions (`skip_acknowledged`)

The session's state and its persistence are gateway/session/model.py's and registry.py's (Session,
SessionRegistry); its subscriptions' lifecycle is gateway/lifecycle/subscriptions.py's and its
will's gateway/session/wills.py's: this module decides *when* each of them happens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from gateway.clock import now_ms
from gateway.lifecycle.subscriptions import SubscriptionLifecycle
from gateway.protocol import ReasonCode, Will
from gateway.session.model import Connected, Session
from gateway.session.registry import SessionRegistry
from gateway.session.wills import Wills
from gateway.storage.port import Storage, StorageUnavailable, StoreError

log = logging.getLogger("lmqtt.gateway")


class Connecting(Connected, Protocol):
    """A connection whose CONNECT was accepted (gateway/connection/client.py ClientConnection)."""

    @property
    def peer(self) -> str:
        """The client's address, for a takeover's log line (asked only then)."""
        ...


class SessionLifecycle:
    """Decides when sessions begin and end (see the module docstring)."""

    def __init__(
        self,
        registry: SessionRegistry,
        subscriptions: SubscriptionLifecycle,
        wills: Wills,
        store: Storage,
    ) -> None:
        self.registry = registry
        self._subscriptions = subscriptions
        self._wills = wills
        self._store = store
        self._stopping = False
        registry.on_expire = self.end

    def restore(self, foreign: Callable[[str], bool] | None = None) -> None:
        """At start: rebuild the sessions from the state log, register their subscriptions,
        arm their expiry. `foreign(client id)`: True for a session another live node serves
        (cluster mode, gateway/cluster/node.py): left to it."""
        registry = self.registry
        # A clean stop saved no position past a queue end; after a crash the log may end
        # before positions the session records saved.
        clamp = self._store.tail_may_be_lost
        restore = self._subscriptions.restore
        for session, subs in registry.load(materialize_all=clamp, skip=foreign):
            if session is not None and clamp:
                self._clamp_to_store(session)
            for sub in subs:
                restore(sub)
            if (
                session is not None
            ):  # None: dormant (gateway/session/registry.py), expiry kept there
                registry.schedule_expiry(session)
        # QoS 2 publishes stored after their session's last record: their ids, from the log.
        recovered = registry.qos2.recover(registry.sessions)
        if recovered:
            log.warning(
                "restart: %d inbound QoS 2 packet id(s) read back from the log (stored after "
                "their session's last save): their resends are acknowledged, not stored again",
                recovered,
            )

    def _clamp_to_store(self, session: Session) -> None:
        """After an async-flush crash the log may end before positions the session record saved:
        read again from the queue's real end, or new messages would land below the cursor."""
        for sub in session.subscriptions.values():
            end = self._store.max_offset(sub.queue)
            if sub.next_offset > end:
                log.warning(
                    "session %r: %s position %d is past the queue end %d (lost tail); resuming"
                    " at %d",
                    session.client_id,
                    sub.queue,
                    sub.next_offset,
                    end,
                    end,
                )
                sub.next_offset = end
                sub.start_offset = min(sub.start_offset, end)
            for off in [o for o in sub.pending if o >= end]:
                session.inflight.pop(sub.pending.pop(off), None)

    def connect(
        self,
        client_id: str,
        level: int,
        expiry: int,
        clean_start: bool,
        connection: Connecting,
        will: Will | None,
    ) -> tuple[Session, bool]:
        """A CONNECT was accepted: the session it continues or starts, and whether one was
        present (CONNACK's Session Present)."""
        registry = self.registry
        session = registry.get(client_id)
        if session is not None and session.connection is not None:
            log.info(
                "%r: session taken over by a new connection from %s", client_id, connection.peer
            )
            session.connection.close(ReasonCode.SESSION_TAKEN_OVER)
            session = registry.get(client_id)  # the old connection may have ended it
        present = False
        if session is not None and clean_start:
            self.end(session)
            session = None
        if session is None:
            session = Session(client_id, level, expiry)
            registry.add(session)
        else:
            present = True
            self._wills.cancel(client_id)
            registry.cancel_expiry(session)
            session.protocol_level = level
            session.set_expiry(expiry)
        session.disconnected_at_ms = None
        session.connection = connection
        self._wills.store(session, will)  # persisted: a crash must not lose it
        return session, present

    def resume_waits(self, client_id: str, clean_start: bool) -> bool:
        """Whether a CONNECT of `client_id` would resume a session that needs a wait before
        its CONNACK: a crashed node's record to reconcile (`skip_acknowledged`), or messages
        in flight to read (`read_inflight`). Changes nothing."""
        if clean_start:
            return False
        session = self.registry.get(client_id)
        return session is not None and (session.behind or bool(session.inflight))

    async def read_inflight(self, session: Session) -> None:
        """Read the messages `session` has in flight before its CONNACK, where the store's
        synchronous reads would not find them yet (RocketMQ: a restarted gateway's mirrors
        are empty; `prefetch` pulls them), so they are re-sent with DUP rather than dropped.
        Cluster mode does this when the node claims the session (gateway/cluster/sessions.py)."""
        prefetch = getattr(self._store, "prefetch", None)
        if prefetch is None:
            return
        by_queue: dict[str, list[int]] = {}
        for inf in session.inflight.values():
            if inf.queue is not None and not inf.pubrel:
                by_queue.setdefault(inf.queue, []).append(inf.offset)
        for queue, offsets in by_queue.items():
            try:
                await prefetch(queue, offsets)
            except (StoreError, OSError, TimeoutError) as exc:
                # Forgotten like a message deleted by retention: the session still resumes.
                log.warning("session %r: in-flight messages not read: %s", session.client_id, exc)

    async def skip_acknowledged(self, session: Session) -> None:
        """`session` comes from the record of a node that crashed while it was connected
        (`Session.behind`): its positions may lag what its client acknowledged since (a
        connected session's record is rewritten every PROGRESS_SAVE_S while they move). The
        committed offsets are fresher (RocketMQ: the broker's consumer offsets, sent every
        second, read back here): where one is higher, what lies below it was acknowledged and
        is not sent again. An offset this process committed itself is its own (not read
        back): it is older than the crash's, or the session was here since. Called before
        CONNACK."""
        session.behind = False
        subs = [
            sub
            for sub in session.subscriptions.values()
            if sub.share_group is None and sub.replay is None
        ]
        if not subs:
            return
        store = self._store
        cid = session.client_id
        try:
            await store.load_offsets([(cid, sub.queue) for sub in subs])
        except (StoreError, StorageUnavailable, OSError, TimeoutError) as exc:
            log.warning("session %r: committed offsets not read (%s): resuming from its record",
                        cid, exc)  # fmt: skip
            return
        skipped = 0
        for sub in subs:
            committed = store.offsets.get(cid, sub.queue)
            if committed is not None:
                if store.tail_may_be_lost:  # never past the end of a log that lost its tail
                    committed = min(committed, store.max_offset(sub.queue))
                skipped += session.skip_acknowledged(sub, committed)
        if skipped:
            log.info(
                "session %r: %d message(s) acknowledged after its last record not sent again",
                cid, skipped,
            )  # fmt: skip
            self.registry.mark_dirty(session)

    def end(self, session: Session) -> None:
        """The session is over (clean start, expiry, clean disconnect): drop its state."""
        self._subscriptions.end(session)
        if self.registry.get(session.client_id) is session:
            self.registry.remove(session.client_id)
        self._wills.session_ended(session.client_id)

    def connection_ended(self, session: Session, will: Will | None) -> None:
        """A connection of `session` closed; `will` is set when it closed abnormally."""
        self._wills.store(session, None)
        if self._stopping:
            # Closed by our own graceful shutdown: no will; the session resumes after restart
            # (its record, with the time it went offline, is written by the final save).
            session.disconnected_at_ms = now_ms()
            self.registry.touch(session)
            return
        if not session.persistent:
            self.end(session)
            if will is not None:
                self._wills.connection_lost(session, will, session_ended=True)
        else:
            session.disconnected_at_ms = now_ms()
            self.registry.schedule_expiry(session)
            if will is not None:
                self._wills.connection_lost(session, will, session_ended=False)
        self.registry.touch(session)

    def stop(self) -> None:
        """Graceful stop: connections closed from now on leave their sessions to resume after
        the restart (no will, no end)."""
        self._stopping = True
