"""Committed consumer offsets: one record per change in their own compacted log."""

from __future__ import annotations

import json
from pathlib import Path

from store.offsets import OFFSETS_DIR, read_committed_offsets
from store.statelog import read_state_records
from tests.store.conftest import OpenStore


def test_a_commit_appends_one_record_and_survives_reopening(
    open_store: OpenStore, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    s = open_store()
    for i in range(1000):
        s.offsets.commit(f"client-{i}", f"%LMQ%q{i}", i)
    s.flush()
    before = len(list(read_state_records(data / OFFSETS_DIR)))
    assert before == 1000
    s.offsets.commit("client-7", "%LMQ%q7", 70)
    s.offsets.remove("client-8", "%LMQ%q8")
    s.flush()
    records = list(read_state_records(data / OFFSETS_DIR))[before:]
    assert sorted(k for k, _ in records) == ["client-7\x00%LMQ%q7", "client-8\x00%LMQ%q8"]
    s.close()
    got = read_committed_offsets(data)
    assert got[("client-7", "%LMQ%q7")] == 70 and ("client-8", "%LMQ%q8") not in got
    assert len(got) == 999
    s = open_store()
    assert s.offsets.all() == got


def test_the_json_file_of_an_older_version_is_imported_once(
    open_store: OpenStore, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    (data / "config").mkdir(parents=True)
    doc = {"version": 1, "offsets": {"g": {"%LMQ%a": 5}, "$share/x": {"%LMQ%b": 9}}}
    (data / "config" / "consumer_offsets.json").write_text(json.dumps(doc))
    s = open_store()
    assert s.offsets.all() == {("g", "%LMQ%a"): 5, ("$share/x", "%LMQ%b"): 9}
    s.offsets.remove("g", "%LMQ%a")
    s.close()
    assert not (data / "config" / "consumer_offsets.json").exists()
    assert (data / "config" / "consumer_offsets.json.imported").exists()
    assert read_committed_offsets(data) == {("$share/x", "%LMQ%b"): 9}
    s = open_store()
    assert s.offsets.all() == {("$share/x", "%LMQ%b"): 9}


def test_commits_and_removals_before_the_table_is_first_read(
    open_store: OpenStore, tmp_path: Path
) -> None:
    """The table is read from the log on first use; what changed before that is not lost."""
    s = open_store()
    s.offsets.commit("a", "%LMQ%q", 1)
    s.offsets.commit("b", "%LMQ%q", 2)
    s.close()
    s = open_store()
    s.offsets.commit("a", "%LMQ%q", 10)  # before any read: persisted by the next flush
    s.flush()
    s.offsets.remove("b", "%LMQ%q")  # not yet persisted when the table is read
    s.offsets.commit("c", "%LMQ%q", 3)
    assert s.offsets.all() == {("a", "%LMQ%q"): 10, ("c", "%LMQ%q"): 3}
    assert s.offsets.get("b", "%LMQ%q") is None
    s.close()
    assert read_committed_offsets(tmp_path / "data") == {("a", "%LMQ%q"): 10, ("c", "%LMQ%q"): 3}
