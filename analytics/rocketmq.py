"""The fan-out report's inputs read from a RocketMQ deployment, through pulls.

A gateway started with `--store rocketmq` keeps its messages and its sessions on one RocketMQ
broker (gateway/rocketmq_storage.py): every message is sent to the deployment's parent topic
(`rocketmq_topic`, one queue) with INNER_MULTI_DISPATCH = its light queues, and the sessions
are the records of the %STATE% light queue. The report reads exactly that, over the remoting
protocol (rocketmq_remoting), from any machine that reaches the name server:

    messages      PULL_MESSAGE of the parent topic's queue 0, cut into PullRanges of
                  RANGE_MESSAGES offsets, one Spark task each (like one segment each on the
                  embedded store). Each pulled record is a stored CommitLog record (v1 or v2,
                  IPv4 or IPv6 hosts: rocketmq_remoting.message.decode_records); it becomes a
                  row of analytics.segments.ARROW_SCHEMA, its light queues named back to the
                  gateway's queue names (topicmap.rocketmq.decode_lmq).
    subscriptions the %STATE% queue replayed from the offset committed for %STATE-START% (the
                  last compaction's snapshot), newest record per key: the `session/` records
    committed     the broker's consumer offsets (group = the subscriber's light-queue name,
                  topic = the queue's): the only copy, which the gateway sends every second
                  (gateway/rocketmq_offsets.py; its data directory has no offsets table)
    queue ends    GET_MIN_OFFSET / GET_MAX_OFFSET of every subscribed light queue
    account       the delivery account stays in the gateway's data directory (--data-dir):
                  without it, deliveries are counted from the committed offsets alone

Why pulls rather than the brokers' store directories: the report then needs neither a shell on
the broker hosts nor their disks mounted (nor a copy of them), it reads only the deployment's
own topic where a broker's CommitLog holds every topic of the cluster, a broker's retention and
file layout (v2 records, IPv6 hosts, no CRC property) stay the broker's business, and the
numbers are the ones the gateway itself reads. The cost is the broker serving the pulls: a
report reads every kept message of the deployment once (no time pruning yet).

Records that are no MQTT message (the state batches, the gateway's start-up probe: no
`mqtt.topic` property) are left out: on the embedded store they live outside the CommitLog.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from analytics.errors import ClusterError, SnapshotError
from analytics.segments import (
    ARROW_SCHEMA,
    KEY_CLIENT,
    KEY_QOS,
    KEY_RETAIN,
    KEY_TOPIC,
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
)
from store.delivery_account import AccountRecord, read_account
from topicmap.rocketmq import (
    EMPTY_BODY_PROPERTY,
    STATE_QUEUE,
    STATE_START,
    decode_lmq,
    decode_state,
    encode_lmq,
)

#: Parent-queue offsets per Spark task.
RANGE_MESSAGES = 200_000
#: Messages asked per pull (the broker sends fewer when its transfer limits say so).
PULL_MESSAGES = 256
#: The report's pulls: a `%LMQ%` group needs no creation on the broker, and nothing is committed.
PULL_GROUP = "%LMQ%lmqtt-report"
_DISPATCH = "INNER_MULTI_DISPATCH"
_DISPATCH_OFFSETS = "INNER_MULTI_QUEUE_OFFSET"
_TS = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True, slots=True)
class Deployment:
    """A gateway deployment on RocketMQ: the name server, the parent topic (`rocketmq_topic`),
    the broker (`rocketmq_broker`; None: the one holding the topic, else the first registered by
    name, as the gateway picks: RemotingClient.home_broker),
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

    @property
    def name(self) -> str:
        return f"pull-{self.start:020d}"

    @property
    def start_offset(self) -> int:
        return self.start


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the report needs of the deployment besides its messages (read once, before the
    Spark job starts: a deployment that cannot be read fails in a second, without a JVM)."""

    deployment: Deployment
    ranges: list[PullRange]
    subscriptions: list[Subscription]
    committed: dict[tuple[str, str], int]
    ends: list[QueueEnd]
    account: list[AccountRecord]


def _client(dep: Deployment) -> RemotingClient:
    return RemotingClient([dep.namesrv], request_timeout=10.0, connect_timeout=3.0)


async def _broker(client: RemotingClient, dep: Deployment) -> str:
    """The address of the deployment's broker (the gateway's rule: RemotingClient.home_broker)."""
    try:
        return (await client.home_broker(dep.topic, dep.broker)).addr
    except BrokerNotFoundError as exc:
        raise ClusterError(str(exc)) from None
    except RemotingError as exc:
        raise ClusterError(f"RocketMQ name server {dep.namesrv} unreachable: {exc}") from None


def read_deployment(dep: Deployment) -> Snapshot:
    """Everything but the messages, and the ranges their tasks pull (ClusterError when the
    deployment cannot be read or holds no messages)."""
    try:
        return asyncio.run(_read_deployment(dep))
    except RemotingError as exc:
        raise ClusterError(f"reading {dep.label} failed: {exc}") from None


async def _read_deployment(dep: Deployment) -> Snapshot:
    client = _client(dep)
    try:
        addr = await _broker(client, dep)
        lo = await client.get_min_offset(addr, dep.topic)
        hi = await client.get_max_offset(addr, dep.topic)
        if hi <= lo:
            raise ClusterError(
                f"{dep.label} holds no messages (topic {dep.topic!r} is empty or unknown on"
                f" broker {addr}): is --rocketmq-topic the gateway's rocketmq_topic?"
            )
        ranges = [
            PullRange(addr, dep.topic, start, min(hi, start + RANGE_MESSAGES))
            for start in range(lo, hi, RANGE_MESSAGES)
        ]
        subs = subscriptions_of(session_records(await _state(client, addr, dep), dep.label), dep)
        keys = sorted({(_subscriber(s), s.queue) for s in subs})
        committed = {}
        for key, queue in keys:
            found = await client.query_consumer_offset(
                addr, encode_lmq(key, dep.topic), encode_lmq(queue, dep.topic)
            )
            if found is not None:
                committed[(key, queue)] = found
        ends = []
        for queue in sorted({q for _, q in keys}):
            lmq = encode_lmq(queue, dep.topic)
            ends.append(
                QueueEnd(
                    queue,
                    await client.get_min_offset(addr, lmq),
                    await client.get_max_offset(addr, lmq),
                )
            )
    finally:
        await client.close()
    account = read_account(Path(dep.data_dir)) if dep.data_dir is not None else []
    return Snapshot(dep, ranges, subs, committed, ends, account)


def _subscriber(sub: Subscription) -> str:
    return SHARE_PREFIX + sub.share_group if sub.share_group else sub.client_id


async def _state(client: RemotingClient, addr: str, dep: Deployment) -> dict[str, bytes]:
    """The live `session/` records of the %STATE% queue (client id -> value), replayed as the
    gateway replays it at start (topicmap/rocketmq.py)."""
    lmq = encode_lmq(STATE_QUEUE, dep.topic)
    start = await client.query_consumer_offset(addr, encode_lmq(STATE_START, dep.topic), lmq)
    offset = max(await client.get_min_offset(addr, lmq), start or 0)
    hi = await client.get_max_offset(addr, lmq)
    state: dict[str, bytes] = {}
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
                if not key.startswith(SESSION_KEY_PREFIX):
                    continue
                if value is None:
                    state.pop(key[len(SESSION_KEY_PREFIX) :], None)
                else:
                    state[key[len(SESSION_KEY_PREFIX) :]] = value
        offset = res.next_begin_offset
    return state


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
        topic = props.get(KEY_TOPIC)
        if topic is None:
            continue  # a state batch or the start-up probe: no MQTT message
        qos = props.get(KEY_QOS)
        retain = props.get(KEY_RETAIN)
        names = props.get(_DISPATCH, "")
        offsets = props.get(_DISPATCH_OFFSETS, "")
        queues: list[str] = []
        queue_offsets: list[int] = []
        for name, off in zip(names.split(",") if names else [], offsets.split(","), strict=False):
            if not off.lstrip("-").isdigit():
                continue
            queues.append(decode_lmq(name, namespace) or name)
            queue_offsets.append(int(off))
        cols["segment"].append(rng.start)
        cols["physical_offset"].append(rec.commitlog_offset)
        cols["store_timestamp"].append(rec.store_timestamp * 1000)
        cols["born_timestamp"].append(rec.born_timestamp * 1000)
        cols["parent_topic"].append(rec.topic)
        cols["topic"].append(topic)
        cols["client_id"].append(props.get(KEY_CLIENT))
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
