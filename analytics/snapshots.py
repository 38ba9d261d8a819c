"""Who subscribes to what, how far each got, and where each queue ends, from the store's files.

Three small inputs, read without Spark and without opening the store:

    state/ (the state log)        the gateway's session records: subscriptions (filter, queue,
                                  share group, start_offset: the queue end when subscribed),
                                  read with the store's reader (store/statelog.py)
    offsets/ (a state log)        the store's committed offsets: (group, queue) -> next offset;
                                  group = client id, or "$share/<group>" for a shared group
    consumequeue/<queue>/0/<20-digit start byte>
                                  20-byte units; a queue ends at the last file's start unit
                                  plus its size / 20 (the store's ConsumeQueueTable._load)

A *subscriber* is what one delivery goes to: a session, or a shared group (its members compete,
so the group counts once). Its range on a queue is [start, committed): messages at offsets in
the range were delivered and acknowledged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from analytics.copies import base_queue
from analytics.errors import SnapshotError
from store.consumequeue import queue_extents
from store.delivery_account import FLAG_CLEAN, FLAG_CLOSED, FLAG_SHARED, AccountRecord, read_account
from store.errors import StoreError
from store.format import CONFIG_DIR, CONSUMEQUEUE_DIR
from store.offsets import read_committed_offsets
from store.statelog import STATE_DIR, has_state_log, read_state
from topicmap import LMQ_PREFIX, filter_of

SESSIONS_FILE = "sessions.json"  # before the state log
# The gateway's session records in the state log (store/statelog.py): key prefix + client id,
# value the session as JSON (gateway/session/model.py; analytics never imports it).
SESSION_KEY_PREFIX = "session/"
SHARE_PREFIX = "$share/"
LIGHT_QUEUE_PREFIX = LMQ_PREFIX


@dataclass(frozen=True, slots=True)
class Subscription:
    """One subscription of one session, as saved by the gateway."""

    client_id: str
    filter: str  # without any $share/<group>/ prefix
    queue: str
    share_group: str | None
    qos: int
    start_offset: int | None
    next_offset: int | None
    online: bool


@dataclass(frozen=True, slots=True)
class Subscriber:
    """What one delivery of a queue goes to: a session, or a shared group counted once."""

    subscriber: str  # client id, or "$share/<group>"
    queue: str
    filter: str
    start_offset: int
    committed: int
    sessions: int  # member sessions (1 unless shared)
    shared: bool
    online: bool


@dataclass(frozen=True, slots=True)
class QueueEnd:
    queue: str
    min_offset: int
    end_offset: int


def read_subscriptions(data_dir: str | Path) -> list[Subscription]:
    """Every saved subscription (the gateway's session records in the state log, read with
    the store's reader; a data directory's config/sessions.json otherwise)."""
    path = Path(data_dir) / STATE_DIR
    try:
        raw = read_state(path, SESSION_KEY_PREFIX)
    except (OSError, StoreError) as e:
        raise SnapshotError(f"cannot read the state log {path}: {e}") from None
    sessions: dict[str, object]
    source = path
    if raw or has_state_log(path):
        sessions = session_records(raw, path)
    else:
        source = Path(data_dir) / CONFIG_DIR / SESSIONS_FILE
        sessions = _read_sessions_json(source)
    return subscriptions_of(sessions, source)


def session_records(raw: dict[str, bytes], source: object) -> dict[str, object]:
    """The gateway's session records (client id -> JSON value of its `session/` key)."""
    try:
        return {cid: json.loads(value) for cid, value in raw.items()}
    except ValueError as e:
        raise SnapshotError(f"{source}: unreadable session record: {e}") from None


def subscriptions_of(sessions: dict[str, object], source: object) -> list[Subscription]:
    """Every subscription of the sessions (client id -> the gateway's session as JSON)."""
    out: list[Subscription] = []
    try:
        for client_id, session in sessions.items():
            assert isinstance(session, dict)
            online = session.get("disconnected_at_ms") is None
            for sub in session.get("subscriptions", []):
                group = sub.get("share_group")
                text = str(sub["filter"])
                if group and text.startswith(SHARE_PREFIX):
                    text = text.split("/", 2)[2] if text.count("/") >= 2 else text
                out.append(
                    Subscription(
                        client_id=str(client_id),
                        filter=text,
                        queue=str(sub["queue"]),
                        share_group=str(group) if group else None,
                        qos=int(sub.get("qos", 0)),
                        start_offset=_opt_int(sub.get("start_offset")),
                        next_offset=_opt_int(sub.get("next_offset")),
                        online=online,
                    )
                )
    except (KeyError, TypeError, AttributeError, ValueError, AssertionError) as e:
        raise SnapshotError(f"{source} is not in the gateway's sessions format: {e!r}") from None
    return out


