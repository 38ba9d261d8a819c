"""RetainedIndex: matching rules, and durability over a real MessageStore in tmp_path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.messages.retained import (
    CURSOR_KEY,
    RECORD_PREFIX,
    SNAPSHOT_NAME,
    RetainedIndex,
    RetainedMessage,
    RetainedTrie,
)
from gateway.storage.embedded import EmbeddedStorage
from store import StoreConfig, read_state
from store.format import ABORT_FILE, LOCK_FILE

QUEUE = RetainedIndex.QUEUE


def _open(path: Path, **kw: object) -> EmbeddedStorage:
    s = EmbeddedStorage.open(StoreConfig(data_dir=path, **kw))  # type: ignore[arg-type]
    assert isinstance(s, EmbeddedStorage)
    return s


def _crash(s: EmbeddedStorage, dest: Path) -> Path:
    """The data directory as a crash of the process leaves it: copied while the store is open
    (abort marker present, consume-queue units still in memory, no final checkpoint and no
    retained snapshot written on the way out), then the original closed."""
    for attempt in range(3):
        try:
            shutil.copytree(s.data_dir, dest, ignore=shutil.ignore_patterns(LOCK_FILE))
            break
        except shutil.Error:
            # A file renamed under the copy (the store's flush writes its checkpoint as
            # checkpoint.tmp, then renames it): copy the directory again.
            shutil.rmtree(dest, ignore_errors=True)
            if attempt == 2:
                raise
    s.close()
    assert (dest / ABORT_FILE).exists()
    return dest


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStorage]:
    s = _open(tmp_path / "data")
    yield s
    s.close()


def _publish(
    store: EmbeddedStorage,
    index: RetainedIndex | None,
    topic: str,
    payload: bytes,
    qos: int = 0,
    expiry: int | None = None,
    with_offset: bool = True,
) -> RetainedMessage:
    """What the gateway does for a retained PUBLISH: append with %RETAIN%, then apply."""
    props = {"mqtt.topic": topic, "mqtt.qos": str(qos), "mqtt.retain": "1", "mqtt.client": "c"}
    if expiry is not None:
        props["mqtt.expiry"] = str(expiry)
    result = store.put(
        topic=topic.split("/")[0] or "_0empty", body=payload, queues=[QUEUE], properties=props
    )
    msg = RetainedMessage(
        topic=topic,
        payload=payload,
        qos=qos,
        properties=props,
        expiry_interval_s=expiry,
        offset=result.light_offsets[QUEUE] if with_offset else None,
    )
    if index is not None:
        index.apply(msg)
    return msg


def _topics(msgs: list[RetainedMessage]) -> set[str]:
    return {m.topic for m in msgs}


# ---------------------------------------------------------------- matching (no store)


def _trie(*topics: str) -> RetainedTrie:
    t = RetainedTrie()
    for topic in topics:
        t.set(RetainedMessage(topic, b"x", 0))
    return t


def test_wildcards_and_dollar_rule() -> None:
    t = _trie("a", "a/b", "a/b/c", "a/x/c", "/a", "$SYS/broker/uptime", "b")
    assert _topics(t.match("a/#")) == {"a", "a/b", "a/b/c", "a/x/c"}
    assert _topics(t.match("a/+/c")) == {"a/b/c", "a/x/c"}
    assert _topics(t.match("+")) == {"a", "b"}
    assert _topics(t.match("#")) == {"a", "a/b", "a/b/c", "a/x/c", "/a", "b"}
    assert _topics(t.match("+/a")) == {"/a"}
    assert _topics(t.match("+/+")) == {"a/b", "/a"}  # not $SYS/broker
    assert _topics(t.match("$SYS/#")) == {"$SYS/broker/uptime"}
    assert _topics(t.match("$SYS/+/uptime")) == {"$SYS/broker/uptime"}
    assert _topics(t.match("a/b")) == {"a/b"}
    assert t.match("a/b/c/d") == []


def test_delete_prunes() -> None:
    t = _trie("a/b/c")
    assert t.delete("a/b/c") and not t.delete("a/b/c") and not t.delete("a/b")
    assert len(t) == 0 and t.match("#") == []


def _reference_match(flt: str, topic: str) -> bool:
    f, tl = flt.split("/"), topic.split("/")
    if topic.startswith("$") and f[0] in ("+", "#"):
        return False
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(tl) or (level != "+" and level != tl[i]):
            return False
    return len(f) == len(tl)


_level = st.sampled_from(["a", "b", "", "$x"])


@settings(max_examples=200, deadline=None)
@given(
    topics=st.lists(st.lists(_level, min_size=1, max_size=4).map("/".join), max_size=12),
    flt=st.lists(st.sampled_from(["a", "b", "", "+", "$x"]), min_size=1, max_size=4).flatmap(
        lambda ls: st.booleans().map(lambda h: "/".join([*ls, "#"] if h else ls))
    ),
)
def test_trie_matches_reference(topics: list[str], flt: str) -> None:
    t = _trie(*topics)
    assert _topics(t.match(flt)) == {x for x in set(topics) if _reference_match(flt, x)}


def test_shared_filter_gets_no_retained(store: EmbeddedStorage) -> None:
    index = RetainedIndex.open(store)
    _publish(store, index, "a/b", b"1")
    assert index.match("$share/g/a/b") == []
    assert _topics(index.match("a/b")) == {"a/b"}


# ---------------------------------------------------------------- index over a store


def test_set_replace_delete(store: EmbeddedStorage) -> None:
    index = RetainedIndex.open(store)
    _publish(store, index, "site/1/t", b"one", qos=1)
    _publish(store, index, "site/2/t", b"two")
    assert len(index) == 2
    _publish(store, index, "site/1/t", b"uno", qos=2)
    [m] = index.match("site/1/t")
    assert (m.payload, m.qos) == (b"uno", 2)
    _publish(store, index, "site/2/t", b"")  # empty payload deletes
    assert _topics(index.match("site/#")) == {"site/1/t"}
    assert len(index) == 1


def test_restart_with_snapshot(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    for i in range(5):
        _publish(s, index, f"dev/{i}", f"v{i}".encode(), qos=i % 3)
    _publish(s, index, "dev/3", b"")
    index.close()
    s.close()
    snapshot = read_state(tmp_path / "d" / "state")
    assert CURSOR_KEY in snapshot and "retained/dev/0" in snapshot

    s = _open(tmp_path / "d")
    try:
        again = RetainedIndex.open(s)
        assert again.replayed == 0  # all from the snapshot
        got = {m.topic: (m.payload, m.qos) for m in again.match("dev/+")}
        assert got == {
            "dev/0": (b"v0", 0),
            "dev/1": (b"v1", 1),
            "dev/2": (b"v2", 2),
            "dev/4": (b"v4", 1),
        }
        assert got["dev/1"] == (b"v1", 1)
    finally:
        s.close()


def test_crash_without_snapshot_replays_the_log(tmp_path: Path) -> None:
    """Acknowledged (sync-flushed) retained publishes survive when no snapshot was written."""
    s = _open(tmp_path / "d", flush="sync")
    index = RetainedIndex.open(s)
    _publish(s, index, "a", b"1")
    _publish(s, index, "b", b"2")
    _publish(s, index, "a", b"3")
    _publish(s, index, "b", b"")
    crashed = _crash(s, tmp_path / "crashed")  # no index.close(): no snapshot written

    s = _open(crashed)
    try:
        assert s.recovery.abnormal
        again = RetainedIndex.open(s)
        assert again.replayed == 4
        assert {m.topic: m.payload for m in again.match("#")} == {"a": b"3"}
    finally:
        s.close()


def test_replay_reads_records_as_delivery_does(store: EmbeddedStorage) -> None:
    """The log is read with the delivery's record decoder (read_record): a %RETAIN% record
    whose QoS or expiry is not a number is skipped, not fatal to open(); an expiry interval
    of 0 read back from the log means none; the store's own properties are left out."""
    good = {"mqtt.topic": "a", "mqtt.qos": "1", "mqtt.retain": "1", "mqtt.expiry": "0"}
    store.put(topic="a", body=b"1", queues=[QUEUE], properties=good)
    for bad in ({"mqtt.qos": "x"}, {"mqtt.qos": ""}, {"mqtt.expiry": "soon"}):
        props = {"mqtt.topic": "b", "mqtt.retain": "1", **bad}
        store.put(topic="b", body=b"2", queues=[QUEUE], properties=props)
    index = RetainedIndex.open(store)
    assert index.replayed == 1
    [msg] = index.match("#")
    assert (msg.topic, msg.payload, msg.qos, msg.expiry_interval_s) == ("a", b"1", 1, None)
    assert msg.properties == good


