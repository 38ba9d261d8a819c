"""Prometheus metrics, served by the admin HTTP listener (gateway/ops/admin_server.py).

Values are read from the gateway when scraped (a custom Collector on a private registry), so
the hot paths pay nothing for them. The latency histograms time the store from outside, by
wrapping its methods on the instance when the admin endpoint is on: each append call (a single
`put_async`, which in sync mode includes the covering fsync, or a batched `append_encoded` of one
reader turn's run of publishes), the wait for durability a batched run's PUBACKs make in sync
mode (`wait_durable`), and the flusher's CommitLog fsync. The append timing runs once per event
loop turn that stores publishes, so it is kept as plain bucket counts (`_Timings`: one C bisect
and two list additions) and shaped into a histogram when scraped, instead of prometheus_client's
Histogram.observe and Counter.inc (a lock and several Python calls each).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.access.control import AccessControl
from gateway.access.quotas import REASONS as QUOTA_REASONS
from gateway.messages.retained import RetainedIndex
from gateway.ops.gc_monitor import BUCKETS_S, GcMonitor
from gateway.session.registry import SessionRegistry
from gateway.stats import GatewayStats
from gateway.storage.inbound import InboundFeed
from gateway.storage.port import Storage


class Connections(Protocol):
    """What the metrics read of the server's state (gateway/net/server.py ServerState)."""

    @property
    def stopping(self) -> bool:
        """A graceful stop has begun (/health answers 503)."""
        ...

    @property
    def connections(self) -> Sized:
        """The open network connections (only counted)."""
        ...


class LoopLag(Protocol):
    """The event loop's lateness as the overload guard measures it: how late its timer fires
    (gateway/connection/overload.py OverloadGuard)."""

    lag: float  # the last tick's, seconds
    lag_max: float  # the largest of a stalled tick since start, seconds
    stalls: int  # ticks later than its STALL_S


@dataclass(slots=True)
class MetricsSources:
    """What the metrics read when scraped, handed in by the composition root once the
    gateway has started (gateway/app.py)."""

    stats: GatewayStats
    access: AccessControl
    server: Connections  # open connections, graceful stop
    gc: GcMonitor
    store: Storage
    sessions: SessionRegistry
    retained: RetainedIndex
    loop_lag: LoopLag
    # Subscriptions past slow_subscription_threshold, counted before each scrape
    # (gateway/ops/live_view.py LiveView.count_slow); None: not counted.
    slow_subscriptions: Callable[[], Awaitable[int]] | None = None
    inbound: InboundFeed | None = None  # RocketMQ: the inbound topic's consumer
    held_pulls: Callable[[], int] | None = None  # RocketMQ: pulls held on the brokers now


__all__ = ["GatewayMetrics", "MetricsSources"]

log = logging.getLogger("lmqtt.metrics")

CENSUS_STEP = 50  # subscriptions per loop step counting the backlog (an unread queue: a stat)
LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Backlog:
    """lmqtt_backlog_messages, counted before each scrape CENSUS_STEP sessions per event-loop
    step: one pass over every session in a single step would hold the loop; then
    lmqtt_slow_subscriptions, by the live view's census."""

    def __init__(self, sources: MetricsSources) -> None:
        self.sources = sources
        self.value = 0
        self.slow = 0

    async def count(self) -> None:
        store = self.sources.store
        registry = self.sources.sessions
        total = 0
        # A store numbering a queue's messages otherwise (RocketMQ spread: merged offsets)
        # says how many messages lie below an offset.
        count = getattr(store, "account_offset", None)
        for i, (queue, position) in enumerate(registry.positions(), 1):
            if count is None:
                total += max(0, store.max_offset(queue) - position)
            else:
                total += max(0, count(queue, store.max_offset(queue)) - count(queue, position))
            if i % CENSUS_STEP == 0:
                await asyncio.sleep(0)
                if store.closed:
                    return
        self.value = total
        census = self.sources.slow_subscriptions
        if census is not None:
            self.slow = await census()


