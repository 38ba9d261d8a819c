"""The store's timer queue (store/timer.py) on real store files: what is pending after a
reopen, with and without a checkpoint, and that an entry fires once whatever the crash point."""

from __future__ import annotations

import asyncio

import pytest

from store import MessageStore, TimerQueue
from store.timer import CHECKPOINT_NAME, FIRED_QUEUE, PROP_FIRED_OF, read_checkpoint
from tests.store.conftest import OpenStore


def _schedule(timers: TimerQueue, body: bytes, due: int) -> None:
    asyncio.run(timers.schedule(body, {"k": body.decode()}, due))


def _fire(timers: TimerQueue, store: MessageStore, due_ms: int) -> list[bytes]:
    fired = []
    for e in timers.due(due_ms):
        m = timers.message(e)
        assert "TIMER_DELIVER_MS" not in m.properties
        timers.fire(e, "t", ("%LMQ%t",), m.body, m.properties)
        fired.append(m.body)
    return fired


@pytest.mark.parametrize("checkpoint", [False, True])
def test_pending_survive_reopen_and_fired_never_refire(
    open_store: OpenStore, checkpoint: bool
) -> None:
    s = open_store(flush="sync")
    timers = TimerQueue(s)
    assert timers.recover() == 0
    # Out of arrival order: the later entries fall due first.
    for body, due in ((b"c", 3000), (b"a", 1000), (b"b", 2000), (b"d", 4000)):
        _schedule(timers, body, due)
    assert [e.due_ms for e in timers.pending()] == [1000, 2000, 3000, 4000]
    assert _fire(timers, s, 2000) == [b"a", b"b"]
    if checkpoint:
        s.flush()
        timers.save_checkpoint()
        # C stays at entry 0 ("c", unfired); F at the first fired record naming an entry >= 0.
        assert read_checkpoint(s.read_config(CHECKPOINT_NAME)) == (0, 0)
    s.close()

    s = open_store(flush="sync")
    timers = TimerQueue(s)
    assert timers.recover() == 2
    assert [timers.message(e).body for e in timers.pending()] == [b"c", b"d"]
    # The fired ones are in their queues once, each with its mark.
    got = s.get(FIRED_QUEUE, 0, 10).messages
    assert [m.body for m in got] == [b"a", b"b"]
    assert [m.properties[PROP_FIRED_OF] for m in got] == ["1", "2"]
    assert [m.body for m in s.get("%LMQ%t", 0, 10).messages] == [b"a", b"b"]
    assert _fire(timers, s, 5000) == [b"c", b"d"]
    s.flush()
    timers.save_checkpoint()
    assert read_checkpoint(s.read_config(CHECKPOINT_NAME)) == (4, 4)
    s.close()

    s = open_store(flush="sync")
    timers = TimerQueue(s)
    assert timers.recover() == 0
    assert [m.body for m in s.get("%LMQ%t", 0, 10).messages] == [b"a", b"b", b"c", b"d"]


def test_checkpoint_covers_only_flushed_firings(open_store: OpenStore) -> None:
    """A fired record not yet fsynced may vanish with the log's tail: the checkpoint must not
    pass its entry, which would then be lost instead of fired again."""
    s = open_store(flush="async", flush_interval_ms=60_000)
    timers = TimerQueue(s)
    timers.recover()
    _schedule(timers, b"a", 1)
    s.flush()
    assert _fire(timers, s, 1) == [b"a"]
    timers.save_checkpoint()
    assert read_checkpoint(s.read_config(CHECKPOINT_NAME))[0] == 0  # not flushed yet
    s.flush()
    assert timers.save_checkpoint()
    assert read_checkpoint(s.read_config(CHECKPOINT_NAME)) == (1, 1)


def test_fire_twice_refused(open_store: OpenStore) -> None:
    s = open_store()
    timers = TimerQueue(s)
    timers.recover()
    _schedule(timers, b"a", 1)
    (e,) = timers.due(1)
    timers.fire(e, "t", (), b"a", {})
    with pytest.raises(ValueError):
        timers.fire(e, "t", (), b"a", {})
