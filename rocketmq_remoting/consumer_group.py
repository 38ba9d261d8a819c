"""Consumer groups: the groups a RemotingClient is a member of, and the broker calls on them.

A member announces itself in every HEART_BEAT (``HeartbeatData.consumerDataSet``: what
:class:`ConsumerGroups` holds); the broker lists a group's members to any of them
(`consumer_ids`), and forgets one at UNREGISTER_CLIENT (`leave_group`) or when its connection
closes. The calls here take the client they go through.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from rocketmq_remoting import headers
from rocketmq_remoting.codes import RequestCode, ResponseCode
from rocketmq_remoting.command import RemotingCommand
from rocketmq_remoting.errors import raise_for


class ConsumerGroups:
    """The consumer groups one client is a member of (group -> its subscribed topics)."""

    def __init__(self) -> None:
        self._topics: dict[str, list[str]] = {}

    def join(self, group: str, topics: Iterable[str]) -> None:
        self._topics[group] = list(topics)

    def leave(self, group: str) -> None:
        self._topics.pop(group, None)

    def consumer_data(self) -> list[dict[str, Any]]:
        """``ConsumerData`` of each group for a heartbeat: a pull consumer, clustering, `*`
        on each topic."""
        return [
            {
                "groupName": group,
                "consumeType": "CONSUME_ACTIVELY",
                "messageModel": "CLUSTERING",
                "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET",
                "subscriptionDataSet": [
                    {
                        "classFilterMode": False,
                        "topic": topic,
                        "subString": "*",
                        "tagsSet": [],
                        "codeSet": [],
                        "subVersion": 0,
                        "expressionType": "TAG",
                    }
                    for topic in topics
                ],
                "unitMode": False,
            }
            for group, topics in self._topics.items()
        ]


class GroupClient(Protocol):
    """What the calls here use of a RemotingClient."""

    @property
    def client_id(self) -> str: ...

    @property
    def groups(self) -> ConsumerGroups: ...

    async def heartbeat(self, broker_addr: str) -> None: ...

    async def invoke_broker(
        self,
        addr: str,
        code: int,
        ext_fields: Mapping[str, str] | None = None,
        body: bytes = b"",
        timeout: float | None = None,
    ) -> RemotingCommand: ...


async def join_group(
    client: GroupClient, group: str, topics: list[str], broker_addrs: Iterable[str]
) -> None:
    """Make `client` a member of consumer group `group` (reading `topics`) on each broker:
    announced now by a heartbeat, then by every periodic one."""
    client.groups.join(group, topics)
    for addr in broker_addrs:
        await client.heartbeat(addr)


async def leave_group(client: GroupClient, group: str, broker_addrs: Iterable[str]) -> None:
    """UNREGISTER_CLIENT (35) on each broker: the other members take this one's queues at
    their next look instead of when the broker notices the closed connection."""
    client.groups.leave(group)
    for addr in broker_addrs:
        answer = await client.invoke_broker(
            addr,
            RequestCode.UNREGISTER_CLIENT,
            headers.unregister_client(client.client_id, group),
        )
        raise_for(answer, addr)


async def consumer_ids(client: GroupClient, broker_addr: str, group: str) -> list[str]:
    """GET_CONSUMER_LIST_BY_GROUP (38): the client ids of the group's members the broker
    knows (``GetConsumerListByGroupResponseBody``); empty when it knows none."""
    answer = await client.invoke_broker(
        broker_addr,
        RequestCode.GET_CONSUMER_LIST_BY_GROUP,
        headers.get_consumer_list_by_group(group),
    )
    if answer.code == ResponseCode.SYSTEM_ERROR and not answer.body:
        return []  # "no consumer for this group"
    raise_for(answer, broker_addr)
    body = json.loads(answer.body or b"{}")
    return [str(c) for c in body.get("consumerIdList") or []]
