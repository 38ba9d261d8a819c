"""Sessions: the state that outlives a network connection, and their registry.

A Session holds the subscriptions (with read positions), the outbound in-flight window and the
inbound QoS 2 ids awaiting PUBREL. The offline backlog is NOT here: it is the part of each
subscribed light queue past the session's read position, on disk in the store.

`config/sessions.json` (written atomically through store.write_config):

    {"version": 1, "sessions": {"<client id>": {
        "protocol_level": 5, "expiry_interval": 3600, "disconnected_at_ms": null | int,
        "subscriptions": [{"filter": "site/+/t", "queue": "%LMQ%...", "share_group": null | "g",
                           "qos": 1, "no_local": false, "retain_as_published": false,
                           "retain_handling": 0, "subscription_identifier": null | int,
                           "start_offset": 123, "next_offset": 130, "start_phys": 4096}],
        "qos2_inbound": [packet ids],
        "inflight": [{"packet_id": 1, "queue": "..." | null, "offset": 5, "qos": 1, "pubrel": false,
                      "message": {"topic", "payload" (base64), ...}, "retain": true,
                      "sub_ids": [subscription identifiers]}],
        "will": null | {"topic", "payload" (base64), "qos", "retain", "properties"},
        "will_due_ms": null | int}}}

`will` is the will of the live connection (kept so a crash still publishes it after restart)
or, with `will_due_ms`, a delayed will waiting to be published.

An in-flight entry with `"queue": null` has no queue position to read its message back from (a
retained copy sent on subscribe, or a delivery whose subscription was removed): it carries the
`message` itself (absent once PUBREL was sent).

`filter` is the filter as subscribed (with a `$share/g/` prefix for shared subscriptions).
`next_offset` is the read position; everything below it that is not in `inflight` was delivered
and acknowledged, so sessions.json alone is a consistent resume point (store.offsets also gets the
committed offsets, for inspect and analytics).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.records import RecordedPublish
from gateway.will import will_from_json, will_to_json

if TYPE_CHECKING:
    from gateway.client import ClientConnection
    from gateway.protocol import Will
    from gateway.shared import SharedGroup
    from store import MessageStore

log = logging.getLogger("lmqtt.gateway")

SESSIONS_FILE = "sessions.json"
SESSIONS_VERSION = 1
NEVER_EXPIRES = 0xFFFFFFFF
PROGRESS_SAVE_S = 10.0  # see SessionRegistry.mark_progress
SERIALIZE_STEP = 40  # sessions encoded per event-loop step when saving (~30 us each)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(slots=True)
class SubscriptionState:
    """One subscription of a session and its position in its light queue."""

    topic_filter: str  # as subscribed, including a $share/<group>/ prefix
    queue: str
    share_group: str | None
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_identifier: int | None = None
    start_offset: int = 0
    next_offset: int = 0
    start_phys: int = 0  # CommitLog end when subscribed: covers records at or after it
    # queue offset -> packet id, for QoS > 0 messages read from this queue and not yet
    # acknowledged. Offsets are added in increasing order (the queue is read forwards), so the
    # first key is the smallest.
    pending: dict[int, int] = field(default_factory=dict)
    # What this run last gave store.offsets (-1: nothing yet): a commit that would not change
    # it is skipped (not persisted; the store's copy is the truth).
    last_commit: int = field(default=-1, compare=False, repr=False)
    # CommitLog position just past the last message read from the queue (delivered or passed
    # over); None: not known in this run, found from the store when an overlapping
    # subscription needs it (DeliveryLoop._owner_has_read). Not persisted.
    read_phys: int | None = field(default=None, compare=False, repr=False)

    def committed(self) -> int:
        """Highest offset below which everything is acknowledged (O(1): see `pending`)."""
        return next(iter(self.pending)) if self.pending else self.next_offset

    def to_json(self) -> dict[str, Any]:
        return {
            "filter": self.topic_filter,
            "queue": self.queue,
            "share_group": self.share_group,
            "qos": self.qos,
            "no_local": self.no_local,
            "retain_as_published": self.retain_as_published,
            "retain_handling": self.retain_handling,
            "subscription_identifier": self.subscription_identifier,
            "start_offset": self.start_offset,
            "next_offset": self.next_offset,
            "start_phys": self.start_phys,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SubscriptionState:
        start = int(d.get("start_offset", 0))
        return cls(
            topic_filter=str(d["filter"]),
            queue=str(d["queue"]),
            share_group=d.get("share_group"),
            qos=int(d.get("qos", 0)),
            no_local=bool(d.get("no_local", False)),
            retain_as_published=bool(d.get("retain_as_published", False)),
            retain_handling=int(d.get("retain_handling", 0)),
            subscription_identifier=d.get("subscription_identifier"),
            start_offset=start,
            next_offset=int(d.get("next_offset", start)),
            start_phys=int(d.get("start_phys", 0)),
        )


@dataclass(slots=True)
class Inflight:
    """An outbound QoS 1/2 message awaiting PUBACK, PUBREC or PUBCOMP."""

    packet_id: int
    # None: no queue position to read the message back from (a retained copy sent on
    # subscribe, or a delivery whose subscription was removed since): see `message`.
    queue: str | None
    offset: int
    qos: int
    pubrel: bool = False  # QoS 2: PUBREC received, PUBREL sent, awaiting PUBCOMP
    group: SharedGroup | None = None  # set when delivered for a shared subscription
    topic_filter: str | None = None
    # The message as sent, kept when `queue` is None: a reconnect must re-send it with DUP
    # (MQTT-4.4.0-1), also when it was a retained copy or its subscription is gone
    # (MQTT-3.10.4-3: a QoS 1/2 delivery that has started is completed).
    message: RecordedPublish | None = None
    retain: bool = False  # the RETAIN flag `message` was sent with
    sub_ids: list[int] = field(default_factory=list)  # subscription identifiers `message` had

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "packet_id": self.packet_id,
            "queue": self.queue,
            "offset": self.offset,
            "qos": self.qos,
            "pubrel": self.pubrel,
        }
        if self.message is not None and not self.pubrel:
            d["message"] = self.message.to_json()
            d["retain"] = self.retain
            d["sub_ids"] = self.sub_ids
        return d

    @property
    def resumable(self) -> bool:
        """Whether a reconnect can finish this exchange (what sessions.json keeps)."""
        return self.queue is not None or self.pubrel or self.message is not None


class Session:
    """State of one client id, live or offline."""

    __slots__ = (
        "_next_packet_id",
        "by_queue",
        "client_id",
        "connection",
        "disconnected_at_ms",
        "expiry_interval",
        "expiry_timer",
        "inflight",
        "protocol_level",
        "qos2_inbound",
        "subscriptions",
        "will",
        "will_due_ms",
    )

    def __init__(self, client_id: str, protocol_level: int, expiry_interval: int) -> None:
        self.client_id = client_id
        self.protocol_level = protocol_level
        self.expiry_interval = expiry_interval
        self.disconnected_at_ms: int | None = None
        self.subscriptions: dict[str, SubscriptionState] = {}
        self.by_queue: dict[str, SubscriptionState] = {}  # non-shared subscriptions by queue
        self.qos2_inbound: set[int] = set()
        self.inflight: dict[int, Inflight] = {}  # insertion order = send order
        self.connection: ClientConnection | None = None
        self.expiry_timer: asyncio.TimerHandle | None = None
        self.will: Will | None = None  # of the live connection, or pending after it ended
        self.will_due_ms: int | None = None  # set while a delayed will waits
        self._next_packet_id = 1

    @property
    def persistent(self) -> bool:
        return self.expiry_interval > 0

    def add_subscription(self, sub: SubscriptionState) -> None:
        self.subscriptions[sub.topic_filter] = sub
        if sub.share_group is None:
            self.by_queue[sub.queue] = sub

    def remove_subscription(self, topic_filter: str) -> SubscriptionState | None:
        sub = self.subscriptions.pop(topic_filter, None)
        if sub is not None and sub.share_group is None:
            self.by_queue.pop(sub.queue, None)
        return sub

    def allocate_packet_id(self) -> int:
        """Next free outbound packet id (1..65535); caller guarantees the window is not full."""
        pid = self._next_packet_id
        if pid not in self.inflight:  # the common case, without the loop
            self._next_packet_id = pid % 65535 + 1
            return pid
        for _ in range(65535):
            if pid not in self.inflight:
                self._next_packet_id = pid % 65535 + 1
                return pid
            pid = pid % 65535 + 1
        raise RuntimeError("no free packet id")

    def expires_at_ms(self) -> int | None:
        if self.disconnected_at_ms is None or self.expiry_interval >= NEVER_EXPIRES:
            return None
        return self.disconnected_at_ms + self.expiry_interval * 1000

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol_level": self.protocol_level,
            "expiry_interval": self.expiry_interval,
            "disconnected_at_ms": self.disconnected_at_ms,
            "subscriptions": [s.to_json() for s in self.subscriptions.values()],
            "qos2_inbound": sorted(self.qos2_inbound),
            "inflight": [i.to_json() for i in self.inflight.values() if i.resumable],
            "will": will_to_json(self.will) if self.will is not None else None,
            "will_due_ms": self.will_due_ms,
        }

    @classmethod
    def from_json(cls, client_id: str, d: dict[str, Any]) -> Session:
        s = cls(client_id, int(d.get("protocol_level", 4)), int(d.get("expiry_interval", 0)))
        s.disconnected_at_ms = d.get("disconnected_at_ms")
        for sd in d.get("subscriptions", []):
            s.add_subscription(SubscriptionState.from_json(sd))
        s.qos2_inbound = {int(x) for x in d.get("qos2_inbound", [])}
        if d.get("will"):
            s.will = will_from_json(d["will"])
            s.will_due_ms = d.get("will_due_ms")
        for i in d.get("inflight", []):
            inf = Inflight(
                packet_id=int(i["packet_id"]),
                queue=i.get("queue"),
                offset=int(i["offset"]),
                qos=int(i["qos"]),
                pubrel=bool(i.get("pubrel", False)),
            )
            if inf.queue is None:
                if i.get("message"):
                    inf.message = RecordedPublish.from_json(i["message"])
                    inf.retain = bool(i.get("retain", False))
                    inf.sub_ids = [int(x) for x in i.get("sub_ids", [])]
                if inf.resumable:
                    s.inflight[inf.packet_id] = inf
                continue
            sub = s.by_queue.get(inf.queue)
            if sub is None:
                continue  # shared or unsubscribed: nothing to resume it against
            s.inflight[inf.packet_id] = inf
            sub.pending[inf.offset] = inf.packet_id
        for sub in s.subscriptions.values():
            if len(sub.pending) > 1:
                sub.pending = dict(sorted(sub.pending.items()))  # committed() needs the order
        return s


class SessionRegistry:
    """All sessions by client id, their expiry timers and their persistence."""

    def __init__(self, store: MessageStore, on_expire: Callable[[Session], None]) -> None:
        self._store = store
        self._on_expire = on_expire
        self.sessions: dict[str, Session] = {}
        # Wills of clean sessions cut off by a crash: published once at start.
        self.orphan_wills: list[tuple[str, Will]] = []
        self._dirty = False
        self._progress = False
        self._last_save = time.monotonic()
        self._lock = asyncio.Lock()
        self._writing: asyncio.Future[None] | None = None
        self._requested = 0
        self._saved = 0

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, client_id: str) -> Session | None:
        return self.sessions.get(client_id)

    def add(self, session: Session) -> None:
        self.sessions[session.client_id] = session
        self.touch(session)

    def remove(self, client_id: str) -> Session | None:
        s = self.sessions.pop(client_id, None)
        if s is not None:
            self.cancel_expiry(s)
            self.touch(s)
        return s

    def touch(self, session: Session) -> None:
        """`session` changed: persistent ones must reach disk soon; clean sessions are listed
        only for inspect and analytics, so they ride along with the slower progress saves."""
        if session.persistent:
            self._dirty = True
        else:
            self._progress = True

    def mark_dirty(self) -> None:
        """A change that must reach disk soon (sessions, subscriptions, wills, QoS 2 state)."""
        self._dirty = True

    def mark_progress(self) -> None:
        """Read positions and acknowledgements moved. Losing these in a crash only re-sends
        messages (at least once), so they are saved at a slower pace: under steady traffic the
        whole file would otherwise be rewritten every second."""
        self._progress = True

    # -- expiry ------------------------------------------------------------------------------

    def schedule_expiry(self, session: Session) -> None:
        self.cancel_expiry(session)
        at = session.expires_at_ms()
        if at is None:
            return
        delay = max(0.0, (at - now_ms()) / 1000)
        loop = asyncio.get_running_loop()
        session.expiry_timer = loop.call_later(delay, self._expire, session)

    def cancel_expiry(self, session: Session) -> None:
        if session.expiry_timer is not None:
            session.expiry_timer.cancel()
            session.expiry_timer = None

    def _expire(self, session: Session) -> None:
        session.expiry_timer = None
        if self.sessions.get(session.client_id) is session and session.connection is None:
            log.info("session %r expired", session.client_id)
            self._on_expire(session)

    # -- persistence -------------------------------------------------------------------------

    def load(self) -> list[Session]:
        """Read sessions.json; sessions that ended with the previous run are dropped."""
        try:
            raw = self._store.read_config(SESSIONS_FILE)
        except (FileNotFoundError, OSError):
            return []
        if raw is None:
            return []
        try:
            doc = json.loads(raw)
            entries = doc.get("sessions", {})
        except (ValueError, AttributeError):
            log.error("config/%s unreadable; starting without sessions", SESSIONS_FILE)
            return []
        loaded = []
        now = now_ms()
        for cid, d in entries.items():
            try:
                s = Session.from_json(cid, d)
            except (KeyError, TypeError, ValueError) as e:
                log.error("session %r in %s unreadable (%s); dropped", cid, SESSIONS_FILE, e)
                continue
            crashed = s.disconnected_at_ms is None  # connected when the previous run ended
            if crashed:
                s.disconnected_at_ms = now
            if not s.persistent:
                if crashed and s.will is not None:
                    self.orphan_wills.append((cid, s.will))
                continue
            self.sessions[cid] = s
            loaded.append(s)
        self._dirty = True
        return loaded

    def _serialize(self) -> bytes:
        doc = {
            "version": SESSIONS_VERSION,
            # Clean sessions are listed while connected (inspect, analytics), not after.
            "sessions": {
                cid: s.to_json()
                for cid, s in self.sessions.items()
                if s.persistent or s.connection is not None
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    async def _serialize_in_steps(self) -> bytes:
        """`_serialize`, SERIALIZE_STEP sessions per event-loop step (about a millisecond): with
        50,000 connected devices the whole document at once held the loop for hundreds of
        milliseconds. A session changed after its step is dirty again and goes into the next
        save."""
        # Values only: items() would make one young tuple per session, and the collector
        # walks young containers at every collection while the save runs.
        items = list(self.sessions.values())
        sessions = self.sessions
        parts: list[str] = []
        for i in range(0, len(items), SERIALIZE_STEP):
            chunk = {
                s.client_id: s.to_json()
                for s in items[i : i + SERIALIZE_STEP]
                if (s.persistent or s.connection is not None) and sessions.get(s.client_id) is s
            }
            if chunk:
                parts.append(json.dumps(chunk, separators=(",", ":"))[1:-1])
            if i + SERIALIZE_STEP < len(items):
                await asyncio.sleep(0)
        head = json.dumps({"version": SESSIONS_VERSION, "sessions": {}}, separators=(",", ":"))
        return (head[:-2] + ",".join(parts) + "}}").encode()  # head ends with {}}

    def save_now(self) -> None:
        """Synchronous save (shutdown)."""
        self._dirty = False
        self._store.write_config(SESSIONS_FILE, self._serialize())

    async def save(self) -> None:
        """Durable save that coalesces concurrent callers into as few writes as possible.

        Each caller takes a ticket; a write serializes the state after every ticket issued so
        far, so callers whose ticket it covers return without writing again.
        """
        self._requested += 1
        ticket = self._requested
        async with self._lock:
            if self._saved >= ticket:
                return
            covered = self._requested
            self._dirty = False
            self._progress = False
            self._last_save = time.monotonic()
            data = await self._serialize_in_steps()
            loop = asyncio.get_running_loop()
            self._writing = loop.run_in_executor(
                None, self._store.write_config, SESSIONS_FILE, data
            )
            # Shielded: a cancelled caller must not release the lock while the thread writes.
            await asyncio.shield(self._writing)
            self._saved = covered

    async def close(self) -> None:
        """Final synchronous save, after any write still running in the executor."""
        while self._writing is not None and not self._writing.done():
            await asyncio.wait([self._writing])
        self.save_now()

    async def save_if_dirty(self, progress_interval_s: float = PROGRESS_SAVE_S) -> None:
        now = time.monotonic()
        if self._dirty or (self._progress and now - self._last_save >= progress_interval_s):
            await self.save()
