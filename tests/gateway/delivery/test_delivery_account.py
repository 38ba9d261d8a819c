"""The gateway's delivery account: what every subscription was sent and acknowledged, on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from store import FLAG_CLEAN, FLAG_CLOSED, FLAG_SHARED, AccountRecord, read_account
from tests.gateway.conftest import Client, GatewayHarness, quick_account, stop_clients, wait_until
from topicmap import queue_name

N = 10


def _newest(data: Path, subscriber: str, flt: str) -> AccountRecord | None:
    q = queue_name(flt)
    mine = [r for r in read_account(data) if r.subscriber == subscriber and r.queue == q]
    return mine[-1] if mine else None


def test_ranges_of_every_kind_of_subscription(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick_account(monkeypatch)  # the settled() wait is for the next periodic records
    data = tmp_path / "data"
    h = GatewayHarness(data).start()
    made: list[Client] = []
    try:
        keep = Client(h.port, "keep", clean=False)
        zero = Client(h.port, "zero")  # clean session, QoS 0: sent counts, nothing to ack
        g1 = Client(h.port, "g1", v5=True)
        g2 = Client(h.port, "g2", v5=True)
        pub = Client(h.port, "pub")
        made += [keep, zero, g1, g2, pub]
        keep.subscribe("a/#", qos=1)
        zero.subscribe("a/b", qos=0)
        g1.subscribe("$share/g/a/b", qos=1)
        g2.subscribe("$share/g/a/b", qos=1)
        for i in range(N):
            pub.publish("a/b", str(i).encode(), qos=1)
        keep.wait_messages(N)
        zero.wait_messages(N)
        wait_until(lambda: len(g1.messages) + len(g2.messages) >= N, what="the group")

        def settled() -> bool:
            rows = [
                _newest(data, "keep", "a/#"),
                _newest(data, "zero", "a/b"),
                _newest(data, "$share/g", "a/b"),
            ]
            return all(r is not None and r.acked == N for r in rows)

        wait_until(settled, timeout=30, what="the account's next records")
        k = _newest(data, "keep", "a/#")
        z = _newest(data, "zero", "a/b")
        g = _newest(data, "$share/g", "a/b")
        assert k is not None and z is not None and g is not None
        assert (k.flags, k.qos, k.start, k.queue_end) == (0, 1, 0, N)
        assert (z.flags & FLAG_CLEAN, z.qos, z.sent) == (FLAG_CLEAN, 0, N)
        assert (g.flags & FLAG_SHARED, g.qos) == (FLAG_SHARED, 1)
        # The clean session ends: its range is closed with the queue end it saw.
        zero.disconnect()
        wait_until(
            lambda: (r := _newest(data, "zero", "a/b")) is not None and bool(r.flags & FLAG_CLOSED),
            what="the closing record",
        )
        closed = _newest(data, "zero", "a/b")
        assert closed is not None and (closed.acked, closed.queue_end) == (N, N)
    finally:
        stop_clients(made)
        h.stop()
    # At shutdown every open subscription is written once more; the persistent one stays open.
    k = _newest(data, "keep", "a/#")
    assert k is not None and not k.flags & FLAG_CLOSED and k.acked == N


def test_turned_off_the_gateway_writes_no_account(tmp_path: Path) -> None:
    """delivery_account = false: messages flow as before, and no account file appears, not even
    at shutdown (clean sessions' ranges are written then when it is on)."""
    from store.delivery_account import ACCOUNT_DIR

    data = tmp_path / "data"
    h = GatewayHarness(data, delivery_account=False).start()
    made: list[Client] = []
    try:
        keep = Client(h.port, "keep", clean=False)
        zero = Client(h.port, "zero")
        pub = Client(h.port, "pub")
        made += [keep, zero, pub]
        keep.subscribe("a/#", qos=1)
        zero.subscribe("a/b", qos=0)
        for i in range(N):
            pub.publish("a/b", str(i).encode(), qos=1)
        keep.wait_messages(N)
        zero.wait_messages(N)
        zero.disconnect()
    finally:
        stop_clients(made)
        h.stop()
    assert (data / "commitlog").is_dir()
    assert not (data / ACCOUNT_DIR).exists()
    assert read_account(data) == []


def test_lag_sampled_for_offline_and_stalled_subscribers_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling looks at what may lag without moving, collected as it changes (not a walk over
    every session): an offline persistent subscriber and an online one that stopped
    acknowledging (its window full) both get records whose queue end grows past what they
    acknowledged."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    quick_account(monkeypatch)
    data = tmp_path / "data"
    h = GatewayHarness(data).start()
    made: list[Client] = []
    try:
        archive = Client(h.port, "archive", clean=False)
        made.append(archive)
        archive.subscribe("lag/#", qos=1)
        archive.disconnect()  # offline: its share waits in its queue
        props = Properties(PacketTypes.CONNECT)
        props.ReceiveMaximum = 2
        stalled = Client(h.port, "stalled", v5=True, auto_ack=False, connect_props=props)
        pub = Client(h.port, "pub")
        made += [stalled, pub]
        stalled.subscribe("lag/#", qos=1)

        def lagging(subscriber: str, end: int) -> bool:
            r = _newest(data, subscriber, "lag/#")
            return r is not None and r.queue_end >= end and r.acked == 0

        # The first messages move the stalled subscriber's position (sent), and that is
        # written; what comes after its window filled moves nothing: only sampling writes it.
        for end in (N, 2 * N):
            for i in range(N):
                pub.publish("lag/1", str(i).encode(), qos=1)
            wait_until(
                lambda: lagging("archive", end) and lagging("stalled", end),  # noqa: B023
                timeout=30,
                what=f"lag samples up to {end}",
            )
        assert len(stalled.messages) == 2  # it never acknowledged: the window stayed full
    finally:
        stop_clients(made)
        h.stop()