class _GatewayCollector(Collector):
    def __init__(self, sources: MetricsSources, backlog: _Backlog) -> None:
        self.sources = sources
        self.backlog = backlog

    def collect(self) -> Iterator[Any]:
        src = self.sources
        st = src.stats
        access = src.access

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"lmqtt_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"lmqtt_{name}", doc, value=value)

        yield gauge("connections", "open network connections", len(src.server.connections))
        yield gauge("clients_connected", "clients past CONNECT", st.clients_connected)
        yield counter("clients", "clients accepted since start", st.clients_total)
        yield counter("messages_received", "PUBLISH packets stored", st.messages_received)
        yield counter("messages_sent", "PUBLISH packets delivered", st.messages_sent)
        yield counter("bytes_received", "bytes read from clients", st.bytes_received)
        yield counter("bytes_sent", "bytes written to clients", st.bytes_sent)
        yield counter("publish_dropped", "messages dropped or denied", st.publish_dropped)
        yield gauge("subscriptions", "subscriptions", st.subscriptions)
        if src.inbound is not None:
            yield counter(
                "inbound_consumed",
                "inbound topic messages stored as MQTT publishes",
                st.inbound_consumed,
            )
            yield counter(
                "inbound_dead_lettered",
                "inbound topic messages moved to the dead-letter topic",
                st.inbound_dead_lettered,
            )
            yield gauge(
                "inbound_queues", "inbound topic queues this node reads", src.inbound.queues
            )
        yield counter("connect_refused", "CONNECTs refused (auth, limits)", access.refused_connects)
        yield counter("publish_denied", "PUBLISHes denied by the ACL", access.denied_publishes)
        yield counter(
            "subscribe_denied", "SUBSCRIBE entries denied by the ACL", access.denied_subscriptions
        )
        yield counter("security_reloads", "password/ACL file reloads", access.reloads)
        # Per-client publish quotas (gateway/access/quotas.py), by the bucket that ran out.
        quota_counts = access.quotas.counts
        throttled = CounterMetricFamily(
            "lmqtt_quota_throttled_messages",
            "publishes that waited, their client's reading paused, for its quota",
            labels=["reason"],
        )
        rejected = CounterMetricFamily(
            "lmqtt_quota_rejected_messages",
            "publishes refused over quota (0x97) or dropped (QoS 0)",
            labels=["reason"],
        )
        for i, reason in enumerate(QUOTA_REASONS):
            throttled.add_metric([reason], quota_counts.throttled[i])
            rejected.add_metric([reason], quota_counts.rejected[i])
        yield throttled
        yield rejected
        # bans and flapping (gateway/access/bans.py, flapping.py)
        bans = access.bans
        yield gauge("bans_active", "bans in force (static, admin, flapping)", bans.active_count())
        banned = CounterMetricFamily(
            "lmqtt_connect_banned", "CONNECTs refused by a ban", labels=["cause"]
        )
        banned.add_metric(["ban"], bans.refused - bans.refused_flapping)
        banned.add_metric(["flapping"], bans.refused_flapping)
        yield banned
        yield counter("flapping_bans", "client ids banned for flapping here", access.flapping.bans)
        yield counter("banned_disconnects", "connected clients closed by a new ban", bans.kicked)
        monitor = src.gc
        yield counter("gc_collections", "garbage collections", monitor.collections)
        lag = src.loop_lag
        yield gauge("event_loop_lag_seconds", "lateness of the overload guard's last tick", lag.lag)
        yield gauge("event_loop_lag_max_seconds", "largest stall of the event loop", lag.lag_max)
        yield counter("event_loop_stalls", "ticks of the event loop 50 ms late or more", lag.stalls)
        cumulative, running = [], 0
        for bound, n in zip((*BUCKETS_S, float("inf")), monitor.buckets, strict=True):
            running += n
            cumulative.append((floatToGoString(bound), running))
        yield HistogramMetricFamily(
            "lmqtt_gc_pause_seconds",
            "garbage collection pauses",
            buckets=cumulative,
            sum_value=monitor.total_ns / 1e9,
        )
        yield gauge("gc_pause_max_seconds", "longest GC pause", monitor.max_ns / 1e9)
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            yield gauge(
                f"gc_pause_{label}_seconds",
                f"GC pause {label} over the last collections",
                monitor.percentile_ns(q) / 1e9,
            )
        yield counter(
            "gc_freezes", "gc.freeze() calls (gateway/ops/gc_monitor.py)", monitor.freezes
        )
        yield counter(
            "gc_unfreezes", "frozen objects handed back to the collector", monitor.unfreezes
        )
        yield gauge(
            "gc_escaped", "cyclic garbage found by older collections since", monitor.escaped
        )
        by_gen = GaugeMetricFamily(
            "lmqtt_gc_pause_max_by_generation_seconds",
            "longest GC pause per generation collected",
            labels=["generation"],
        )
        by_gen_count = CounterMetricFamily(
            "lmqtt_gc_collections_by_generation",
            "garbage collections per generation",
            labels=["generation"],
        )
        for generation in range(3):
            by_gen.add_metric([str(generation)], monitor.max_by_generation[generation] / 1e9)
            by_gen_count.add_metric([str(generation)], monitor.by_generation[generation])
        yield by_gen
        yield by_gen_count
        # No gauge of the frozen objects: gc.get_freeze_count() walks the permanent generation
        # object by object, holding the GIL (the event loop's stall on every scrape grows
        # with the fleet); GcMonitor.summary() reports it once, at stop.

        store = src.store
        sessions = src.sessions
        if store.closed:
            return
        yield gauge("sessions", "sessions (connected and offline)", len(sessions))
        yield gauge("retained_messages", "retained messages", len(src.retained))
        yield gauge(
            "store_bytes", "CommitLog bytes kept", store.log_max_offset - store.log_min_offset
        )
        yield gauge("light_queues", "light message queues", len(store.queues()))
        yield gauge(
            "backlog_messages", "messages stored, not yet sent to subscribers", self.backlog.value
        )
        if src.held_pulls is not None:
            yield gauge("rocketmq_held_pulls", "pulls held on the brokers now", src.held_pulls())
        if src.slow_subscriptions is not None:
            yield gauge(
                "slow_subscriptions",
                "subscriptions whose oldest unsent or unacknowledged message is older than "
                "slow_subscription_threshold",
                self.backlog.slow,
            )


