"""The scan's partial aggregates (analytics.scratch) do not depend on how time is packed."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from analytics.fanout import _backlog_from
from analytics.scratch import ScratchPlan, partials
from analytics.segments import SegmentParser, list_segments
from analytics.snapshots import open_subscribers, pieces, queue_ends
from tests.analytics.groundtruth import World


def _sums(table: pa.Table, keys: list[str], values: list[str]) -> Counter[Any]:
    out: Counter[Any] = Counter()
    for row in table.to_pylist():
        for v in values:
            out[(*(row[k] for k in keys), v)] += row[v]
    return out


def test_a_batch_spanning_centuries_aggregates_like_a_dense_one(world: World) -> None:
    """Seconds are packed relative to the batch's first, or ranked when they lie far apart
    (a quiet gateway): both must give the same counts per device, topic and subscriber."""
    pcs = pieces(world.data_dir)
    plan = ScratchPlan(
        since_ms=None,
        until_ms=None,
        subscribers=tuple(
            (p.subscriber, p.queue, p.start, p.end, p.acked, p.qos) for p in pcs if p.end > p.start
        ),
        dedup=True,
        backlog_from=_backlog_from(open_subscribers(pcs), queue_ends(world.data_dir)),
    )
    checked = 0
    for seg in list_segments(world.data_dir):
        for batch in SegmentParser(seg).batches():
            at = batch.schema.get_field_index("store_timestamp")
            days = np.arange(batch.num_rows, dtype=np.int64) * 86_400_000_000 * 400
            spread = batch.set_column(
                at, batch.schema.field(at), pa.array(days, batch.schema.field(at).type)
            )
            dense, sparse = partials(batch, plan), partials(spread, plan)
            keys, values = ["client_id", "topic", "fanout"], ["n", "r", "b"]
            assert _sums(dense[0], keys, values) == _sums(sparse[0], keys, values)
            keys, values = ["client_id", "topic", "subscriber", "queue"], ["d", "d0", "e"]
            assert _sums(dense[1], keys, values) == _sums(sparse[1], keys, values)
            assert len(sparse[0]) >= batch.num_rows  # one cube row per (message, second)
            checked += batch.num_rows
    assert checked == len(world.messages)
