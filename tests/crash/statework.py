"""The state-log workload: a store's user appending state, compacting it and reopening it.

Run as a process under the recorder (``python -m tests.crash.statework DATA_DIR ROUNDS``), so
that its file-system calls are those of the store's first start (directories, the state and
offsets logs' first generation), of every later generation (one per open and per compaction)
and of every compaction (snapshot written, renamed, covered files deleted). Round ``i``
appends ``r<i> = i`` (a new key: the snapshot grows), ``k<i % KEYS> = i`` (keys rewritten:
compaction drops history) and, every third round, deletes ``r<i - 2>``; it then waits for the
fsync and prints ``<i> <CLOCK_MONOTONIC ns>``: the round is acknowledged. The process ends
with ``os._exit`` (a crash: no close).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from store import FlushMode, MessageStore, StateRecord, StoreConfig

KEYS = 5
COMPACT_EVERY = 7
REOPEN_EVERY = 20


def records(i: int) -> list[StateRecord]:
    out: list[StateRecord] = [(f"r{i}", b"%d" % i), (f"k{i % KEYS}", b"%d" % i)]
    if i % 3 == 0:
        out.append((f"r{i - 2}", None))
    return out


def expected(rounds: int) -> dict[str, bytes]:
    """The state once rounds 1..rounds are applied."""
    state: dict[str, bytes] = {}
    for i in range(1, rounds + 1):
        for key, value in records(i):
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
    return state


def _open(data: Path) -> MessageStore:
    return MessageStore.open(
        StoreConfig(data_dir=data, segment_size=64 * 1024, flush=FlushMode.SYNC)
    )


def main(data: Path, rounds: int) -> None:
    store = _open(data)
    for i in range(1, rounds + 1):
        store.sync_state(store.append_state(records(i)))
        print(i, time.monotonic_ns(), flush=True)
        if i % COMPACT_EVERY == 0:
            store.rewrite_state()
        if i % REOPEN_EVERY == 0:
            store.close()
            store = _open(data)
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
