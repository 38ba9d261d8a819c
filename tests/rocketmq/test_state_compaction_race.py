"""A compaction racing another node's write of the same key (gateway/storage/rocketmq/state.py): the
log the race leaves on the broker, replayed, keeps the newer value. A real gateway (in-process, to
reach its state log) on the session's RocketMQ cluster; the batches are real broker messages.
"""

from __future__ import annotations

import pytest

from gateway.storage.rocketmq.adapter import RocketMqStorage
from gateway.storage.rocketmq.state import StateLog
from tests.gateway.conftest import GatewayHarness
from topicmap.rocketmq import STATE_QUEUE, STATE_START, encode_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_snapshot_record_older_than_a_write_after_the_compaction_start_is_skipped(
    rocketmq_gateway: GatewayHarness,
) -> None:
    """The layout of the race, written to the real state queue: key k written by node X
    (old), the compaction starts (its replay start committed), X writes k again (new), then
    the leader's snapshot copy of k (old: it had not read X's second write) follows it in the
    log. A replay keeps "new" for k and the snapshot's values for the keys nobody wrote again."""
    h = rocketmq_gateway
    store = h.gw.store if h.gw is not None else None
    assert isinstance(store, RocketMqStorage)
    state = store._state_log
    broker = store._broker

    async def race() -> dict[str, bytes]:
        lmq = broker.names.lmq(STATE_QUEUE)
        log = StateLog(broker, state._send, "X")  # writes as node X would
        await log.wait_durable(log._send_batch(encode_state([("race/k", b"old")])))
        start = await broker.client.get_max_offset(broker.addr, lmq)
        await log.wait_durable(log._send_batch(encode_state([("race/k", b"new")])))
        snapshot = encode_state([("race/k", b"old"), ("race/other", b"kept")])
        await log.wait_durable(log._send_batch(snapshot, "X", start))
        await broker.client.update_consumer_offset(
            broker.addr, broker.names.lmq(STATE_START), lmq, start
        )
        replay = StateLog(broker, state._send, "replayer")
        await replay.load()
        return replay.records

    records = h.run(race())
    assert records.get("race/k") == b"new"
    assert records.get("race/other") == b"kept"
