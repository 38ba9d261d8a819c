"""Sessions as records of the state log: one append per change, rebuilt at restart."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from gateway.protocol import Disconnect, PubAck, Publish, Subscribe, Subscription
from gateway.session.registry import QOS2_FLOOR_KEY
from store import MessageStore, StoreConfig, read_state, read_state_records
from tests.gateway.conftest import TIMEOUT, GatewayHarness, RawClient, wait_until


def _records(data_dir: Path) -> list[tuple[str, bytes | None]]:
    return list(read_state_records(data_dir / "state"))


def _session_records(data_dir: Path) -> list[tuple[str, bytes | None]]:
    return [r for r in _records(data_dir) if r[0].startswith("session/")]


def _sessions(data_dir: Path) -> dict[str, dict[str, object]]:
    return {k: json.loads(v) for k, v in read_state(data_dir / "state", "session/").items()}


def _persistent_device(port: int, cid: str, topic: str) -> None:
    c = RawClient(port, level=4)
    assert c.connect(cid, clean=False).reason_code == 0
    c.send(Subscribe(1, [Subscription(topic, 1)]))
    assert c.recv().reason_codes == [1]
    c.send(Disconnect())
    c.close()


def test_a_subscribe_appends_one_record_whatever_the_number_of_sessions(
    gateway: GatewayHarness,
) -> None:
    for i in range(30):
        _persistent_device(gateway.port, f"dev-{i}", f"dev/{i}/cmd")
    gw = gateway.gw
    assert gw is not None
    wait_until(
        lambda: gateway.call(
            lambda: all(s.connection is None for s in gw.sessions.sessions.values())
        )
    )
    gateway.call(gw.sessions.save_now)  # the last DISCONNECTs' changes
    before = len(_records(gateway.data_dir))
    c = RawClient(gateway.port, level=4)
    assert c.connect("dev-0", clean=False).session_present
    c.send(Subscribe(2, [Subscription("dev/0/extra", 0)]))
    assert c.recv().reason_codes == [0]
    # The SUBACK came after the record reached the log: it is there now, and only its own.
    new = _records(gateway.data_dir)[before:]
    assert [k for k, _ in new] == ["session/dev-0"]
    assert new[-1][1] is not None
    subs = json.loads(new[-1][1])["subscriptions"]
    assert sorted(s["filter"] for s in subs) == ["dev/0/cmd", "dev/0/extra"]
    c.close()


def test_sessions_are_rebuilt_from_the_log_at_restart(gateway: GatewayHarness) -> None:
    for i in range(20):
        _persistent_device(gateway.port, f"dev-{i}", f"dev/{i}/cmd")
    gateway.restart()
    gw = gateway.gw
    assert gw is not None
    assert gateway.call(lambda: sorted(gw.sessions.client_ids())) == sorted(
        f"dev-{i}" for i in range(20)
    )
    # The router is back too: a publish reaches the offline session's queue.
    pub = RawClient(gateway.port, level=4)
    pub.connect("pub")
    pub.send(Publish("dev/7/cmd", b"hello", qos=1, packet_id=1))
    assert isinstance(pub.recv(), PubAck)
    pub.close()
    c = RawClient(gateway.port, level=4)
    assert c.connect("dev-7", clean=False).session_present
    msg = c.recv()
    assert isinstance(msg, Publish) and msg.payload == b"hello"
    c.close()


def test_an_ended_session_leaves_a_delete_record(gateway: GatewayHarness) -> None:
    _persistent_device(gateway.port, "gone", "g/1")
    assert "gone" in _sessions(gateway.data_dir)
    c = RawClient(gateway.port, level=4)
    assert not c.connect("gone", clean=True).session_present  # clean start ends the session
    c.send(Disconnect())
    c.close()
    gateway.restart()
    assert ("session/gone", None) in _records(gateway.data_dir)
    assert "gone" not in _sessions(gateway.data_dir)
    c = RawClient(gateway.port, level=4)
    assert not c.connect("gone", clean=False).session_present
    c.close()


def test_a_compaction_keeps_every_session(gateway: GatewayHarness) -> None:
    for i in range(10):
        _persistent_device(gateway.port, f"dev-{i}", f"dev/{i}/cmd")
    gw = gateway.gw
    assert gw is not None
    gateway.call(lambda: gw.sessions.save_now())
    store = gw.store
    gateway.run(asyncio.to_thread(store.rewrite_state))  # type: ignore[attr-defined]
    state = gateway.data_dir / "state"
    assert len(list(state.glob("*.snapshot"))) == 1
    snapshot_keys = {k for k, _ in _records(gateway.data_dir)}
    assert {f"session/dev-{i}" for i in range(10)} <= snapshot_keys
    _persistent_device(gateway.port, "dev-after", "dev/after/cmd")
    gateway.restart()
    gw2 = gateway.gw
    assert gw2 is not None
    assert gateway.call(lambda: sorted(gw2.sessions.client_ids())) == sorted(
        [f"dev-{i}" for i in range(10)] + ["dev-after"]
    )


def test_sessions_json_of_an_older_version_is_imported_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "config").mkdir(parents=True)
    sub = {"filter": "old/t", "queue": "%LMQ%old.t", "share_group": None, "qos": 1}
    doc = {
        "version": 1,
        "sessions": {
            "old-dev": {"protocol_level": 4, "expiry_interval": 0xFFFFFFFF,
                        "disconnected_at_ms": 1, "subscriptions": [sub]},
        },
    }  # fmt: skip
    (data / "config" / "sessions.json").write_text(json.dumps(doc))
    h = GatewayHarness(data).start()
    try:
        assert "old-dev" in _sessions(data)  # now a record of the state log
        c = RawClient(h.port, level=4)
        assert c.connect("old-dev", clean=True).reason_code == 0  # ends it
        c.send(Disconnect())
        c.close()
        h.restart()
        # The old file is not read again: the ended session stays ended.
        gw = h.gw
        assert gw is not None
        assert h.call(lambda: gw.sessions.get("old-dev")) is None
    finally:
        h.stop()


def test_offline_sessions_stay_dormant_until_their_client_returns(gateway: GatewayHarness) -> None:
    for i in range(5):
        _persistent_device(gateway.port, f"dev-{i}", f"dev/{i}/cmd")
    gateway.restart()
    gw = gateway.gw
    assert gw is not None
    # Restored as records, not objects; still counted, still routed.
    assert gateway.call(lambda: (len(gw.sessions), len(gw.sessions.sessions))) == (5, 0)
    pub = RawClient(gateway.port, level=4)
    pub.connect("pub")
    pub.send(Publish("dev/3/cmd", b"wake", qos=1, packet_id=1))
    assert isinstance(pub.recv(), PubAck)
    pub.close()
    c = RawClient(gateway.port, level=4)
    assert c.connect("dev-3", clean=False).session_present
    msg = c.recv()
    assert isinstance(msg, Publish) and msg.payload == b"wake"
    assert msg.packet_id is not None  # QoS 1
    c.send(PubAck(msg.packet_id))
    c.close()
    assert gateway.call(lambda: "dev-3" in gw.sessions.sessions)


def test_a_dormant_session_expires_on_time(gateway: GatewayHarness) -> None:
    from gateway.protocol import Properties

    c = RawClient(gateway.port, level=5)
    ack = c.connect("short", clean=True, properties=Properties(session_expiry_interval=2))
    assert ack.reason_code == 0
    c.send(Subscribe(1, [Subscription("s/t", 1)]))
    c.recv()
    c.send(Disconnect())
    c.close()
    gateway.restart()
    gw = gateway.gw
    assert gw is not None
    assert gateway.call(lambda: gw.sessions.client_ids()) == ["short"]
    wait_until(lambda: gateway.call(lambda: len(gw.sessions)) == 0, 10, "dormant expiry")
    assert gateway.call(lambda: gw.stats.subscriptions) == 0  # its subscription went too
    gateway.call(gw.sessions.save_now)
    assert "short" not in _sessions(gateway.data_dir)


def test_a_dormant_session_built_without_its_client_still_expires(gateway: GatewayHarness) -> None:
    from gateway.protocol import Properties

    c = RawClient(gateway.port, level=5)
    c.connect("peeked", clean=True, properties=Properties(session_expiry_interval=2))
    c.send(Disconnect())
    c.close()
    gateway.restart()
    gw = gateway.gw
    assert gw is not None
    # Something looks the session up (it is built from its record), its client stays away.
    assert gateway.call(lambda: gw.sessions.get("peeked") is not None)
    wait_until(lambda: gateway.call(lambda: len(gw.sessions)) == 0, 10, "expiry")


def test_after_a_crash_positions_past_a_queue_end_are_pulled_back(
    gateway: GatewayHarness,
) -> None:
    """An async-flush crash can lose the log's tail that a saved position already covers;
    the restart after it (abort marker left) reads on from the queue's real end."""
    _persistent_device(gateway.port, "lagger", "lag/t")
    pub = RawClient(gateway.port, level=4)
    pub.connect("pub")
    for i in range(3):
        pub.send(Publish("lag/t", f"m{i}".encode(), qos=1, packet_id=i + 1))
        assert isinstance(pub.recv(), PubAck)
    pub.close()
    gateway.stop()
    # What a crash that lost the tail leaves: a record whose position is past the queue end
    # (appended as the gateway would), and the store's abort marker.
    data = gateway.data_dir
    record = json.loads(read_state(data / "state", "session/")["lagger"])
    record["subscriptions"][0]["next_offset"] = 50
    s = MessageStore.open(StoreConfig(data_dir=data))
    s.append_state([("session/lagger", json.dumps(record).encode())])
    s.close()
    (data / "abort").touch()
    gateway.start()
    c = RawClient(gateway.port, level=4)
    assert c.connect("lagger", clean=False).session_present
    pub = RawClient(gateway.port, level=4)
    pub.connect("pub")
    pub.send(Publish("lag/t", b"after", qos=1, packet_id=9))
    assert isinstance(pub.recv(), PubAck)
    pub.close()
    # Delivered: the position came back to the queue's end (3), below the new message.
    assert c.recv().payload == b"after"
    c.close()


