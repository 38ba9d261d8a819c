"""GroupCommit (gateway/storage/group_commit.py): the event loop's waits for the state log's
fsync, on a real state log (store/statelog.py) in a temporary directory."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.storage.group_commit import GroupCommit
from store.statelog import StateLog, read_state


async def _write(log: StateLog, commit: GroupCommit, key: str, work_s: float = 0.0) -> int:
    # `work_s`: the rest of the turn's work before this write, the GIL free meanwhile (a
    # syscall's): an fsync started at once covers only the turn's writes before it.
    time.sleep(work_s)
    position = log.append([(key, b"v")])
    await commit.wait(position)
    assert log.synced >= position  # durable once answered
    return position


def test_a_write_on_an_idle_log_is_fsynced_at_once_the_rest_of_its_turn_share_one(
    tmp_path: Path,
) -> None:
    log = StateLog.open(tmp_path)
    commit = GroupCommit(log)

    async def main() -> None:
        # Ten writers whose first steps run in the same turn (as SUBSCRIBEs of one poll): the
        # first write's fsync starts at once (nothing in flight) and ends during the turn's
        # other work; the other nine, requested at the end of the turn, share the next.
        await asyncio.gather(*(_write(log, commit, f"k{i}", 0.01 if i else 0) for i in range(10)))
        assert log.fsyncs == 2
        # A later turn's write gets an fsync of its own.
        await _write(log, commit, "later")
        assert log.fsyncs == 3

    try:
        asyncio.run(main())
    finally:
        commit.stop()
        log.close()
    assert sorted(read_state(tmp_path)) == sorted([f"k{i}" for i in range(10)] + ["later"])


def test_writers_that_append_during_an_fsync_are_answered_by_the_next(tmp_path: Path) -> None:
    log = StateLog.open(tmp_path)
    commit = GroupCommit(log)

    async def writer(n: int) -> None:
        for i in range(50):
            await _write(log, commit, f"w{n}-{i}")

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(writer(n) for n in range(4))), 60)

    try:
        asyncio.run(main())
    finally:
        commit.stop()
        log.close()
    # Each fsync answered every writer waiting when it ended, and never more than 200 ran.
    assert 50 <= log.fsyncs <= 200
    assert len(read_state(tmp_path)) == 200


def test_a_cancelled_waiter_leaves_the_others_answered(tmp_path: Path) -> None:
    log = StateLog.open(tmp_path)
    commit = GroupCommit(log)

    async def main() -> None:
        gone = asyncio.ensure_future(_write(log, commit, "gone"))
        kept = asyncio.ensure_future(_write(log, commit, "kept"))
        await asyncio.sleep(0)  # both appended and waiting
        gone.cancel()
        assert await asyncio.wait_for(kept, 30) > 0
        with pytest.raises(asyncio.CancelledError):
            await gone

    try:
        asyncio.run(main())
    finally:
        commit.stop()
        log.close()


def test_waiters_left_at_stop_are_answered_by_the_logs_close(tmp_path: Path) -> None:
    log = StateLog.open(tmp_path)
    commit = GroupCommit(log)

    async def main() -> None:
        task = asyncio.ensure_future(_write(log, commit, "last"))
        await asyncio.sleep(0)  # appended; its fsync not requested yet (end of the turn)
        log.close()  # fsyncs everything (as the store's close does)
        commit.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert read_state(tmp_path) == {"last": b"v"}
