"""The fan-out report's inputs read from a RocketMQ deployment, through pulls.

A gateway started with `--store rocketmq` sends every message to the deployment's parent topic
(`rocketmq_topic`, one queue) dispatched to its light queues, on one of the
topic's brokers (one broker today; over several: `broker_for(mqtt topic, writable brokers)`,
docs/rocketmq.md "Several brokers"), and keeps its sessions in the %STATE% light queue of its
home broker. The report reads exactly that, over the remoting protocol (rocketmq_remoting), from
any machine that reaches the name server:

    messages      PULL_MESSAGE of the parent topic's queue 0 on EVERY readable broker of its
                  route (TopicRoute.readable_brokers: a broker drained of writes still holds
                  messages), each cut into PullRanges of RANGE_MESSAGES offsets, one Spark task
                  each (like one segment each on the embedded store). Each pulled record is a
                  stored CommitLog record (v1 or v2, IPv4 or IPv6 hosts:
                  rocketmq_remoting.message.decode_records); it becomes a row of
                  analytics.segments.ARROW_SCHEMA, its light queues named back to the gateway's
                  queue names (topicmap.rocketmq.decode_lmq) and then to its broker's copies
                  (analytics.copies: `Q` on the home broker, `Q\\x00b` on broker b), its light
                  queue offsets being that copy's. Its physical offset is `k << 48 | CommitLog
                  offset` (k: the broker's rank by name among the readable ones), unique across
                  brokers. Rows of different brokers are not ordered by offset; where order
                  matters (the timeline, --since/--until) the store timestamp gives it.
    subscriptions the %STATE% queue of the home broker, replayed from the offset committed for
                  %STATE-START% (the last compaction's snapshot), newest record per key: the
                  `session/` records, and `meta/brokers` (the broker slots of a spread
                  deployment, topicmap/spread.py). A spread session keeps ONE entry per light
                  queue `Q`, its start/next offsets merged (the per-broker offsets packed,
                  above 2**62); the report splits it into one subscription per copy (per_copy:
                  `Q` on slot 0, the home, `Q\\x00b` on slot b), each with that broker's
                  offsets, so every later step sees plain 64-bit offsets of one copy.
    committed     the broker's consumer offsets (group = the subscriber's light-queue name,
                  topic = the queue's), per copy from that copy's broker: the only copy, which
                  the gateway sends every second (gateway/storage/rocketmq/offsets.py)
    queue ends    GET_MIN_OFFSET / GET_MAX_OFFSET of every copy of every subscribed light
                  queue, on its broker
    account       the delivery account stays in the gateway's data directory (--data-dir):
                  without it, deliveries are counted from the committed offsets alone. A
                  spread gateway's account counts its light queues' messages over all
                  brokers together, not per copy: the report leaves those records out.

A message is stored on one broker, so it is in that broker's copies only: a subscriber holding
`Q` and `Q\\x00b` is due it through one of them, and every count (fan-out, deliveries per
device and per subscriber) counts it once whichever broker it was on.

Time pruning (plan_ranges): with --since/--until, SEARCH_OFFSET_BY_TIMESTAMP per broker finds
the parent-queue offsets of the window (the first stored at or after `since`, the last at or
before `until` - 1 ms; store timestamps never decrease along one broker's queue), and only the
ranges overlapping them are pulled, plus those holding the backlog (the queues' current state,
whatever the window): from the parent offset of the first undelivered message of each
subscribed copy, found by pulling that one message from the copy. Rows are then filtered
exactly, as on the embedded store.

Why pulls rather than the brokers' store directories: the report then needs neither a shell on
the broker hosts nor their disks mounted (nor a copy of them), it reads only the deployment's
own topic where a broker's CommitLog holds every topic of the cluster, a broker's retention and
file layout (v2 records, IPv6 hosts, no CRC property) stay the broker's business, and the
numbers are the ones the gateway itself reads. The cost is the brokers serving the pulls: a
report reads every kept message of the deployment in its window (all of them without one) once.

Records that are no MQTT message (the state batches, the gateway's start-up probe: no topic
property of the record schema, topicmap/record.py) are left out: on the embedded store they
live outside the CommitLog.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from analytics.copies import base_queue, copy_name, split_copy
from analytics.errors import ClusterError, SnapshotError
from analytics.segments import (
    ARROW_SCHEMA,
)
from analytics.snapshots import (
    SESSION_KEY_PREFIX,
    SHARE_PREFIX,
    QueueEnd,
    Subscription,
    session_records,
    subscriptions_of,
)
from rocketmq_remoting import (
    BrokerNotFoundError,
    MessageRecord,
    OffsetMovedError,
    RemotingClient,
    RemotingError,
    TopicNotExistError,
)
from store.delivery_account import AccountRecord, read_account
from topicmap import record
from topicmap.rocketmq import (
    EMPTY_BODY_PROPERTY,
    STATE_QUEUE,
    STATE_START,
    decode_lmq,
    decode_state,
    encode_lmq,
)
from topicmap.spread import SLOTS_KEY, position, slots_from_state, spread_queue

#: Parent-queue offsets per Spark task.
RANGE_MESSAGES = 200_000
#: Messages asked per pull (the broker sends fewer when its transfer limits say so).
PULL_MESSAGES = 256
#: The report's pulls: a `%LMQ%` group needs no creation on the broker, and nothing is committed.
PULL_GROUP = "%LMQ%lmqtt-report"
#: A row's physical offset: the broker's rank above, its CommitLog offset below (2**48 B = 256 TiB).
BROKER_SHIFT = 48
_TS = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True, slots=True)
class Deployment:
    """A gateway deployment on RocketMQ: the name server, the parent topic (`rocketmq_topic`),
    the home broker (`rocketmq_broker`; None: the first by name of those holding the topic,
    else the first registered, as the gateway picks: RemotingClient.home_broker),
    and optionally the gateway's data directory (its delivery account)."""

    namesrv: str
    topic: str = "lmqtt"
    broker: str | None = None
    data_dir: str | None = None

    @property
    def label(self) -> str:
        return f"rocketmq://{self.namesrv}/{self.topic}"


