"""State kept per device must not cost O(devices) per change.

Clean sessions' read positions are kept in memory only: a flush does not append them to the
offsets log (10,000 devices' command subscriptions would each cost a record per delivery), and
they are still readable while their session lives. Session saves append only the sessions that
changed (tests/gateway/session/test_state_records.py).
"""

from __future__ import annotations

from pathlib import Path

from store.offsets import ConsumerOffsets, read_offsets_log


def test_volatile_offsets_are_readable_but_never_written(tmp_path: Path) -> None:
    directory = tmp_path / "offsets"
    offsets = ConsumerOffsets(directory, tmp_path / "consumer_offsets.json")
    offsets.load()
    offsets.commit("backend", "q/all", 5)
    offsets.commit("dev-1", "q/cmd1", 3, durable=False)
    assert offsets.persist()
    offsets.commit("dev-1", "q/cmd1", 4, durable=False)
    assert not offsets.persist()  # nothing durable changed: nothing appended
    assert offsets.get("dev-1", "q/cmd1") == 4
    assert offsets.all() == {("backend", "q/all"): 5, ("dev-1", "q/cmd1"): 4}
    assert read_offsets_log(directory) == {("backend", "q/all"): 5}
    # An entry already durable stays durable whatever a later commit says.
    offsets.commit("backend", "q/all", 6, durable=False)
    assert offsets.persist()
    assert read_offsets_log(directory) == {("backend", "q/all"): 6}
    offsets.remove("dev-1", "q/cmd1")
    assert offsets.get("dev-1", "q/cmd1") is None
    offsets.close()
