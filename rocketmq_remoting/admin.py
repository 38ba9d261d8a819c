"""Administration calls: topics created, a broker's configuration read, brokers awaited.

Functions taking the RemotingClient they go through: a deployment's start-up and the tests
use them, the message path does not.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rocketmq_remoting import headers
from rocketmq_remoting.codes import PERM_READ, PERM_WRITE, RequestCode
from rocketmq_remoting.errors import RemotingError, raise_for
from rocketmq_remoting.route import ClusterInfo

if TYPE_CHECKING:
    from rocketmq_remoting.client import RemotingClient


async def create_topic(
    client: RemotingClient,
    broker_addr: str,
    topic: str,
    *,
    queues: int = 1,
    perm: int | None = None,
) -> None:
    """UPDATE_AND_CREATE_TOPIC (17) on one broker, which registers it at the name server."""
    fields = headers.create_topic(
        topic,
        read_queue_nums=queues,
        write_queue_nums=queues,
        perm=PERM_READ | PERM_WRITE if perm is None else perm,
    )
    answer = await client.invoke_broker(broker_addr, RequestCode.UPDATE_AND_CREATE_TOPIC, fields)
    raise_for(answer, broker_addr)


async def get_broker_config(client: RemotingClient, broker_addr: str) -> dict[str, str]:
    """GET_BROKER_CONFIG (26): the broker's running configuration (``MixAll.properties2String``
    of BrokerConfig, MessageStoreConfig, ...: Java properties text, ``key=value`` lines)."""
    answer = await client.invoke_broker(broker_addr, RequestCode.GET_BROKER_CONFIG, {})
    raise_for(answer, broker_addr)
    config: dict[str, str] = {}
    for line in (answer.body or b"").decode("utf-8", "replace").splitlines():
        if not line or line.startswith(("#", "!")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = re.sub(r"\\(.)", r"\1", value.strip())
    return config


async def update_broker_config(
    client: RemotingClient, broker_addr: str, settings: dict[str, str]
) -> None:
    """UPDATE_BROKER_CONFIG (25): change settings of a running broker (Java properties text in
    the body, ``key=value`` lines), applied to its live configuration objects."""
    body = "".join(f"{key}={value}\n" for key, value in settings.items()).encode()
    answer = await client.invoke_broker(
        broker_addr, RequestCode.UPDATE_BROKER_CONFIG, {}, body=body
    )
    raise_for(answer, broker_addr)


async def wait_for_brokers(
    client: RemotingClient, cluster: str, broker_names: Iterable[str], timeout: float
) -> ClusterInfo:
    """Poll GET_BROKER_CLUSTER_INFO until every named broker has a master registered."""
    wanted = set(broker_names)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            info = await client.get_cluster_info()
            members = set(info.clusters.get(cluster, []))
            known = [info.brokers.get(n) for n in wanted]
            if wanted <= members and all(b is not None and b.master_addr for b in known):
                return info
            last = RemotingError(f"registered so far: {sorted(members)}")
        except RemotingError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise RemotingError(f"brokers {sorted(wanted)} not registered in time: {last}")
        await asyncio.sleep(0.2)