@dataclass(frozen=True, slots=True)
class PullRange:
    """Offsets [start, end) of the parent topic's queue on one broker: one Spark task."""

    broker_addr: str
    topic: str
    start: int
    end: int
    broker: str = ""  # its name
    rank: int = 0  # the broker's rank by name among the readable ones (BROKER_SHIFT)
    home: str = ""  # the deployment's home broker (its copies are named without a broker)

    @property
    def name(self) -> str:
        return f"pull-{self.rank:02d}-{self.start:020d}"

    @property
    def start_offset(self) -> int:
        """Unique among the ranges of all brokers (the report's key of a task's input)."""
        return self.rank << BROKER_SHIFT | self.start

    def copy_of(self, queue: str) -> str:
        """The name of `queue`'s copy on this range's broker."""
        return copy_name(queue, self.broker, self.home)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the report needs of the deployment besides its messages (read once, before the
    Spark job starts: a deployment that cannot be read fails in a second, without a JVM)."""

    deployment: Deployment
    ranges: list[PullRange]  # every broker's, in broker order
    subscriptions: list[Subscription]
    committed: dict[tuple[str, str], int]  # (subscriber, copy) -> offset in that copy
    ends: list[QueueEnd]  # per copy
    account: list[AccountRecord]
    home: str = ""  # the home broker's name
    brokers: dict[str, str] = field(default_factory=dict)  # readable broker -> address


@dataclass(frozen=True, slots=True)
class RangePlan:
    """The ranges a windowed report pulls (plan_ranges): those that can hold rows of the
    window, and those holding the backlog; `read` is both, each range once, in snap order."""

    window: list[PullRange]
    tail: list[PullRange]
    read: list[PullRange]


def _client(dep: Deployment) -> RemotingClient:
    return RemotingClient([dep.namesrv], request_timeout=10.0, connect_timeout=3.0)


def read_deployment(dep: Deployment, range_messages: int = RANGE_MESSAGES) -> Snapshot:
    """Everything but the messages, and the ranges their tasks pull (ClusterError when the
    deployment cannot be read or holds no messages)."""
    try:
        return asyncio.run(_read_deployment(dep, range_messages))
    except RemotingError as exc:
        raise ClusterError(f"reading {dep.label} failed: {exc}") from None


async def _brokers(client: RemotingClient, dep: Deployment) -> tuple[str, str, dict[str, str]]:
    """(home broker, its address, readable broker -> address by name): the gateway's rule for
    the home broker (RemotingClient.home_broker), the parent topic's route for the rest."""
    try:
        home = await client.home_broker(dep.topic, dep.broker)
        try:
            route = await client.get_route(dep.topic)
        except TopicNotExistError:
            return home.name, home.addr, {}
    except BrokerNotFoundError as exc:
        raise ClusterError(str(exc)) from None
    except RemotingError as exc:
        raise ClusterError(f"RocketMQ name server {dep.namesrv} unreachable: {exc}") from None
    addrs = route.master_addrs()
    return home.name, home.addr, {b: addrs[b] for b in route.readable_brokers()}


