"""Per-subscriber tables of the report, from the delivery account alone (small: no Spark).

    subscribers      one row per piece (analytics.snapshots.Piece): who, which filter, kind
                     (persistent / clean / shared), QoS, open or ended, the acknowledged and
                     sent ends, the queue end, lag (open: queue end - acknowledged end; ended:
                     what it was due and never got), behind_since and the account's first and
                     last record; deliveries and due (eligible) in the report's window are
                     joined by the job
    subscriber_lag   lag over time: per (subscriber, queue, window), the largest and the last
                     lag among the account's records in that window (queue end - acknowledged
                     end when written)

behind_since: for a piece with lag now, the time of the first record of its current run of
records that all show lag (None when the last record shows none, or no record exists).
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from analytics.snapshots import OPEN_END, Piece, QueueEnd
from store.delivery_account import AccountRecord

_TS = pa.timestamp("ms", tz="UTC")
SUBSCRIBERS_TABLE = pa.schema(
    [
        ("subscriber", pa.string()),
        ("queue", pa.string()),
        ("filter", pa.string()),
        ("kind", pa.string()),
        ("qos", pa.int32()),
        ("open", pa.bool_()),
        ("online", pa.bool_()),
        ("start_offset", pa.int64()),
        ("end_offset", pa.int64()),  # null while open
        ("acked", pa.int64()),
        ("sent", pa.int64()),
        ("queue_end", pa.int64()),
        ("lag", pa.int64()),
        ("behind_since", _TS),
        ("first_record", _TS),
        ("last_record", _TS),
    ]
)
LAG_TABLE = pa.schema(
    [
        ("subscriber", pa.string()),
        ("queue", pa.string()),
        ("window_start", _TS),
        ("lag_max", pa.int64()),
        ("lag_last", pa.int64()),
        ("records", pa.int64()),
    ]
)


def subscriber_rows(
    pieces: list[Piece], ends: list[QueueEnd], account: Iterable[AccountRecord]
) -> pa.Table:
    end_of = {q.queue: q.end_offset for q in ends}
    history: dict[tuple[str, str, int], list[AccountRecord]] = {}
    for r in account:
        history.setdefault((r.subscriber, r.queue, r.start), []).append(r)
    rows = []
    for p in pieces:
        is_open = p.end == OPEN_END
        queue_end = max(end_of.get(p.queue, 0), p.queue_end, p.acked) if is_open else p.end
        lag = max(0, queue_end - p.acked)
        since = None
        recs = sorted(history.get((p.subscriber, p.queue, p.start), ()), key=lambda r: r.time_ms)
        if lag and recs and recs[-1].queue_end > recs[-1].acked:
            since = recs[-1].time_ms
            for r in reversed(recs):
                if r.queue_end <= r.acked:
                    break
                since = r.time_ms
        rows.append(
            {
                "subscriber": p.subscriber,
                "queue": p.queue,
                "filter": p.filter,
                "kind": p.kind,
                "qos": p.qos,
                "open": is_open,
                "online": p.online,
                "start_offset": p.start,
                "end_offset": None if is_open else p.end,
                "acked": p.acked,
                "sent": p.sent,
                "queue_end": queue_end,
                "lag": lag,
                "behind_since": since,
                "first_record": p.first_ms,
                "last_record": p.last_ms,
            }
        )
    return pa.Table.from_pylist(rows, schema=SUBSCRIBERS_TABLE)


def lag_rows(
    account: Iterable[AccountRecord],
    window_s: int,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> pa.Table:
    """Lag over time (see the module docstring), records in [since_ms, until_ms) only."""
    step = window_s * 1000
    cells: dict[tuple[str, str, int], list[int]] = {}  # -> [max, last, last time, count]
    for r in account:
        if (since_ms is not None and r.time_ms < since_ms) or (
            until_ms is not None and r.time_ms >= until_ms
        ):
            continue
        lag = max(0, r.queue_end - r.acked)
        key = (r.subscriber, r.queue, r.time_ms // step * step)
        cell = cells.get(key)
        if cell is None:
            cells[key] = [lag, lag, r.time_ms, 1]
        else:
            cell[0] = max(cell[0], lag)
            if r.time_ms >= cell[2]:
                cell[1], cell[2] = lag, r.time_ms
            cell[3] += 1
    rows = [
        {
            "subscriber": s,
            "queue": q,
            "window_start": w,
            "lag_max": c[0],
            "lag_last": c[1],
            "records": c[3],
        }
        for (s, q, w), c in sorted(cells.items())
    ]
    return pa.Table.from_pylist(rows, schema=LAG_TABLE)
