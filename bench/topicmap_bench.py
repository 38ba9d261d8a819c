"""Benchmark topicmap.Router: routes/s with many filters, flatness as filters grow, and the
speed-up over a linear scan of all filters.

    python bench/topicmap_bench.py               # 1,000,000 topics vs 100,000 filters + growth
    python bench/topicmap_bench.py --quick       # smaller, for a smoke run

Filters are realistic IoT shapes over `site/{n}/dev/{m}/{metric}`: mostly exact filters, then
`+` at the device or metric level, `#` under a device or a site, and a few global wildcards.
Topics are drawn from the same space (including sites and devices nobody subscribed to), so
each publish matches 0 to ~10 filters. Routing runs with the per-topic cache disabled (pure
trie walk) and with the default cache; one core, one process.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from topicmap import NameTable, Router, TopicFilter
from topicmap.topic import matches_levels

METRICS = ["temp", "humidity", "pressure", "co2", "battery", "rssi", "status", "alarm"]
DEVICES_PER_SITE = 50


def sites_for(filter_count: int) -> int:
    # Twice as many (device, metric) pairs as filters: dense, but the sampling always finishes.
    return filter_count * 2 // (DEVICES_PER_SITE * len(METRICS)) + 1


def make_filters(count: int, rng: random.Random) -> list[str]:
    sites = sites_for(count)
    chosen: set[str] = set()
    while len(chosen) < count:
        site, dev, metric = (
            rng.randrange(sites),
            rng.randrange(DEVICES_PER_SITE),
            rng.choice(METRICS),
        )
        roll = rng.random()
        if roll < 0.60:
            text = f"site/{site}/dev/{dev}/{metric}"
        elif roll < 0.72:
            text = f"site/{site}/dev/{dev}/+"
        elif roll < 0.84:
            text = f"site/{site}/dev/+/{metric}"
        elif roll < 0.94:
            text = f"site/{site}/dev/{dev}/#"
        elif roll < 0.97:
            text = f"site/{site}/#"
        elif roll < 0.995:
            text = f"site/+/dev/{dev}/{metric}"
        else:
            text = rng.choice(["#", "+/+/dev/+/alarm", "site/+/dev/+/status", "$SYS/#", "+/#"])
        chosen.add(text)
    return sorted(chosen)


def make_topics(count: int, filter_count: int, rng: random.Random) -> list[str]:
    sites = sites_for(filter_count) * 6 // 5 + 1  # some sites nobody subscribed to
    metrics = [*METRICS, "firmware", "uptime"]
    return [
        f"site/{rng.randrange(sites)}/dev/{rng.randrange(DEVICES_PER_SITE + 10)}/"
        f"{metrics[rng.randrange(len(metrics))]}"
        for _ in range(count)
    ]


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


# (label, topic cache size, prefix cache size)
MODES = [
    ("plain trie walk    ", 0, 0),
    ("trie + prefix cache", 0, 65_536),
    ("trie + both caches ", 65_536, 65_536),
]


def build(filters: list[str], cache_size: int, prefix_cache_size: int = 0) -> tuple[Router, float]:
    router = Router(names=NameTable(), cache_size=cache_size, prefix_cache_size=prefix_cache_size)
    seconds = timed(lambda: [router.add(text) for text in filters])
    return router, seconds


def route_rate(router: Router, topics: list[str]) -> tuple[float, int]:
    """Routes per CPU second of this process: the machine is shared, so wall time would
    measure the neighbours; CPU time measures the router on the one core it uses."""
    route = router.route
    matched = 0
    start = time.process_time()
    for topic in topics:
        matched += len(route(topic))
    seconds = time.process_time() - start
    return len(topics) / seconds, matched


def linear_rate(filters: list[str], topics: list[str]) -> float:
    """The amqtt way: test every filter on every publish (levels pre-split, no validation)."""
    compiled = [(TopicFilter(text).levels, text) for text in filters]
    start = time.process_time()
    for topic in topics:
        levels = topic.split("/")
        {text for flevels, text in compiled if matches_levels(flevels, levels)}
    return len(topics) / (time.process_time() - start)


def calibration() -> float:
    """ns per `dict.get` loop iteration: how fast this core is right now (a quiet modern core
    does ~30 ns)."""
    table = {"a": 1}
    start = time.process_time()
    for _ in range(2_000_000):
        table.get("a")
    return (time.process_time() - start) / 2_000_000 * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filters", type=int, default=100_000)
    parser.add_argument("--topics", type=int, default=1_000_000)
    parser.add_argument("--growth-topics", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="10x smaller everything")
    args = parser.parse_args()
    if args.quick:
        args.filters //= 10
        args.topics //= 10
        args.growth_topics //= 10
    rng = random.Random(args.seed)
    print(
        f"python {sys.version.split()[0]}, one process, seed {args.seed}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, {calibration():.0f} ns per "
        "dict.get loop; rates are per CPU second"
    )

    # 1. The headline: N topics against F filters.
    filters = make_filters(args.filters, rng)
    topics = make_topics(args.topics, args.filters, rng)
    router, add_seconds = build(filters, cache_size=0)
    print(
        f"\n{len(filters):,} filters added in {add_seconds:.2f}s "
        f"({len(filters) / add_seconds:,.0f} adds/s); {len(topics):,} topics, "
        f"{len(set(topics)):,} distinct, {len({t.rpartition('/')[0] for t in topics}):,} "
        "distinct prefixes"
    )
    del router
    target = 200_000
    expected = None
    for label, cache_size, prefix_cache_size in MODES:
        router, _ = build(filters, cache_size, prefix_cache_size)
        rate, matched = route_rate(router, topics)
        assert expected is None or matched == expected, "modes disagree"
        expected = matched
        print(
            f"  {label}: {rate:>10,.0f} routes/s  ({matched / len(topics):.2f} queues/topic)"
            f"  target {target:,}: {'MET' if rate >= target else 'missed'}"
        )
        del router

    # 1b. Steady telemetry: the same 30,000 device topics published over and over.
    pool = make_topics(30_000, args.filters, rng)
    repeating = [pool[rng.randrange(len(pool))] for _ in range(len(topics) // 2)]
    print(f"\nsteady telemetry, {len(repeating):,} publishes over {len(pool):,} distinct topics:")
    for label, cache_size, prefix_cache_size in MODES:
        router, _ = build(filters, cache_size, prefix_cache_size)
        rate, _ = route_rate(router, repeating)
        print(f"  {label}: {rate:>10,.0f} routes/s")
        del router

    # 2. Flat as filters grow 10x (and 100x): same topic shape, uncached.
    print(f"\ngrowth, {args.growth_topics:,} topics each, plain trie walk (no caches):")
    base = None
    for count in (args.filters // 10, args.filters, args.filters * 10):
        grow_filters = make_filters(count, rng)
        grow_router, _ = build(grow_filters, cache_size=0)
        grow_rate, grow_matched = route_rate(
            grow_router, make_topics(args.growth_topics, count, rng)
        )
        base = base or grow_rate
        print(
            f"  {count:>10,} filters: {grow_rate:>10,.0f} routes/s  "
            f"({grow_rate / base:.2f}x of the smallest; "
            f"{grow_matched / args.growth_topics:.2f} queues/topic)"
        )
        del grow_router, grow_filters

    # 3. Against a linear scan (what amqtt's broker does on every publish).
    print("\nlinear scan comparison (same filters, same topics, plain trie walk, no caches):")
    for count, probe_count in ((1_000, 5_000), (args.filters, 200)):
        small_filters = make_filters(count, rng)
        probes = make_topics(probe_count, count, rng)
        small_router, _ = build(small_filters, cache_size=0)
        for topic in probes[:50]:  # same answers, by construction and by check
            linear = {
                f for f in small_filters if matches_levels(TopicFilter(f).levels, topic.split("/"))
            }
            assert {small_router._queues[f] for f in linear} == small_router.route(topic)
        trie_rate, _ = route_rate(small_router, probes * (20_000 // probe_count + 1))
        scan_rate = linear_rate(small_filters, probes)
        print(
            f"  {count:>10,} filters: linear {scan_rate:>10,.0f} routes/s, "
            f"trie {trie_rate:>10,.0f} routes/s, ratio {trie_rate / scan_rate:,.0f}x"
        )


if __name__ == "__main__":
    main()