async def _spread_home(
    client: RemotingClient, dep: Deployment, brokers: dict[str, str], first: str
) -> tuple[str, str, dict[str, bytes], bytes] | None:
    """(home, its address, its sessions, its slots record) of a spread deployment whose home
    is not `first`, the first broker by name: a spread topic is on every broker, and the
    gateway's home is then the first by name whose %STATE% holds records (a broker that joined
    later may sort first: gateway/storage/rocketmq/adapter.py). Only a state naming slots counts, so
    a deployment that is not spread is read exactly as before. None: no such broker."""
    lmq = encode_lmq(STATE_QUEUE, dep.topic)
    for name, addr in brokers.items():
        if name == first:
            continue
        try:
            if await client.get_max_offset(addr, lmq) <= 0:
                continue
        except RemotingError:
            continue
        sessions, slots = await _state(client, addr, dep)
        if slots is not None:
            return name, addr, sessions, slots
    return None


async def _read_deployment(dep: Deployment, range_messages: int) -> Snapshot:
    client = _client(dep)
    try:
        home, home_addr, brokers = await _brokers(client, dep)
        sessions, slots_raw = await _state(client, home_addr, dep)
        if slots_raw is None and dep.broker is None and len(brokers) > 1:
            spread_home = await _spread_home(client, dep, brokers, home)
            if spread_home is not None:
                home, home_addr, sessions, slots_raw = spread_home
        ranges: list[PullRange] = []
        for rank, (name, addr) in enumerate(brokers.items()):
            lo = await client.get_min_offset(addr, dep.topic)
            hi = await client.get_max_offset(addr, dep.topic)
            ranges += [
                PullRange(addr, dep.topic, start, min(hi, start + range_messages), name, rank,
                          home)
                for start in range(lo, hi, range_messages)
            ]  # fmt: skip
        if not ranges:
            held = ", ".join(brokers) or "no broker"
            raise ClusterError(
                f"{dep.label} holds no messages (topic {dep.topic!r} is empty or unknown on"
                f" {held}): is --rocketmq-topic the gateway's rocketmq_topic?"
            )
        subs = subscriptions_of(session_records(sessions, dep.label), dep)
        if slots_raw is not None:  # a spread deployment: one subscription per copy
            slots = slots_from_state(slots_raw, home, [])
            if slots[0] != home:
                raise ClusterError(
                    f"{dep.label}: its brokers are numbered from home broker {slots[0]}"
                    f" (state record {SLOTS_KEY}), not {home}: pass --rocketmq-broker {slots[0]}"
                )
            subs = per_copy(subs, slots)
        at = dict(brokers)
        at.setdefault(home, home_addr)

        def where(copy: str) -> tuple[str | None, str]:
            """(the address of the copy's broker, None if not readable now; the copy's %LMQ%
            name there: every broker names its copy as the gateway queue)."""
            queue, broker = split_copy(copy)
            return at.get(broker or home), encode_lmq(queue, dep.topic)

        keys = sorted({(_subscriber(s), s.queue) for s in subs})
        committed = {}
        for key, copy in keys:
            on, lmq = where(copy)
            if on is None:
                continue
            found = await client.query_consumer_offset(on, encode_lmq(key, dep.topic), lmq)
            if found is not None:
                committed[(key, copy)] = found
        # Every copy of every subscribed queue, on every readable broker.
        copies = {copy_name(base_queue(q), b, home) for _, q in keys for b in brokers}
        copies |= {q for _, q in keys}
        ends = []
        for copy in sorted(copies):
            on, lmq = where(copy)
            if on is None:
                continue
            lo = await client.get_min_offset(on, lmq)
            ends.append(QueueEnd(copy, lo, await client.get_max_offset(on, lmq)))
    finally:
        await client.close()
    account = read_account(Path(dep.data_dir)) if dep.data_dir is not None else []
    if slots_raw is not None:
        # A spread gateway's account counts a queue's messages over all brokers together
        # (gateway/delivery/account.py CountedAccount), not per copy: its light queues' records
        # cannot be split, so their deliveries come from the committed offsets alone.
        account = [r for r in account if not spread_queue(r.queue)]
    return Snapshot(dep, ranges, subs, committed, ends, account, home, brokers)


