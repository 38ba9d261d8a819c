"""The C twin of RecentMessages.add_many's loop (`extend_windows` in gateway/messages/_batch.c)
against its Python reference (gateway/messages/recent.py `extend_windows_py`): from the same
windows (none, one that a run continues, one with a gap, one with an evicted head) and the
same runs (consecutive or not, several queues), the same windows after (first, head, the very
same messages), the same trims and the same totals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.messages import recent
from gateway.messages.recent import _Window, extend_windows_py
from gateway.storage.port import StoredMessage

speedups = pytest.importorskip("gateway.messages._batch")
if recent._EXTEND_WINDOWS is extend_windows_py:
    pytest.skip(
        "the gateway runs the reference (a LMQTT_PURE_PYTHON switch)", allow_module_level=True
    )

QUEUES = ["a", "b/#", "+/c"]


def _msg(queue: str, offset: int, body: bytes) -> StoredMessage:
    return StoredMessage("p", body, {}, offset, offset * 10, 1, 1, offset, (queue,))


# Per queue: its window before (None: none; else first, head, length) and the run's offsets.
window_states = st.one_of(
    st.none(),
    st.tuples(st.integers(0, 50), st.integers(0, 3), st.integers(0, 6)),
)
runs_spec = st.lists(st.integers(0, 60), min_size=1, max_size=6)
plans = st.dictionaries(
    st.sampled_from(QUEUES),
    st.tuples(window_states, st.booleans(), runs_spec, st.booleans()),
    max_size=3,
)


def _build(
    plan: dict[str, tuple[tuple[int, int, int] | None, bool, list[int], bool]],
) -> tuple[dict[str, tuple[list[StoredMessage], int]], dict[str, _Window], dict[_Window, int]]:
    runs: dict[str, tuple[list[StoredMessage], int]] = {}
    windows: dict[str, _Window] = {}
    trims: dict[_Window, int] = {}
    for q, (state, follows, offsets, consecutive) in plan.items():
        start = offsets[0]
        if state is not None:
            first, head, length = state
            w = _Window(q, first)
            w.head = min(head, length)
            w.msgs = [_msg(q, first - w.head + i, b"w") for i in range(length)]
            windows[q] = w
            if follows:  # the run continues the window
                start = w.first + len(w.msgs) - w.head
            if length % 2:
                trims[w] = length
        if consecutive:
            offsets = [start + i for i in range(len(offsets))]
        run = [_msg(q, off, b"x" * (off % 5)) for off in offsets]
        runs[q] = (run, sum(len(m.body) for m in run))
    return runs, windows, trims


def _seen(windows: dict[str, _Window], trims: dict[_Window, int]) -> tuple[object, object]:
    shape = {q: (w.queue, w.first, w.head, [id(m) for m in w.msgs]) for q, w in windows.items()}
    counted = sorted((w.queue, w.first, n) for w, n in trims.items())
    return shape, counted


@given(plans)
def test_extend_windows_matches_reference(
    plan: dict[str, tuple[tuple[int, int, int] | None, bool, list[int], bool]],
) -> None:
    runs, windows, trims = _build(plan)
    runs2 = {q: (list(run), n) for q, (run, n) in runs.items()}
    windows2: dict[str, _Window] = {}
    twin: dict[_Window, _Window] = {}
    for q, w in windows.items():
        c = _Window(q, w.first)
        c.head = w.head
        c.msgs = list(w.msgs)
        windows2[q] = twin[w] = c
    trims2 = {twin[w]: n for w, n in trims.items()}
    ours = recent._EXTEND_WINDOWS(runs, windows, trims)
    reference = extend_windows_py(runs2, windows2, trims2)
    assert ours == reference
    assert _seen(windows, trims) == _seen(windows2, trims2)


def test_a_continued_window_is_extended_in_place() -> None:
    w = _Window("a", 5)
    w.msgs = [_msg("a", 5, b"")]
    windows = {"a": w}
    trims: dict[_Window, int] = {}
    run = [_msg("a", 6, b"xy"), _msg("a", 7, b"z")]
    assert recent._EXTEND_WINDOWS({"a": (run, 3)}, windows, trims) == (2, 3)
    assert windows["a"] is w and w.msgs[1:] == run and trims == {w: 2}


def test_rejects_what_is_not_a_run() -> None:
    with pytest.raises(TypeError):
        recent._EXTEND_WINDOWS({"a": ([1], 0)}, {}, {})
    with pytest.raises(TypeError):
        recent._EXTEND_WINDOWS({"a": ([_msg("a", 0, b"")], 0)}, {"a": object()}, {})