def _read_sessions_json(path: Path) -> dict[str, object]:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise SnapshotError(f"cannot read {path}: {e}") from None
    sessions = doc.get("sessions") if isinstance(doc, dict) else None
    if not isinstance(sessions, dict):
        raise SnapshotError(f"{path} is not in the gateway's sessions format: no sessions")
    return sessions


def read_committed(data_dir: str | Path) -> dict[tuple[str, str], int]:
    """Committed offsets by (group, queue), read with the store's reader; none if absent."""
    try:
        return read_committed_offsets(Path(data_dir))
    except (OSError, StoreError) as e:
        raise SnapshotError(f"cannot read the committed offsets: {e}") from None


def subscribers(
    subscriptions: list[Subscription], committed: dict[tuple[str, str], int]
) -> list[Subscriber]:
    """Fold subscriptions into subscribers: one per session and queue, one per shared group.

    start = the earliest start among the members (a missing start_offset counts as 0: the
    gateway predates the field, so every committed message is taken as delivered);
    committed = the store's committed offset, else the session's read position, else start.
    """
    folded: dict[tuple[str, str], list[Subscription]] = {}
    for sub in subscriptions:
        key = SHARE_PREFIX + sub.share_group if sub.share_group else sub.client_id
        folded.setdefault((key, sub.queue), []).append(sub)
    out = []
    for (key, queue), members in sorted(folded.items()):
        start = min(m.start_offset if m.start_offset is not None else 0 for m in members)
        done = committed.get((key, queue))
        if done is None and len(members) == 1 and members[0].share_group is None:
            done = members[0].next_offset
        if done is None:
            done = start
        out.append(
            Subscriber(
                subscriber=key,
                queue=queue,
                filter=members[0].filter,
                start_offset=start,
                committed=max(done, start),
                sessions=len({m.client_id for m in members}),
                shared=key.startswith(SHARE_PREFIX),
                online=any(m.online for m in members),
            )
        )
    return out


def queue_ends(data_dir: str | Path) -> list[QueueEnd]:
    """Every consume queue's min and end offset from its files (no store open needed)."""
    out = [
        QueueEnd(queue=queue, min_offset=lo, end_offset=end)
        for queue, lo, end in queue_extents(Path(data_dir) / CONSUMEQUEUE_DIR)
    ]
    out.sort(key=lambda q: q.queue)
    return out


def subscribers_table(rows: list[Subscriber]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "subscriber": r.subscriber,
                "queue": r.queue,
                "filter": r.filter,
                "start_offset": r.start_offset,
                "committed": r.committed,
                "sessions": r.sessions,
                "shared": r.shared,
                "online": r.online,
            }
            for r in rows
        ],
        schema=SUBSCRIBERS_SCHEMA,
    )


SUBSCRIBERS_SCHEMA = pa.schema(
    [
        ("subscriber", pa.string()),
        ("queue", pa.string()),
        ("filter", pa.string()),
        ("start_offset", pa.int64()),
        ("committed", pa.int64()),
        ("sessions", pa.int32()),
        ("shared", pa.bool_()),
        ("online", pa.bool_()),
    ]
)

QUEUE_ENDS_SCHEMA = pa.schema(
    [
        ("queue", pa.string()),
        ("queue_filter", pa.string()),
        ("min_offset", pa.int64()),
        ("end_offset", pa.int64()),
    ]
)


def queue_ends_table(rows: list[QueueEnd]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "queue": q.queue,
                "queue_filter": _filter_of(q.queue),
                "min_offset": q.min_offset,
                "end_offset": q.end_offset,
            }
            for q in rows
        ],
        schema=QUEUE_ENDS_SCHEMA,
    )


def _opt_int(value: object) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    raise ValueError(f"not an integer offset: {value!r}")


def _filter_of(queue: str) -> str | None:
    """The filter a light queue (or its copy on a broker: analytics.copies) was named after
    (None for other queues or unknown names)."""
    if not queue.startswith(LMQ_PREFIX):
        return None
    try:
        return filter_of(base_queue(queue))
    except (ValueError, KeyError):
        return None


# -- the delivery account ------------------------------------------------------------------------

OPEN_END = 1 << 62  # the eligible end of a subscription still open: every later message


@dataclass(frozen=True, slots=True)
class Piece:
    """One subscriber's time on one queue: messages at offsets in [start, end) were due to it,
    those in [start, acked) done (acknowledged at QoS 1/2, sent at QoS 0). A subscriber's
    pieces on a queue never overlap, so each message counts once per subscriber and queue."""

    subscriber: str  # client id, or "$share/<group>"
    queue: str
    filter: str | None
    kind: str  # "persistent", "clean" or "shared"
    qos: int
    start: int
    end: int  # OPEN_END while subscribed
    acked: int
    sent: int
    online: bool
    first_ms: int | None  # first and last account record (None: only in sessions.json)
    last_ms: int | None
    queue_end: int = 0  # the largest queue end the account saw