class _Timings:
    """A latency histogram as plain counts, for a path timed once per event-loop turn.

    `counts[i]`: observations in (bounds[i-1], bounds[i]] (the last slot: above every bound),
    so `counts[bisect_left(bounds, seconds)] += 1` files one; `sums[0]`: their total seconds;
    `items[0]`: what the timed calls handled (messages appended). One writer (the event-loop
    thread); the scrape only reads. `collect` shapes them as Prometheus expects (cumulative
    `le` buckets, `_count` and `_sum`, the counter's `_total`)."""

    __slots__ = ("bounds", "counts", "doc", "items", "items_doc", "items_name", "name", "sums")

    def __init__(
        self, name: str, doc: str, items_name: str, items_doc: str, bounds: Sequence[float]
    ) -> None:
        self.name = name
        self.doc = doc
        self.items_name = items_name
        self.items_doc = items_doc
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sums = [0.0]
        self.items = [0]

    def observe(self, seconds: float, items: int = 0) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sums[0] += seconds
        self.items[0] += items

    def collect(self) -> Iterator[Any]:
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sums[0])
        yield CounterMetricFamily(self.items_name, self.items_doc, value=self.items[0])


class _TimingsCollector(Collector):
    def __init__(self, timings: _Timings) -> None:
        self.timings = timings

    def collect(self) -> Iterator[Any]:
        return self.timings.collect()


class GatewayMetrics:
    """The registry for one gateway, plus the store latency histograms."""

    def __init__(self, sources: MetricsSources) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.backlog = _Backlog(sources)
        self.registry.register(_GatewayCollector(sources, self.backlog))
        self.append_seconds = _Timings(
            "lmqtt_store_append_seconds",
            "store append latency per call: put_async of one message (sync flush: with the "
            "covering fsync) or append_encoded of one reader turn's run of publishes",
            "lmqtt_store_appended_messages",
            "messages appended to the CommitLog by the gateway",
            LATENCY_BUCKETS,
        )
        self.registry.register(_TimingsCollector(self.append_seconds))
        self.durable_wait_seconds = Histogram(
            "lmqtt_store_durable_wait_seconds",
            "sync flush: wait from a batched append until the CommitLog is fsynced past it",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.fsync_seconds = Histogram(
            "lmqtt_store_fsync_seconds",
            "CommitLog fsync latency (flusher thread)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def instrument_store(self, store: Any) -> None:
        """Time the store's appends and fsyncs by wrapping them on this instance.

        Called only when the admin endpoint is on (gateway/net/listeners.py): nobody can read the
        histograms otherwise, and a wrapper around every put costs CPU on every publish. The
        gateway's ingest path is the same either way (batched runs go through append_encoded,
        which is timed per batch)."""
        timings = self.append_seconds
        observe = timings.observe
        bounds = timings.bounds
        counts = timings.counts
        sums = timings.sums
        items = timings.items
        put_async: Callable[..., Awaitable[Any]] = store.put_async
        append_encoded: Callable[[Sequence[Any]], list[Any]] = store.append_encoded
        wait_durable: Callable[[int], Awaitable[None]] = store.wait_durable
        durable = self.durable_wait_seconds
        perf_counter = time.perf_counter

        @functools.wraps(put_async)
        async def timed_put_async(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = await put_async(*args, **kwargs)
            except BaseException:
                observe(time.perf_counter() - t0)
                raise
            observe(time.perf_counter() - t0, 1)
            return result

        @functools.wraps(append_encoded)
        def timed_append_encoded(messages: Sequence[Any]) -> list[Any]:
            # _Timings.observe inlined: this runs once per turn that stores publishes.
            t0 = perf_counter()
            try:
                results = append_encoded(messages)
            finally:
                seconds = perf_counter() - t0
                counts[bisect_left(bounds, seconds)] += 1
                sums[0] += seconds
            items[0] += len(results)
            return results

        @functools.wraps(wait_durable)
        async def timed_wait_durable(end_offset: int) -> None:
            t0 = time.perf_counter()
            try:
                await wait_durable(end_offset)
            finally:
                durable.observe(time.perf_counter() - t0)

        store.put_async = timed_put_async
        store.append_encoded = timed_append_encoded
        store.wait_durable = timed_wait_durable
        flusher = getattr(store, "_flusher", None)
        flush_log = getattr(flusher, "_flush_log", None)
        if flusher is not None and callable(flush_log):
            fsync = self.fsync_seconds

            def timed_flush_log() -> int:
                t0 = time.perf_counter()
                try:
                    return int(flush_log())
                finally:
                    fsync.observe(time.perf_counter() - t0)

            flusher._flush_log = timed_flush_log

    def render(self) -> bytes:
        return generate_latest(self.registry)
