"""A compaction racing another node's write of the same key (gateway/storage/rocketmq/state.py): the
log the race leaves on the broker, replayed, keeps the newer value. A real gateway (in-process, to
reach its state log) on the session's RocketMQ cluster; the batches are real broker messages.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from bench.compaction_bench import LagProbe, TurnProbe
from gateway.storage.rocketmq.adapter import RocketMqStorage
from gateway.storage.rocketmq.fences import FENCE_KEY_PREFIX
from gateway.storage.rocketmq.state import StateLog
from tests.gateway.conftest import GatewayHarness
from topicmap.rocketmq import STATE_QUEUE, STATE_START, encode_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


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


def test_a_fenced_nodes_batch_after_its_marker_is_dropped_by_a_replay_across_a_compaction(
    rocketmq_gateway: GatewayHarness,
) -> None:
    """The fence rule (gateway/storage/rocketmq/fences.py) at a replay, on the real state queue:
    node X writes k, node B's marker fences X, the leader's compaction starts after the
    marker, X's late batch (k again, and a key of its own) lands after that start and before
    the snapshot's copy of the marker (value: the marker's offset). A replay from the
    compaction's start reads the late batch before it knows the marker, so it replays again:
    k is X's value from before the marker, the late key is absent, the marker is kept with its
    offset (a later compaction copies it so)."""
    h = rocketmq_gateway
    store = h.gw.store if h.gw is not None else None
    assert isinstance(store, RocketMqStorage)
    state = store._state_log
    broker = store._broker
    x = f"x-{uuid.uuid4().hex[:6]}"

    async def late_write() -> tuple[dict[str, bytes], int]:
        lmq = broker.names.lmq(STATE_QUEUE)

        async def end_at_least(n: int) -> int:
            """The queue's end once it counts `n` (its dispatch lags SEND_OK a little)."""
            while (end := await broker.client.get_max_offset(broker.addr, lmq)) < n:
                await asyncio.sleep(0.01)
            return end

        before = await broker.client.get_max_offset(broker.addr, lmq)
        log_x = StateLog(broker, state._send, x)
        await log_x.wait_durable(log_x.append([("fence-test/k", b"before")]))
        marked_at = await end_at_least(before + 1)  # where the marker goes
        log_b = StateLog(broker, state._send, "B")
        await log_b.wait_durable(log_b.fence(x))
        start = await end_at_least(marked_at + 1)  # the compaction starts after the marker
        late = [("fence-test/k", b"late"), ("fence-test/late", b"late")]
        await log_x.wait_durable(log_x.append(late))
        copies = [(FENCE_KEY_PREFIX + x, str(marked_at).encode())]
        await log_b.wait_durable(log_b._send_batch(encode_state(copies), "B", start))
        keep = [("fence-test/k", b"before")]
        await log_b.wait_durable(log_b._send_batch(encode_state(keep), x, start))
        await broker.client.update_consumer_offset(
            broker.addr, broker.names.lmq(STATE_START), lmq, start
        )
        replay = StateLog(broker, state._send, "replayer")
        await replay.load()
        assert replay.fences.at.get(x) == marked_at
        return replay.records, marked_at

    records, marked_at = h.run(late_write())
    assert records.get("fence-test/k") == b"before"
    assert "fence-test/late" not in records
    assert records.get(FENCE_KEY_PREFIX + x) == str(marked_at).encode()


def test_a_compaction_of_100000_records_yields_to_the_loop_at_every_batch(
    rocketmq_gateway: GatewayHarness,
) -> None:
    """The compaction runs on the event loop: it sends its snapshot one batch of
    STATE_SNAPSHOT_BATCH records per turn of the loop (structural: counted per turn), no
    turn runs 50 ms of CPU (the loop thread's CPU time, which a loaded host does not
    inflate), and a 10 ms timer is never a second late (wall clock: generous, the host's
    load is in it). The replay after it has every record."""
    h = rocketmq_gateway
    store = h.gw.store if h.gw is not None else None
    assert isinstance(store, RocketMqStorage)
    state = store._state_log
    n = 100_000
    value = b"x" * 240

    async def compact() -> tuple[int, float, float, dict[str, bytes]]:
        ticket = 0
        for i in range(0, n, 1000):
            ticket = state.append([(f"pace/{k}", value) for k in range(i, i + 1000)])
        await state.wait_durable(ticket)
        state.history += 3 * n  # as if every record had been written 4 times: compaction due
        turn = 0
        per_turn: dict[int, int] = {}
        send = state._send_batch

        def spy(
            body: bytes,
            writer: str | None = None,
            snapshot: int | None = None,
            *,
            fence: str | None = None,
        ) -> int:
            if snapshot is not None:
                per_turn[turn] = per_turn.get(turn, 0) + 1
            return send(body, writer, snapshot, fence=fence)

        async def count_turns() -> None:
            nonlocal turn
            while True:
                await asyncio.sleep(0)
                turn += 1

        state._send_batch = spy  # type: ignore[method-assign]
        counter = asyncio.get_running_loop().create_task(count_turns())
        try:
            with TurnProbe() as turns, LagProbe() as lags:
                await store.compact_state()
        finally:
            counter.cancel()
            del state._send_batch
        assert state.history < 2 * n, "the compaction ran"
        replay = StateLog(store._broker, state._send, "replayer")
        await replay.load()
        return max(per_turn.values()), turns.longest, max(lags.lags), replay.records

    most, longest, lag, records = h.run(compact(), timeout=240)
    assert most == 1, f"{most} snapshot batches sent in one turn of the loop"
    assert longest < 0.05, f"a turn of the loop ran {longest * 1000:.1f} ms of CPU"
    assert lag < 1.0, f"the loop was {lag * 1000:.0f} ms late (generous: a loaded host's own)"
    assert sum(1 for k in records if k.startswith("pace/")) == n
