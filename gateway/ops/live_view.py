"""The live view of this node's clients, for the admin API and `lmqtt top`.

    GET    /api/clients?sort=KEY&limit=N    one row per connected client (ClientRow), sorted
    GET    /api/clients/{id}                one client's row, with its subscriptions
    DELETE /api/clients/{id}                kick: closed now (MQTT 5: DISCONNECT 0x98 first)
    GET    /api/slow-subscriptions?limit=N  the subscriptions furthest behind, two ways

On a cluster each node answers for the clients connected to it; `lmqtt top` merges nodes.

What it costs. A connection counts PUBLISH packets and bytes in and out as plain integers
(gateway/connection/transport.py: per read and per write; the delivery loop's `sent`: per
delivery run), always. Rates are made only while someone reads: the first request starts a
1 s sampler (a task looking at STEP connections per event-loop step) that keeps, per
connection, a ring of the snapshots of those four counters where they changed (`_record`), and
it stops (dropping the rings) IDLE_S after the last request. A rate is the difference between
now and the counters at the start of the last WINDOW_S; before the sampler has a snapshot of a
client a second old (the first request, a client that just connected) it is the average since
the client connected.

Backlog, lag and acknowledgement age are read from the sessions when asked, nothing is kept:

    backlog           messages of its (non-shared) subscriptions' queues past its read position
    backlog_s         age of the oldest of them: how far behind delivery is (delivery lag)
    inflight          messages sent at QoS 1/2 and not acknowledged yet
    oldest_unacked_s  time since the oldest of them was stored (store to acknowledgement, so
                      far: EMQX's slow-subscription measure of a message not yet acknowledged)

A subscription is slow when either age passes slow_subscription_threshold; the metrics count
them (lmqtt_slow_subscriptions).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from gateway.ops.admin_api import ApiError, ApiRequest, ApiResponse, Route
from gateway.protocol import Connection, ReasonCode
from gateway.session.model import Session, SubscriptionState
from gateway.session.registry import SessionRegistry
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage

__all__ = ["ClientRow", "LiveClient", "LiveView", "SlowSubscription"]

WINDOW_S = 10.0  # rates are over the last WINDOW_S
TICK_S = 1.0  # the sampler's period
IDLE_S = 30.0  # the sampler stops this long after the last request
STEP = 200  # sessions looked at per event-loop step (a census yields in between)
DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000

PROTOCOLS = {3: "3.1", 4: "3.1.1", 5: "5.0"}


class LiveClient(Protocol):
    """A connection as the live view reads it (gateway/connection/client.py ClientConnection)."""

    client_id: str
    username: str | None
    closed: bool
    conn: Connection
    msgs_in: int
    bytes_in: int
    bytes_out: int

    @property
    def peer(self) -> str: ...

    @property
    def session(self) -> Session | None: ...

    @property
    def messages_sent(self) -> int:
        """PUBLISH packets sent to it on this connection."""
        ...

    @property
    def opened(self) -> float:
        """Event-loop time the connection was accepted."""
        ...

    def close(
        self, reason: int | None = None, *, abnormal: bool = True, linger: bool = True
    ) -> None: ...


# A connection's counters at one moment: (loop time, msgs in, bytes in, msgs out, bytes out).
Sample = tuple[float, int, int, int, int]


def _sample(client: LiveClient, now: float) -> Sample:
    return (now, client.msgs_in, client.bytes_in, client.messages_sent, client.bytes_out)


def _record(rings: dict[LiveClient, list[Sample]], client: LiveClient, now: float) -> None:
    """Add `client`'s counters to its ring when they changed since its last sample.

    A ring holds the counters where they changed, so between two samples they stood at the
    first one's values, and its first sample is the value at the window's start: samples are
    dropped from the front while the next one is also at or before it (an idle client keeps
    one sample, a busy one at most WINDOW_S / TICK_S + 1). A client first seen within WINDOW_S
    of its connect starts from that (its counters were zero then); otherwise from now."""
    sample = _sample(client, now)
    ring = rings.get(client)
    if ring is None:
        first = (client.opened, 0, 0, 0, 0) if now - client.opened <= WINDOW_S else sample
        rings[client] = [first] if first is sample else [first, sample]
        return
    if ring[-1][1:] != sample[1:]:
        ring.append(sample)
    start = now - WINDOW_S
    while len(ring) > 1 and ring[1][0] <= start:
        del ring[0]


@dataclass(slots=True)
class ClientRow:
    client_id: str
    username: str | None
    address: str
    protocol: str
    connected_at_ms: int
    connected_s: float
    msgs_in_rate: float  # PUBLISH packets per second from the client, over the last WINDOW_S
    bytes_in_rate: float
    msgs_out_rate: float
    bytes_out_rate: float
    msgs_in: int  # totals since it connected
    bytes_in: int
    msgs_out: int
    bytes_out: int
    subscriptions: int
    inflight: int
    backlog: int
    backlog_s: float
    oldest_unacked_s: float


#: The keys /api/clients may sort by (client_id and address ascending, the rest descending).
SORT_KEYS = tuple(ClientRow.__dataclass_fields__)
_ASCENDING = frozenset({"client_id", "username", "address", "protocol", "connected_at_ms"})


@dataclass(slots=True)
class SlowSubscription:
    client_id: str
    topic_filter: str
    backlog: int
    delivery_lag_s: float  # age of the oldest message not sent yet
    ack_lag_s: float  # age of the oldest message sent and not acknowledged yet


class LiveView:
    """The admin API's client routes (see the module docstring)."""

    def __init__(
        self,
        connections: Callable[[], Iterable[LiveClient]],
        sessions: SessionRegistry,
        store: Storage,
        cursor: QueueCursor,
        slow_threshold_s: float,
    ) -> None:
        self._connections = connections
        self._sessions = sessions
        self._store = store
        self._cursor = cursor
        self.slow_threshold_s = slow_threshold_s
        self._loop = asyncio.get_running_loop()
        self._rings: dict[LiveClient, list[Sample]] = {}
        self._sampler: asyncio.Task[None] | None = None
        self._last_read = 0.0
        # A store numbering a queue's messages otherwise (RocketMQ spread: merged offsets)
        # says how many messages lie below an offset.
        self._count: Callable[[str, int], int] | None = getattr(store, "account_offset", None)

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/api/clients", self._list),
            Route("GET", "/api/clients/{id}", self._one),
            Route("DELETE", "/api/clients/{id}", self._kick),
            Route("GET", "/api/slow-subscriptions", self._slow),
        ]

    def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None
        self._rings.clear()

    # -- the sampler ---------------------------------------------------------------------------

    def _touch(self) -> None:
        """A request came: keep the sampler running (start it if it is not)."""
        self._last_read = self._loop.time()
        if self._sampler is None:
            self._sampler = self._loop.create_task(self._sample_while_read())

    async def _sample_while_read(self) -> None:
        """Every TICK_S until IDLE_S after the last request: a sample of each connection whose
        counters changed since its last, STEP connections per event-loop step."""
        loop = self._loop
        rings = self._rings
        try:
            while loop.time() - self._last_read <= IDLE_S:
                started = loop.time()
                seen = set()
                for i, client in enumerate(self._connected(), 1):
                    seen.add(client)
                    _record(rings, client, loop.time())
                    if i % STEP == 0:
                        await asyncio.sleep(0)
                for gone in [c for c in rings if c not in seen]:
                    del rings[gone]
                await asyncio.sleep(max(0.0, TICK_S - (loop.time() - started)))
        finally:
            rings.clear()
            self._sampler = None

    def _connected(self) -> Iterator[LiveClient]:
        for client in list(self._connections()):
            if not client.closed and client.session is not None:
                yield client

    def _rates(self, client: LiveClient, now: float) -> tuple[float, float, float, float]:
        """Per second over the last WINDOW_S (see `_record`), or since the sampler first saw
        the client if that is later; the average since it connected when there is no sample
        a second old yet."""
        current = _sample(client, now)
        ring = self._rings.get(client)
        if ring and now - ring[0][0] >= TICK_S:
            base = ring[0]
            start = max(base[0], now - WINDOW_S)
        else:
            base = (client.opened, 0, 0, 0, 0)
            start = client.opened
        dt = max(now - start, 1e-3)
        return (
            (current[1] - base[1]) / dt,
            (current[2] - base[2]) / dt,
            (current[3] - base[3]) / dt,
            (current[4] - base[4]) / dt,
        )

    # -- reading sessions -------------------------------------------------------------------

    def _age_s(self, queue: str, offset: int, now_ms: int) -> float:
        """Seconds since the message at `offset` of `queue` was stored (0: not there)."""
        msg = self._cursor.one(queue, offset)
        return max(0.0, (now_ms - msg.store_timestamp) / 1000) if msg is not None else 0.0

    def _behind(self, sub: SubscriptionState) -> int:
        end = self._store.max_offset(sub.queue)
        count = self._count
        if count is None:
            return max(0, end - sub.next_offset)
        return max(0, count(sub.queue, end) - count(sub.queue, sub.next_offset))

    def _oldest_unacked_s(self, session: Session, now_ms: int) -> float:
        """Age of the oldest message in flight (the first sent: the dict keeps send order)."""
        for inf in session.inflight.values():
            if inf.queue is not None:
                return self._age_s(inf.queue, inf.offset, now_ms)
            if inf.message is not None and inf.message.stored_at_ms:
                return max(0.0, (now_ms - inf.message.stored_at_ms) / 1000)
            return 0.0
        return 0.0

    def row(self, client: LiveClient, now: float, now_ms: int) -> ClientRow:
        session = client.session
        assert session is not None
        backlog = 0
        lag = 0.0
        for sub in session.by_queue.values():
            behind = self._behind(sub)
            if behind:
                backlog += behind
                lag = max(lag, self._age_s(sub.queue, sub.next_offset, now_ms))
        r_in, b_in, r_out, b_out = self._rates(client, now)
        age = now - client.opened
        return ClientRow(
            client_id=client.client_id,
            username=client.username,
            address=client.peer,
            protocol=PROTOCOLS.get(client.conn.protocol_level or 0, "?"),
            connected_at_ms=int(now_ms - age * 1000),
            connected_s=round(age, 3),
            msgs_in_rate=round(r_in, 2),
            bytes_in_rate=round(b_in, 1),
            msgs_out_rate=round(r_out, 2),
            bytes_out_rate=round(b_out, 1),
            msgs_in=client.msgs_in,
            bytes_in=client.bytes_in,
            msgs_out=client.messages_sent,
            bytes_out=client.bytes_out,
            subscriptions=len(session.subscriptions),
            inflight=len(session.inflight),
            backlog=backlog,
            backlog_s=round(lag, 3),
            oldest_unacked_s=round(self._oldest_unacked_s(session, now_ms), 3),
        )

    async def rows(self) -> list[ClientRow]:
        """Every connected client's row; yields to the event loop every STEP clients."""
        rows = []
        for i, client in enumerate(self._connected(), 1):
            if client.closed or client.session is None:
                continue
            rows.append(self.row(client, self._loop.time(), _now_ms()))
            if i % STEP == 0:
                await asyncio.sleep(0)
        return rows

    async def slow_subscriptions(self) -> list[SlowSubscription]:
        """Every subscription of a connected client that is behind or awaits an
        acknowledgement; yields to the event loop every STEP clients."""
        out = []
        for i, client in enumerate(self._connected(), 1):
            session = client.session
            if client.closed or session is None:
                continue
            now_ms = _now_ms()
            for sub in list(session.by_queue.values()):
                backlog = self._behind(sub)
                lag = self._age_s(sub.queue, sub.next_offset, now_ms) if backlog else 0.0
                ack = 0.0
                if sub.pending:
                    ack = self._age_s(sub.queue, next(iter(sub.pending)), now_ms)
                if lag or ack:
                    slow = SlowSubscription(
                        session.client_id, sub.topic_filter, backlog, round(lag, 3), round(ack, 3)
                    )
                    out.append(slow)
            if i % STEP == 0:
                await asyncio.sleep(0)
        return out

    async def count_slow(self) -> int:
        """Subscriptions past the threshold either way (the metrics' gauge)."""
        t = self.slow_threshold_s
        return sum(
            1 for s in await self.slow_subscriptions() if s.delivery_lag_s > t or s.ack_lag_s > t
        )

    # -- the routes --------------------------------------------------------------------------

    async def _list(self, request: ApiRequest) -> ApiResponse:
        self._touch()
        key = request.query.get("sort", "msgs_in_rate")
        if key not in SORT_KEYS:
            raise ApiError(400, f"cannot sort by {key!r}: one of {', '.join(SORT_KEYS)}")
        limit = _limit(request)
        rows = await self.rows()
        rows.sort(key=lambda r: _sort_value(getattr(r, key)), reverse=key not in _ASCENDING)
        return ApiResponse(
            200,
            {
                "clients": [asdict(r) for r in rows[:limit]],
                "total": len(rows),
                "sort": key,
                "window_s": WINDOW_S,
            },
        )

    def _find(self, request: ApiRequest) -> LiveClient:
        client_id = request.params["id"]
        for client in self._connected():
            if client.client_id == client_id:
                return client
        raise ApiError(404, f"no client {client_id!r} is connected to this node")

    async def _one(self, request: ApiRequest) -> ApiResponse:
        self._touch()
        client = self._find(request)
        session = client.session
        assert session is not None
        body: dict[str, Any] = asdict(self.row(client, self._loop.time(), _now_ms()))
        body["subscriptions_detail"] = [
            {
                "filter": sub.topic_filter,
                "qos": sub.qos,
                "next_offset": sub.next_offset,
                "backlog": self._behind(sub) if sub.share_group is None else None,
            }
            for sub in session.subscriptions.values()
        ]
        return ApiResponse(200, body)

    async def _kick(self, request: ApiRequest) -> ApiResponse:
        client = self._find(request)
        client.close(ReasonCode.ADMINISTRATIVE_ACTION)
        return ApiResponse(200, {"kicked": client.client_id, "address": client.peer})

    async def _slow(self, request: ApiRequest) -> ApiResponse:
        self._touch()
        limit = _limit(request)
        subs = await self.slow_subscriptions()
        t = self.slow_threshold_s
        by_delivery = sorted(
            (s for s in subs if s.delivery_lag_s), key=lambda s: s.delivery_lag_s, reverse=True
        )
        by_ack = sorted((s for s in subs if s.ack_lag_s), key=lambda s: s.ack_lag_s, reverse=True)
        return ApiResponse(
            200,
            {
                "threshold_s": t,
                "over_threshold": sum(1 for s in subs if s.delivery_lag_s > t or s.ack_lag_s > t),
                "by_delivery_lag": [asdict(s) for s in by_delivery[:limit]],
                "by_ack_lag": [asdict(s) for s in by_ack[:limit]],
            },
        )


def _limit(request: ApiRequest) -> int:
    text = request.query.get("limit", str(DEFAULT_LIMIT))
    try:
        limit = int(text)
    except ValueError:
        raise ApiError(400, f"limit must be a whole number, not {text!r}") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit must be between 1 and {MAX_LIMIT}")
    return limit


def _sort_value(value: object) -> Any:
    return "" if value is None else value


def _now_ms() -> int:
    return int(time.time() * 1000)
