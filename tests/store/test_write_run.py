"""store/_speedups.c `write_run` and `prepare_run` (Appender._section's and Appender.append's
loops in C) against their Python references in store/append.py, `write_run_py` and
`prepare_run_py`: two stores fed the same batches, one per implementation, must
return the same PutResults, leave the same CommitLog and consume-queue bytes on disk, the
same queue ends, and read back the same messages; small segments make the runs stop for
rolls, new queues make them stop for routes to resolve."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import FlushMode, MessageStore, StoreConfig, kernel
from store import append as append_module
from store import results as results_module

speedups = pytest.importorskip("store._speedups")
kernel.configure(speedups)  # as store.kernel.load does; a pure-Python run skipped that

QUEUES = ["l/a", "l/b", "l/c", "l/d"]

message = st.tuples(
    st.sampled_from(["t1", "t2", "t3"]),
    st.lists(st.sampled_from(QUEUES), max_size=3, unique=True).map(lambda q: tuple(sorted(q))),
    st.binary(max_size=700),
    st.sampled_from([{}, {"k": "v"}, {"mqtt.qos": "1", "mqtt.client": "c"}]),
)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ("commitlog" in p.parts or "consumequeue" in p.parts)
    }


def _feed(
    root: Path, batches: list[list[tuple[str, tuple[str, ...], bytes, dict[str, str]]]]
) -> tuple[list[object], dict[str, tuple[int, int]], dict[str, list[bytes]]]:
    store = MessageStore.open(StoreConfig(data_dir=root, segment_size=4096, flush=FlushMode.ASYNC))
    results: list[object] = []
    try:
        for batch in batches:
            encoded = [(t, q, body, store.encode_properties(p)) for t, q, body, p in batch]
            results.append(store.append_encoded(encoded))
        ends = {q: (store.min_offset(q), store.max_offset(q)) for q in [*QUEUES, "t1", "t2", "t3"]}
        read = {
            q: [m.body for m in store.get(q, store.min_offset(q), 10_000).messages]
            for q in [*QUEUES, "t1"]
        }
    finally:
        store.close()
    return results, ends, read


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(message, min_size=1, max_size=12), min_size=1, max_size=6))
def test_c_run_writes_what_the_reference_writes(
    batches: list[list[tuple[str, tuple[str, ...], bytes, dict[str, str]]]],
) -> None:
    seen = []
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        patch.setattr(append_module, "_time", lambda: 1_700_000_000.0)  # one store time
        # The general loops on every batch (append_batch has its own test, test_append_batch.py).
        patch.setattr(append_module, "_append_batch", lambda *args: -1)
        for name, run, prepare in (
            ("c", speedups.write_run, speedups.prepare_run),
            ("py", append_module.write_run_py, append_module.prepare_run_py),
        ):
            patch.setattr(append_module, "_write_run", run)
            patch.setattr(append_module, "_prepare_run", prepare)
            root = Path(tmp) / name
            seen.append((_feed(root, batches), _files(root)))
    (c_out, c_files), (py_out, py_files) = seen
    assert c_out == py_out
    assert c_files == py_files
    assert c_out[1]["t1"][1] + c_out[1]["t2"][1] + c_out[1]["t3"][1] == sum(map(len, batches))


def test_a_run_stops_for_a_roll_and_a_new_route() -> None:
    """Not vacuous: a run stops where the segment is full and where a route is new."""
    with tempfile.TemporaryDirectory() as tmp:
        store = MessageStore.open(
            StoreConfig(data_dir=Path(tmp), segment_size=4096, flush=FlushMode.ASYNC)
        )
        try:
            block = store.encode_properties({})
            first = store.append_encoded([("t", ("l/a",), b"x" * 100, block)])
            route, body = next(iter(store._appender.routes.values())), b"y" * 1000
            batch = [(route, body, block, None)] * 5
            state = [first[0].end_offset, 0]
            results: list[object] = []
            writer = store.commitlog.batch()
            with store._lock:
                gen = store.queues_table.generation
                stop = speedups.write_run(
                    batch, 0, 1, writer.buf, writer.limit, state, gen,
                    store.queues_table.dirty, results, append_module.PutResult,
                )  # fmt: skip
                writer.finish(state[0])
            assert 0 < stop < 5  # 4096-byte segments hold three of these records
            assert len(results) == stop and state[1] == 2 * stop
            stale = speedups.write_run(
                batch, 0, 1, bytearray(), 1 << 40, [0, 0], gen + 1, {}, [], append_module.PutResult
            )
            assert stale == 0  # a route resolved for another generation: left to Python
        finally:
            store.close()


PURE = any(
    os.environ.get(name, "") not in ("", "0")
    for name in ("LMQTT_PURE_PYTHON", "LMQTT_PURE_PYTHON_APPEND")
)


@pytest.mark.skipif(PURE, reason="a LMQTT_PURE_PYTHON switch is set: the store runs the reference")
def test_the_store_uses_the_c_runs() -> None:
    assert append_module._write_run is speedups.write_run
    assert append_module._prepare_run is speedups.prepare_run
    assert results_module._STORED_RUNS is speedups.stored_runs