def plan_ranges(
    snap: Snapshot,
    since_ms: int | None,
    until_ms: int | None,
    backlog_from: Iterable[tuple[str, int]] = (),
) -> RangePlan:
    """The ranges a report of [since_ms, until_ms) pulls (see the module doc): per broker, the
    ranges overlapping the offsets SEARCH_OFFSET_BY_TIMESTAMP gives for the window, and those
    from the parent offset of each copy's first undelivered message (`backlog_from`: copy ->
    offset) on. Every range without a window."""
    if since_ms is None and until_ms is None:
        return RangePlan(list(snap.ranges), [], list(snap.ranges))
    try:
        window, tail = asyncio.run(_plan(snap, since_ms, until_ms, dict(backlog_from)))
    except RemotingError as exc:
        raise ClusterError(f"reading {snap.deployment.label} failed: {exc}") from None
    keep = {r.start_offset for r in window} | {r.start_offset for r in tail}
    return RangePlan(window, tail, [r for r in snap.ranges if r.start_offset in keep])


async def _plan(
    snap: Snapshot, since_ms: int | None, until_ms: int | None, backlog_from: dict[str, int]
) -> tuple[list[PullRange], list[PullRange]]:
    client = _client(snap.deployment)
    topic = snap.deployment.topic
    window: list[PullRange] = []
    tail: list[PullRange] = []
    try:
        for broker, addr in snap.brokers.items():
            mine = [r for r in snap.ranges if r.broker == broker]
            if not mine:
                continue
            # lower: the first offset stored at or after the time (the queue's end when none
            # is); upper: the last at or before it (the queue's first when none is, which
            # only widens the plan). Checked against the broker in the report's tests.
            lo, hi = mine[0].start, mine[-1].end
            if since_ms is not None:
                lo = max(lo, await client.search_offset(addr, topic, since_ms, boundary="lower"))
            if until_ms is not None:
                last = await client.search_offset(addr, topic, until_ms - 1, boundary="upper")
                hi = min(hi, last + 1)
            window += [r for r in mine if r.end > lo and r.start < hi]
            first = await _backlog_start(client, snap, broker, addr, backlog_from)
            if first is not None:
                tail += [r for r in mine if r.end > first]
    finally:
        await client.close()
    return window, tail


