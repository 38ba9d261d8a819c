"""store/_speedups.c `stored_runs` against its Python reference `stored_runs_py`: the same
StoredMessages per light queue (same type, same fields, same order) and the same body byte
counts, for batches as append_encoded returns them (light queues named once, twice, or not
matching the route's tuple; messages with no light queue), and the same refusal of lists
that differ in length."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from store import PutResult, StoredMessage
from store import results as results_module

speedups = pytest.importorskip("store._speedups")

# (topic, light queues, body, property block): what an appended batch is made of.
Encoded = tuple[str, tuple[str, ...], bytes, bytes]
Batch = tuple[list[Encoded], list[dict[str, str]], list[PutResult]]

QUEUES = ["a", "b", "c/#", "d"]


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    messages: list[Encoded] = []
    props: list[dict[str, str]] = []
    results: list[PutResult] = []
    phys = 0
    for k in range(draw(st.integers(0, 10))):
        lights = draw(st.lists(st.sampled_from(QUEUES), max_size=3, unique=True))
        routed = tuple(draw(st.sampled_from([lights, lights + lights[:1], lights[:1]])))
        body = draw(st.binary(max_size=50))
        messages.append((draw(st.sampled_from(["p", "q"])), routed, body, b"block"))
        props.append(draw(st.sampled_from([{}, {"mqtt.qos": "1"}])))
        offsets = {q: draw(st.integers(0, 1 << 40)) for q in lights}
        end = phys + 100 + len(body)
        results.append(PutResult(phys, k, offsets, end, draw(st.integers(0, 1 << 41))))
        phys = end
    return messages, props, results


@given(batch=batches())
def test_c_runs_equal_python_runs(
    batch: Batch,
) -> None:
    ours = speedups.stored_runs(*batch, StoredMessage)
    reference = results_module.stored_runs_py(*batch)
    assert ours == reference
    assert list(ours) == list(reference)
    for run, _ in ours.values():
        assert all(type(m) is StoredMessage for m in run)
        assert all(m[2] is batch[1][0] or m[2] in batch[1] for m in run)


def test_runs_of_a_batch() -> None:
    """Not vacuous: two messages, one in two queues, one in one."""
    messages = [("p", ("a", "b"), b"xy", b""), ("p", ("a",), b"z", b"")]
    props: list[dict[str, str]] = [{}, {"k": "v"}]
    results = [PutResult(0, 7, {"a": 3, "b": 9}, 90, 5), PutResult(90, 8, {"a": 4}, 180, 6)]
    for runs in (
        speedups.stored_runs(messages, props, results, StoredMessage),
        results_module.stored_runs_py(messages, props, results),
    ):
        assert runs == {
            "a": (
                [
                    StoredMessage("p", b"xy", {}, 3, 0, 5, 5, 7, ("a", "b")),
                    StoredMessage("p", b"z", {"k": "v"}, 4, 90, 6, 6, 8, ("a",)),
                ],
                3,
            ),
            "b": ([StoredMessage("p", b"xy", {}, 9, 0, 5, 5, 7, ("a", "b"))], 2),
        }


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError):
        speedups.stored_runs([("p", (), b"", b"")], [], [], StoredMessage)
    with pytest.raises(ValueError):
        results_module.stored_runs_py([("p", (), b"", b"")], [], [])
