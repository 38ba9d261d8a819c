"""store/_speedups.c `append_batch` (Appender.append's common case in one call) against its
Python reference `append_batch_py` and against the general loops it stands in for (prepare_run,
then write_run under the lock): three stores fed the same batches must return the same
PutResults, tell the listeners the same queue ends, leave the same CommitLog and consume-queue
bytes on disk, and read back the same messages. Small segments make batches roll mid-way, new
topics and queues (no offset yet) make them fall back, large bodies and property blocks reach
the size limits (an error with nothing written, in all three)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import EncodedMessage, FlushMode, MessageStore, PutResult, StoreConfig, kernel
from store import append as append_module
from store.errors import StoreError

speedups = pytest.importorskip("store._speedups")
kernel.configure(speedups)  # as store.kernel.load does; a pure-Python run skipped that
speedups.configure_batch(
    append_module.Route,
    append_module.BATCH_ROUTE_SLOTS,
    append_module.ConsumeQueue,
    append_module.BATCH_QUEUE_SLOTS,
)

QUEUES = ["l/a", "l/b", "l/c", "l/d"]
TOPICS = ["t1", "t2", "t3"]
SEGMENT = 4096
# A body this long, with its properties, is past what a 4096-byte segment takes.
TOO_BIG = 4000

message = st.tuples(
    st.sampled_from(TOPICS),
    st.lists(st.sampled_from(QUEUES), max_size=3, unique=True).map(lambda q: tuple(sorted(q))),
    st.one_of(st.binary(max_size=700), st.just(b"z" * TOO_BIG)),
    st.sampled_from(
        [{}, {"k": "v"}, {"mqtt.qos": "1", "mqtt.client": "c"}, {"mqtt.user": "u" * 300}]
    ),
)

Batch = list[tuple[str, tuple[str, ...], bytes, dict[str, str]]]


class Ends:
    """A listener recording every batch notice."""

    def __init__(self) -> None:
        self.seen: list[dict[str, int]] = []

    def on_arrivals(self, ends: dict[str, int]) -> None:
        self.seen.append(dict(ends))

    def on_arrival(self, queue: str, max_offset: int) -> None:
        """The per-queue notice of ArrivalListener; the store calls on_arrivals instead."""
        self.seen.append({queue: max_offset})


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ("commitlog" in p.parts or "consumequeue" in p.parts)
    }


def _feed(root: Path, batches: list[Batch]) -> tuple[Any, ...]:
    store = MessageStore.open(
        StoreConfig(data_dir=root, segment_size=SEGMENT, flush=FlushMode.ASYNC)
    )
    listener = Ends()
    store.add_listener(listener)
    results: list[object] = []
    try:
        for batch in batches:
            encoded = [(t, q, body, store.encode_properties(p)) for t, q, body, p in batch]
            try:
                results.append(store.append_encoded(encoded))
            except StoreError as e:
                results.append(type(e).__name__)
        ends = {q: (store.min_offset(q), store.max_offset(q)) for q in [*QUEUES, *TOPICS]}
        read = {
            q: [(m.body, m.properties, m.queue_offset) for m in store.get(q, 0, 10_000).messages]
            for q in [*QUEUES, *TOPICS]
        }
    finally:
        store.close()
    return results, listener.seen, ends, read


def _general_only(*args: object) -> int:
    return -1  # every batch through prepare_run and write_run, as before append_batch


VARIANTS = {
    "c": lambda: speedups.append_batch,
    "py": lambda: append_module.append_batch_py,
    "general": lambda: _general_only,
}


def _run_all(batches: list[Batch]) -> dict[str, tuple[Any, dict[str, bytes]]]:
    seen = {}
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        patch.setattr(append_module, "_time", lambda: 1_700_000_000.0)  # one store time
        for name, batch_step in VARIANTS.items():
            patch.setattr(append_module, "_append_batch", batch_step())
            root = Path(tmp) / name
            seen[name] = (_feed(root, batches), _files(root))
    return seen


@settings(max_examples=30, deadline=None)  # three stores per example
@given(batches=st.lists(st.lists(message, min_size=1, max_size=12), min_size=1, max_size=8))
def test_append_batch_writes_what_the_reference_and_the_general_loops_write(
    batches: list[Batch],
) -> None:
    seen = _run_all(batches)
    assert seen["c"] == seen["py"]
    assert seen["c"] == seen["general"]


def test_the_rare_cases_agree_and_are_reached() -> None:
    """Not vacuous: the batches below make append_batch write a whole batch, fall back
    (a new route; a queue with no offset yet; a record too big), and stop for a roll."""
    calls: list[tuple[int, int]] = []

    def counting(*args: Any) -> int:
        i: int = speedups.append_batch(*args)
        calls.append((i, len(args[0])))
        return i

    big = {"mqtt.user": "u" * 300}
    batches: list[Batch] = [
        [("t1", ("l/a",), b"a" * 100, {})],  # new route: fallback
        [("t1", ("l/a",), b"b" * 100, {}), ("t1", ("l/a",), b"c" * 100, big)],  # whole batch
        [("t1", ("l/a",), b"d" * 1000, {})] * 5,  # rolls mid-way (4096-byte segments)
        [("t1", ("l/a",), b"e" * 10, {}), ("t2", ("l/d",), b"f" * 10, {})],  # l/d: new queue
        [("t1", ("l/a",), b"g" * TOO_BIG, {})],  # too big: refused, nothing written
    ]
    seen = _run_all(batches)
    assert seen["c"] == seen["py"] == seen["general"]
    results = seen["c"][0][0]
    assert results[-1] == "MessageTooLargeError"
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        patch.setattr(append_module, "_append_batch", counting)
        _feed(Path(tmp), batches)
    assert calls[0] == (-1, 1)  # the route was new
    assert calls[1] == (2, 2)  # written whole
    assert 0 < calls[2][0] < 5  # stopped for the roll; the general loop wrote the rest
    assert calls[3] == (-1, 2)  # a new route with a new queue
    assert calls[4] == (-1, 1)  # too big for the common case: the general path refuses it


def test_a_stale_route_is_left_to_the_general_loops() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = MessageStore.open(
            StoreConfig(data_dir=Path(tmp), segment_size=SEGMENT, flush=FlushMode.ASYNC)
        )
        try:
            block = store.encode_properties({})
            store.append_encoded([("t", ("l/a",), b"x", block)])
            msgs: list[EncodedMessage] = [("t", ("l/a",), b"y", block)]
            gen = store.queues_table.generation
            args = (msgs, store._appender.routes, 1 << 20, 1, bytearray(), 1 << 40)
            for step in (speedups.append_batch, append_module.append_batch_py):
                state = [0, 0]
                results: list[PutResult] = []
                ends: dict[str, int] = {}
                stale = step(*args, state, gen + 1, {}, results, append_module.PutResult, ends)
                assert (stale, state, results, ends) == (-1, [0, 0], [], {})
        finally:
            store.close()


def test_the_store_uses_the_c_batch() -> None:
    if append_module._run_kernel is None:
        pytest.skip("a LMQTT_PURE_PYTHON switch is set: the store runs the reference")
    assert append_module._append_batch is speedups.append_batch
