"""`lmqtt inspect`: what is in a data directory, without a running server.

Read-only by construction: the store is opened with ``read_only=True`` (no lock, no abort
marker, no recovery writes), config files are only read, and the retained index is rebuilt in
memory without writing its snapshot. It is safe to run next to a live gateway; the numbers are
then a moment's picture.

What it reports:

    queues         every store queue: kind (parent / light / retained), MQTT filter of light
                   queues, min and max offset (max = next offset to be written), messages held
    sessions       the state log's session records: protocol level, expiry, connected or since when
    subscriptions  per session: filter, queue, QoS, committed offset (store.offsets, group =
                   client id or "$share/<group>") and backlog = max offset - max(committed, min)
    offsets        every committed consumer offset, including groups without a session
    retained       number of live retained messages
    delayed        the pending delayed messages ($delayed/{seconds}/{topic}) of the store's
                   timer queue: due time, topic, publisher, QoS, size; earliest due first
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from gateway.storage.port import Storage, StoredMessage

__all__ = [
    "InspectError",
    "StoreReport",
    "inspect_data_dir",
    "inspect_rocketmq",
    "render_json",
    "render_text",
]

SESSIONS_FILE = "sessions.json"  # written by versions before the state log
_Row = TypeVar("_Row")


class InspectError(Exception):
    """The directory cannot be inspected; str() says why, for the operator."""


@dataclass(slots=True)
class QueueInfo:
    name: str
    kind: str  # "parent", "light", "retained", "wills" (gateway/messages/will_log.py)
    filter: str | None
    min_offset: int
    max_offset: int

    @property
    def messages(self) -> int:
        return max(0, self.max_offset - self.min_offset)


@dataclass(slots=True)
class SubscriptionInfo:
    client_id: str
    filter: str
    queue: str
    qos: int
    share_group: str | None
    group: str  # the consumer-offset group
    start_offset: int | None
    committed: int | None
    max_offset: int
    backlog: int


@dataclass(slots=True)
class SessionInfo:
    client_id: str
    protocol_level: int | None
    expiry_interval: int | None
    disconnected_at_ms: int | None
    subscriptions: int
    inflight: int
    qos2_inbound: int


@dataclass(slots=True)
class DelayedInfo:
    due_ms: int
    topic: str
    client_id: str
    qos: int
    bytes: int


@dataclass(slots=True)
class StoreReport:
    data_dir: str
    queues: list[QueueInfo] = field(default_factory=list)
    sessions: list[SessionInfo] = field(default_factory=list)
    subscriptions: list[SubscriptionInfo] = field(default_factory=list)
    offsets: list[dict[str, Any]] = field(default_factory=list)
    retained_count: int = 0
    delayed: list[DelayedInfo] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for q, qd in zip(self.queues, doc["queues"], strict=True):
            qd["messages"] = q.messages
        return doc


def _queue_kind(name: str) -> str:
    from gateway.messages.retained import RetainedIndex
    from gateway.messages.will_log import WILLS_QUEUE
    from topicmap import LMQ_PREFIX

    if name == RetainedIndex.QUEUE:
        return "retained"
    if name == WILLS_QUEUE:
        return "wills"
    if name.startswith(LMQ_PREFIX):
        return "light"
    return "parent"


def _check_data_dir(data_dir: Path) -> None:
    if not data_dir.exists():
        raise InspectError(f"{data_dir}: no such directory")
    if not data_dir.is_dir():
        raise InspectError(f"{data_dir}: not a directory")
    if not (data_dir / "commitlog").is_dir():
        raise InspectError(
            f"{data_dir}: not an lmqtt data directory (no commitlog/ inside);"
            " pass the --data-dir the gateway was started with"
        )


def _read_sessions(store: Storage, config_dir: Path, warnings: list[str]) -> dict[str, Any]:
    """Client id -> session JSON, from the state log (through the gateway's own reader), or
    from the config/sessions.json of a data directory an older version wrote."""
    from gateway.session.registry import read_session_records
    from gateway.storage.port import StoreError

    meta: dict[str, bytes] = {}
    try:
        raw = read_session_records(store.state_records(), meta)
    except StoreError as exc:
        warnings.append(f"state log unreadable ({exc}); sessions not shown")
        return {}
    if raw or meta:
        sessions: dict[str, Any] = {}
        for cid, value in raw.items():
            try:
                sessions[cid] = json.loads(value)
            except ValueError as exc:
                warnings.append(f"session {cid!r}: unreadable record ({exc})")
        return sessions
    path = config_dir / SESSIONS_FILE
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.append(f"{path}: unreadable ({exc}); sessions not shown")
        return {}
    old = doc.get("sessions") if isinstance(doc, dict) else None
    if not isinstance(old, dict):
        warnings.append(f"{path}: no 'sessions' object; sessions not shown")
        return {}
    return old


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def inspect_data_dir(data_dir: Path) -> StoreReport:
    """Open the store read-only and collect a StoreReport. Raises InspectError."""
    data_dir = Path(data_dir)
    _check_data_dir(data_dir)

    from gateway.messages.retained import RetainedIndex
    from gateway.storage.embedded import open_read_only
    from gateway.storage.port import StoreError
    from topicmap import TopicError, filter_of

    try:
        store = open_read_only(data_dir)
    except StoreError as exc:
        raise InspectError(f"{data_dir}: cannot open the store read-only: {exc}") from None
    report = StoreReport(data_dir=str(data_dir))
    try:
        sessions = _read_sessions(store, data_dir / "config", report.warnings)
        # Filters known from sessions resolve hash-based queue names filter_of cannot decode.
        known_filters: dict[str, str] = {}
        for sess in sessions.values():
            for sub in (sess or {}).get("subscriptions") or []:
                if isinstance(sub, dict) and "queue" in sub and "filter" in sub:
                    text = str(sub["filter"])
                    if text.startswith("$share/") and text.count("/") >= 2:
                        text = text.split("/", 2)[2]  # the queue belongs to the plain filter
                    known_filters[str(sub["queue"])] = text

        maxima: dict[str, int] = {}
        minima: dict[str, int] = {}
        for name in sorted(store.queues()):
            kind = _queue_kind(name)
            flt: str | None = None
            if kind == "light":
                flt = known_filters.get(name)
                if flt is None:
                    try:
                        flt = filter_of(name)
                    except TopicError:
                        flt = None
            lo, hi = store.min_offset(name), store.max_offset(name)
            minima[name], maxima[name] = lo, hi
            report.queues.append(QueueInfo(name, kind, flt, lo, hi))

        for client_id, sess in sorted(sessions.items()):
            sess = sess if isinstance(sess, dict) else {}
            subs = [s for s in sess.get("subscriptions") or [] if isinstance(s, dict)]
            report.sessions.append(
                SessionInfo(
                    client_id=client_id,
                    protocol_level=_int_or_none(sess.get("protocol_level")),
                    expiry_interval=_int_or_none(sess.get("expiry_interval")),
                    disconnected_at_ms=_int_or_none(sess.get("disconnected_at_ms")),
                    subscriptions=len(subs),
                    inflight=len(sess.get("inflight") or []),
                    qos2_inbound=len(sess.get("qos2_inbound") or []),
                )
            )
            for sub in subs:
                queue = str(sub.get("queue", ""))
                group_name = sub.get("share_group")
                group = f"$share/{group_name}" if group_name else client_id
                committed = store.offsets.get(group, queue)
                start = _int_or_none(sub.get("start_offset"))
                hi = maxima.get(queue, store.max_offset(queue) if queue else 0)
                lo = minima.get(queue, 0)
                position = committed if committed is not None else (start or 0)
                report.subscriptions.append(
                    SubscriptionInfo(
                        client_id=client_id,
                        filter=str(sub.get("filter", "")),
                        queue=queue,
                        qos=_int_or_none(sub.get("qos")) or 0,
                        share_group=str(group_name) if group_name else None,
                        group=group,
                        start_offset=start,
                        committed=committed,
                        max_offset=hi,
                        backlog=max(0, hi - max(position, lo)),
                    )
                )

        for (group, queue), offset in sorted(store.offsets.all().items()):
            hi = maxima.get(queue, 0)
            report.offsets.append(
                {"group": group, "queue": queue, "offset": offset, "lag": max(0, hi - offset)}
            )
        report.retained_count = len(RetainedIndex.open(store))
        report.delayed = _pending_delayed(store)
    finally:
        store.close()
    return report


def _delayed_info(due_ms: int, m: StoredMessage) -> DelayedInfo:
    from topicmap import record

    p = m.properties
    return DelayedInfo(
        due_ms=due_ms,
        topic=p.get(record.TOPIC, "?"),
        client_id=p.get(record.CLIENT, ""),
        qos=int(p.get(record.QOS, "0")),
        bytes=len(m.body),
    )


def _pending_delayed(store: Storage) -> list[DelayedInfo]:
    timers = store.timers
    if timers is None:
        return []
    return [_delayed_info(e.due_ms, timers.message(e)) for e in timers.pending()]


def inspect_rocketmq(namesrv: str, topic: str, broker: str | None) -> StoreReport:
    """A RocketMQ deployment's pending delayed messages, read from its brokers' timer topic
    (gateway/storage/rocketmq/timers.py); the other tables are the embedded store's only.
    Raises InspectError when the cluster cannot be read."""
    import asyncio

    from gateway.clock import now_ms
    from gateway.storage.rocketmq.timers import pending_delayed
    from rocketmq_remoting import RemotingError

    try:
        pending = asyncio.run(pending_delayed(namesrv, topic, broker, now_ms()))
    except RemotingError as exc:
        raise InspectError(f"RocketMQ name server {namesrv}: {exc}") from None
    report = StoreReport(data_dir=f"rocketmq {namesrv} topic {topic}")
    report.warnings.append(
        "RocketMQ: only the pending delayed messages are listed (queues, sessions and offsets"
        " are the embedded store's tables)"
    )
    report.delayed = [_delayed_info(due, m) for due, m in pending]
    return report


def render_json(report: StoreReport) -> str:
    return json.dumps(report.to_json(), indent=2, sort_keys=False)


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ms / 1000))


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _top(rows: list[_Row], limit: int | None, key: Callable[[_Row], int]) -> list[_Row]:
    """All rows, or the `limit` largest by `key` (in their original order)."""
    if limit is None or len(rows) <= limit:
        return rows
    keep = set(map(id, sorted(rows, key=key, reverse=True)[:limit]))
    return [r for r in rows if id(r) in keep]


def _caption(shown: int, total: int, what: str) -> str | None:
    if shown == total:
        return None
    return f"{shown} of {total} shown ({what}); --all shows every row"


def render_text(report: StoreReport, console: Console, limit: int | None = 50) -> None:
    """Rich tables; with `limit`, each table shows only its `limit` most significant rows."""
    console.print(f"[bold]lmqtt data directory[/bold] {report.data_dir}")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")

    queues = Table(title=f"Queues ({len(report.queues)})", title_justify="left")
    for col in ("queue", "kind", "filter"):
        queues.add_column(col, overflow="fold")
    for col in ("min", "max", "messages"):
        queues.add_column(col, justify="right")
    rows_q = _top(report.queues, limit, lambda q: q.messages)
    queues.caption = _caption(len(rows_q), len(report.queues), "most messages")
    for q in rows_q:
        queues.add_row(
            q.name, q.kind, _opt(q.filter), str(q.min_offset), str(q.max_offset), str(q.messages)
        )
    console.print(queues)

    sessions = Table(title=f"Sessions ({len(report.sessions)})", title_justify="left")
    for col in ("client id", "level", "expiry s", "state"):
        sessions.add_column(col, overflow="fold")
    for col in ("subs", "in-flight", "qos2 in"):
        sessions.add_column(col, justify="right")
    rows_s = report.sessions if limit is None else report.sessions[:limit]
    sessions.caption = _caption(len(rows_s), len(report.sessions), "first by client id")
    for s in rows_s:
        state = (
            "connected"
            if s.disconnected_at_ms is None
            else f"offline since {_utc(s.disconnected_at_ms)}"
        )
        sessions.add_row(
            s.client_id,
            _opt(s.protocol_level),
            _opt(s.expiry_interval),
            state,
            str(s.subscriptions),
            str(s.inflight),
            str(s.qos2_inbound),
        )
    console.print(sessions)

    subs = Table(title=f"Subscriptions ({len(report.subscriptions)})", title_justify="left")
    for col in ("client id", "filter", "group"):
        subs.add_column(col, overflow="fold")
    for col in ("qos", "start", "committed", "max", "backlog"):
        subs.add_column(col, justify="right")
    rows_sub = _top(report.subscriptions, limit, lambda sub: sub.backlog)
    subs.caption = _caption(len(rows_sub), len(report.subscriptions), "largest backlog")
    for sub in rows_sub:
        subs.add_row(
            sub.client_id,
            sub.filter,
            sub.group,
            str(sub.qos),
            _opt(sub.start_offset),
            _opt(sub.committed),
            str(sub.max_offset),
            str(sub.backlog),
        )
    console.print(subs)

    if report.offsets:
        offsets = Table(title=f"Committed offsets ({len(report.offsets)})", title_justify="left")
        offsets.add_column("group", overflow="fold")
        offsets.add_column("queue", overflow="fold")
        offsets.add_column("offset", justify="right")
        offsets.add_column("lag", justify="right")
        rows_o = _top(report.offsets, limit, lambda o: int(o["lag"]))
        offsets.caption = _caption(len(rows_o), len(report.offsets), "largest lag")
        for o in rows_o:
            offsets.add_row(o["group"], o["queue"], str(o["offset"]), str(o["lag"]))
        console.print(offsets)

    console.print(f"Retained messages: {report.retained_count}")

    if report.delayed:
        delayed = Table(
            title=f"Delayed messages ({len(report.delayed)} pending)", title_justify="left"
        )
        for col in ("due", "topic", "publisher"):
            delayed.add_column(col, overflow="fold")
        for col in ("qos", "bytes"):
            delayed.add_column(col, justify="right")
        rows_d = report.delayed if limit is None else report.delayed[:limit]
        delayed.caption = _caption(len(rows_d), len(report.delayed), "earliest due")
        for d in rows_d:
            delayed.add_row(_utc(d.due_ms), d.topic, d.client_id, str(d.qos), str(d.bytes))
        console.print(delayed)
