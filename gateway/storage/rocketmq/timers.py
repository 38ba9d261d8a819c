"""The delayed messages a RocketMQ deployment still holds: read from the broker's timer topic.

A delayed publish on RocketMQ is a timer message (gateway/storage/rocketmq/adapter.py
`put_delayed`); until it is due the broker keeps it in its timer topic (TIMER_TOPIC, queue 0),
with its own topic in REAL_TOPIC and its due time in TIMER_DELIVER_MS, and the topic keeps it
after it fired too (until the broker's retention). Pending = those of the deployment's topic
due after now; a long delay the broker rolled over (re-put to the timer topic, same UNIQ_KEY)
counts once. Read-only (plain pulls, no offset committed): for `lmqtt inspect --store rocketmq`.
"""

from __future__ import annotations

from gateway.storage.port import StoredMessage
from gateway.storage.rocketmq.broker import to_stored
from gateway.storage.rocketmq.history import PULL_GROUP, deployment_brokers
from rocketmq_remoting import OffsetMovedError, RemotingClient
from rocketmq_remoting.message import (
    PROPERTY_REAL_TOPIC,
    PROPERTY_TIMER_DELIVER_MS,
    TIMER_TOPIC,
)
from rocketmq_remoting.message import PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX as UNIQ_KEY

_BATCH = 256


async def pending_delayed(
    namesrv: str, topic: str, broker: str | None, now_ms: int
) -> list[tuple[int, StoredMessage]]:
    """(due ms, message) of every delayed message of deployment `topic` due after `now_ms`,
    earliest first, from each broker holding the deployment."""
    client = RemotingClient([namesrv], request_timeout=10.0, connect_timeout=3.0)
    try:
        found: dict[str, tuple[int, StoredMessage]] = {}
        for _name, addr in await deployment_brokers(client, topic, broker):
            offset = await client.get_min_offset(addr, TIMER_TOPIC, 0)
            end = await client.get_max_offset(addr, TIMER_TOPIC, 0)
            while offset < end:
                try:
                    res = await client.pull(
                        addr, TIMER_TOPIC, offset, consumer_group=PULL_GROUP,
                        queue_id=0, max_messages=_BATCH,
                    )  # fmt: skip
                except OffsetMovedError as exc:
                    offset = exc.next_begin_offset
                    continue
                if not res.messages:
                    break
                for rec in res.messages:
                    props = rec.properties
                    due = int(props.get(PROPERTY_TIMER_DELIVER_MS) or 0)
                    if props.get(PROPERTY_REAL_TOPIC) != topic or due <= now_ms:
                        continue
                    key = props.get(UNIQ_KEY) or str(rec.commitlog_offset)
                    found[key] = (due, to_stored(rec, rec.queue_offset, str))
                offset = res.next_begin_offset
        return sorted(found.values(), key=lambda x: x[0])
    finally:
        await client.close()