async def _backlog_start(
    client: RemotingClient, snap: Snapshot, broker: str, addr: str, backlog_from: dict[str, int]
) -> int | None:
    """The parent offset on `broker` from which every message a subscriber of one of its copies
    has not committed is held (None: nothing waits there). A record pulled from a light queue
    carries its parent-queue offset (`queue_offset`): the copy's first undelivered message
    says where its backlog starts."""
    ends = {q.queue: q for q in snap.ends}
    lowest: int | None = None
    for copy, begin in backlog_from.items():
        queue, on = split_copy(copy)
        if (on or snap.home) != broker:
            continue
        end = ends.get(copy)
        if end is None:
            return 0  # a copy whose end is unknown: all of this broker's ranges
        if max(begin, end.min_offset) >= end.end_offset:
            continue  # nothing waiting in this copy
        lmq = encode_lmq(queue, snap.deployment.topic)
        try:
            res = await client.pull(
                addr, lmq, max(begin, end.min_offset), consumer_group=PULL_GROUP, max_messages=1
            )
        except OffsetMovedError:
            return 0  # retention moved it meanwhile: read all that is left
        if not res.messages:
            return 0
        parent = res.messages[0].queue_offset
        lowest = parent if lowest is None else min(lowest, parent)
    return lowest


def per_copy(subs: Iterable[Subscription], slots: Sequence[str]) -> list[Subscription]:
    """The subscriptions of a spread deployment (broker `slots`, home first) per copy: each
    entry of a spread queue `Q` becomes one per slot, named as analytics.copies names the
    copies, its start/next offsets that broker's component of the merged ones (a value below
    topicmap.spread.BASE is a home offset saved before spread: 0 elsewhere). Entries of other
    queues (on the home broker only) stay as they are."""
    out: list[Subscription] = []
    n = len(slots)
    for sub in subs:
        if not spread_queue(sub.queue):
            out.append(sub)
            continue
        start = None if sub.start_offset is None else position(sub.start_offset, n)
        nxt = None if sub.next_offset is None else position(sub.next_offset, n)
        for k, broker in enumerate(slots):
            out.append(
                dataclasses.replace(
                    sub,
                    queue=copy_name(sub.queue, broker, slots[0]),
                    start_offset=None if start is None else start[k],
                    next_offset=None if nxt is None else nxt[k],
                )
            )
    return out


def _subscriber(sub: Subscription) -> str:
    return SHARE_PREFIX + sub.share_group if sub.share_group else sub.client_id


async def _state(
    client: RemotingClient, addr: str, dep: Deployment
) -> tuple[dict[str, bytes], bytes | None]:
    """The live `session/` records of the %STATE% queue (client id -> value) and the value of
    its `meta/brokers` record (None: not spread), replayed as the gateway replays it at start
    (topicmap/rocketmq.py)."""
    lmq = encode_lmq(STATE_QUEUE, dep.topic)
    start = await client.query_consumer_offset(addr, encode_lmq(STATE_START, dep.topic), lmq)
    offset = max(await client.get_min_offset(addr, lmq), start or 0)
    hi = await client.get_max_offset(addr, lmq)
    state: dict[str, bytes] = {}
    slots: bytes | None = None
    while offset < hi:
        try:
            res = await client.pull(
                addr, lmq, offset, consumer_group=PULL_GROUP, max_messages=PULL_MESSAGES
            )
        except OffsetMovedError as exc:
            offset = exc.next_begin_offset
            continue
        if not res.messages:
            break
        for rec in res.messages:
            records, whole = decode_state(rec.body)
            if not whole:
                raise SnapshotError(
                    f"{dep.label}: a damaged state batch at CommitLog offset {rec.commitlog_offset}"
                )
            for key, value in records:
                if key == SLOTS_KEY:
                    slots = value
                if not key.startswith(SESSION_KEY_PREFIX):
                    continue
                if value is None:
                    state.pop(key[len(SESSION_KEY_PREFIX) :], None)
                else:
                    state[key[len(SESSION_KEY_PREFIX) :]] = value
        offset = res.next_begin_offset
    return state, slots


