"""Numbers of RocketMQ's remoting protocol, as apache/rocketmq 5.3.3 defines them.

Each constant was read from the Java source named beside it (remoting/.../protocol/).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final


class RequestCode(IntEnum):
    """``RequestCode.java``: what a request asks for."""

    SEND_MESSAGE = 10
    PULL_MESSAGE = 11
    QUERY_CONSUMER_OFFSET = 14
    UPDATE_CONSUMER_OFFSET = 15
    UPDATE_AND_CREATE_TOPIC = 17
    GET_ALL_TOPIC_CONFIG = 21
    UPDATE_BROKER_CONFIG = 25
    GET_BROKER_CONFIG = 26
    SEARCH_OFFSET_BY_TIMESTAMP = 29
    GET_MAX_OFFSET = 30
    GET_MIN_OFFSET = 31
    GET_EARLIEST_MSG_STORETIME = 32
    HEART_BEAT = 34
    UNREGISTER_CLIENT = 35
    GET_CONSUMER_LIST_BY_GROUP = 38
    GET_ROUTEINFO_BY_TOPIC = 105
    GET_BROKER_CLUSTER_INFO = 106
    DELETE_TOPIC_IN_BROKER = 215
    DELETE_TOPIC_IN_NAMESRV = 216
    SEND_MESSAGE_V2 = 310
    SEND_BATCH_MESSAGE = 320


class ResponseCode(IntEnum):
    """``RemotingSysResponseCode.java`` (0-4) and ``ResponseCode.java`` (the rest)."""

    SUCCESS = 0
    SYSTEM_ERROR = 1
    SYSTEM_BUSY = 2
    REQUEST_CODE_NOT_SUPPORTED = 3
    TRANSACTION_FAILED = 4
    FLUSH_DISK_TIMEOUT = 10
    SLAVE_NOT_AVAILABLE = 11
    FLUSH_SLAVE_TIMEOUT = 12
    MESSAGE_ILLEGAL = 13
    SERVICE_NOT_AVAILABLE = 14
    VERSION_NOT_SUPPORTED = 15
    NO_PERMISSION = 16
    TOPIC_NOT_EXIST = 17
    TOPIC_EXIST_ALREADY = 18
    PULL_NOT_FOUND = 19
    PULL_RETRY_IMMEDIATELY = 20
    PULL_OFFSET_MOVED = 21
    QUERY_NOT_FOUND = 22
    SUBSCRIPTION_PARSE_FAILED = 23
    SUBSCRIPTION_NOT_EXIST = 24
    SUBSCRIPTION_NOT_LATEST = 25
    SUBSCRIPTION_GROUP_NOT_EXIST = 26
    FILTER_DATA_NOT_EXIST = 27
    FILTER_DATA_NOT_LATEST = 28
    INVALID_PARAMETER = 29
    FLOW_CONTROL = 215
    NOT_LEADER_FOR_QUEUE = 501
    ILLEGAL_OPERATION = 604
    GO_AWAY = 1500


class LanguageCode(IntEnum):
    """``LanguageCode.java``: the JSON header names it, the binary header carries the byte."""

    JAVA = 0
    CPP = 1
    DOTNET = 2
    PYTHON = 3
    DELPHI = 4
    ERLANG = 5
    RUBY = 6
    OTHER = 7
    HTTP = 8
    GO = 9
    PHP = 10
    OMS = 11
    RUST = 12


class SerializeType(IntEnum):
    """``SerializeType.java``: the high byte of the frame's second int."""

    JSON = 0
    ROCKETMQ = 1


#: ``flag`` bits of a command (``RemotingCommand.RPC_TYPE`` / ``RPC_ONEWAY``).
FLAG_RESPONSE: Final = 1 << 0
FLAG_ONEWAY: Final = 1 << 1

#: ``MQVersion.Version.V5_3_3.ordinal()``: the ``version`` we send. The name server answers a
#: route query in standard JSON when the version is at least V4_9_4 (401) or the request sets
#: ``acceptStandardJsonOnly=true`` (ClientRequestProcessor.getRouteInfoByTopic); we do both.
VERSION_5_3_3: Final = 479
VERSION_4_9_4: Final = 401

#: ``PullSysFlag.java``.
PULL_COMMIT_OFFSET: Final = 0x1
PULL_SUSPEND: Final = 0x1 << 1
PULL_SUBSCRIPTION: Final = 0x1 << 2
PULL_CLASS_FILTER: Final = 0x1 << 3
PULL_LITE: Final = 0x1 << 4

#: ``PermName.java``: topic permissions for UPDATE_AND_CREATE_TOPIC.
PERM_PRIORITY: Final = 0x1 << 3
PERM_READ: Final = 0x1 << 2
PERM_WRITE: Final = 0x1 << 1
PERM_INHERIT: Final = 0x1 << 0

#: ``MixAll.java``: light queues are topics named ``%LMQ%...``, each with one queue, id 0.
LMQ_PREFIX: Final = "%LMQ%"
LMQ_QUEUE_ID: Final = 0
LMQ_DISPATCH_SEPARATOR: Final = ","
#: ``TopicValidator.AUTO_CREATE_TOPIC_KEY_TOPIC``: the template topic of auto-creation.
AUTO_CREATE_TOPIC_KEY: Final = "TBW102"
