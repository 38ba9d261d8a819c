"""The will lifecycle: a will message is published when a connection ends without a normal
DISCONNECT.

    CONNECT with a will   -> stored with the session (`store`: its record keeps it, so a crash
                             still publishes it after the restart)
    connection lost       -> published now, or delayed (`connection_lost`)
    the session resumes   -> a delayed will is cancelled (`cancel`)
    the session ends      -> a delayed will is published now (`session_ended`)
    restart               -> delayed wills keep their due time; those of connections the
                             previous run lost in a crash start their delay now (`restore`);
                             one due before the restart may have been published by the
                             previous run, its record not yet rewritten: published only if
                             the wills log lacks its id (gateway/messages/will_log.py)

Timing (MQTT 5 3.1.3.2.2): the will waits `will_delay_interval` seconds, or until the session
ends, whichever is first; a new connection to the same session before then cancels it.
With no delay (and always for MQTT 3.1.1) it is published at once. The will's JSON form in
the session record is gateway/messages/message_json.py's (will_to_json).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.clock import now_ms
from gateway.messages.will_log import WillsReader, published_wills, will_id
from gateway.protocol import Publish, Will
from gateway.session.model import Session, will_publish
from gateway.session.registry import SessionRegistry

log = logging.getLogger("lmqtt.gateway")

WillPublisher = Callable[[str, Will], Awaitable[None]]


class WillScheduler:
    """Pending (delayed) wills by client id."""

    def __init__(self, publish: WillPublisher) -> None:
        self._publish = publish
        self._pending: dict[str, tuple[Will, asyncio.TimerHandle]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._pending)

    def schedule(self, client_id: str, will: Will, delay_s: float) -> None:
        """Publish `will` after `delay_s` (0 = now) unless cancelled first."""
        self.cancel(client_id)
        if delay_s <= 0:
            self._fire(client_id, will)
            return
        loop = asyncio.get_running_loop()
        handle = loop.call_later(delay_s, self._due, client_id)
        self._pending[client_id] = (will, handle)

    def cancel(self, client_id: str) -> bool:
        """The session resumed: drop the pending will. True if there was one."""
        entry = self._pending.pop(client_id, None)
        if entry is None:
            return False
        entry[1].cancel()
        return True

    def fire_now(self, client_id: str) -> None:
        """The session ended before the delay passed: publish at once."""
        entry = self._pending.pop(client_id, None)
        if entry is not None:
            entry[1].cancel()
            self._fire(client_id, entry[0])

    def _due(self, client_id: str) -> None:
        entry = self._pending.pop(client_id, None)
        if entry is not None:
            self._fire(client_id, entry[0])

    def _fire(self, client_id: str, will: Will) -> None:
        task = asyncio.get_running_loop().create_task(self._run(client_id, will))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, client_id: str, will: Will) -> None:
        try:
            await self._publish(client_id, will)
        except Exception:
            log.exception("publishing the will of %r failed", client_id)

    async def drain(self) -> None:
        """Wait for wills being published right now (shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def cancel_all(self) -> None:
        for _, handle in self._pending.values():
            handle.cancel()
        self._pending.clear()


# Stores one PUBLISH for a client id, a will with its id (gateway/messages/will_log.py):
# gateway/messages/publishing.py PublishPath.store_publish.
StorePublish = Callable[[Publish, str, str | None], Awaitable[None]]


class Wills:
    """Every will, from CONNECT to its publication (see the module docstring)."""

    def __init__(
        self, sessions: SessionRegistry, store_publish: StorePublish, wills_log: WillsReader
    ) -> None:
        self._sessions = sessions
        self._store_publish = store_publish
        self._wills_log = wills_log
        self._scheduler = WillScheduler(self._publish)
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids: dict[str, str] = {}  # wills of ended sessions being published: their ids

    def __len__(self) -> int:
        """Wills waiting for their delay."""
        return len(self._scheduler)

    def store(self, session: Session, will: Will | None) -> None:
        """A connection of `session` came with `will` (None: none): kept in the session's
        record while it lives, published if it ends abnormally."""
        session.will = will
        session.will_due_ms = None
        if will is not None:
            session.will_conn_ms = now_ms()  # the will's id (gateway/messages/will_log.py)

    def cancel(self, client_id: str) -> None:
        """The session resumed: a delayed will of its previous connection is not published."""
        self._scheduler.cancel(client_id)

    def connection_lost(self, session: Session, will: Will, *, session_ended: bool) -> None:
        """The connection ended abnormally: publish its will now when the session ended with
        it, else after the will delay (bounded by the session's expiry)."""
        cid = session.client_id
        if session_ended:
            if session.will_conn_ms is not None:  # the session is gone when it is published
                self._ids[cid] = will_id(cid, session.will_conn_ms, None)
            self._scheduler.schedule(cid, will, 0)
            return
        delay = 0
        if session.protocol_level == 5 and will.properties is not None:
            delay = will.properties.will_delay_interval or 0
        delay = min(delay, session.expiry_interval)
        session.will = will
        session.will_due_ms = now_ms() + delay * 1000
        self._scheduler.schedule(cid, will, delay)

    def session_ended(self, client_id: str) -> None:
        """The session is over before the will delay passed: publish it now."""
        self._scheduler.fire_now(client_id)

    def restore(self) -> None:
        """At start: wills survive restarts. Delayed ones keep their due time; those of
        connections the previous run lost without a DISCONNECT (a crash) start their delay
        now."""
        sessions = self._sessions
        now = now_ms()
        for cid, orphan in sessions.orphan_wills:
            self._scheduler.schedule(cid, orphan, 0)
        sessions.orphan_wills.clear()
        # Wills the previous run may have published already: due while it was still up, or
        # of a connection its record still shows alive (the run published the will when the
        # connection dropped and died before the record said so). Their ids are looked up in
        # the wills log, back to the earliest due time or connection start, before any of
        # them is scheduled.
        unsure: list[Session] = []
        since = now
        for session in sessions.sessions.values():
            will = session.will
            if will is None:
                continue
            if session.will_due_ms is None:
                delay = (will.properties.will_delay_interval or 0) if will.properties else 0
                session.will_due_ms = now + delay * 1000
                if session.will_conn_ms is not None:
                    unsure.append(session)
                    since = min(since, session.will_conn_ms)
                    continue
            elif session.will_due_ms <= now:
                unsure.append(session)
                since = min(since, session.will_due_ms)
                continue
            self._schedule(session, now)
        if unsure:
            task = asyncio.get_running_loop().create_task(self._restore_unsure(unsure, since))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _schedule(self, session: Session, now: int) -> None:
        will, due = session.will, session.will_due_ms
        assert will is not None and due is not None
        expires = session.expires_at_ms()
        if expires is not None:
            due = min(due, expires)
        self._scheduler.schedule(session.client_id, will, max(0, due - now) / 1000)

    async def _restore_unsure(self, sessions: list[Session], since: int) -> None:
        """Wills the previous run may have published (stored at `since` or later): those the
        wills log has are only cleared from their sessions; the others are scheduled (those
        due already are published now). An unreadable log means publishing (at least once,
        never lost)."""
        try:
            published = await published_wills(self._wills_log, since)
        except Exception as exc:  # whatever failed, the wills go out (never lost)
            log.warning("the wills log could not be read (%s): wills may be published twice", exc)
            published = set()
        if self._stopping:
            return  # the sessions keep their wills for the next run
        now = now_ms()
        for session in sessions:
            if session.will is None or session.will_due_ms is None or session.connection:
                continue  # its client came back meanwhile
            wid = will_id(session.client_id, session.will_conn_ms, session.will_due_ms)
            if wid in published:
                log.info("the will of %r was published before the restart", session.client_id)
                session.will = None
                session.will_due_ms = None
                self._sessions.mark_dirty(session)
            else:
                self._schedule(session, now)

    async def _publish(self, client_id: str, will: Will) -> None:
        wid = self._ids.pop(client_id, None)  # a will in a record has an id
        if self._stopping:
            return
        session = self._sessions.get(client_id)
        if session is not None and session.will is will:
            if session.will_conn_ms is not None or session.will_due_ms is not None:
                wid = will_id(client_id, session.will_conn_ms, session.will_due_ms)
            session.will = None
            session.will_due_ms = None
            self._sessions.mark_dirty(session)
        log.info("publishing the will of %r to %r", client_id, will.topic)
        pub = will_publish(will)
        await self._store_publish(pub, client_id, wid)

    def stop_publishing(self) -> None:
        """Graceful stop begins: no will is published from now on (the sessions resume after
        the restart, their wills with them)."""
        self._stopping = True

    async def stop(self) -> None:
        """Graceful stop ends: wills being published right now finish, delayed ones wait for
        the next run."""
        self._stopping = True
        await self._scheduler.drain()
        self._scheduler.cancel_all()