def test_a_progress_pass_writes_only_the_sessions_whose_progress_moved(
    gateway: GatewayHarness,
) -> None:
    gw = gateway.gw
    assert gw is not None
    devices = []
    for i in range(20):
        c = RawClient(gateway.port, level=4)
        assert c.connect(f"dev-{i}", clean=False).reason_code == 0
        c.send(Subscribe(1, [Subscription(f"dev/{i}/cmd", 1)]))
        assert c.recv().reason_codes == [1]
        devices.append(c)
    pub = RawClient(gateway.port, level=4)
    pub.connect("pub")
    gateway.call(gw.sessions.save_now)  # the CONNECTs' and SUBSCRIBEs' changes
    before = len(_session_records(gateway.data_dir))
    # Twenty-one connected sessions, none of whose progress moved: a progress pass writes none
    # of their records, whatever their number: at most the QoS 2 floor (session/qos2.py).
    total = len(_records(gateway.data_dir))
    gateway.run(gw.sessions.save_if_dirty(progress_interval_s=0))
    assert _session_records(gateway.data_dir)[before:] == []
    assert [k for k, _ in _records(gateway.data_dir)[total:]] in ([], [QOS2_FLOOR_KEY])
    pub.send(Publish("dev/3/cmd", b"on", qos=1, packet_id=1))
    assert isinstance(pub.recv(), PubAck)
    msg = devices[3].recv()
    assert isinstance(msg, Publish) and msg.payload == b"on"
    assert msg.packet_id is not None
    devices[3].send(PubAck(msg.packet_id))
    wait_until(lambda: gateway.call(lambda: not gw.sessions.sessions["dev-3"].inflight))
    # One session received and acknowledged: the pass writes its record, and only its own.
    gateway.run(gw.sessions.save_if_dirty(progress_interval_s=0))
    new = _session_records(gateway.data_dir)[before:]
    assert [k for k, _ in new] == ["session/dev-3"]
    assert new[0][1] is not None
    doc = json.loads(new[0][1])
    assert doc["subscriptions"][0]["next_offset"] == 1 and doc["inflight"] == []
    gateway.run(gw.sessions.save_if_dirty(progress_interval_s=0))
    assert len(_session_records(gateway.data_dir)) == before + 1  # written once, not again
    # A QoS 0 delivery moves a position that no acknowledgement reports: written too.
    pub.send(Publish("dev/4/cmd", b"off", qos=0))
    msg = devices[4].recv()
    assert isinstance(msg, Publish) and msg.payload == b"off"
    gateway.run(gw.sessions.save_if_dirty(progress_interval_s=0))
    new = _session_records(gateway.data_dir)[before + 1 :]
    assert [k for k, _ in new] == ["session/dev-4"]
    assert new[0][1] is not None
    assert json.loads(new[0][1])["subscriptions"][0]["next_offset"] == 1
    # A graceful stop writes every session it disconnects, offline as of the stop.
    gateway.restart()
    sessions = _sessions(gateway.data_dir)
    assert all(sessions[f"dev-{i}"]["disconnected_at_ms"] is not None for i in range(20))
    assert not any(d.get("behind") for d in sessions.values())
    for c in [*devices, pub]:
        c.close()


