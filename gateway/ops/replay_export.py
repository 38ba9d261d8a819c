"""`lmqtt replay`: export what a replay would deliver, offline, without a gateway or Spark.

The store is opened read-only (safe beside a running gateway), and the same cursor as a live
replay (gateway/session/replay.py) walks the parent topics (a RocketMQ deployment's one parent
topic, pulled from its broker: gateway/storage/rocketmq/history.py PulledHistory) from `--since` to
`--until` (or the end) in store order, matching the filter. Rows stream out: JSON Lines one at a
time, Parquet in row groups of ROW_GROUP rows, so memory stays bounded whatever the history's size.

One row per message:

    field               type     meaning
    ------------------  -------  --------------------------------------------------------
    topic               string   MQTT topic name
    payload             string   the payload as UTF-8 text, null when it is not valid UTF-8
    payload_base64      string   the payload, base64 (always)
    qos                 int      publish QoS
    retain              bool     the RETAIN flag it was published with
    client_id           string   publishing client ("" for the gateway's own messages)
    store_time          string   RFC 3339, milliseconds, UTC
    store_timestamp_ms  int      epoch milliseconds
    parent              string   parent topic (store queue name)
    parent_offset       int      offset in the parent queue
    physical_offset     int      CommitLog offset (the store order)
    properties          string   JSON object of the other MQTT properties (mqtt.* keys)
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

from gateway.messages.records import RecordedPublish
from gateway.session.replay import iso_ms, start_replay
from gateway.storage.cursor import QueueCursor
from gateway.storage.embedded import open_read_only
from gateway.storage.port import Storage, StoredMessage
from gateway.storage.rocketmq.spread import SEP
from topicmap import TopicFilter, record
from topicmap.rocketmq import TOPIC_PROPERTY

ROW_GROUP = 10_000
# (TOPIC_PROPERTY: the copy of the topic a RocketMQ deployment may add for native consumers.)
_BASE_PROPS = frozenset(
    {record.TOPIC, record.QOS, record.RETAIN, record.CLIENT, record.PID, TOPIC_PROPERTY}
)


def _row(msg: StoredMessage, rec: RecordedPublish) -> dict[str, Any]:
    try:
        text: str | None = rec.payload.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    others = {k: v for k, v in rec.props.items() if k not in _BASE_PROPS}
    return {
        "topic": rec.topic,
        "payload": text,
        "payload_base64": base64.b64encode(rec.payload).decode("ascii"),
        "qos": rec.qos,
        "retain": rec.retain,
        "client_id": rec.client_id,
        "store_time": iso_ms(msg.store_timestamp),
        "store_timestamp_ms": msg.store_timestamp,
        "parent": msg.topic.partition(SEP)[0],  # a spread deployment's: topic SEP broker
        "parent_offset": msg.queue_offset,
        "physical_offset": msg.physical_offset,
        "properties": json.dumps(others, separators=(",", ":")),
    }


def replay_rows(
    store: Storage, tf: TopicFilter, since_ms: int, until_ms: int | None, start: str
) -> tuple[Iterator[dict[str, Any]], str | None]:
    """The rows, and a note when retention cut the requested start off."""
    replay, cutoff = start_replay(store, tf, since_ms, start, until_ms)
    rows = (_row(msg, rec) for msg, rec in replay.messages(QueueCursor(store)))
    return rows, cutoff.text(tf.filter) if cutoff is not None else None


def write_jsonl(rows: Iterator[dict[str, Any]], out: IO[str]) -> int:
    n = 0
    for row in rows:
        out.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
        out.write("\n")
        n += 1
    return n


def write_parquet(rows: Iterator[dict[str, Any]], path: Path) -> int:
    import pyarrow as pa  # the analytics extra; imported only for this format
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("topic", pa.string()),
            ("payload", pa.string()),
            ("payload_base64", pa.string()),
            ("qos", pa.int8()),
            ("retain", pa.bool_()),
            ("client_id", pa.string()),
            ("store_time", pa.string()),
            ("store_timestamp_ms", pa.int64()),
            ("parent", pa.string()),
            ("parent_offset", pa.int64()),
            ("physical_offset", pa.int64()),
            ("properties", pa.string()),
        ]
    )
    n = 0
    with pq.ParquetWriter(path, schema) as writer:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(row)
            if len(batch) >= ROW_GROUP:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n += len(batch)
                batch = []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
    return n


def open_store(data_dir: Path) -> Storage:
    return open_read_only(data_dir)


def open_rocketmq_history(namesrv: str, topic: str, broker: str | None) -> Storage:
    """A RocketMQ deployment's parent topic, read with blocking pulls (read-only): it makes the
    reads a replay makes (history_queues, min/max_offset, offset_by_time, get), which is all
    replay_rows asks of a Storage. RemotingError when the cluster cannot be read."""
    from gateway.storage.rocketmq.history import PulledHistory

    return cast("Storage", PulledHistory(namesrv, topic, broker))
