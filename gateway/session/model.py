"""The session model: the state of one client id that outlives a network connection.

A Session holds the subscriptions (with read positions), the outbound in-flight window and the
inbound QoS 2 ids awaiting PUBREL. The offline backlog is NOT here: it is the part of each
subscribed light queue past the session's read position, on disk in the store.

Its JSON (Session.to_json), kept by the registry (gateway/session/registry.py) as a state record::

    "session/<client id>" -> {
        "protocol_level": 5, "expiry_interval": 3600, "disconnected_at_ms": null | int,
        "subscriptions": [{"filter": "site/+/t", "queue": "%LMQ%...", "share_group": null | "g",
                           "qos": 1, "no_local": false, "retain_as_published": false,
                           "retain_handling": 0, "subscription_identifier": null | int,
                           "start_offset": 123, "next_offset": 130, "start_phys": 4096,
                           "replay": absent | {"filter", "since_ms", "start",
                                               "todo": {"<parent>": [next, end]}}}],
        "qos2_inbound": [packet ids],
        "inflight": [{"packet_id": 1, "queue": "..." | null, "offset": 5, "qos": 1, "pubrel": false,
                      "message": {"topic", "payload" (base64), ...}, "retain": true,
                      "sub_ids": [subscription identifiers]}],
        "will": null | {"topic", "payload" (base64), "qos", "retain", "properties"},
        "will_due_ms": null | int,
        "will_conn_ms": absent | int,
        "behind": absent | true,
        "log_pos": absent | int,
        "qos2_since": absent | int}

`will` is the will of the live connection (kept so a crash still publishes it after restart)
or, with `will_due_ms`, a delayed will waiting to be published. `will_conn_ms`: when the
connection that left the will was accepted; with the client id it names the will wherever and
whenever it is published (gateway/messages/will_log.py).

`behind`: the record was the newest of a session whose node crashed while it was connected
(read back at a restart, or rewritten by the cluster's leader, gateway/cluster/node_wills.py): its
positions may lag what the client acknowledged by up to the registry's PROGRESS_SAVE_S, and the
committed offsets (RocketMQ: the broker's, sent every second) are fresher. The session's next
CONNECT takes them where they are higher (SessionLifecycle.skip_acknowledged).

An in-flight entry is on record before its client can see it: a QoS 2 PUBLISH leaves once the
record naming its packet id is saved, its PUBREL once the record with `"pubrel": true` is
(gateway/delivery/loop.py `_hold`, gateway/connection/publish.py `on_pubrecs`), so a restart or
a takeover re-sends the PUBLISH with the same packet id and DUP, or only the PUBREL: never the
message as a new one. QoS 1 entries are saved at the progress pace (a re-send is allowed).

An in-flight entry with `"queue": null` has no queue position to read its message back from (a
retained copy sent on subscribe, or a delivery whose subscription was removed): it carries the
`message` itself (absent once PUBREL was sent).

`log_pos` (embedded store): every QoS 2 message of this client stored in the log below this
position has its id in `qos2_inbound` or was released; a restart reads the ids of those past it
back from the log (gateway/session/qos2.py). On RocketMQ it is the parent queue's position, and
`qos2_since` (absent: none) is at or below each QoS 2 PUBLISH of the client whose outcome its
writer did not know: a resend of one (DUP) is looked for from there (same module).

`filter` is the filter as subscribed (with a `$share/g/` prefix for shared subscriptions).
`next_offset` is the read position; everything below it that is not in `inflight` was delivered
and acknowledged, so the session record alone is a consistent resume point (store.offsets also
gets the committed offsets, for inspect and analytics).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from gateway.messages.message_json import will_from_json, will_to_json
from gateway.messages.records import RecordedPublish
from gateway.protocol import Publish, Will
from gateway.session.replay import Replay

NEVER_EXPIRES = 0xFFFFFFFF  # an expiry interval that never ends (MQTT 5 3.1.2.11.2)
# The QoS 2 ids of a session that has none: shared, since a set is 216 bytes and most sessions
# (a device fleet publishes QoS 0 and 1) never receive a QoS 2 PUBLISH.
NO_IDS: frozenset[int] = frozenset()


class _SharedEmpty(dict[Any, Any]):
    """The one empty `SubscriptionState.pending` (NO_PENDING) and `Session.inflight`
    (NO_INFLIGHT) of all that have none yet: most never get one (QoS 0, not delivered to, a
    device that only publishes), so each holds the shared one instead of an empty dict of
    its own. Written only through a real dict: the delivery loop puts one in before it
    writes (`pending_of` when it reads a subscription's queue, its start for the session's
    in-flight window), a restore before it fills one; a write here raises rather than leak
    into every holder."""

    __slots__ = ()

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a shared empty dict: give its holder a dict of its own")

    __setitem__ = _read_only
    setdefault = _read_only
    update = _read_only
    __ior__ = _read_only  # type: ignore[assignment]


NO_PENDING: dict[int, int] = _SharedEmpty()
NO_INFLIGHT: dict[int, Inflight] = _SharedEmpty()


def _no_pending() -> dict[int, int]:
    return NO_PENDING


def pending_of(sub: SubscriptionState) -> dict[int, int]:
    """`sub.pending`, made its own dict first if it still holds the shared empty one."""
    pending = sub.pending
    if pending is NO_PENDING:
        sub.pending = pending = {}
    return pending


class Connected(Protocol):
    """The live connection of a session (gateway/connection/client.py ClientConnection): what the
    session side needs of it is to end it (a takeover)."""

    def close(
        self, reason: int | None = None, *, abnormal: bool = True, linger: bool = True
    ) -> None: ...


class InflightGroup(Protocol):
    """The shared group (gateway/delivery/shared.py SharedGroup) a shared delivery in flight came
    from."""

    def ack(self, offset: int) -> None: ...

    def give_back(self, offset: int) -> None: ...


def will_publish(will: Will) -> Publish:
    """The PUBLISH a will becomes when it is published (by its node, or a survivor's leader)."""
    return Publish(
        topic=will.topic,
        payload=will.payload,
        qos=will.qos,
        retain=will.retain,
        properties=will.properties,
    )


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
    # NO_PENDING (shared, read-only) until the first one: see pending_of.
    pending: dict[int, int] = field(default_factory=_no_pending)
    # What this run last gave store.offsets (-1: nothing yet): a commit that would not change
    # it is skipped (not persisted; the store's copy is the truth).
    last_commit: int = field(default=-1, compare=False, repr=False)
    # CommitLog position just past the last message read from the queue (delivered or passed
    # over); None: not known in this run, found from the store when an overlapping
    # subscription needs it (gateway/delivery/overlap.py owner_has_read). Not persisted.
    read_phys: int | None = field(default=None, compare=False, repr=False)
    # A replay still running before the light queue is read (gateway/session/replay.py); persisted.
    replay: Replay | None = field(default=None, compare=False)
    # After a replay: the light queue's messages stored at or before this CommitLog position
    # were handed over by the replay and are passed over when read (-1: none). Kept until
    # read, not just applied to what the store holds when the replay ends: on RocketMQ they
    # may not be in the gateway's mirror then (not pulled yet, or dropped from it during a
    # long replay). Persisted, so a session saved in between does not deliver them twice.
    replayed_phys: int = field(default=-1, compare=False)

    def committed(self) -> int:
        """Highest offset below which everything is acknowledged (O(1): see `pending`)."""
        return next(iter(self.pending)) if self.pending else self.next_offset

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
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
        if self.replay is not None:
            d["replay"] = self.replay.to_json()
        if self.replayed_phys >= 0:
            d["replayed_phys"] = self.replayed_phys
        return d

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
            replay=Replay.from_json(d["replay"]) if d.get("replay") else None,
            replayed_phys=int(d.get("replayed_phys", -1)),
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
    group: InflightGroup | None = None  # set when delivered for a shared subscription
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
        """Whether a reconnect can finish this exchange (what the session record keeps)."""
        return self.queue is not None or self.pubrel or self.message is not None


class OneSubscription(Mapping[str, SubscriptionState]):
    """A session's subscriptions while it has one (most devices): the filter and its state,
    without a dict's hash table. Read-only, like NO_SUBSCRIPTIONS (the empty one). Its
    `by_queue` too (keyed by the queue), until a delivery loop starts."""

    __slots__ = ("key", "sub")

    def __init__(self, topic_filter: str, sub: SubscriptionState) -> None:
        self.key = topic_filter  # the one key: the filter (the queue in a `by_queue`), read-only
        self.sub = sub  # the one subscription (read-only)

    def __getitem__(self, key: str) -> SubscriptionState:
        if key == self.key:
            return self.sub
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.sub if key == self.key else default

    def __contains__(self, key: object) -> bool:
        return key == self.key

    def __iter__(self) -> Iterator[str]:
        yield self.key

    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"{{{self.key!r}: {self.sub!r}}}"


NO_SUBSCRIPTIONS: Mapping[str, SubscriptionState] = MappingProxyType({})


class Session:
    """State of one client id, live or offline."""

    __slots__ = (
        "_next_packet_id",
        "behind",
        "by_queue",
        "client_id",
        "connection",
        "disconnected_at_ms",
        "expiry_interval",
        "expiry_timer",
        "inflight",
        "log_pos",
        "persistent",
        "protocol_level",
        "qos2_inbound",
        "qos2_since",
        "subscriptions",
        "will",
        "will_conn_ms",
        "will_due_ms",
    )

    def __init__(self, client_id: str, protocol_level: int, expiry_interval: int) -> None:
        self.client_id = client_id
        self.protocol_level = protocol_level
        self.expiry_interval = expiry_interval
        #: Whether the session outlives its connection (an expiry interval above 0): set with
        #: `expiry_interval`, by set_expiry only (read at every step of a session's life: an
        #: attribute, not a property's call).
        self.persistent = expiry_interval > 0
        self.disconnected_at_ms: int | None = None
        # By filter; read-only here (add_subscription and remove_subscription change it):
        # NO_SUBSCRIPTIONS, a OneSubscription, or a dict from the second one on.
        self.subscriptions: Mapping[str, SubscriptionState] = NO_SUBSCRIPTIONS
        # The non-shared ones by queue; read-only here as `subscriptions` (NO_SUBSCRIPTIONS, a
        # OneSubscription) until a delivery loop makes it a dict of its own (by_queue_of).
        self.by_queue: Mapping[str, SubscriptionState] = NO_SUBSCRIPTIONS
        # Read-only here; add_qos2 and release_qos2 change it (a set from the first id on).
        self.qos2_inbound: Set[int] = NO_IDS
        # Insertion order = send order. NO_INFLIGHT until a delivery loop or a restore gives
        # it a dict of its own (inflight_of).
        self.inflight: dict[int, Inflight] = NO_INFLIGHT
        self.connection: Connected | None = None
        self.expiry_timer: asyncio.TimerHandle | None = None
        self.will: Will | None = None  # of the live connection, or pending after it ended
        self.will_due_ms: int | None = None  # set while a delayed will waits
        self.will_conn_ms: int | None = None  # its connection's start: the will's id
        self.behind = False  # from a crashed node's record (module docstring)
        self.log_pos: int | None = None  # its record's (gateway/session/qos2.py)
        #: At or below each QoS 2 PUBLISH of unknown outcome (gateway/session/qos2.py).
        self.qos2_since: int | None = None
        self._next_packet_id = 1

    def inflight_of(self) -> dict[int, Inflight]:
        """`inflight`, made its own dict first if it still holds the shared empty one."""
        inflight = self.inflight
        if inflight is NO_INFLIGHT:
            self.inflight = inflight = {}
        return inflight

    def by_queue_of(self) -> dict[str, SubscriptionState]:
        """`by_queue`, made a dict first if it is still a read-only one (a delivery loop looks
        its queues up per message: a dict's C lookup, not a Python method)."""
        by_queue = self.by_queue
        if not isinstance(by_queue, dict):
            self.by_queue = by_queue = dict(by_queue)
        return by_queue

    def set_expiry(self, expiry_interval: int) -> None:
        """A new session expiry interval (seconds): `persistent` follows it."""
        self.expiry_interval = expiry_interval
        self.persistent = expiry_interval > 0

    def subscription_list(self) -> tuple[SubscriptionState, ...]:
        """The subscriptions' states, a copy that stays as it is while they change: the
        common shapes (none, one) without a views object (walks over every offline session
        call this per session)."""
        subs = self.subscriptions
        if type(subs) is OneSubscription:
            return (subs.sub,)
        return tuple(subs.values()) if subs else ()

    def add_subscription(self, sub: SubscriptionState) -> None:
        subs = self.subscriptions
        key = sub.topic_filter
        if isinstance(subs, dict):
            subs[key] = sub
        elif not subs or key in subs:
            self.subscriptions = OneSubscription(key, sub)
        else:
            self.subscriptions = {**subs, key: sub}  # subscription order kept
        if sub.share_group is None:
            by_queue = self.by_queue
            if isinstance(by_queue, dict):
                by_queue[sub.queue] = sub
            elif not by_queue or sub.queue in by_queue:
                self.by_queue = OneSubscription(sub.queue, sub)
            else:
                self.by_queue = {**by_queue, sub.queue: sub}

    def add_qos2(self, packet_id: int) -> bool:
        """A QoS 2 PUBLISH with this id was received (stored); False if it was known."""
        ids = self.qos2_inbound
        if packet_id in ids:
            return False
        if isinstance(ids, set):
            ids.add(packet_id)
        else:
            self.qos2_inbound = {packet_id}
        return True

    def release_qos2(self, packet_id: int) -> bool:
        """PUBREL for this id: it leaves; False if it was not known."""
        ids = self.qos2_inbound
        if packet_id not in ids:
            return False
        if len(ids) == 1:
            self.qos2_inbound = NO_IDS
        else:
            assert isinstance(ids, set)
            ids.discard(packet_id)
        return True

    def remove_subscription(self, topic_filter: str) -> SubscriptionState | None:
        subs = self.subscriptions
        sub = subs.get(topic_filter)
        if sub is None:
            return None
        if isinstance(subs, dict):
            del subs[topic_filter]
        else:
            self.subscriptions = NO_SUBSCRIPTIONS
        if sub.share_group is None:
            by_queue = self.by_queue
            if isinstance(by_queue, dict):
                by_queue.pop(sub.queue, None)
            elif sub.queue in by_queue:
                self.by_queue = NO_SUBSCRIPTIONS
        return sub

    @property
    def next_packet_id(self) -> int:
        """The id allocate_packet_id() tries first (a batch allocating outside it, in
        gateway/delivery/loop.py, reads and writes it back)."""
        return self._next_packet_id

    @next_packet_id.setter
    def next_packet_id(self, pid: int) -> None:
        self._next_packet_id = pid

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

    def skip_acknowledged(self, sub: SubscriptionState, committed: int) -> int:
        """`committed` is a committed offset of `sub`'s queue fresher than this session's
        record (everything below it was acknowledged): move the position up to it and drop
        the in-flight entries below it. Returns how many offsets were skipped."""
        if committed <= sub.committed():
            return 0
        skipped = committed - sub.committed()
        for off in [o for o in sub.pending if o < committed]:
            self.inflight.pop(sub.pending.pop(off), None)
        sub.next_offset = max(sub.next_offset, committed)
        return skipped

    def to_json(self) -> dict[str, Any]:
        # Encoded at every change of the session: the common shapes (one subscription, none
        # in flight, no QoS 2 ids) without a views object, a comprehension or a sort each.
        subs = self.subscriptions
        inflight = self.inflight
        d: dict[str, Any] = {
            "protocol_level": self.protocol_level,
            "expiry_interval": self.expiry_interval,
            "disconnected_at_ms": self.disconnected_at_ms,
            "subscriptions": (
                [subs.sub.to_json()]
                if type(subs) is OneSubscription
                else [s.to_json() for s in subs.values()]
            ),
            "qos2_inbound": sorted(self.qos2_inbound) if self.qos2_inbound else [],
            "inflight": (
                [i.to_json() for i in inflight.values() if i.resumable] if inflight else []
            ),
            "will": will_to_json(self.will) if self.will is not None else None,
            "will_due_ms": self.will_due_ms,
        }
        if self.will is not None and self.will_conn_ms is not None:
            d["will_conn_ms"] = self.will_conn_ms
        if self.behind:
            d["behind"] = True
        if self.qos2_since is not None:
            d["qos2_since"] = self.qos2_since
        return d

    @classmethod
    def from_json(cls, client_id: str, d: dict[str, Any]) -> Session:
        s = cls(client_id, int(d.get("protocol_level", 4)), int(d.get("expiry_interval", 0)))
        s.disconnected_at_ms = d.get("disconnected_at_ms")
        s.behind = bool(d.get("behind", False))
        s.log_pos = d.get("log_pos")
        s.qos2_since = d.get("qos2_since")
        for sd in d.get("subscriptions", []):
            s.add_subscription(SubscriptionState.from_json(sd))
        for x in d.get("qos2_inbound", []):
            s.add_qos2(int(x))
        if d.get("will"):
            s.will = will_from_json(d["will"])
            s.will_due_ms = d.get("will_due_ms")
            s.will_conn_ms = d.get("will_conn_ms")
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
                    s.inflight_of()[inf.packet_id] = inf
                continue
            sub = s.by_queue.get(inf.queue)
            if sub is None:
                continue  # shared or unsubscribed: nothing to resume it against
            s.inflight_of()[inf.packet_id] = inf
            pending_of(sub)[inf.offset] = inf.packet_id
        for sub in s.subscriptions.values():
            if len(sub.pending) > 1:
                sub.pending = dict(sorted(sub.pending.items()))  # committed() needs the order
        return s
