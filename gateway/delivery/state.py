"""What a delivery loop is made of: the connection it writes to (Subscriber), the collaborators
every loop shares (DeliveryContext), and the per-session state its parts share (LoopState).

The parts of a DeliveryLoop (gateway/delivery/loop.py) are classes of their own modules, each
over this one state: pacing.py (when a pass runs), send.py (the send paths), acks.py
(acknowledgements, re-sends and offset commits), replay.py (history before the light queue).
They are composed as bases of DeliveryLoop rather than as objects it holds, so that a call
from one part to another on the per-message path stays a plain method call on one object:
one chain, each part extending the one before (LoopState <- Pacing <- Sender <-
Acknowledgements <- Replaying <- DeliveryLoop), because mypyc compiles single inheritance
(multiple inheritance only through traits) and the loop is in the compiled group
(accelerators/compiled.py). A part calls the later ones through what LoopState declares.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from gateway.access.acl import ClientAccess
from gateway.delivery.account import DeliveryAccount
from gateway.delivery.arrivals import ArrivalHub
from gateway.delivery.backlog import BacklogWatch
from gateway.delivery.load import LoopLoad
from gateway.delivery.shared import SharedGroup
from gateway.messages.recent import PreparedCache, RecentMessages
from gateway.messages.retained import RetainedMessage
from gateway.protocol import Connection, Publish
from gateway.session.model import Session, SubscriptionState
from gateway.session.registry import SessionRegistry
from gateway.session.replay import ReplayPacer
from gateway.stats import GatewayStats
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage, StoredMessage


class Subscriber(Protocol):
    """The connection a delivery loop writes to (gateway/connection/client.py ClientConnection)."""

    conn: Connection
    acl: ClientAccess | None
    writable: bool
    closed: bool

    def write(self, data: bytes) -> None: ...

    def abort(self, reason: int) -> None: ...


class UnstoredInput(Protocol):
    """The publishes this turn of the event loop read and has not stored yet
    (gateway/connection/ingest.py IngestBatch, stored at the end of the turn)."""

    pubs: list[Publish]

    def flush(self) -> None:
        """Store them now (and acknowledge them)."""


@dataclass(slots=True)
class DeliveryContext:
    """What every delivery loop uses, built once by the composition root (gateway/app.py) and
    shared by all of them (the shape of uvicorn's ServerState): one attribute hop to each
    collaborator, and only these."""

    store: Storage  # max_offset, log_max_offset, committed offsets
    cursor: QueueCursor  # every queue read (gateway/storage/cursor.py)
    arrivals: ArrivalHub  # long polling
    recent: RecentMessages  # decoded records of fan-outs
    prepared: PreparedCache  # encoded packets of fan-outs
    stats: GatewayStats
    sessions: SessionRegistry  # progress to persist
    account: DeliveryAccount
    replay_pacer: ReplayPacer
    # told when a pass leaves something unsent (gateway/connection/overload.py)
    overload: BacklogWatch
    max_inflight: int  # settings.max_inflight
    outbound_topic_aliases: bool  # settings.outbound_topic_aliases
    # whether the event loop is under load: busy subscribers' passes are batched then (pacing.py)
    load: LoopLoad = field(default_factory=LoopLoad)
    # stored before a pass, so that what this turn read goes with it (loop.py _step); None in
    # sync flush mode
    ingest: UnstoredInput | None = None


# A ready queue's end when no arrival notice told it (the pass asks the store).
UNKNOWN_END = -1
# The topic aliases of every loop without any (alias_max 0): shared, never written.
NO_ALIASES: dict[str, int] = {}


class LoopState:
    """The state of one session's delivery loop, shared by its parts (set by DeliveryLoop)."""

    __slots__ = (
        "_arrived_at",
        "_batch",
        "_behind",
        "_busy",
        "_full",
        "_gap",
        "_gap_before",
        "_held",
        "_last_write",
        "_live",
        "_loop",
        "_pass_timer",
        "_plain",
        "_ready",
        "_replay_timer",
        "_scheduled",
        "_stopped",
        "_uncommitted",
        "_waiting",
        "_watched",
        "alias_max",
        "aliases",
        "client",
        "ctx",
        "groups",
        "level",
        "max_packet",
        "retained_backlog",
        "sent",
        "session",
        "window",
    )

    ctx: DeliveryContext
    session: Session
    client: Subscriber
    level: int  # the client's protocol level
    window: int  # packets at QoS > 0 in flight at most
    max_packet: int | None  # the client's Maximum Packet Size
    alias_max: int  # outbound topic aliases (0: none)
    aliases: dict[str, int]  # NO_ALIASES (shared, never written) while alias_max is 0
    # Neither topic aliases nor a packet size limit: the plain send path may send.
    _plain: bool
    retained_backlog: deque[tuple[RetainedMessage, SubscriptionState]] | None
    # Shared groups joined, and (below) queues watched: tuples, replaced when they change
    # (rarely), so a loop with none holds the one empty tuple rather than a list of its own.
    groups: tuple[SharedGroup, ...]
    sent: int  # PUBLISH packets sent on this connection (the live view reads it)
    _loop: asyncio.AbstractEventLoop
    # Pacing (pacing.py): a pass is scheduled; the loop stopped; loop time of the last pass
    # that wrote; whether that write came within BUSY_WINDOW of the one before (sustained
    # load: passes are paced only then); a paced pass's timer.
    _scheduled: bool
    _stopped: bool
    _last_write: float
    _busy: bool
    _pass_timer: asyncio.TimerHandle | None
    # A busy subscriber's pass waiting for the next arrival's company (pacing.py), the time of
    # the last arrival that asked for a pass, and the last two gaps between such arrivals.
    _waiting: bool
    _arrived_at: float
    _gap: float
    _gap_before: float
    # Next pass: every queue (_full) or only those the store reported (_ready: queue -> where
    # the notice said it ends, or UNKNOWN_END; ordered; None when there are none: an idle
    # loop holds no dict, and a pass that takes them leaves None rather than a new one).
    _full: bool
    _ready: dict[str, int] | None
    # A pass stopped at a full window or transport: the next acknowledgement looks at all.
    _behind: bool
    _live: bool  # caught up once since it started (see DeliveryLoop._step)
    _watched: tuple[str, ...]  # queues watched with the ArrivalHub (a session has few)
    # Packets of the pass being made, written with one transport.write() at its end.
    _batch: list[bytes] | None
    # Passes' packets waiting for the session record to be saved (a QoS 2 delivery; loop.py
    # _hold), or None.
    _held: list[bytes] | None
    # Subscriptions whose acknowledged position moved since it was last committed (acks.py);
    # None when there are none (as _ready).
    _uncommitted: dict[str, SubscriptionState] | None
    # Set while a replay waits for its share of the loop (replay.py).
    _replay_timer: asyncio.TimerHandle | None

    # What a part calls on a later one of the chain (see the module docstring): defined there.

    def _step(self) -> None:  # pacing.py -> loop.py
        raise NotImplementedError

    def capacity(self) -> int:  # replay.py -> loop.py
        raise NotImplementedError

    def can_send(self) -> bool:  # replay.py -> loop.py
        raise NotImplementedError

    def _pass_replayed(  # send.py -> replay.py
        self, sub: SubscriptionState, messages: list[StoredMessage]
    ) -> list[StoredMessage]:
        raise NotImplementedError
