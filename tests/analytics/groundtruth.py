"""A store with known traffic, written through the real store API, and its expected report.

Subscriptions are saved as the gateway's session records in the state log (with start_offset) and
committed offsets through store.offsets, exactly as the gateway does; clean sessions (one that
ended, one still open) leave only their delivery account (store.delivery_account), as the
gateway's; the gateway's own $SYS messages have client id "". The expected numbers come
from a plain-Python model of the definitions in analytics.fanout, evaluated over the messages
this module itself put, never over anything read back from the files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store import (
    FLAG_CLEAN,
    FLAG_CLOSED,
    AccountRecord,
    AccountWriter,
    MessageStore,
    StoreConfig,
)
from store import append as append_module
from topicmap import LMQ_PREFIX, Router, TopicFilter


@dataclass
class Sub:
    client_id: str
    filter: str  # as subscribed, maybe $share/g/...
    online: bool
    subscribe_after: int  # subscribes once this many messages were published
    progress: float  # fraction of its queue (since start) it has committed at the end


@dataclass
class Message:
    client_id: str
    topic: str
    body_size: int
    store_ms: int
    queues: list[str]
    offsets: list[int]
    physical_offset: int = -1
    qos: int = 0


@dataclass
class World:
    data_dir: Path
    segment_size: int = 1 << 30
    messages: list[Message] = field(default_factory=list)
    # (subscriber key, queue) -> (start, committed) of the subscriptions open at the end
    ranges: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    # (subscriber key, queue, start, end (None: open), acked, qos): every subscription
    pieces: list[tuple[str, str, int, int | None, int, int]] = field(default_factory=list)
    ends: dict[str, int] = field(default_factory=dict)

    def device_messages(self) -> list[Message]:
        return [m for m in self.messages if m.client_id]

    def expected_devices(self) -> dict[str, dict[str, float | int]]:
        out: dict[str, dict[str, float | int]] = {}
        for m in self.device_messages():
            d = out.setdefault(
                m.client_id,
                {"messages": 0, "bytes": 0, "deliveries": 0, "eligible": 0, "fanout_max": 0,
                 "deliveries_qos0": 0, "messages_unreached": 0},
            )  # fmt: skip
            d["messages"] += 1
            d["bytes"] += m.body_size
            d["fanout_max"] = max(d["fanout_max"], sum(q.startswith(LMQ_PREFIX) for q in m.queues))
            eligible, delivered = self.reach(m)
            d["eligible"] += len(eligible)
            d["deliveries"] += len(delivered)
            d["deliveries_qos0"] += len(self.reach_qos0(m))
            d["messages_unreached"] += not delivered
        for client, d in out.items():
            reached: set[str] = set()
            topics: set[str] = set()
            for m in self.messages:
                if m.client_id == client:
                    reached |= self.reach(m)[1]
                    topics.add(m.topic)
            d["subscribers_reached"] = len(reached)
            d["topics"] = len(topics)
        return out

    def reach(self, m: Message) -> tuple[set[str], set[str]]:
        eligible: set[str] = set()
        delivered: set[str] = set()
        for queue, off in zip(m.queues, m.offsets, strict=True):
            for key, q, start, end, acked, _ in self.pieces:
                if q == queue and start <= off and (end is None or off < end):
                    eligible.add(key)
                    if off < acked:
                        delivered.add(key)
        return eligible, delivered

    def reach_qos0(self, m: Message) -> set[str]:
        """The subscribers that got `m` at QoS 0 (min(publish, subscription QoS) == 0 for
        every subscription of theirs it was delivered through)."""
        by_qos: dict[str, int] = {}
        for queue, off in zip(m.queues, m.offsets, strict=True):
            for key, q, start, end, acked, qos in self.pieces:
                if q == queue and start <= off < acked and (end is None or off < end):
                    by_qos[key] = max(by_qos.get(key, 0), min(m.qos, qos))
        return {k for k, q in by_qos.items() if q == 0}


DEVICES = {
    "dev-a": ["site/1/temp", "site/1/hum"],
    "dev-b": ["site/2/temp"],
    "dev-c": ["fleet/9/gps"],
    "dev-quiet": ["nobody/listens"],
}

SUBS = [
    Sub("s-all", "site/#", online=True, subscribe_after=0, progress=1.0),
    Sub("s-all", "site/+/temp", online=True, subscribe_after=0, progress=1.0),  # overlap
    Sub("s-slow", "site/+/temp", online=False, subscribe_after=0, progress=0.5),
    Sub("m1", "$share/g/site/1/#", online=True, subscribe_after=0, progress=0.75),
    Sub("m2", "$share/g/site/1/#", online=False, subscribe_after=10, progress=0.75),
    Sub("s-late", "fleet/#", online=True, subscribe_after=30, progress=1.0),
    Sub("s-none", "site/2/temp", online=False, subscribe_after=0, progress=0.0),
    Sub("ops", "$SYS/#", online=True, subscribe_after=0, progress=1.0),
]


@dataclass
class CleanSub:
    """A clean session's subscription, known only from the delivery account (and, while its
    connection is open, from sessions.json)."""

    client_id: str
    filter: str
    qos: int
    subscribe_after: int
    end_after: int | None  # unsubscribes (clean session over) after this many messages
    lost: int  # messages due that it never acknowledged


CLEAN = [
    CleanSub("c-gone", "site/1/temp", qos=1, subscribe_after=8, end_after=40, lost=2),
    CleanSub("c-open", "site/2/temp", qos=0, subscribe_after=12, end_after=None, lost=3),
]
GATEWAY_TOPIC = "$SYS/broker/uptime"


def build_world(
    data_dir: Path, rounds: int = 20, segment_size: int = 1 << 30, t0_ms: int = 1_700_000_000_000
) -> World:
    """Publish `rounds` rounds of every device's topics; return the model of what happened.

    The store's clock is set to each message's time (one second apart from t0_ms), so the
    store timestamps are known exactly and span enough time to prune segments by.
    """
    world = World(data_dir, segment_size)
    wall_clock = append_module._time
    clock_s = [t0_ms / 1000]
    append_module._time = lambda: clock_s[0]
    router = Router()
    store = MessageStore.open(StoreConfig(data_dir=data_dir, segment_size=segment_size))
    subscribed: dict[int, str] = {}  # index in SUBS -> queue
    starts: dict[int, int] = {}
    schedule = [
        (c, t)
        for _ in range(rounds)
        for c, ts in [*DEVICES.items(), ("", [GATEWAY_TOPIC])]
        for t in ts
    ]
    writer = AccountWriter(data_dir)
    clean_at: dict[int, tuple[str, int]] = {}  # index in CLEAN -> (queue, start)
    try:
        for i, (client, topic) in enumerate(schedule):
            for k, sub in enumerate(SUBS):
                if k not in subscribed and sub.subscribe_after <= i:
                    queue = router.add(TopicFilter(sub.filter))
                    subscribed[k] = queue
                    starts[k] = store.max_offset(queue)
            for k, c in enumerate(CLEAN):
                if k not in clean_at and c.subscribe_after <= i:
                    queue = router.add(TopicFilter(c.filter))
                    clean_at[k] = (queue, store.max_offset(queue))
                elif c.end_after == i and k in clean_at:
                    queue, start = clean_at[k]
                    end = store.max_offset(queue)
                    _account(writer, c, queue, start, end, end, clock_s[0], closed=True)
                    world.pieces.append((c.client_id, queue, start, end, end - c.lost, c.qos))
                    router.remove(c.filter)
            queues = sorted(router.route(topic))
            body = bytes(10 + (i % 7))
            ts = t0_ms + i * 1000
            clock_s[0] = ts / 1000
            r = store.put(
                topic=topic.split("/", 1)[0],
                body=body,
                queues=queues,
                properties={
                    "mqtt.topic": topic,
                    "mqtt.qos": str(i % 3),
                    "mqtt.retain": "0",
                    "mqtt.client": client,
                },  # the gateway's own messages carry client id "" (gateway.messages.records)
                born_timestamp=ts,
            )
            world.messages.append(
                Message(
                    client,
                    topic,
                    len(body),
                    r.store_timestamp,
                    queues,
                    [r.light_offsets[q] for q in queues],
                    r.physical_offset,
                    i % 3,
                )
            )
            assert r.store_timestamp == ts
        sessions: dict[str, dict[str, Any]] = {}  # JSON documents
        for k, sub in enumerate(SUBS):
            queue = subscribed[k]
            tf = TopicFilter(sub.filter)
            end = store.max_offset(queue)
            start = starts[k]
            key = f"$share/{tf.share_group}" if tf.share_group else sub.client_id
            committed = start + int((end - start) * sub.progress)
            if key in {kk for kk, _ in world.ranges} and (key, queue) in world.ranges:
                # shared group: one range per group and queue, the earliest start
                old_start, old_committed = world.ranges[(key, queue)]
                start = min(start, old_start)
                committed = old_committed
            world.ranges[(key, queue)] = (start, committed)
            world.pieces = [p for p in world.pieces if (p[0], p[1]) != (key, queue)]
            world.pieces.append((key, queue, start, None, committed, 1))
            store.offsets.commit(key, queue, committed)
            session = sessions.setdefault(
                sub.client_id,
                {
                    "protocol_level": 5,
                    "expiry_interval": 3600,
                    "disconnected_at_ms": None if sub.online else t0_ms,
                    "subscriptions": [],
                    "qos2_inbound": [],
                    "inflight": [],
                },
            )
            session["subscriptions"].append(
                {
                    "filter": sub.filter,
                    "queue": queue,
                    "share_group": tf.share_group,
                    "qos": 1,
                    "no_local": False,
                    "retain_as_published": False,
                    "retain_handling": 0,
                    "subscription_identifier": None,
                    "start_offset": starts[k],
                    "next_offset": committed,
                }
            )
            world.ends[queue] = end
        for k, c in enumerate(CLEAN):
            if c.end_after is not None:
                continue
            queue, start = clean_at[k]
            end = store.max_offset(queue)
            acked = end - c.lost
            _account(writer, c, queue, start, acked, end, clock_s[0], closed=False)
            world.pieces.append((c.client_id, queue, start, None, acked, c.qos))
            world.ranges[(c.client_id, queue)] = (start, acked)
            world.ends[queue] = end
            store.offsets.commit(c.client_id, queue, acked)
            sessions[c.client_id] = {  # listed while connected, as the gateway does
                "protocol_level": 4,
                "expiry_interval": 0,
                "disconnected_at_ms": None,
                "subscriptions": [
                    {"filter": c.filter, "queue": queue, "share_group": None, "qos": c.qos,
                     "start_offset": start, "next_offset": acked}
                ],
                "qos2_inbound": [],
                "inflight": [],
            }  # fmt: skip
        for k, c in enumerate(CLEAN):
            if c.end_after is not None:
                queue = clean_at[k][0]
                world.ends.setdefault(queue, store.max_offset(queue))
        # As the gateway keeps them: one state record per session (gateway/session/registry.py).
        store.append_state(
            (f"session/{cid}", json.dumps(doc).encode()) for cid, doc in sessions.items()
        )
    finally:
        writer.close()
        store.close()
        append_module._time = wall_clock
    return world


def _account(
    writer: AccountWriter, c: CleanSub, queue: str, start: int, acked: int, end: int,
    now_s: float, closed: bool,
) -> None:  # fmt: skip
    """The delivery account records the gateway leaves for a clean subscription."""
    flags = FLAG_CLEAN | (FLAG_CLOSED if closed else 0)
    lag_first = AccountRecord(c.client_id, queue, FLAG_CLEAN, c.qos, start, start, start,
                              start + 1, int(now_s * 1000) - 500)  # fmt: skip
    last = AccountRecord(c.client_id, queue, flags, c.qos, start, end - c.lost if closed else acked,
                         acked, end, int(now_s * 1000))  # fmt: skip
    writer.append([lag_first, last])
