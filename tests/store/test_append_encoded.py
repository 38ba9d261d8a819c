"""MessageStore.append_encoded: the batched put with pre-encoded property blocks."""

from __future__ import annotations

import pytest

from store import (
    GetStatus,
    InvalidPropertyError,
    InvalidQueueNameError,
    MessageTooLargeError,
    StoreError,
)
from tests.store.conftest import OpenStore


class Arrivals:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_arrival(self, queue: str, max_offset: int) -> None:
        self.calls.append((queue, max_offset))


def test_records_equal_those_of_put(open_store: OpenStore) -> None:
    s = open_store()
    props = {"mqtt.topic": "a/b", "k": "v"}
    block = s.encode_properties(props)
    rs = s.append_encoded(
        [("a", ("%LMQ%x", "%LMQ%y"), b"m0", block), ("a", ("%LMQ%x",), b"m1", block + block[:0])]
    )
    r2 = s.put("a", b"m2", ["%LMQ%x", "%LMQ%y"], props)
    assert [r.queue_offset for r in rs] == [0, 1]
    assert rs[0].light_offsets == {"%LMQ%x": 0, "%LMQ%y": 0}
    assert rs[1].light_offsets == {"%LMQ%x": 1}
    got = s.get("%LMQ%x", 0, 10)
    assert got.status is GetStatus.FOUND
    assert [m.body for m in got.messages] == [b"m0", b"m1", b"m2"]
    assert all(m.properties == props for m in got.messages)
    assert got.messages[0].queues == ("%LMQ%x", "%LMQ%y")
    assert s.message_at(rs[0].physical_offset).properties == props
    assert rs[1].end_offset == r2.physical_offset


def test_blocks_concatenate(open_store: OpenStore) -> None:
    s = open_store()
    block = s.encode_properties({"a": "1"}) + s.encode_properties({"b": "2"})
    s.append_encoded([("t", (), b"x", block)])
    assert s.get("t", 0).messages[0].properties == {"a": "1", "b": "2"}


@pytest.mark.parametrize(
    ("props", "error"),
    [
        ({"INNER_MULTI_DISPATCH": "q"}, InvalidPropertyError),
        ({"k": "a\x01b"}, InvalidPropertyError),
        ({"": "v"}, InvalidPropertyError),
    ],
)
def test_encode_properties_validates(
    open_store: OpenStore, props: dict[str, str], error: type[StoreError]
) -> None:
    with pytest.raises(error):
        open_store().encode_properties(props)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (("t", ("%LMQ%a",), b"x" * 5000, b""), MessageTooLargeError),
        (("t", ("bad,name",), b"x", b""), InvalidQueueNameError),
        (("t", ("%LMQ%a",), b"x", b"k\x01" + b"v" * 5000 + b"\x02"), StoreError),
    ],
)
def test_a_bad_message_stores_none_of_the_batch(
    open_store: OpenStore, bad: tuple[str, tuple[str, ...], bytes, bytes], error: type[StoreError]
) -> None:
    s = open_store(segment_size=4096, max_body_size=4096)
    arrivals = Arrivals()
    s.add_listener(arrivals)
    ok = ("t", ("%LMQ%a",), b"ok", b"")
    end = s.log_max_offset
    with pytest.raises(error):
        s.append_encoded([ok, ok, bad, ok])
    assert s.log_max_offset == end
    assert s.max_offset("t") == 0
    assert arrivals.calls == []
    assert s.append_encoded([ok])[0].light_offsets == {"%LMQ%a": 0}


def test_listeners_hear_once_per_queue(open_store: OpenStore) -> None:
    s = open_store()
    arrivals = Arrivals()
    s.add_listener(arrivals)
    s.append_encoded(
        [("t", ("%LMQ%all", f"%LMQ%q{i % 3}"), b"%d" % i, b"") for i in range(10)]
        + [("u", ("%LMQ%all",), b"u", b"")]
    )
    assert sorted(arrivals.calls) == sorted(
        [("t", 10), ("u", 1), ("%LMQ%all", 11), ("%LMQ%q0", 4), ("%LMQ%q1", 3), ("%LMQ%q2", 3)]
    )


class BatchArrivals(Arrivals):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[dict[str, int]] = []

    def on_arrivals(self, ends: dict[str, int]) -> None:
        self.batches.append(dict(ends))


def test_a_batch_listener_hears_once_per_batch(open_store: OpenStore) -> None:
    """A listener with on_arrivals gets one call per appended batch, with every queue the
    batch touched and its end, and no per-queue calls; a plain listener beside it still
    hears once per queue."""
    s = open_store()
    batch, plain = BatchArrivals(), Arrivals()
    s.add_listener(batch)
    s.add_listener(plain)
    s.append_encoded([("t", ("%LMQ%a", f"%LMQ%q{i}"), b"x", b"") for i in range(3)])
    s.put("t", b"y", ["%LMQ%a"], None)
    expected = {"t": 3, "%LMQ%a": 3, "%LMQ%q0": 1, "%LMQ%q1": 1, "%LMQ%q2": 1}
    assert batch.batches == [expected, {"t": 4, "%LMQ%a": 4}]
    assert batch.calls == []
    assert sorted(plain.calls) == sorted([*expected.items(), ("t", 4), ("%LMQ%a", 4)])


async def test_wait_durable_in_sync_mode(open_store: OpenStore) -> None:
    s = open_store(flush="sync")
    r = s.append_encoded([("t", (), b"x", b"")])[-1]
    await s.wait_durable(r.end_offset)
    assert s.commitlog.flushed_pos >= r.end_offset
