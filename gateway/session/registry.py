"""The session registry: every session by client id, their expiry and their persistence.

Persistence: one state record per session in the store's state log (gateway/storage/port.py,
store/statelog.py), key "session/<client id>", value the session as UTF-8 JSON (its layout:
gateway/session/model.py); a DELETE record ends the session. A `config/sessions.json` file
({"version": 1, "sessions": {"<client id>": <the same JSON>}}) is imported once at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic_core import from_json, to_json

from gateway.clock import now_ms
from gateway.session.expiry import ExpiryTicks
from gateway.session.model import NEVER_EXPIRES, Session, SubscriptionState
from gateway.session.qos2 import LOG_POS_FIELD, InboundQos2

if TYPE_CHECKING:
    from gateway.protocol import Will
    from gateway.storage.port import StateRecord, Storage

log = logging.getLogger("lmqtt.gateway")

# State record key of a session (gateway/storage/port.py: StateRecord); the value is the session's
# JSON (Session.to_json), a DELETE record ends it.
SESSION_KEY_PREFIX = "session/"
SESSIONS_FILE = "sessions.json"  # sessions as a file (before the state log), imported once
META_KEY_PREFIX = "meta/"
# Present: SESSIONS_FILE was imported (or absent).
IMPORTED_KEY = META_KEY_PREFIX + "sessions.json-imported"
#: The floor of the QoS 2 ids a restart reads back from the log (gateway/session/qos2.py),
#: appended at each progress pass: the decimal log position.
QOS2_FLOOR_KEY = META_KEY_PREFIX + "qos2-floor"
PROGRESS_SAVE_S = 10.0  # see SessionRegistry.mark_progress
RECORDS_PER_STEP = 200  # session records encoded per event-loop step by save_all
# Housekeeping's saves (save_if_dirty: every PROGRESS_SAVE_S the records of every session whose
# progress moved, a whole fleet's at once) go in smaller steps, each followed by a pause
# PACED_PAUSE_RATIO times as long as the step took: the save takes at most 1 / (1 + ratio) of
# the event loop, so a loaded gateway's deliveries keep the time they need meanwhile (steps
# back to back would hold the loop nearly whole until the save is done: a latency spike).
PACED_RECORDS_PER_STEP = 50
PACED_PAUSE_RATIO = 9.0
_ID_BITS = 31  # dormant expiry: (due second << _ID_BITS | index); seconds fit 33 bits
_ID_MASK = (1 << _ID_BITS) - 1


class SessionRegistry:
    """All sessions by client id, their expiry timers and their persistence.

    Each session is one state record (key `SESSION_KEY_PREFIX + client id`, see the module
    docstring), appended when it changes: a change costs one small append, whatever the
    number of sessions. Changes that must survive a crash before they are acknowledged
    (`save()`: SUBACK, PUBREC) are appended at once and awaited durable (group commit);
    the others are appended by the next housekeeping pass.
    """

    def __init__(self, store: Storage) -> None:
        self._store = store
        # Ends an expired session: set by the session lifecycle (gateway/lifecycle/sessions.py)
        # that owns this registry.
        self.on_expire: Callable[[Session], None] = _never
        self.sessions: dict[str, Session] = {}
        # Wills of clean sessions cut off by a crash: published once at start.
        self.orphan_wills: list[tuple[str, Will]] = []
        self._dirty: set[str] = set()  # client ids whose record must be appended soon
        # ... at the slower progress pace: the sessions whose progress moved (mark_progress)
        # since their last record, and clean ones changed while connected. Idle sessions are
        # in neither set, so a pass costs what changed, whatever the number connected.
        self._progress: set[str] = set()
        self._last_save = time.monotonic()
        # The state log's other records, read by load() (IMPORTED_KEY; the retained index's).
        self._meta: dict[str, bytes] = {}
        # Dormant sessions (see load): client id -> its record; their expiry deadlines.
        self._dormant: dict[str, bytes] = {}
        # Their expiry, static once loaded: a sorted array of (due second << _ID_BITS | index
        # into _dormant_ids), walked by one timer: 16 bytes per session instead of ~115 for
        # a heap of (deadline, id) tuples.
        self._dormant_ids: list[str] = []
        self._dormant_due = array("Q")
        self._dormant_next = 0
        self._dormant_timer: asyncio.TimerHandle | None = None
        # The expiry of the other offline sessions (schedule_expiry).
        self._expiry: ExpiryTicks[Session] = ExpiryTicks(self._expire)
        # Each record's `log_pos`, and the QoS 2 ids a restart finds past it (session/qos2.py).
        self.qos2 = InboundQos2(store)

    def __len__(self) -> int:
        return len(self.sessions) + len(self._dormant)

    def get(self, client_id: str) -> Session | None:
        s = self.sessions.get(client_id)
        if s is None and self._dormant:
            s = self._wake(client_id)
        return s

    def add(self, session: Session) -> None:
        self.sessions[session.client_id] = session
        self.touch(session)

    def remove(self, client_id: str) -> Session | None:
        self.get(client_id)  # a dormant one is built, to be ended like any other
        s = self.sessions.pop(client_id, None)
        if s is not None:
            self.cancel_expiry(s)
            self.touch(s)
        return s

    def touch(self, session: Session) -> None:
        """`session` changed: persistent ones must reach disk soon; clean sessions are listed
        only for inspect and analytics, so they ride along with the slower progress saves."""
        cid = session.client_id
        if session.persistent or session.will is not None:
            # A clean session's will must outlive a crash too (it is published after one).
            self._dirty.add(cid)
        else:
            self._progress.add(cid)

    def mark_dirty(self, session: Session) -> None:
        """A change that must reach disk soon (sessions, subscriptions, wills, QoS 2 state)."""
        self._dirty.add(session.client_id)

    def mark_progress(self, session: Session) -> None:
        """`session`'s read positions, in-flight window or acknowledgements moved (its
        delivery loop calls this once per pass that sent or passed over messages, and once
        per batch of acknowledgements, not per message). Losing these in a crash only
        re-sends messages (at least once), so they are saved at a slower pace: the next
        progress pass writes the session's record as it stands then."""
        self._progress.add(session.client_id)

    # -- expiry ------------------------------------------------------------------------------

    def schedule_expiry(self, session: Session) -> None:
        """`session` went offline (or its expiry changed): it ends when its expiry is due
        (gateway/session/expiry.py: one loop timer for every session)."""
        at = session.expires_at_ms()
        if at is None:
            self._expiry.discard(session.client_id)
        else:
            self._expiry.add(session.client_id, session, at)

    def cancel_expiry(self, session: Session) -> None:
        self._expiry.discard(session.client_id)

    def _expire(self, session: Session) -> None:
        if self.sessions.get(session.client_id) is session and session.connection is None:
            log.info("session %r expired", session.client_id)
            self.on_expire(session)

    # -- persistence -------------------------------------------------------------------------

    def load(
        self, *, materialize_all: bool = False, skip: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[Session | None, Sequence[SubscriptionEntry | SubscriptionState]]]:
        """Rebuild the sessions from the state log (a config/sessions.json is imported
        once); sessions that ended with the previous run are dropped.

        Yields (session, its subscriptions) for every restored session, to register the
        subscriptions. An offline session that needs nothing from us until its client comes
        back (no will; its expiry is kept in one sorted array) stays *dormant*: its record is
        kept as bytes, the session is None here, and get() builds it when asked. A fleet of offline
        devices then costs its records, not its objects. `materialize_all`: build them all
        (the caller must check every position against the store). `skip`: client ids whose
        sessions are not this process's (another live cluster node serves them).
        """
        raw = read_session_records(self._store.state_records(), self._meta)
        floor = self._meta.pop(QOS2_FLOOR_KEY, None)
        if floor is not None:
            self.qos2.floor = int(floor)
        imported = False
        if IMPORTED_KEY not in self._meta:
            old = self._import_sessions_json()
            imported = old is not None
            raw.update(old or {})
        now = now_ms()
        loads = from_json
        # The records read become the dormant table itself: the ones that are not dormant are
        # taken out of it (a second table would double the memory a large fleet takes).
        dormant = self._dormant = raw
        ids = self._dormant_ids
        due = array("Q")
        for cid in list(raw):
            if skip is not None and skip(cid):
                del dormant[cid]
                continue
            value = raw[cid]
            try:
                d = loads(value)
                crashed = d.get("disconnected_at_ms") is None  # connected when the run ended
                if not (materialize_all or crashed or imported or d.get("will")) and int(
                    d.get("expiry_interval", 0)
                ):
                    subs = [_entry(sd) for sd in d.get("subscriptions", [])]
                    if int(d["expiry_interval"]) < NEVER_EXPIRES:
                        at = int(d["disconnected_at_ms"]) + int(d["expiry_interval"]) * 1000
                        due.append(-(-at // 1000) << _ID_BITS | len(ids))
                        ids.append(cid)
                    yield None, subs
                    continue
                del dormant[cid]
                s = Session.from_json(cid, d)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                log.error("session %r in the state log unreadable (%s); dropped", cid, e)
                dormant.pop(cid, None)
                self._dirty.add(cid)
                continue
            if crashed:
                s.disconnected_at_ms = now
                s.behind = True
                self._dirty.add(cid)
            if not s.persistent:
                if crashed and s.will is not None:
                    self.orphan_wills.append((cid, s.will))
                self._dirty.add(cid)  # its record goes
                continue
            self.sessions[cid] = s
            if crashed and LOG_POS_FIELD in d:
                self.qos2.saved[cid] = int(d[LOG_POS_FIELD])
            yield s, list(s.subscriptions.values())
        self._dormant_due = array("Q", sorted(due))
        del due
        self._arm_dormant_expiry()
        if imported:
            # Written at once, marked done: the old file is never read again.
            self._dirty.update(self.sessions)
            self._store.append_state([*self._records(self._dirty), (IMPORTED_KEY, b"1")])
            self._dirty.clear()

    def other_records(self) -> dict[str, bytes]:
        """The state records load() read that are not sessions' (newest per key); taken once:
        the other owners of state (the retained index) start from them."""
        out, self._meta = self._meta, {}
        return out

    # -- sessions kept by other gateway nodes (gateway/cluster/sessions.py) -------------------

    def entries(self, client_id: str) -> list[SubscriptionEntry | SubscriptionState]:
        """The subscriptions this registry holds for `client_id` (dormant or not)."""
        s = self.sessions.get(client_id)
        if s is not None:
            return list(s.subscriptions.values())
        value = self._dormant.get(client_id)
        if value is None:
            return []
        return [_entry(sd) for sd in from_json(value).get("subscriptions", [])]

    def adopt(self, client_id: str, value: bytes | None) -> Session | None:
        """Another node wrote `client_id`'s record (None: ended it): replace our copy with it,
        without writing anything (the record is the other node's), and forget the changes of
        ours still due (they are older). A session disconnected there expires here on time
        unless a newer record comes first; one connected there has no expiry here. A clean
        session disconnected there is over (its record's deletion follows). Returns the
        session now held, or None."""
        old = self.sessions.pop(client_id, None)
        if old is not None:
            self.cancel_expiry(old)
        self._dormant.pop(client_id, None)
        self.settle(client_id)
        self._dirty.discard(client_id)
        if value is None:
            return None
        s = Session.from_json(client_id, from_json(value))
        if not s.persistent and s.disconnected_at_ms is not None:
            return None
        self.sessions[client_id] = s
        self.schedule_expiry(s)  # none while connected there (no disconnected_at_ms)
        return s

    def drop_changes(self, client_id: str) -> None:
        """Write nothing more of `client_id`: another node took the session over, and its
        record is the session's (gateway/cluster/sessions.py)."""
        self.settle(client_id)
        self._dirty.discard(client_id)

    def settle(self, client_id: str) -> None:
        """`client_id`'s record was just written and is not ours to rewrite at the next
        progress pass (it disconnected: another node may resume it at any moment)."""
        self._progress.discard(client_id)

    def client_ids(self) -> list[str]:
        """Every session's client id, dormant ones included."""
        return [*self.sessions, *self._dormant]

    def positions(self) -> Iterator[tuple[str, int]]:
        """(queue, read position) of every subscription, dormant sessions' included (metrics)."""
        # Copies: the metrics census yields to the event loop between steps.
        for session in list(self.sessions.values()):
            for sub in session.subscription_list():
                yield sub.queue, sub.next_offset
        for value in list(self._dormant.values()):
            for sd in from_json(value).get("subscriptions", []):
                yield str(sd["queue"]), int(sd.get("next_offset", sd.get("start_offset", 0)))

    def _wake(self, client_id: str) -> Session | None:
        """Build a dormant session (it becomes an ordinary one)."""
        value = self._dormant.pop(client_id, None)
        if value is None:
            return None
        s = Session.from_json(client_id, from_json(value))
        self.sessions[client_id] = s
        # Its own timer from now on (a connecting client cancels it; its entry in the dormant
        # expiry array is skipped when due).
        self.schedule_expiry(s)
        return s

    def _arm_dormant_expiry(self) -> None:
        if self._dormant_timer is not None:
            self._dormant_timer.cancel()
            self._dormant_timer = None
        if self._dormant_next < len(self._dormant_due):
            due_s = self._dormant_due[self._dormant_next] >> _ID_BITS
            delay = max(0.0, due_s - now_ms() / 1000)
            loop = asyncio.get_running_loop()
            self._dormant_timer = loop.call_later(delay, self._expire_dormant)

    def _expire_dormant(self) -> None:
        """Expire the dormant sessions that are due (one timer for all of them)."""
        self._dormant_timer = None
        now = now_ms()
        due, ids = self._dormant_due, self._dormant_ids
        while self._dormant_next < len(due) and (due[self._dormant_next] >> _ID_BITS) * 1000 <= now:
            cid = ids[due[self._dormant_next] & _ID_MASK]
            self._dormant_next += 1
            session = self._wake(cid)  # None: woken since (it has its own timer now)
            if session is not None:
                log.info("session %r expired", cid)
                self.on_expire(session)
        self._arm_dormant_expiry()

    def _import_sessions_json(self) -> dict[str, bytes] | None:
        """The sessions of config/sessions.json; None: there is no such file."""
        try:
            doc = self._store.read_config(SESSIONS_FILE)
        except OSError:
            return None
        if doc is None:
            return None
        try:
            entries = json.loads(doc).get("sessions", {})
            out = {str(cid): json.dumps(d).encode() for cid, d in entries.items()}
        except (ValueError, AttributeError):
            log.error("config/%s unreadable; not imported", SESSIONS_FILE)
            return {}
        log.info("importing %d session(s) from config/%s", len(out), SESSIONS_FILE)
        return out

    def _records(self, cids: set[str]) -> list[StateRecord]:
        out: list[StateRecord] = []
        dumps = to_json  # compact JSON by pydantic's core: faster than the json module
        end = self.qos2.end()
        fields = self.qos2.record_fields
        dormant = self._dormant
        sessions = self.sessions
        for cid in cids:
            if cid in dormant:
                continue  # unchanged since its record was read
            s = sessions.get(cid)
            # Clean sessions are listed while connected (inspect, analytics), not after.
            if s is not None and (s.persistent or s.connection is not None):
                d = s.to_json()
                if end is not None:
                    fields(s, end, d)
                out.append((SESSION_KEY_PREFIX + cid, dumps(d)))
            else:
                out.append((SESSION_KEY_PREFIX + cid, None))
        return out

    def _take(self, progress: bool) -> set[str]:
        """The client ids whose records are due: the changed ones, and with `progress` the
        slower kind too (the sessions whose progress moved since their last record)."""
        cids = self._dirty
        self._dirty = set()
        if progress:
            cids |= self._progress
            self._progress = set()
            self._last_save = time.monotonic()
        return cids

    def _write(self, progress: bool) -> int:
        """Append the due records at once; returns the state log position to wait for (0:
        nothing written)."""
        cids = self._take(progress)
        return self._store.append_state(self._records(cids)) if cids else 0

    async def _write_in_steps(self, progress: bool, paced: bool = False) -> int:
        """`_write`, RECORDS_PER_STEP records per event-loop step: when a large fleet's
        progress all moved, encoding its records at once would hold the event loop for too
        long. `paced`: PACED_RECORDS_PER_STEP records per step, then a pause (see
        PACED_PAUSE_RATIO). A session changed after its step is due again later; the ids not
        written when the save is cancelled are due again (the final save writes them)."""
        ids = list(self._take(progress))
        position = 0
        floor = self.qos2.floor_now() if progress else None
        if floor is not None and floor != self.qos2.floor:
            # Every id that joined a qos2_inbound before now was saved already (qos2.py).
            position = self._store.append_state([(QOS2_FLOOR_KEY, str(floor).encode())])
            self.qos2.floor = floor
        step = PACED_RECORDS_PER_STEP if paced else RECORDS_PER_STEP
        pause = 0.0
        for i in range(0, len(ids), step):
            if i:
                try:
                    await asyncio.sleep(pause)
                except BaseException:
                    self._dirty.update(ids[i:])
                    raise
            started = time.perf_counter()
            position = self._store.append_state(self._records(set(ids[i : i + step])))
            if paced:
                pause = (time.perf_counter() - started) * PACED_PAUSE_RATIO
        return position

    async def save(self, session: Session) -> None:
        """`session` changed in a way a client was (or is about to be) told of: append its
        record, with the other pending changes, and wait until it is durable (group commit:
        callers waiting at the same time share one fsync)."""
        self._dirty.add(session.client_id)
        position = self._write(progress=False)
        if position:
            await self._store.wait_state_durable(position)

    def save_written(self, session: Session) -> asyncio.Future[None] | None:
        """`save` without a coroutine: the append, and what to wait for before telling the
        client (None: nothing, the async flush mode; else the future of the store's
        `state_durable`)."""
        self._dirty.add(session.client_id)
        position = self._write(progress=False)
        return self._store.state_durable(position) if position else None

    async def save_all(self) -> None:
        """Append every pending change, the slower kind included (in steps), and wait until
        it is durable."""
        position = await self._write_in_steps(progress=True)
        if position:
            await self._store.wait_state_durable(position)

    def save_now(self) -> None:
        """Append every pending change (shutdown: the store's close fsyncs it)."""
        self._write(progress=True)

    async def close(self) -> None:
        """Final save of every session that changed since its record was last written (a
        graceful stop has touched every session it disconnected)."""
        if self._dormant_timer is not None:
            self._dormant_timer.cancel()
            self._dormant_timer = None
        self._expiry.close()
        self.save_now()

    async def save_if_dirty(self, progress_interval_s: float = PROGRESS_SAVE_S) -> None:
        """Housekeeping: append pending changes; compact the state log when due."""
        progress = time.monotonic() - self._last_save >= progress_interval_s
        await self._write_in_steps(progress, paced=True)
        await self._store.compact_state()


def _never(session: Session) -> None:
    raise RuntimeError("SessionRegistry.on_expire is not set")


class SubscriptionEntry(NamedTuple):
    """What registering a dormant session's subscription needs (SubscriptionState has the
    same attributes)."""

    topic_filter: str
    share_group: str | None
    queue: str


def _entry(d: dict[str, Any]) -> SubscriptionEntry:
    group = d.get("share_group")
    return SubscriptionEntry(str(d["filter"]), None if group is None else str(group), d["queue"])


def read_session_records(
    records: Iterable[StateRecord], meta: dict[str, bytes] | None = None
) -> dict[str, bytes]:
    """Client id -> the newest session record (JSON bytes) of a stream of state records;
    `meta` gets every other record (newest per key), for the other owners of state."""
    out: dict[str, bytes] = {}
    n = len(SESSION_KEY_PREFIX)
    for key, value in records:
        if not key.startswith(SESSION_KEY_PREFIX):
            if meta is not None:
                if value is None:
                    meta.pop(key, None)
                else:
                    meta[key] = value
            continue
        if value is None:
            out.pop(key[n:], None)
        else:
            out[key[n:]] = value
    return out
