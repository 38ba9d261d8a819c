"""The C twin of PublishPath.append_publishes's loop (`encode_publishes` in
gateway/messages/_batch.c) against its Python reference (gateway/messages/publishing.py
`encode_publishes_py`): the same stop index, the same (parent, light queues, payload,
block) messages and the very same property dicts, for PUBLISHes with and without a cached
route, a cached block, MQTT 5 properties and packet ids; a publisher's new block made in the
loop (PublishProperties.new_plain and its C twin) for names and client ids of every kind; and
the whole append (the loop that finishes what they leave) against the block
PublishProperties.of gives, and the store's own encoding."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import accelerators
from gateway.config import GatewaySettings
from gateway.messages import publishing, records
from gateway.messages.records import PublishProperties, _base_properties
from gateway.protocol import Properties, Publish
from gateway.storage.embedded import open_storage
from topicmap.record import PID

speedups = pytest.importorskip("gateway.messages._batch")
if publishing._ENCODE_PUBLISHES is publishing.encode_publishes_py:
    pytest.skip(
        "the gateway runs the reference (a LMQTT_PURE_PYTHON switch)", allow_module_level=True
    )


def _encode(props: dict[str, str]) -> bytes:
    return "".join(f"{k}\x01{v}\x02" for k, v in props.items()).encode()


ROUTES = {"a/1": ("a", ("a/#",)), "a/2": ("a", ("a/#", "+/2")), "b": ("b", ())}

publishes = st.builds(
    Publish,
    topic=st.sampled_from(["a/1", "a/2", "b", "unrouted"]),
    payload=st.binary(max_size=20),
    qos=st.sampled_from([0, 1, 2]),
    retain=st.booleans(),
    packet_id=st.sampled_from([None, 1, 65535, 300]),
    properties=st.sampled_from([None, None, None, Properties(content_type="x")]),
)


def _publishers(seeds: list[Publish]) -> list[PublishProperties]:
    out = []
    for name in ("c1", "c2"):
        p = PublishProperties(name, _encode)
        for pub in seeds:  # blocks a publisher encoded before
            p.of(pub)
        out.append(p)
    return out


@given(
    pubs=st.lists(publishes, max_size=10),
    seeds=st.lists(publishes, max_size=6),
    owners=st.lists(st.integers(0, 1), min_size=10, max_size=10),
    start=st.integers(0, 3),
)
def test_c_loop_equals_reference(
    pubs: list[Publish], seeds: list[Publish], owners: list[int], start: int
) -> None:
    publishers = _publishers(seeds)
    blocks = [publishers[owners[k]] for k in range(len(pubs))]
    start = min(start, len(pubs))
    got: list[Any] = []
    for run in (speedups.encode_publishes, publishing.encode_publishes_py):
        messages: list[Any] = []
        props: list[Any] = []
        stop = run(pubs, blocks, ROUTES, messages, props, start)
        got.append((stop, messages, [id(p) for p in props]))
    assert got[0] == got[1]
    stop, messages, _ = got[0]
    for pub, publisher, message in zip(pubs[start:stop], blocks[start:stop], messages, strict=True):
        route = ROUTES[pub.topic]
        assert message == (route[0], route[1], pub.payload, publisher.of(pub)[0])


def test_the_loop_takes_cached_publishes_and_stops_at_others() -> None:
    publisher = PublishProperties("c", _encode)
    first = Publish("a/1", b"x", 1, packet_id=7)
    publisher.of(first)
    pubs = [first, Publish("a/1", b"y", 1, packet_id=8), Publish("unrouted", b"z", 0)]
    for run in (speedups.encode_publishes, publishing.encode_publishes_py):
        messages: list[Any] = []
        props: list[Any] = []
        assert run(pubs, [publisher] * 3, ROUTES, messages, props, 0) == 2
        assert [m[3] for m in messages] == [publisher.of(p)[0] for p in pubs[:2]]
        assert messages[1][3].endswith(b"mqtt.pid\x018\x02")
    with pytest.raises(ValueError):
        speedups.encode_publishes(pubs, [publisher], ROUTES, [], [], 0)


def test_the_build_matches_the_source() -> None:
    """A .so compiled from an older _batch.c would test old code."""
    source = Path(publishing.__file__).with_name("_batch.c")
    digest = accelerators.source_digest(source)
    assert digest == speedups.SOURCE_SHA256, "stale build: run `make .venv/.installed-dev`"


def test_the_c_loop_spells_no_record_key() -> None:
    """The record schema's names come from Python (configure), not from the C source."""
    source = Path(publishing.__file__).with_name("_batch.c").read_text()
    assert "mqtt." not in source