def test_concurrent_subscribes_in_sync_mode_share_state_log_fsyncs(tmp_path: Path) -> None:
    h = GatewayHarness(tmp_path / "data", flush="sync").start()
    devices = []
    try:
        gw = h.gw
        assert gw is not None
        for i in range(30):
            c = RawClient(h.port, level=4)
            assert c.connect(f"dev-{i}", clean=False).reason_code == 0
            devices.append(c)
        state = gw.store.state  # type: ignore[attr-defined]
        before = h.call(lambda: state.fsyncs)
        # Thirty SUBSCRIBEs at once, each SUBACK after its fsync: the event loop is held while
        # they are written, so the gateway reads them together however slowly this thread
        # sends (on a loaded host it would otherwise read a few per turn, an fsync each).
        held, release = threading.Event(), threading.Event()
        assert h.loop is not None

        def hold_loop() -> None:
            held.set()
            release.wait(TIMEOUT)

        h.loop.call_soon_threadsafe(hold_loop)
        assert held.wait(TIMEOUT)
        try:
            for i, c in enumerate(devices):
                c.send(Subscribe(1, [Subscription(f"dev/{i}/cmd", 1)]))
        finally:
            release.set()
        for c in devices:
            assert c.recv().reason_codes == [1]
        fsyncs = h.call(lambda: state.fsyncs) - before
        # Group commit: the saves that wait together share an fsync (one per save otherwise).
        assert 1 <= fsyncs <= 5, fsyncs
        records = _sessions(h.data_dir)  # each SUBACKed subscription is in the log
        assert all(records[f"dev-{i}"]["subscriptions"] != [] for i in range(30))
    finally:
        for c in devices:
            c.close()
        h.stop()
