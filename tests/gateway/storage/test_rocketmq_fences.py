"""The fence rule of the state log (gateway/storage/rocketmq/fences.py) on its own: which batches a
reader applies around a marker, as the tails and replays use it (the partition suite and
tests/rocketmq/test_state_compaction_race.py run it against real brokers)."""

from __future__ import annotations

from gateway.storage.rocketmq.fences import FENCE_KEY_PREFIX, Fences, has_marker, marker


def test_a_nodes_batches_after_the_first_marker_naming_it_are_dropped() -> None:
    fences = Fences()
    assert fences.admits("A", 100)
    kept = fences.read([marker("A"), ("session/c", b"{}")], 101)
    assert kept == [(FENCE_KEY_PREFIX + "A", b"101")]  # readers keep the marker's offset
    assert fences.read([marker("A")], 103) == [(FENCE_KEY_PREFIX + "A", b"101")]  # first counts
    assert fences.admits("A", 100)  # before the marker: its
    assert not fences.admits("A", 104)  # after: no one's
    assert fences.admits("A", 104, snapshot=True)  # a compaction's copy of what was honoured
    assert fences.admits("B", 104)
    assert not fences.late


def test_a_snapshot_copy_read_after_a_late_batch_asks_for_a_second_replay() -> None:
    """A replay from a compaction's start reads node A's late batch (105) before the snapshot's
    copy of A's marker (value 101): it applied what the rule drops, so it must replay again."""
    fences = Fences()
    assert fences.admits("A", 105)
    fences.applied("A", 105)
    fences.read([(FENCE_KEY_PREFIX + "A", b"101")], 110)
    assert fences.late
    again = Fences(fences.at)
    assert not again.admits("A", 105)
    # A copy that does not contradict what was applied needs no second pass.
    calm = Fences()
    calm.applied("A", 99)
    calm.read([(FENCE_KEY_PREFIX + "A", b"101")], 110)
    assert not calm.late


def test_only_marker_keys_are_markers() -> None:
    assert has_marker([("session/x", b"{}"), marker("n")])
    assert not has_marker([("session/fence/x", b"{}")])
    assert Fences().read([("session/x", b"{}"), (FENCE_KEY_PREFIX + "gone", None)], 7) == []