def test_snapshot_then_more_publishes_then_crash(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    _publish(s, index, "x/1", b"old")
    _publish(s, index, "x/2", b"keep")
    index.snapshot()
    covered = index.next_offset
    _publish(s, index, "x/1", b"new")
    _publish(s, index, "x/2", b"")
    _publish(s, index, "x/3", b"added")
    crashed = _crash(s, tmp_path / "crashed")

    s = _open(crashed)
    try:
        assert s.recovery.abnormal
        again = RetainedIndex.open(s)
        assert again.replayed == 3  # only what came after the snapshot's offset
        assert again.next_offset == covered + 3
        assert {m.topic: m.payload for m in again.match("x/#")} == {"x/1": b"new", "x/3": b"added"}
    finally:
        s.close()


def test_out_of_order_applies_keep_log_order(store: EmbeddedStorage) -> None:
    """Concurrent publishers can call apply() out of log order; the newer offset wins."""
    index = RetainedIndex.open(store)
    first = _publish(store, None, "t", b"first")
    second = _publish(store, None, "t", b"second")
    index.apply(second)
    index.apply(first)
    assert [m.payload for m in index.match("t")] == [b"second"]
    # A deletion is a version too: a late older set must not resurrect the topic.
    gone = _publish(store, None, "t", b"")
    late = _publish(store, None, "u", b"u")
    index.apply(gone)
    index.apply(second)
    index.apply(late)
    assert _topics(index.match("#")) == {"u"}


def test_offsetless_applies_follow_the_log(store: EmbeddedStorage) -> None:
    index = RetainedIndex.open(store)
    a = _publish(store, None, "t", b"a", with_offset=False)
    b = _publish(store, None, "t", b"b", with_offset=False)
    assert [m.payload for m in index.match("t")] == [b"b"]  # the log made them visible
    index.apply(a)  # late confirmations must not roll the topic back
    index.apply(b)
    assert [m.payload for m in index.match("t")] == [b"b"]
    # Without any log record (a detached caller), apply() is authoritative.
    index.apply(RetainedMessage("v", b"direct", 0))
    assert [m.payload for m in index.match("v")] == [b"direct"]


def test_writes_of_others_become_visible_on_match(store: EmbeddedStorage) -> None:
    index = RetainedIndex.open(store)
    _publish(store, None, "late/1", b"x")
    assert _topics(index.match("late/#")) == {"late/1"}


def test_expiry(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    _publish(s, index, "e/short", b"bye", expiry=1)
    _publish(s, index, "e/long", b"stay", expiry=3600)
    _publish(s, index, "e/never", b"forever")
    [long] = index.match("e/long")
    assert long.remaining_expiry_s() in (3599, 3600)
    deadline = time.monotonic() + 5
    while index.match("e/short") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _topics(index.match("e/#")) == {"e/long", "e/never"}
    index.close()
    s.close()

    # Expired messages are neither snapshotted nor resurrected by replay.
    records = read_state(tmp_path / "d" / "state", RECORD_PREFIX)
    assert set(records) == {"e/long", "e/never"}
    shutil.rmtree(tmp_path / "d" / "state")  # without the snapshot: replay alone
    s = _open(tmp_path / "d")
    try:
        assert _topics(RetainedIndex.open(s).match("e/#")) == {"e/long", "e/never"}
    finally:
        s.close()


def test_expired_before_apply_is_not_stored(store: EmbeddedStorage) -> None:
    index = RetainedIndex.open(store)
    msg = RetainedMessage(
        "old", b"x", 0, stored_at_ms=int(time.time() * 1000) - 10_000, expiry_interval_s=1
    )
    index.apply(msg)
    assert index.match("old") == [] and len(index) == 0


def test_payload_bytes_round_trip(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    blob = bytes(range(256)) * 4
    _publish(s, index, "bin", blob, qos=1)
    index.close()
    s.close()
    s = _open(tmp_path / "d")
    try:
        [m] = RetainedIndex.open(s).match("bin")
        assert m.payload == blob and m.properties["mqtt.retain"] == "1"
        assert "INNER_MULTI_DISPATCH" not in m.properties
    finally:
        s.close()


def test_corrupt_snapshot_falls_back_to_replay(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    _publish(s, index, "k", b"v")
    s.close()
    (tmp_path / "d" / "config").mkdir(exist_ok=True)
    (tmp_path / "d" / "config" / SNAPSHOT_NAME).write_text('{"version": 1, "messa')
    s = _open(tmp_path / "d")
    try:
        assert {m.topic: m.payload for m in RetainedIndex.open(s).match("#")} == {"k": b"v"}
    finally:
        s.close()


def test_snapshot_ahead_of_truncated_log(tmp_path: Path) -> None:
    """A snapshot claiming offsets the log lost (async-flush crash) must not hide new records,
    not after this restart and not after the next crash either."""
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    _publish(s, index, "p", b"1")
    index.close()
    cursor = json.loads(read_state(tmp_path / "d" / "state")[CURSOR_KEY])
    cursor["next_offset"] = 50  # pretend the log's tail was cut after this snapshot
    s.append_state([(CURSOR_KEY, json.dumps(cursor).encode())])
    s.close()

    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    assert index.next_offset == 1
    _publish(s, index, "q", b"2")
    crashed = _crash(s, tmp_path / "crashed")  # no index.close()

    s = _open(crashed)
    try:
        assert s.recovery.abnormal
        again = RetainedIndex.open(s)
        assert {m.topic for m in again.match("#")} == {"p", "q"}
    finally:
        s.close()


def test_read_only_store_open_does_not_write(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    _publish(s, index, "r", b"1")
    s.flush()
    ro = _open(tmp_path / "d", read_only=True)
    try:
        view = RetainedIndex.open(ro)
        assert len(view) == 1
        view.close()
        assert not (tmp_path / "d" / "config" / SNAPSHOT_NAME).exists()
    finally:
        ro.close()
        s.close()


async def test_periodic_snapshot(store: EmbeddedStorage) -> None:
    import asyncio

    index = RetainedIndex.open(store)
    _publish(store, index, "z", b"1")
    task = asyncio.create_task(index.snapshot_periodically(0.02))
    try:
        for _ in range(250):
            if read_state(store.state_dir, RECORD_PREFIX):
                break
            await asyncio.sleep(0.02)
        records = read_state(store.state_dir, RECORD_PREFIX)
        assert json.loads(records["z"])["topic"] == "z"
    finally:
        task.cancel()


def test_snapshot_outlives_store_retention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The snapshot holds payloads, so deleting the segments that stored them loses nothing;
    only a retained publish made after the last snapshot and already deleted is lost (logged)."""
    s = _open(tmp_path / "d", segment_size=4096, retention_bytes=4096)
    index = RetainedIndex.open(s)
    for i in range(4):
        _publish(s, index, f"keep/{i}", bytes([i]) * 900)
    index.snapshot()
    _publish(s, index, "late", b"L" * 900)  # after the snapshot
    for _ in range(12):
        s.put(topic="noise", body=b"n" * 900, queues=[], properties={})
    assert s.delete_expired() > 0
    assert s.min_offset(QUEUE) > 0  # the retained records' segments are gone
    crashed = _crash(s, tmp_path / "crashed")  # no final snapshot

    s = _open(crashed, segment_size=4096)
    try:
        assert s.recovery.abnormal
        with caplog.at_level("WARNING", logger="lmqtt.retained"):
            again = RetainedIndex.open(s)
        got = {m.topic: m.payload for m in again.match("#")}
        assert {f"keep/{i}" for i in range(4)} <= set(got)
        assert got["keep/3"] == b"\x03" * 900
        assert "late" not in got  # its segment went before any snapshot covered it
        assert "deleted by retention" in caplog.text
    finally:
        s.close()


# ---------------------------------------------------------------- through the real server


def _serve(data: Path) -> tuple[subprocess.Popen[str], int]:
    import re

    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMQTT_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", "0", "--data-dir", str(data),
         "--flush", "sync", "--sys-interval", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server prints it once listening (or exits: "")
    m = re.search(r"listening on \S+:(\d+),", line)
    if m is None:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"server did not start: {line!r}")
    return proc, int(m.group(1))


def test_acknowledged_retained_publish_survives_sigkill(tmp_path: Path) -> None:
    """flush=sync: once PUBACK arrived, a retained message survives SIGKILL of the server
    (no snapshot was written: it comes back from the %RETAIN% replay)."""
    import paho.mqtt.client as mqtt

    pytest.importorskip("gateway.app")
    data = tmp_path / "data"
    proc, port = _serve(data)
    try:
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub")
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        for topic, body in (("crash/a", b"gone"), ("crash/a", b"kept"), ("crash/b", b"\x00bin")):
            info = pub.publish(topic, body, qos=1, retain=True)
            info.wait_for_publish(30)  # generous: a loaded disk can make fsync slow
            assert info.is_published(), "no PUBACK"
        proc.kill()  # SIGKILL right after the last PUBACK
        proc.wait(10)
        pub.loop_stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not (data / "config" / SNAPSHOT_NAME).exists()

    proc, port = _serve(data)
    try:
        got: dict[str, bytes | bytearray] = {}
        flags: list[bool] = []  # checked here, not in paho's thread (which would swallow it)
        done = threading.Event()

        def on_message(_c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
            flags.append(bool(msg.retain))
            got[msg.topic] = msg.payload
            if len(got) == 2:
                done.set()

        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sub")
        sub.on_message = on_message
        sub.connect("127.0.0.1", port)
        sub.loop_start()
        sub.subscribe("crash/#", qos=1)
        assert done.wait(30), got
        sub.disconnect()
        sub.loop_stop()
        assert got == {"crash/a": b"kept", "crash/b": b"\x00bin"}
        assert flags == [True, True], "retained copies must carry the RETAIN flag"
    finally:
        proc.terminate()
        proc.wait(15)


def test_retained_json_of_an_older_version_becomes_records(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    _publish(s, index, "old/a", b"A")
    _publish(s, index, "old/b", b"B")
    msgs = [m.to_json() for m in index.match("#")]
    doc = {"version": 1, "queue": QUEUE, "next_offset": index.next_offset, "messages": msgs}
    s.write_config(SNAPSHOT_NAME, json.dumps(doc).encode())
    s.close()  # no index.close(): the old file is the only snapshot
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    assert index.replayed == 0  # covered by the old file
    index.close()
    s.close()
    assert set(read_state(tmp_path / "d" / "state", RECORD_PREFIX)) == {"old/a", "old/b"}
    (tmp_path / "d" / "config" / SNAPSHOT_NAME).unlink()  # not needed any more
    s = _open(tmp_path / "d")
    try:
        again = RetainedIndex.open(s)
        assert again.replayed == 0
        assert {m.topic: m.payload for m in again.match("#")} == {"old/a": b"A", "old/b": b"B"}
    finally:
        s.close()


def test_an_unusable_snapshot_record_falls_back_to_replay(tmp_path: Path) -> None:
    s = _open(tmp_path / "d")
    index = RetainedIndex.open(s)
    _publish(s, index, "k", b"v")
    index.close()
    s.append_state([(CURSOR_KEY, b'{"next_off')])
    s.close()
    s = _open(tmp_path / "d")
    try:
        again = RetainedIndex.open(s)
        assert again.replayed == 1
        assert {m.topic: m.payload for m in again.match("#")} == {"k": b"v"}
    finally:
        s.close()