# New names for new blocks: ASCII, non-ASCII, the store's separators, a lone surrogate.
NEW_TOPICS = ["n/1", "n/\u00e9t\u00e9", "n/\x01", "n/\x02x", "n/\ud800", "n/\U0001f600"]
NEW_ROUTES = {**ROUTES, **{t: ("n", ("n/#",)) for t in NEW_TOPICS}}
new_publishes = st.builds(
    Publish,
    topic=st.sampled_from([*NEW_TOPICS, "a/1", "unrouted"]),
    payload=st.binary(max_size=8),
    qos=st.sampled_from([0, 1, 2]),
    retain=st.booleans(),
    packet_id=st.sampled_from([None, 1, 300]),
    properties=st.sampled_from([None, None, None, None, Properties(content_type="x")]),
)


@given(
    pubs=st.lists(new_publishes, max_size=10),
    client=st.sampled_from(["c", "d\u00e9v", "c\x01", "c\x02", "c\udc80"]),
    kinds=st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.booleans()), max_size=4),
)
def test_new_blocks_in_the_c_loop_equal_the_reference(
    pubs: list[Publish], client: str, kinds: list[tuple[int, bool]]
) -> None:
    """A device's first publish to its topic: both loops make the same block and properties
    (or both leave it to of()), and keep the same blocks, whatever the kinds known."""
    saved = dict(records.KIND_MIDDLES)
    records.KIND_MIDDLES.clear()
    try:
        teacher = PublishProperties("t", _encode)
        for qos, retain in kinds:  # the kinds whose middle the process knows
            teacher.of(Publish("a/1", b"", qos, retain=retain, packet_id=1 if qos else None))
        got = []
        for run in (speedups.encode_publishes, publishing.encode_publishes_py):
            publisher = PublishProperties(client, _encode)
            messages: list[Any] = []
            props: list[Any] = []
            stop = run(pubs, [publisher] * len(pubs), NEW_ROUTES, messages, props, 0)
            got.append((stop, messages, props, publisher.blocks))
        assert got[0] == got[1]
        stop, messages, props, _ = got[0]
        for pub, message, p in zip(pubs[:stop], messages, props, strict=True):
            fresh = PublishProperties(client, _encode)  # the store's encoding, from scratch
            records.KIND_MIDDLES.clear()
            assert (message[3], p) == fresh.of(pub)
    finally:
        records.KIND_MIDDLES.clear()
        records.KIND_MIDDLES.update(saved)


def test_a_first_publish_stays_in_the_c_loop_once_its_kind_is_known(tmp_path: Path) -> None:
    """On a real store: the loop takes a device's first publish (a routed new topic) without
    leaving for of(), with the block the store itself encodes."""
    store = open_storage(GatewaySettings(data_dir=tmp_path / "data"))
    try:
        PublishProperties("seed", store.encode_properties).of(Publish("s/0", b"", 1, packet_id=1))
        devices = [PublishProperties(f"dev-{d}", store.encode_properties) for d in range(3)]
        pubs = [Publish(f"site/{d}/temp", b"x", 1, packet_id=5) for d in range(3)]
        routes: dict[str, tuple[str, tuple[str, ...]]] = {
            p.topic: ("site", ("site/#",)) for p in pubs
        }
        for run in (speedups.encode_publishes, publishing.encode_publishes_py):
            for device in devices:
                device.blocks.clear()
            messages: list[Any] = []
            props: list[Any] = []
            assert run(pubs, devices, routes, messages, props, 0) == 3
            for d, (pub, message, p) in enumerate(zip(pubs, messages, props, strict=True)):
                base = _base_properties(pub.topic, 1, False, f"dev-{d}")
                assert p == base
                assert message[3] == store.encode_properties({**base, PID: "5"})
    finally:
        store.close()


def test_new_blocks_leak_no_reference() -> None:
    """The C loop's new block holds and lets go of what it reads (the kind's middle, the
    encoded client id, the name, the client id), block after block."""
    publisher = PublishProperties("dev-1", _encode)
    publisher.of(Publish("a/1", b"", 1, packet_id=1))  # teaches the kind (1, False)
    pubs = [Publish("a/2", b"x", 1, packet_id=2)]
    middle = records.KIND_MIDDLES[(1, False)]
    watched = (middle, publisher._client_raw, publisher._client_id, pubs[0].topic)

    def run() -> None:
        publisher.blocks.clear()
        assert speedups.encode_publishes(pubs, [publisher], ROUTES, [], [], 0) == 1

    run()
    counts = [sys.getrefcount(o) for o in watched]
    for _ in range(20_000):
        run()
    assert [sys.getrefcount(o) for o in watched] == counts
