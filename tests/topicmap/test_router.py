"""Router: trie routing against a reference matcher, reference counts, cache, snapshots."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.topicmap.strategies import filters, topics
from topicmap import NameTable, Router, Topic, TopicError, TopicFilter, filter_of, queue_name
from topicmap.topic import matches_levels

SPEC_FILTERS = [
    "sport/tennis/player1/#",
    "sport/tennis/+",
    "sport/#",
    "sport/+",
    "+/+",
    "/+",
    "+",
    "#",
    "$SYS/#",
    "$SYS/monitor/+",
    "+/monitor/Clients",
    "+/#",
]


def reference_route(registered: list[str], topic: str) -> set[str]:
    """Obviously correct and slow: test every filter."""
    levels = topic.split("/")
    return {f for f in registered if matches_levels(TopicFilter(f).levels, levels)}


def routed_filters(router: Router, topic: str) -> set[str]:
    return {filter_of(queue) for queue in router.route(topic)}


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        ("sport/tennis/player1", {"sport/tennis/player1/#", "sport/tennis/+", "sport/#", "#"}),
        ("sport/tennis/player1/ranking", {"sport/tennis/player1/#", "sport/#", "#", "+/#"}),
        ("sport", {"sport/#", "+", "#", "+/#"}),
        ("sport/", {"sport/+", "sport/#", "+/+", "#", "+/#"}),
        ("/finance", {"+/+", "/+", "#", "+/#"}),
        ("$SYS/monitor/Clients", {"$SYS/#", "$SYS/monitor/+"}),
        ("$SYS", {"$SYS/#"}),
        ("SYS/monitor/Clients", {"+/monitor/Clients", "#", "+/#"}),
        ("$other", set()),
    ],
)
def test_spec_examples_route(topic: str, expected: set[str]) -> None:
    router = Router()
    for text in SPEC_FILTERS:
        router.add(text)
    # "+/#" also matches every one-level topic; the table lists the spec's expectations.
    want = expected | ({"+/#"} if not topic.startswith("$") else set())
    assert routed_filters(router, topic) == want
    assert routed_filters(router, topic) == reference_route(SPEC_FILTERS, topic)


@settings(max_examples=120, deadline=None)
@given(st.lists(filters(), max_size=25), st.lists(topics(), min_size=1, max_size=10))
def test_route_equals_reference_matcher(registered: list[str], probes: list[str]) -> None:
    routers = [
        Router(names=NameTable()),
        Router(names=NameTable(), cache_size=0, prefix_cache_size=0),  # the plain walk
        Router(names=NameTable(), cache_size=2, prefix_cache_size=1),  # caches keep rolling
    ]
    for router in routers:
        for text in registered:
            router.add(text)
    for topic in probes:
        expected = {queue_name(f) for f in reference_route(registered, topic)}
        for router in routers:
            assert router.route(topic) == expected
            assert router.route(topic) == expected  # second time from a cache
            assert router.route_sorted(topic) == tuple(sorted(expected))
            assert router.route_sorted(topic) == tuple(sorted(expected))  # kept per shape


def test_refcounts_and_shared_subscriptions() -> None:
    router = Router()
    queue = router.add("site/+/temp")
    assert router.add("site/+/temp") == queue
    assert router.add("$share/g/site/+/temp") == queue
    assert router.filters() == {"site/+/temp": 3}
    assert router.route("site/1/temp") == {queue}
    assert router.remove("site/+/temp") is False
    assert router.remove("$share/g/site/+/temp") is False
    assert router.route("site/1/temp") == {queue}
    assert router.remove(TopicFilter("site/+/temp")) is True
    assert router.route("site/1/temp") == set()
    assert router.filters() == {}
    assert router.remove("site/+/temp") is False
    assert router.remove("never/added") is False


def test_removal_prunes_the_trie() -> None:
    router = Router()
    texts = ["a/b/c", "a/b/#", "a/+/c", "a/b", "#", "+", "/", "a//"]
    for text in texts:
        router.add(text)
    for text in texts:
        assert router.remove(text) is True
    assert router._root == {}


def test_a_filter_without_wildcards_leaves_no_trie_node() -> None:
    # A device's own topic is matched by one lookup of the topic, not by a trie leaf of its
    # own (the trie holds the wildcard filters); both ways route as before.
    router = Router(names=NameTable())
    exact = [f"cmd/{d}" for d in range(50)] + ["solo", "$SYS/x"]
    for text in exact:
        router.add(text)
    assert router._root == {}
    wild = router.add("cmd/+")
    assert router.route("cmd/7") == {queue_name("cmd/7"), wild}
    assert router.route("solo") == {queue_name("solo")}
    assert router.route("$SYS/x") == {queue_name("$SYS/x")}
    assert router.route("cmd/x") == {wild}
    assert router.add("$share/g/cmd/7") == queue_name("cmd/7")
    assert router.remove("cmd/7") is False  # the shared subscription's reference is left
    assert router.remove("$share/g/cmd/7") is True
    assert router.route("cmd/7") == {wild}
    for text in exact[:-3]:
        if text != "cmd/7":
            router.remove(text)
    router.remove("cmd/+")
    assert router._root == {} and router.route("cmd/8") == set()


def test_remove_keeps_siblings() -> None:
    router = Router()
    router.add("a/b/c")
    router.add("a/b")
    router.add("a/b/#")
    router.remove("a/b")
    assert routed_filters(router, "a/b/c") == {"a/b/c", "a/b/#"}
    assert routed_filters(router, "a/b") == {"a/b/#"}


def test_cache_is_invalidated_and_bounded() -> None:
    router = Router(cache_size=2)
    assert router.route("a/b") == set()
    queue = router.add("a/+")
    assert router.route("a/b") == {queue}
    for index in range(10):
        assert router.route(f"a/{index}") == {queue}
    router.remove("a/+")
    assert router.route("a/b") == set()
    assert len(router._cache) <= 2 and len(router._cache_old) <= 2


def test_prefix_cache_sees_additions_under_a_cached_prefix() -> None:
    router = Router(cache_size=0)
    first = router.add("d/1/temp")
    assert router.route("d/1/temp") == {first}  # caches the prefix "d/1"
    second = router.add("d/1/+")
    third = router.add("d/1/#")
    assert router.route("d/1/temp") == {first, second, third}
    assert router.route("d/1") == {third}
    router.remove("d/1/+")
    assert router.route("d/1/hum") == {third}


def test_new_devices_share_one_prefix_entry_per_shape() -> None:
    # A device id that no filter names is routed by its place alone: every new device under
    # site/k/dev shares one prefix entry, and the ids a filter does name keep their own.
    registered = ["site/+/dev/+/temp", "site/#", "site/3/dev/42/#", "site/+/dev/7/+", "+/+/dev/+"]
    router = Router(names=NameTable(), cache_size=0)
    for text in registered:
        router.add(text)
    probes = [f"site/{k}/dev/{d}/{m}" for k in range(6) for d in range(60) for m in ("temp", "x")]
    probes += [f"site/{k}/dev/{d}" for k in range(6) for d in range(60)]
    for topic in probes:
        expected = {queue_name(f) for f in reference_route(registered, topic)}
        assert router.route(topic) == expected, topic
    # site/k/dev/+ and site/k/dev/7 (6 each), site/3/dev/42, site/k/dev (6): not 360 devices.
    assert len(router._prefixes) == 19
    # The sorted answer is kept with the shape: the next device's is the same tuple.
    for topic in probes:
        expected = {queue_name(f) for f in reference_route(registered, topic)}
        assert router.route_sorted(topic) == tuple(sorted(expected)), topic
    assert router.route_sorted("site/2/dev/11/temp") is router.route_sorted("site/2/dev/12/temp")
    assert router.route_sorted("site/2/dev/7/temp") != router.route_sorted("site/2/dev/8/temp")
    router.add("site/1/dev/5/temp")  # a device named by a new filter leaves its shape
    assert router.route("site/1/dev/5/temp") == {
        queue_name(f)
        for f in reference_route([*registered, "site/1/dev/5/temp"], "site/1/dev/5/temp")
    }
    assert queue_name("site/1/dev/5/temp") not in router.route("site/1/dev/6/temp")


def test_route_result_is_a_fresh_set() -> None:
    router = Router()
    queue = router.add("a")
    router.route("a").add("junk")
    assert router.route("a") == {queue}


def test_uncached_router_routes() -> None:
    router = Router(cache_size=0, prefix_cache_size=0)
    queue = router.add("x/#")
    assert router.route("x/y") == {queue}
    assert router.route(Topic("x")) == {queue}


@pytest.mark.parametrize("topic", ["", "a/+", "#", "a\x00", "x" * 70_000])
def test_route_rejects_invalid_topics(topic: str) -> None:
    router = Router()
    router.add("#")
    with pytest.raises(TopicError):
        router.route(topic)


def test_route_accepts_a_long_valid_topic() -> None:
    router = Router()
    queue = router.add("#")
    assert router.route("x" * 20_000) == {queue}


def test_membership_and_queue_of() -> None:
    router = Router()
    queue = router.add("a/#")
    assert "a/#" in router and "$share/g/a/#" in router and TopicFilter("a/#") in router
    assert "b" not in router and "a/#/b" not in router and 5 not in router
    assert router.queue_of("$share/g/a/#") == queue
    assert router.queue_of("b") is None
    assert len(router) == 1


def test_snapshot_restores_through_json_with_long_filters() -> None:
    router = Router(names=NameTable())
    long_filter = "fleet/" + "v" * 300 + "/+/#"
    for text in ["a/+", "a/+", "$share/g/b/#", long_filter, "/"]:
        router.add(text)
    blob = router.snapshot_bytes()
    assert json.loads(blob) == router.snapshot()
    fresh_names = NameTable()
    restored = Router.restore(blob, names=fresh_names)
    assert restored.filters() == {"a/+": 2, "b/#": 1, long_filter: 1, "/": 1}
    long_queue = queue_name(long_filter, fresh_names)
    assert fresh_names.filter_of(long_queue) == long_filter
    assert router.snapshot()["names"] == {long_queue: long_filter}
    for topic in ["a/x", "b", "/", "fleet/" + "v" * 300 + "/1/2"]:
        assert restored.route(topic) == router.route(topic)
    restored.remove("a/+")
    assert restored.filters()["a/+"] == 1
    assert Router.restore(router.snapshot()).snapshot() == router.snapshot()


@pytest.mark.parametrize(
    ("snapshot", "hint"),
    [
        (b"{not json", "not JSON"),
        ("[]", "not a JSON object"),
        ({"format": "other", "version": 1, "filters": {}}, "format"),
        ({"format": "lmqtt.topicmap.router", "version": 9, "filters": {}}, "version"),
        ({"format": "lmqtt.topicmap.router", "version": 1, "filters": []}, "'filters'"),
        ({"format": "lmqtt.topicmap.router", "version": 1, "filters": {"a": 0}}, "positive"),
        ({"format": "lmqtt.topicmap.router", "version": 1, "filters": {"a": True}}, "positive"),
        ({"format": "lmqtt.topicmap.router", "version": 1, "filters": {"a/#/b": 1}}, "last"),
        ({"format": "lmqtt.topicmap.router", "version": 1, "filters": {"$share/g/a": 1}}, "once"),
        (
            {"format": "lmqtt.topicmap.router", "version": 1, "filters": {}, "names": []},
            "'names'",
        ),
    ],
)
def test_restore_rejects_bad_snapshots(snapshot: object, hint: str) -> None:
    with pytest.raises(TopicError, match=hint):
        Router.restore(snapshot)  # type: ignore[arg-type]


class RouterModel(RuleBasedStateMachine):
    """Random add / remove / route / snapshot sequences against a dict of refcounts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Router(names=NameTable(), cache_size=4, prefix_cache_size=2)
        self.model: dict[str, int] = {}

    @rule(text=filters(), shared=st.booleans())
    def add(self, text: str, shared: bool) -> None:
        self.router.add(f"$share/g/{text}" if shared else text)
        self.model[text] = self.model.get(text, 0) + 1

    @rule(text=filters())
    def remove(self, text: str) -> None:
        last = self.model.get(text) == 1
        assert self.router.remove(text) is last
        if text in self.model:
            self.model[text] -= 1
            if not self.model[text]:
                del self.model[text]

    @rule(topic=topics())
    def route(self, topic: str) -> None:
        assert routed_filters(self.router, topic) == reference_route(list(self.model), topic)

    @rule()
    def snapshot_restore(self) -> None:
        self.router = Router.restore(
            self.router.snapshot_bytes(), cache_size=4, prefix_cache_size=2
        )

    @invariant()
    def refcounts_match(self) -> None:
        assert self.router.filters() == self.model


TestRouterModel = RouterModel.TestCase
TestRouterModel.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_a_filter_without_wildcards_is_routed_beside_its_shape() -> None:
    # Such a filter is not in the trie, so its device keeps the shape its siblings share; the
    # answer kept per shape must not stand in for the device whose topic a filter names.
    registered = ["site/+/dev/+/temp", "site/2/dev/13/temp"]
    router = Router(names=NameTable(), cache_size=0)
    for text in registered:
        router.add(text)
    for topic in ("site/2/dev/12/temp", "site/2/dev/13/temp", "site/2/dev/14/temp"):
        expected = {queue_name(f) for f in reference_route(registered, topic)}
        assert router.route_sorted(topic) == tuple(sorted(expected)), topic
        assert router.route(topic) == expected, topic
    assert len(router.route_sorted("site/2/dev/13/temp")) == 2
