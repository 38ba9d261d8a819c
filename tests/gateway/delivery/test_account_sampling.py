"""The delivery account's sampling is driven by change: an offline persistent session's queues
are watched (ArrivalHub), so a cycle asks the store about the queues that grew, not about every
offline session. A real store and account file; the cycles are walked by the test."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.delivery.account import DeliveryAccount
from gateway.delivery.arrivals import ArrivalHub
from gateway.session.model import NEVER_EXPIRES, Session, SubscriptionState
from store import AccountWriter, MessageStore, StoreConfig, read_account
from topicmap import queue_name

N = 50


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    s = MessageStore.open(StoreConfig(data_dir=tmp_path / "data"))
    yield s
    s.close()


def test_a_cycle_asks_about_the_offline_queues_that_grew_only(
    tmp_path: Path, store: MessageStore
) -> None:
    loop = asyncio.new_event_loop()  # the hub's; notices come on this (its) thread
    try:
        hub = ArrivalHub(loop)
        store.add_listener(hub)
        asked: list[str] = []

        def max_offset(queue: str) -> int:
            asked.append(queue)
            return store.max_offset(queue)

        account = DeliveryAccount(AccountWriter(tmp_path / "data"), max_offset, hub)
        sessions: dict[str, Session] = {}
        for i in range(N):
            s = Session(f"dev-{i}", 4, NEVER_EXPIRES)
            s.add_subscription(
                SubscriptionState(f"dev/{i}/cmd", queue_name(f"dev/{i}/cmd"), None, 1)
            )
            sessions[s.client_id] = s

        def cycle() -> list[str]:
            """One whole cycle: the subscribers it wrote records for."""
            asked.clear()
            before = len(read_account(tmp_path / "data"))
            for _ in account.start_cycle(sessions, []):
                pass
            account.flush(moved=False)
            return sorted(r.subscriber for r in read_account(tmp_path / "data")[before:])

        # The first cycle finds the sessions restored offline, once: it looks at each.
        assert cycle() == []
        assert len(asked) == N
        # Nothing grew: nothing asked, nothing written, however many are offline.
        assert cycle() == []
        assert asked == []
        seven = queue_name("dev/7/cmd")
        store.put("dev", b"x", [seven])
        assert cycle() == ["dev-7"]
        assert asked == [seven]  # the record's queue end
        assert hub.watchers(seven) == 0  # the account watches, but reads nothing
        # Online again (its loop started): no longer sampled as offline.
        account.online(sessions["dev-7"])
        store.put("dev", b"y", [seven])
        assert cycle() == []
        assert asked == []
        # Offline again after its loop ran: looked at once (it may owe), then by growth only.
        account.offline(sessions["dev-7"])
        assert cycle() == ["dev-7"]  # its queue holds 2 messages it never acknowledged
        assert cycle() == []
        assert asked == []
        # A session that ends while offline is no longer watched.
        account.ended(sessions["dev-3"], sessions["dev-3"].subscriptions["dev/3/cmd"])
        del sessions["dev-3"]
        account.flush()
        store.put("dev", b"z", [queue_name("dev/3/cmd")])
        assert cycle() == []
    finally:
        loop.close()
