"""A small asyncio client of Apache RocketMQ's remoting protocol (TCP, JSON headers).

Standalone: it imports nothing of lmqtt. See docs/rocketmq.md for what was verified against
RocketMQ 5.3.3 and how lmqtt's storage operations map onto these calls.
"""

from rocketmq_remoting.client import HomeBroker, PullResult, RemotingClient, SendResult
from rocketmq_remoting.codes import RequestCode, ResponseCode
from rocketmq_remoting.command import RemotingCommand, decode_frame
from rocketmq_remoting.errors import (
    BrokerBusyError,
    BrokerError,
    BrokerNotFoundError,
    OffsetMovedError,
    ProtocolError,
    RemotingClosedError,
    RemotingConnectError,
    RemotingError,
    RemotingTimeoutError,
    TopicNotExistError,
)
from rocketmq_remoting.message import MessageRecord, decode_records
from rocketmq_remoting.route import ClusterInfo, TopicRoute, broker_for

__all__ = [
    "BrokerBusyError",
    "BrokerError",
    "BrokerNotFoundError",
    "ClusterInfo",
    "HomeBroker",
    "MessageRecord",
    "OffsetMovedError",
    "ProtocolError",
    "PullResult",
    "RemotingClient",
    "RemotingClosedError",
    "RemotingCommand",
    "RemotingConnectError",
    "RemotingError",
    "RemotingTimeoutError",
    "RequestCode",
    "ResponseCode",
    "SendResult",
    "TopicNotExistError",
    "TopicRoute",
    "broker_for",
    "decode_frame",
    "decode_records",
]
