"""Typed request headers, flattened the way ``RemotingCommand.makeCustomHeaderToNet`` does.

Each builder returns the ``extFields`` of one request: the Java header class's fields in their
declaration order (the order matters only for byte-identical frames), values as Java's
``toString()`` writes them, ``None`` fields left out. Field names and which are required
(``@CFNotNull``) were read from ``remoting/.../protocol/header/*.java`` of RocketMQ 5.3.3.
"""

from __future__ import annotations

from rocketmq_remoting.codes import AUTO_CREATE_TOPIC_KEY, PERM_READ, PERM_WRITE


def _flat(fields: dict[str, object | None]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in fields.items():
        if v is None:
            continue
        out[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return out


def get_route_info(topic: str) -> dict[str, str]:
    """``namesrv.GetRouteInfoRequestHeader``: topic, acceptStandardJsonOnly.

    Without acceptStandardJsonOnly (and with a version below V4_9_4) the name server writes
    the route with fastjson's defaults: ``brokerAddrs`` then has bare integer keys
    (``{0:"host:port"}``), which is not JSON. We always ask for the standard form.
    """
    return _flat({"topic": topic, "acceptStandardJsonOnly": True})


def send_message_v2(
    *,
    producer_group: str,
    topic: str,
    queue_id: int,
    born_timestamp: int,
    properties: str,
    default_topic: str = AUTO_CREATE_TOPIC_KEY,
    default_topic_queue_nums: int = 4,
    sys_flag: int = 0,
    flag: int = 0,
    reconsume_times: int = 0,
    unit_mode: bool = False,
    consume_retry_times: int | None = None,
    batch: bool = False,
    broker_name: str | None = None,
) -> dict[str, str]:
    """``SendMessageRequestHeaderV2``: SEND_MESSAGE's header with one-letter names a..n."""
    return _flat(
        {
            "a": producer_group,
            "b": topic,
            "c": default_topic,
            "d": default_topic_queue_nums,
            "e": queue_id,
            "f": sys_flag,
            "g": born_timestamp,
            "h": flag,
            "i": properties,
            "j": reconsume_times,
            "k": unit_mode,
            "l": consume_retry_times,
            "m": batch,
            "n": broker_name,
        }
    )


def pull_message(
    *,
    consumer_group: str,
    topic: str,
    queue_id: int,
    queue_offset: int,
    max_msg_nums: int,
    sys_flag: int,
    commit_offset: int,
    suspend_timeout_millis: int,
    subscription: str | None,
    sub_version: int = 0,
    expression_type: str | None = "TAG",
    max_msg_bytes: int | None = None,
) -> dict[str, str]:
    """``PullMessageRequestHeader``."""
    return _flat(
        {
            "consumerGroup": consumer_group,
            "topic": topic,
            "queueId": queue_id,
            "queueOffset": queue_offset,
            "maxMsgNums": max_msg_nums,
            "sysFlag": sys_flag,
            "commitOffset": commit_offset,
            "suspendTimeoutMillis": suspend_timeout_millis,
            "subscription": subscription,
            "subVersion": sub_version,
            "expressionType": expression_type,
            "maxMsgBytes": max_msg_bytes,
        }
    )


def query_consumer_offset(
    consumer_group: str, topic: str, queue_id: int, set_zero_if_not_found: bool | None = None
) -> dict[str, str]:
    """``QueryConsumerOffsetRequestHeader``."""
    return _flat(
        {
            "consumerGroup": consumer_group,
            "topic": topic,
            "queueId": queue_id,
            "setZeroIfNotFound": set_zero_if_not_found,
        }
    )


def update_consumer_offset(
    consumer_group: str, topic: str, queue_id: int, commit_offset: int
) -> dict[str, str]:
    """``UpdateConsumerOffsetRequestHeader``."""
    return _flat(
        {
            "consumerGroup": consumer_group,
            "topic": topic,
            "queueId": queue_id,
            "commitOffset": commit_offset,
        }
    )


def get_consumer_list_by_group(consumer_group: str) -> dict[str, str]:
    """``GetConsumerListByGroupRequestHeader``."""
    return _flat({"consumerGroup": consumer_group})


def unregister_client(client_id: str, consumer_group: str) -> dict[str, str]:
    """``UnregisterClientRequestHeader``: a consumer leaving its group."""
    return _flat({"clientID": client_id, "consumerGroup": consumer_group})


def search_offset(
    topic: str, queue_id: int, timestamp: int, boundary: str = "lower"
) -> dict[str, str]:
    """``SearchOffsetRequestHeader``; boundaryType is a ``BoundaryType`` name: lower, upper."""
    return _flat(
        {
            "topic": topic,
            "queueId": queue_id,
            "timestamp": timestamp,
            "boundaryType": boundary.upper(),
        }
    )


def get_max_offset(topic: str, queue_id: int, committed: bool = True) -> dict[str, str]:
    """``GetMaxOffsetRequestHeader`` (``committed`` is a primitive: always sent)."""
    return _flat({"topic": topic, "queueId": queue_id, "committed": committed})


def get_min_offset(topic: str, queue_id: int) -> dict[str, str]:
    """``GetMinOffsetRequestHeader``."""
    return _flat({"topic": topic, "queueId": queue_id})


def create_topic(
    topic: str,
    *,
    read_queue_nums: int = 1,
    write_queue_nums: int = 1,
    perm: int = PERM_READ | PERM_WRITE,
    default_topic: str = AUTO_CREATE_TOPIC_KEY,
    topic_filter_type: str = "SINGLE_TAG",
    topic_sys_flag: int = 0,
    order: bool = False,
    attributes: str | None = None,
    force: bool = False,
) -> dict[str, str]:
    """``CreateTopicRequestHeader`` (UPDATE_AND_CREATE_TOPIC)."""
    return _flat(
        {
            "topic": topic,
            "defaultTopic": default_topic,
            "readQueueNums": read_queue_nums,
            "writeQueueNums": write_queue_nums,
            "perm": perm,
            "topicFilterType": topic_filter_type,
            "topicSysFlag": topic_sys_flag,
            "order": order,
            "attributes": attributes,
            "force": force,
        }
    )
