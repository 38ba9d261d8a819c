"""Housekeeping's save (SessionRegistry.save_if_dirty) in paced steps: the event loop runs
other work between its steps, and a save cancelled part way (the gateway stopping) leaves the
records it had not written to the final save, so none is lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.config import GatewaySettings
from gateway.session import registry as registry_module
from gateway.session.model import Session
from gateway.session.registry import SessionRegistry
from gateway.storage.embedded import open_storage
from store import read_state

SESSIONS = 3 * registry_module.PACED_RECORDS_PER_STEP + 7


def _registry(data_dir: Path) -> SessionRegistry:
    registry = SessionRegistry(open_storage(GatewaySettings(data_dir=data_dir)))
    for i in range(SESSIONS):
        session = Session(f"dev-{i}", 4, 3600)
        registry.add(session)
        registry.mark_progress(session)
    return registry


def _saved(data_dir: Path) -> set[str]:
    return set(read_state(data_dir / "state", "session/"))


def test_a_paced_save_writes_every_record_and_lets_the_loop_run_between_steps(
    tmp_path: Path,
) -> None:
    registry = _registry(tmp_path / "data")
    turns = 0

    async def main() -> None:
        nonlocal turns
        save = asyncio.ensure_future(registry.save_if_dirty(progress_interval_s=0))
        while not save.done():
            turns += 1
            await asyncio.sleep(0)
        await save
        await registry.close()

    asyncio.run(main())
    registry._store.close()
    assert _saved(tmp_path / "data") == {f"dev-{i}" for i in range(SESSIONS)}
    # The other task ran during every pause, more than once (a pause is a timer, not one turn).
    steps = -(-SESSIONS // registry_module.PACED_RECORDS_PER_STEP)
    assert turns > 2 * (steps - 1)


def test_a_save_cancelled_part_way_leaves_the_rest_to_the_final_save(tmp_path: Path) -> None:
    registry = _registry(tmp_path / "data")

    async def main() -> None:
        save = asyncio.ensure_future(registry.save_if_dirty(progress_interval_s=0))
        await asyncio.sleep(0)  # the first step is written, the save pauses
        save.cancel()
        await asyncio.gather(save, return_exceptions=True)
        await registry.close()  # the gateway's stop: the final save

    asyncio.run(main())
    registry._store.close()
    assert _saved(tmp_path / "data") == {f"dev-{i}" for i in range(SESSIONS)}