# -- the messages: one task's range -----------------------------------------------------------


def pull_batches(rng: PullRange, batch_rows: int = 65_536) -> Iterator[pa.RecordBatch]:
    """The MQTT messages of `rng` as record batches of ARROW_SCHEMA (runs in a Spark worker).

    Offsets deleted by retention meanwhile are skipped (the pull moves on to the first kept).
    """
    rows: list[MessageRecord] = []
    for records in _pulled(rng):
        rows.extend(records)
        if len(rows) >= batch_rows:
            yield to_batch(rows, rng)
            rows = []
    if rows:
        yield to_batch(rows, rng)


def _pulled(rng: PullRange) -> Iterator[list[MessageRecord]]:
    loop = asyncio.new_event_loop()
    client = RemotingClient([], request_timeout=30.0, connect_timeout=5.0)
    try:
        offset = rng.start
        while offset < rng.end:
            try:
                res = loop.run_until_complete(
                    client.pull(
                        rng.broker_addr,
                        rng.topic,
                        offset,
                        consumer_group=PULL_GROUP,
                        max_messages=min(PULL_MESSAGES, rng.end - offset),
                    )
                )
            except OffsetMovedError as exc:
                if exc.next_begin_offset <= offset:
                    return  # the queue ends below the range: nothing more
                offset = exc.next_begin_offset
                continue
            except RemotingError as exc:
                raise ClusterError(
                    f"pulling {rng.topic} offsets {offset}..{rng.end} from {rng.broker_addr}"
                    f" failed: {exc}"
                ) from None
            if not res.messages:
                if res.next_begin_offset <= offset:
                    return
                offset = res.next_begin_offset
                continue
            yield [m for m in res.messages if m.queue_offset < rng.end]
            offset = res.next_begin_offset
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def to_batch(records: list[MessageRecord], rng: PullRange) -> pa.RecordBatch:
    """Rows of ARROW_SCHEMA for the MQTT messages among `records`."""
    cols: dict[str, list[object]] = {f.name: [] for f in ARROW_SCHEMA}
    namespace = rng.topic
    for rec in records:
        props = rec.properties
        topic = props.get(record.TOPIC)
        if topic is None:
            continue  # a state batch or the start-up probe: no MQTT message
        qos = props.get(record.QOS)
        retain = props.get(record.RETAIN)
        # The broker's dispatch properties, read by the remoting client's one rule
        # (MessageRecord.light_queue_offsets): a queue without an integer offset (the broker
        # writes none for a name it did not index) is left out, and a list longer than the
        # other is cut to the shorter one, rather than failing the report.
        lights = rec.light_queue_offsets()
        queues = [rng.copy_of(decode_lmq(name, namespace) or name) for name in lights]
        queue_offsets = list(lights.values())
        cols["segment"].append(rng.start_offset)
        cols["physical_offset"].append(rng.rank << BROKER_SHIFT | rec.commitlog_offset)
        cols["store_timestamp"].append(rec.store_timestamp * 1000)
        cols["born_timestamp"].append(rec.born_timestamp * 1000)
        cols["parent_topic"].append(rec.topic)
        cols["topic"].append(topic)
        cols["client_id"].append(props.get(record.CLIENT))
        cols["qos"].append(int(qos) if qos in ("0", "1", "2") else None)
        cols["retain"].append(None if retain is None else retain == "1")
        cols["body_size"].append(0 if EMPTY_BODY_PROPERTY in props else len(rec.body))
        cols["queues"].append(queues)
        cols["queue_offsets"].append(queue_offsets)
    arrays = []
    for f in ARROW_SCHEMA:
        values = cols[f.name]
        if f.type == _TS:
            arrays.append(pa.array(values, pa.int64()).cast(_TS))
        else:
            arrays.append(pa.array(values, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)