def pieces(
    data_dir: str | Path,
    subscriptions: list[Subscription] | None = None,
    committed: dict[tuple[str, str], int] | None = None,
    account: list[AccountRecord] | None = None,
) -> list[Piece]:
    """Every subscriber's pieces, from the delivery account and the saved sessions together.

    A subscription is keyed by (subscriber, queue, start offset); its newest state wins (the
    records are cumulative). A subscriber's keys on one queue are cut into pieces that do not
    overlap; an acknowledged end past the next key's start (a shared group resumed after a
    restart at its committed offset) carries over to it. sessions.json adds what the account has
    not written yet. A clean subscription the account never closed and sessions.json no longer
    lists ended with the gateway (a crash): it was due what the queue held at its last record.
    """
    subs = read_subscriptions(data_dir) if subscriptions is None else subscriptions
    done = read_committed(data_dir) if committed is None else committed
    records = read_account(data_dir) if account is None else account
    filters = {s.queue: s.filter for s in subs}
    listed = subscribers(subs, done)
    qos: dict[tuple[str, str], int] = {}
    for s in subs:
        key = (SHARE_PREFIX + s.share_group if s.share_group else s.client_id, s.queue)
        qos[key] = max(qos.get(key, 0), s.qos)
    state: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in records:
        st = state.get((r.subscriber, r.queue, r.start))
        if st is None:
            st = state[(r.subscriber, r.queue, r.start)] = {
                "flags": r.flags, "qos": r.qos, "acked": r.acked, "sent": r.sent,
                "end": None, "first": r.time_ms, "last": r.time_ms, "qend": r.queue_end,
            }  # fmt: skip
        st["flags"] |= r.flags & (FLAG_CLEAN | FLAG_SHARED)
        st["qos"] = max(st["qos"], r.qos)
        st["acked"] = max(st["acked"], r.acked)
        st["sent"] = max(st["sent"], r.sent)
        st["qend"] = max(st["qend"], r.queue_end)
        st["first"] = min(st["first"], r.time_ms)
        st["last"] = max(st["last"], r.time_ms)
        if r.flags & FLAG_CLOSED:
            st["end"] = max(st["end"] or 0, r.queue_end)
    online = {(ls.subscriber, ls.queue): ls.online for ls in listed}
    for ls in listed:
        key3 = (ls.subscriber, ls.queue, ls.start_offset)
        st = state.get(key3)
        if st is None:
            kind_flag = FLAG_SHARED if ls.shared else 0
            st = state[key3] = {
                "flags": kind_flag, "qos": qos.get((ls.subscriber, ls.queue), 0),
                "acked": ls.committed, "sent": ls.committed, "end": None, "first": None,
                "last": None, "qend": ls.committed, "listed": True,
            }  # fmt: skip
        else:
            st["acked"] = max(st["acked"], ls.committed)
            st["end"] = None  # listed now: still subscribed
            st["listed"] = True
    by_queue: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
    for (subscriber, queue, start), st in state.items():
        if st["end"] is None and st["flags"] & FLAG_CLEAN and not st.get("listed"):
            st["end"] = st["qend"]  # ended unrecorded (see the docstring)
        by_queue.setdefault((subscriber, queue), []).append((start, st))
    out: list[Piece] = []
    for (subscriber, queue), items in sorted(by_queue.items()):
        items.sort(key=lambda item: item[0])
        carried = 0  # done offsets are facts about the subscriber, whichever key said so
        for i, (start, st) in enumerate(items):
            end = OPEN_END if st["end"] is None else st["end"]
            if i + 1 < len(items):
                end = min(end, items[i + 1][0])
            end = max(end, start)
            st["acked"] = max(st["acked"], carried)
            carried = max(carried, st["acked"])
            flags = st["flags"]
            kind = (
                "shared"
                if flags & FLAG_SHARED
                else "clean"
                if flags & FLAG_CLEAN
                else ("persistent")
            )
            out.append(
                Piece(
                    subscriber=subscriber,
                    queue=queue,
                    filter=filters.get(queue) or _filter_of(queue),
                    kind=kind,
                    qos=int(st["qos"]),
                    start=start,
                    end=end,
                    acked=min(max(st["acked"], start), end),
                    sent=max(st["sent"], start),
                    online=online.get((subscriber, queue), False) and end == OPEN_END,
                    first_ms=st["first"],
                    last_ms=st["last"],
                    queue_end=int(st["qend"]),
                )
            )
    return out


def open_subscribers(rows: list[Piece]) -> list[Subscriber]:
    """The pieces still subscribed, as the backlog sees them (one per subscriber and queue)."""
    out = []
    for p in rows:
        if p.end != OPEN_END:
            continue
        out.append(
            Subscriber(
                subscriber=p.subscriber,
                queue=p.queue,
                filter=p.filter or "",
                start_offset=p.start,
                committed=p.acked,
                sessions=1,
                shared=p.kind == "shared",
                online=p.online,
            )
        )
    return out
