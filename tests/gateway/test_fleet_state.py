"""State kept per device must not cost the event loop O(devices) at once.

- Session saves are encoded a few hundred sessions per loop step, into the same document.
- Clean sessions' read positions are kept in memory only: a flush does not rewrite them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gateway import session as session_module
from gateway.session import Session, SessionRegistry, SubscriptionState
from store import MessageStore, StoreConfig
from store.offsets import ConsumerOffsets, read_offsets_file


def _registry(tmp_path: Path, sessions: int) -> tuple[MessageStore, SessionRegistry]:
    store = MessageStore.open(StoreConfig(data_dir=tmp_path / "d"))
    registry = SessionRegistry(store, lambda s: None)
    for i in range(sessions):
        s = Session(f"dev-{i}", 4, 3600 if i % 3 == 0 else 0)
        s.add_subscription(
            SubscriptionState(
                topic_filter=f"cmd/{i}",
                queue=f"%LMQ%cmd/{i}",
                share_group=None,
                qos=1,
                start_offset=0,
                next_offset=i,
                start_phys=0,
            )
        )
        if i % 2:
            s.connection = object()  # type: ignore[assignment]  # connected: listed too
        registry.sessions[s.client_id] = s
    return store, registry


async def test_stepwise_save_matches_the_whole_document_and_yields(tmp_path: Path) -> None:
    count = session_module.SERIALIZE_STEP * 3 + 11
    store, registry = _registry(tmp_path, count)
    try:
        turns = 0

        async def other_work() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(other_work())
        await asyncio.sleep(0)
        before = turns
        stepwise = await registry._serialize_in_steps()
        ticker.cancel()
        assert turns - before >= 3
        whole = json.loads(registry._serialize())
        assert json.loads(stepwise) == whole
        # Offline clean sessions are not listed; persistent and connected ones are.
        listed = set(whole["sessions"])
        assert "dev-0" in listed and "dev-1" in listed and "dev-2" not in listed
    finally:
        store.close()


async def test_stepwise_save_of_no_sessions_is_valid_json(tmp_path: Path) -> None:
    store, registry = _registry(tmp_path, 0)
    try:
        assert json.loads(await registry._serialize_in_steps()) == json.loads(registry._serialize())
    finally:
        store.close()


def test_volatile_offsets_are_readable_but_never_written(tmp_path: Path) -> None:
    path = tmp_path / "consumer_offsets.json"
    offsets = ConsumerOffsets(path)
    offsets.commit("backend", "q/all", 5)
    offsets.commit("dev-1", "q/cmd1", 3, durable=False)
    assert offsets.persist()
    offsets.commit("dev-1", "q/cmd1", 4, durable=False)
    assert not offsets.persist()  # nothing durable changed: no rewrite
    assert offsets.get("dev-1", "q/cmd1") == 4
    assert offsets.all() == {("backend", "q/all"): 5, ("dev-1", "q/cmd1"): 4}
    assert read_offsets_file(path) == {("backend", "q/all"): 5}
    # An entry already durable stays durable whatever a later commit says.
    offsets.commit("backend", "q/all", 6, durable=False)
    assert offsets.persist()
    assert read_offsets_file(path) == {("backend", "q/all"): 6}
    offsets.remove("dev-1", "q/cmd1")
    assert offsets.get("dev-1", "q/cmd1") is None
