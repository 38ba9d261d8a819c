"""The router: registered subscription filters in a trie, `route(topic)` -> light-queue names.

Theory of operation. The trie is nested plain dicts, because dict lookups are the cheapest
thing CPython does. A node maps a filter level to the child node; three keys never collide
with a level of a valid *topic* and carry the wildcards and the queues:

    node = {
        "<level>": child node,          # literal level (may be "" for an empty level)
        "+":       child node,          # single-level wildcard
        "#":       "%LMQ%...",          # queue of the filter <path>/#  (always a leaf)
        "/":       "%LMQ%...",          # queue of the filter that ends exactly at this node
    }

Topic levels never contain "/" and never equal "+" or "#" (topic names have no wildcards and
`route` checks that), so `node.get(level)` only ever finds a literal child.

Only filters with a wildcard are in the trie. A filter without one matches exactly the topic
equal to it, so it is found with one lookup of the topic in `_queues` (filter -> queue, which
holds every filter anyway): a fleet's devices each subscribing to their own topic (`cmd/42`)
leave no trie node behind (a leaf dict, its level string and a slot in its parent: about 270
bytes per device), and the walk never meets them.

`route` walks the topic's levels once, keeping the (few) nodes whose path matches so far:
at each node it collects "#" (matches one or more remaining levels, and also zero at the end:
`a/#` matches `a`), then follows the literal child and the "+" child. At the end it collects
"/" and "#" of the surviving nodes. Work is O(levels x live nodes); the live set is bounded
by the wildcard shapes registered, not by how many filters exist. At the root a `$`-topic does
not follow "+" or "#" (MQTT-4.7.2-1).

Two bounded caches make the walk cheaper still; any add or remove that changes the trie clears
both. The topic cache maps a topic string to its result, in two generations (a cheap
approximation of LRU). The prefix cache maps a topic without its last level (`site/7/dev/42`)
to what every topic under it matches whatever the last level is ("#" and "+" filters) and the
nodes whose literal children may match the last level, so the many metrics a device publishes
under one prefix only pay one dict lookup per live node. A prefix seen for the first time is
walked from the state its own parent path left (`site/7/dev`: the live nodes and the "#" queues
met so far, kept in the walk cache beside the prefix cache), so a fleet whose device id sits in
the middle of the topic (`site/7/dev/42/temp`: every prefix new, the parent paths few) walks one
level per new device, not all of them. A prefix whose last level is no literal child of the
nodes its parent path left (a device id no filter names) matches what any other value there
matches, so it is kept under its shape (`site/7/dev/+`: no topic prefix contains "+") and a
fleet's new devices share one entry. Such a shared entry also keeps, per last level, the sorted
tuple `route_sorted` answers (what a store record lists), so a fleet's new device costs the
prefix lookups, not the match and the sort. `cache_size=0, prefix_cache_size=0` is the plain
walk.
Not thread-safe: the gateway calls it from one event loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from topicmap.errors import IMPLEMENTATION_SPECIFIC_ERROR, TopicError
from topicmap.naming import DEFAULT_NAME_TABLE, NameTable
from topicmap.topic import Topic, TopicFilter

SNAPSHOT_FORMAT = "lmqtt.topicmap.router"
SNAPSHOT_VERSION = 1
_EXACT = "/"
_PLUS = "+"
_HASH = "#"
_SHORT_ENOUGH = 65_535 // 4
# Last levels whose sorted routes one shared prefix entry keeps (cleared when full).
_ENDS_SIZE = 1024

Node = dict[str, Any]
# A prefix's state (_settle): the nodes whose literal children may match the last level, the
# queues matched whatever the last level is, and, for an entry shared by a shape
# (`site/7/dev/+`), last level -> sorted queues (route_sorted); None for one prefix's own entry.
PrefixState = tuple[tuple[Node, ...], tuple[str, ...], dict[str, tuple[str, ...]] | None]


class Router:
    """Registered filters with reference counts, and `route(topic)` to their queue names.

    Shared subscriptions (`$share/g/f`) count as references to `f` and route to its queue.
    """

    __slots__ = (
        "_cache",
        "_cache_old",
        "_cache_size",
        "_named",
        "_names",
        "_prefix_cache_size",
        "_prefixes",
        "_queues",
        "_refs",
        "_root",
        "_walked",
    )

    def __init__(
        self,
        *,
        names: NameTable | None = None,
        cache_size: int = 65_536,
        prefix_cache_size: int = 65_536,
    ) -> None:
        self._root: Node = {}
        self._refs: dict[str, int] = {}
        self._queues: dict[str, str] = {}
        self._names = DEFAULT_NAME_TABLE if names is None else names
        # (underlying filter, queue name) of the last unregistered filter queue_name() named:
        # a new subscription asks its name (to open the queue) right before add().
        self._named: tuple[str, str] | None = None
        self._cache_size = max(0, cache_size)
        # Results are stored as tuples: a 5-name tuple is 80 bytes, a 5-name frozenset 700.
        self._cache: dict[str, tuple[str, ...]] = {}
        self._cache_old: dict[str, tuple[str, ...]] = {}
        self._prefix_cache_size = max(0, prefix_cache_size)
        self._prefixes: dict[str, PrefixState] = {}
        # A prefix's parent path -> (live nodes, "#" queues matched) after walking it (_settle).
        self._walked: dict[str, tuple[tuple[Node, ...], tuple[str, ...]]] = {}

    # registration -------------------------------------------------------------------------

    def add(self, filter: str | TopicFilter) -> str:
        """Take one reference to `filter`; return its light-queue name."""
        parsed = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        underlying = parsed.filter
        queue = self._queues.get(underlying)
        if queue is not None:
            self._refs[underlying] += 1
            return queue
        named = self._named
        if named is not None and named[0] == underlying:
            queue = named[1]
        else:
            queue = self._names.queue_name(parsed)
        if parsed.is_wildcard:  # a filter without one is matched in _queues (docstring)
            node = self._root
            *path, last = parsed.levels
            for level in path:
                child = node.get(level)
                if child is None:
                    child = node[level] = {}
                node = child
            if last == _HASH:
                node[_HASH] = queue
            else:
                child = node.get(last)
                if child is None:
                    child = node[last] = {}
                child[_EXACT] = queue
        self._queues[underlying] = queue
        self._refs[underlying] = 1
        self._invalidate()
        return queue

    def remove(self, filter: str | TopicFilter) -> bool:
        """Drop one reference; True when it was the last one and the filter is no longer
        routed. Removing a filter that is not registered returns False."""
        parsed = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        underlying = parsed.filter
        count = self._refs.get(underlying)
        if count is None:
            return False
        if count > 1:
            self._refs[underlying] = count - 1
            return False
        del self._refs[underlying]
        del self._queues[underlying]
        if not parsed.is_wildcard:
            self._invalidate()
            return True
        levels = parsed.levels
        if levels[-1] == _HASH:
            trail = [self._root]
            for level in levels[:-1]:
                trail.append(trail[-1][level])
            del trail[-1][_HASH]
            keys = levels[:-1]
        else:
            trail = [self._root]
            for level in levels:
                trail.append(trail[-1][level])
            del trail[-1][_EXACT]
            keys = levels
        # Prune nodes left empty, deepest first, so memory follows the live filter set.
        for depth in range(len(keys), 0, -1):
            if trail[depth]:
                break
            del trail[depth - 1][keys[depth - 1]]
        self._invalidate()
        return True

    def filters(self) -> dict[str, int]:
        """Registered (underlying) filters and their reference counts."""
        return dict(self._refs)

    def queue_name(self, filter: str | TopicFilter) -> str:
        """The queue `filter` has or would get from add() (registers nothing)."""
        parsed = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        underlying = parsed.filter
        queue = self._queues.get(underlying)
        if queue is None:
            queue = self._names.queue_name(parsed)
            self._named = (underlying, queue)
        return queue

    def queue_of(self, filter: str | TopicFilter) -> str | None:
        """The queue of a registered filter, or None."""
        parsed = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        return self._queues.get(parsed.filter)

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, filter: object) -> bool:
        if isinstance(filter, TopicFilter):
            return filter.filter in self._refs
        if isinstance(filter, str):
            try:
                return TopicFilter(filter).filter in self._refs
            except TopicError:
                return False
        return False

    # routing ------------------------------------------------------------------------------

    def route(self, topic: str | Topic) -> set[str]:
        """Queue names of every registered filter matching the topic name `topic`."""
        if type(topic) is not str:
            topic = topic.name if isinstance(topic, Topic) else Topic(topic).name
        hit = self._cache.get(topic)
        if hit is not None:
            return set(hit)
        hit = self._cache_old.get(topic)
        found = self._match(topic) if hit is None else set(hit)
        if self._cache_size:
            if len(self._cache) >= self._cache_size:
                self._cache_old = self._cache
                self._cache = {}
            self._cache[topic] = tuple(found) if hit is None else hit
        return found

    def _match(self, topic: str) -> set[str]:
        if (
            not topic
            or "+" in topic
            or "#" in topic
            or "\x00" in topic
            or len(topic) > _SHORT_ENOUGH
        ):
            Topic(topic)  # raises with the precise reason, or accepts a long valid topic
        cut = topic.rfind("/")
        if cut < 0:
            return self._match_one_level(topic)
        prefix = topic[:cut]
        state = self._prefixes.get(prefix)
        if state is None:
            state = self._settle(prefix)
        found = self._trie_end(state, topic[cut + 1 :])
        queue = self._queues.get(topic)  # the filter without a wildcard equal to the topic
        if queue is not None:
            found.add(queue)
        return found

    def route_sorted(self, topic: str) -> tuple[str, ...]:
        """`sorted(route(topic))` as a tuple, for a topic name (TopicError if invalid). Under a
        prefix whose state a shape shares (see the module docstring) the answer is kept per
        last level: the next device of the fleet publishing that metric gets the same tuple."""
        cut = topic.rfind("/")
        if (
            cut < 0
            or not self._prefix_cache_size
            or "+" in topic
            or "#" in topic
            or "\x00" in topic
            or len(topic) > _SHORT_ENOUGH
        ):
            return tuple(sorted(self.route(topic)))
        prefix = topic[:cut]
        state = self._prefixes.get(prefix)
        if state is None:
            state = self._settle(prefix)
        if topic in self._queues:  # a filter without a wildcard names it: not the shape's
            return tuple(sorted(self._match(topic)))
        last = topic[cut + 1 :]
        ends = state[2]
        if ends is None:
            return tuple(sorted(self._trie_end(state, last)))
        hit = ends.get(last)
        if hit is None:
            hit = tuple(sorted(self._trie_end(state, last)))
            if len(ends) >= _ENDS_SIZE:
                ends.clear()
            ends[last] = hit
        return hit

    @staticmethod
    def _trie_end(state: PrefixState, last: str) -> set[str]:
        """The queues of filters with a wildcard a topic `<prefix>/<last>` matches, from its
        prefix's state (a filter without one is looked up in `_queues` by the caller)."""
        found = set(state[1])
        # Only literal children depend on the last level: a filter ending there ("/"), or "#"
        # under it matching zero further levels (`a/b/#` matches `a/b`).
        for node in state[0]:
            child = node.get(last)
            if child is not None:
                queue = child.get(_EXACT)
                if queue is not None:
                    found.add(queue)
                queue = child.get(_HASH)
                if queue is not None:
                    found.add(queue)
        return found

    def _settle(self, prefix: str) -> PrefixState:
        """Everything a topic `prefix/<last>` matches whatever its last level is, and the nodes
        whose literal child named <last> may still end a matching filter; kept in the prefix
        cache (when on) under the prefix, or under its shape when its last level is no literal
        of the filters walked there (`site/7/dev/+`: every device id in that place matches
        the same "+" and "#" filters, so the new devices of a fleet share one entry)."""
        cut = prefix.rfind("/")
        key = prefix
        shared = False  # kept under its shape, for every prefix of that shape
        if cut > 0 and self._prefix_cache_size:
            # Walk the prefix's last level from the state its parent path left, kept.
            parent = prefix[:cut]
            walked = self._walked.get(parent)
            if walked is None:
                nodes, found = self._advance(parent.split("/"))
                if len(self._walked) >= self._prefix_cache_size:
                    self._walked.clear()
                walked = self._walked[parent] = (tuple(nodes), tuple(found))
            level = prefix[cut + 1 :]
            for node in walked[0]:
                if level in node:  # a literal child (a topic level is never a special key)
                    break
            else:
                key = parent + "/" + _PLUS  # no topic prefix contains "+"
                shared = True
                state = self._prefixes.get(key)
                if state is not None:
                    return state
            found = set(walked[1])
            nodes = self._step(walked[0], level, found)
        else:
            nodes, found = self._advance(prefix.split("/"))
        for node in nodes:
            queue = node.get(_HASH)  # one or more levels below the prefix
            if queue is not None:
                found.add(queue)
            child = node.get(_PLUS)  # `+` matches any last level
            if child is not None:
                queue = child.get(_EXACT)
                if queue is not None:
                    found.add(queue)
                queue = child.get(_HASH)
                if queue is not None:
                    found.add(queue)
        state = (tuple(nodes), tuple(found), {} if shared else None)
        if self._prefix_cache_size:
            if len(self._prefixes) >= self._prefix_cache_size:
                self._prefixes.clear()
            self._prefixes[key] = state
        return state

    def _match_one_level(self, topic: str) -> set[str]:
        queue = self._queues.get(topic)  # the filter without a wildcard equal to the topic
        found: set[str] = set() if queue is None else {queue}
        root = self._root
        ends = [root.get(topic)]
        if topic[0] != "$":
            queue = root.get(_HASH)
            if queue is not None:
                found.add(queue)
            ends.append(root.get(_PLUS))
        for node in ends:
            if node is not None:
                queue = node.get(_EXACT)
                if queue is not None:
                    found.add(queue)
                queue = node.get(_HASH)
                if queue is not None:
                    found.add(queue)
        return found

    def _advance(self, levels: list[str]) -> tuple[list[Node], set[str]]:
        """Consume `levels` (a topic's levels but its last): the nodes still matching, and the
        queues of "#" filters already matched on the way."""
        found: set[str] = set()
        root = self._root
        # First level by hand: `$`-topics skip the root's wildcards.
        first = levels[0]
        child = root.get(first)
        if first[:1] == "$":
            nodes = [] if child is None else [child]
        else:
            queue = root.get(_HASH)
            if queue is not None:
                found.add(queue)
            nodes = [node for node in (child, root.get(_PLUS)) if node is not None]
        for index in range(1, len(levels)):
            if not nodes:
                break
            nodes = self._step(nodes, levels[index], found)
        return nodes, found

    @staticmethod
    def _step(nodes: Sequence[Node], level: str, found: set[str]) -> list[Node]:
        """Consume one level (not the first) from `nodes`: the nodes still matching; "#"
        filters ending at `nodes` match (one or more levels from here) and go to `found`."""
        following = []
        for node in nodes:
            queue = node.get(_HASH)
            if queue is not None:
                found.add(queue)
            child = node.get(level)
            if child is not None:
                following.append(child)
            child = node.get(_PLUS)
            if child is not None:
                following.append(child)
        return following

    def _invalidate(self) -> None:
        if self._cache or self._cache_old or self._prefixes or self._walked:
            self._cache = {}
            self._cache_old = {}
            self._prefixes = {}
            self._walked = {}

    # persistence --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able picture of the registry: filters with reference counts, plus the
        hash-based queue names they use (so a store reader can resolve them offline)."""
        hashed = self._names.snapshot()
        return {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "filters": dict(sorted(self._refs.items())),
            "names": {
                queue: filter
                for filter, queue in sorted(self._queues.items())
                if hashed.get(queue) == filter
            },
        }

    def snapshot_bytes(self) -> bytes:
        return json.dumps(self.snapshot(), ensure_ascii=False, sort_keys=True).encode("utf-8")

    @classmethod
    def restore(
        cls,
        snapshot: Mapping[str, Any] | bytes | str,
        *,
        names: NameTable | None = None,
        cache_size: int = 65_536,
        prefix_cache_size: int = 65_536,
    ) -> Router:
        """Rebuild a Router from `snapshot()` / `snapshot_bytes()` output, checking it."""

        def fail(problem: str) -> TopicError:
            return TopicError(
                f"router snapshot rejected: {problem}",
                value=None,
                reason_code=IMPLEMENTATION_SPECIFIC_ERROR,
            )

        if isinstance(snapshot, bytes | str):
            try:
                snapshot = json.loads(snapshot)
            except ValueError as exc:
                raise fail(f"not JSON ({exc})") from None
        if not isinstance(snapshot, Mapping):
            raise fail("not a JSON object")
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            raise fail(f"format is {snapshot.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise fail(f"version {snapshot.get('version')!r} is not {SNAPSHOT_VERSION}")
        filters = snapshot.get("filters")
        if not isinstance(filters, Mapping):
            raise fail("'filters' is not an object")
        router = cls(names=names, cache_size=cache_size, prefix_cache_size=prefix_cache_size)
        recorded = snapshot.get("names", {})
        if not isinstance(recorded, Mapping):
            raise fail("'names' is not an object")
        router._names.update(recorded)
        for filter, count in filters.items():
            if type(count) is not int or count < 1:
                raise fail(f"reference count of {filter!r} is {count!r}, not a positive integer")
            try:
                parsed = TopicFilter(filter)
            except TopicError as exc:
                raise fail(str(exc)) from None
            if parsed.is_shared or parsed.filter in router._refs:
                raise fail(f"{filter!r} is not an underlying filter listed once")
            router.add(parsed)
            router._refs[parsed.filter] = count
        return router

    def __repr__(self) -> str:
        return f"Router({len(self._refs)} filters)"
