"""An asyncio RocketMQ remoting client: name-server routes and the broker calls lmqtt needs.

One :class:`RemotingClient` holds at most one pipelined connection per address, reconnects and
sends the brokers their heartbeats (its base, connections.py); this module has the calls.

Broker answers other than the success codes a call expects raise :class:`BrokerError` (or a
subclass) carrying the broker's own ``code`` and ``remark``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field

from rocketmq_remoting import headers
from rocketmq_remoting.codes import (
    LMQ_QUEUE_ID,
    PULL_COMMIT_OFFSET,
    PULL_SUBSCRIPTION,
    PULL_SUSPEND,
    RequestCode,
    ResponseCode,
)
from rocketmq_remoting.command import RemotingCommand
from rocketmq_remoting.connections import Connections
from rocketmq_remoting.errors import (
    OffsetMovedError,
    RemotingError,
    TopicNotExistError,
    raise_for,
)
from rocketmq_remoting.held_pull import HeldPull
from rocketmq_remoting.message import (
    PROPERTY_INNER_MULTI_DISPATCH,
    PROPERTY_WAIT_STORE_MSG_OK,
    MessageRecord,
    decode_records,
    dispatch_property,
    encode_properties,
    scan_records,
)
from rocketmq_remoting.pull_frames import PullFrames
from rocketmq_remoting.route import ClusterInfo, TopicRoute

log = logging.getLogger(__name__)

#: How often the broker looks at its held pulls: PullRequestHoldService (and its light-queue
#: twin) wakes every 5 s when longPollingEnable is on (the default) and answers a pull whose
#: suspend time has gone by then. A held pull that finds nothing is thus answered PULL_NOT_FOUND
#: up to suspend + HOLD_CHECK_S after it arrived, and waiting only suspend + the request
#: timeout for it races the broker's answer.
HOLD_CHECK_S = 5.0
#: Pull frame templates kept (one per reader: a tail per broker, a mirror per queue without
#: notify pulls); past it they are made again.
PULL_TEMPLATES = 1024
#: The sys flag of a held pull without commit (`held_pull`).
_HELD_PULL = PULL_SUBSCRIPTION | PULL_SUSPEND


@dataclass(slots=True)
class SendResult:
    """SEND_MESSAGE_V2's answer (``SendMessageResponseHeader``).

    The broker does not return the light-queue offsets it assigned: they are stored with the
    message (its dispatch offsets property, message.py) and come back with it on a pull.
    """

    code: int  # SUCCESS, or FLUSH_DISK_TIMEOUT / FLUSH_SLAVE_TIMEOUT / SLAVE_NOT_AVAILABLE
    msg_id: str
    queue_id: int
    queue_offset: int
    transaction_id: str | None
    region: str | None

    @property
    def ok(self) -> bool:
        """SEND_OK: stored (and, on a SYNC_FLUSH broker, flushed) before the answer."""
        return self.code == ResponseCode.SUCCESS


@dataclass(slots=True)
class PullResult:
    """PULL_MESSAGE's answer when the offset is valid (FOUND, NOT_FOUND or RETRY)."""

    code: int
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: list[MessageRecord] = field(default_factory=list)
    #: With `pull(wanted=...)`: the CommitLog offset of the answer's last record, passed over
    #: or not (-1 if none): how far the broker's log goes, as far as this answer shows.
    last_commitlog_offset: int = -1

    @property
    def found(self) -> bool:
        return self.code == ResponseCode.SUCCESS


@dataclass(frozen=True, slots=True)
class HomeBroker:
    """A deployment's home broker (RemotingClient.home_broker) and every broker its parent
    topic is on now (`serving`, sorted; empty for a new deployment)."""

    name: str
    addr: str
    serving: list[str]


#: The answers to a send that mean stored (durability in doubt for all but SUCCESS).
SEND_STORED = (
    ResponseCode.SUCCESS,
    ResponseCode.FLUSH_DISK_TIMEOUT,
    ResponseCode.FLUSH_SLAVE_TIMEOUT,
    ResponseCode.SLAVE_NOT_AVAILABLE,
)


def pull_result(
    answer: RemotingCommand, broker_addr: str, wanted: Container[str] | None, check_crc: bool
) -> PullResult:
    """A PULL_MESSAGE answer as `RemotingClient.pull` returns it (see there), or raised."""
    next_begin = _int(answer, "nextBeginOffset")
    min_offset = _int(answer, "minOffset")
    max_offset = _int(answer, "maxOffset")
    if answer.code == ResponseCode.PULL_OFFSET_MOVED:
        raise OffsetMovedError(
            answer.code, answer.remark, broker_addr, next_begin, min_offset, max_offset
        )
    raise_for(
        answer,
        broker_addr,
        ok=(
            ResponseCode.SUCCESS,
            ResponseCode.PULL_NOT_FOUND,
            ResponseCode.PULL_RETRY_IMMEDIATELY,
        ),
    )
    if answer.code != ResponseCode.SUCCESS:
        return PullResult(answer.code, next_begin, min_offset, max_offset, [])
    if wanted is None:
        messages = list(decode_records(answer.body, check_crc))
        return PullResult(answer.code, next_begin, min_offset, max_offset, messages)
    messages, last = scan_records(answer.body, wanted, check_crc)
    return PullResult(answer.code, next_begin, min_offset, max_offset, messages, last)


def send_result(answer: RemotingCommand, broker_addr: str) -> SendResult:
    """A send's answer as a SendResult; the typed error (BrokerBusyError, BrokerError) unless
    the broker stored the message."""
    raise_for(answer, broker_addr, ok=SEND_STORED)
    return SendResult(
        code=answer.code,
        msg_id=answer.ext_fields.get("msgId", ""),
        queue_id=_int(answer, "queueId"),
        queue_offset=_int(answer, "queueOffset"),
        transaction_id=answer.ext_fields.get("transactionId"),
        region=answer.ext_fields.get("MSG_REGION"),
    )


def _int(cmd: RemotingCommand, name: str, default: int = 0) -> int:
    value = cmd.ext_fields.get(name)
    return int(value) if value not in (None, "", "null") else default


class RemotingClient(Connections):
    """Talks to the name servers in ``namesrv_addrs`` and to any broker address (the
    connections, requests and heartbeats: Connections, its base)."""

    # -- name server --------------------------------------------------------------------------

    async def get_route(self, topic: str) -> TopicRoute:
        """GET_ROUTEINFO_BY_TOPIC (105); TopicNotExistError when no broker serves the topic."""
        addr, answer = await self._invoke_namesrv(
            RequestCode.GET_ROUTEINFO_BY_TOPIC, headers.get_route_info(topic)
        )
        raise_for(answer, addr)
        return TopicRoute.from_body(answer.body)

    async def get_cluster_info(self) -> ClusterInfo:
        """GET_BROKER_CLUSTER_INFO (106): the brokers registered with the name server."""
        addr, answer = await self._invoke_namesrv(RequestCode.GET_BROKER_CLUSTER_INFO, {})
        raise_for(answer, addr)
        return ClusterInfo.from_body(answer.body)

    async def home_broker(self, topic: str, preferred: str | None = None) -> HomeBroker:
        """The home broker of the deployment whose parent topic is `topic`
        (ClusterInfo.choose_broker: `preferred`, else the first by name of the brokers the
        topic's route lists, else the first registered), and the brokers the topic is on.
        BrokerNotFoundError when there is none; other RemotingErrors when the name server
        does not answer."""
        info = await self.get_cluster_info()
        try:
            serving = (await self.get_route(topic)).readable_brokers()
        except TopicNotExistError:
            serving = []  # a new deployment
        where = "name server " + ", ".join(self.namesrv_addrs)
        name, addr = info.choose_broker(preferred, where, serving)
        return HomeBroker(name, addr, serving)

    # -- broker: messages ---------------------------------------------------------------------

    async def send_message(
        self,
        broker_addr: str,
        topic: str,
        body: bytes,
        *,
        queue_id: int = 0,
        light_queues: list[str] | None = None,
        properties: Mapping[str, str] | None = None,
        raw_properties: str = "",
        wait_store: bool = True,
        flag: int = 0,
        timeout: float | None = None,
    ) -> SendResult:
        """SEND_MESSAGE_V2 (310) to ``topic``/``queue_id``, also indexed in ``light_queues``.

        ``light_queues`` become the dispatch property (message.py); the broker appends the
        message once and indexes it in the parent queue and in each light queue.
        ``wait_store`` sets WAIT=true: on a SYNC_FLUSH broker the answer then comes after the
        flush (FLUSH_DISK_TIMEOUT if it did not complete in time, returned here as ``code``
        rather than raised: the message is stored, only its durability is in doubt).
        ``raw_properties`` is a block already in the wire form (``name \x01 value \x02`` pairs,
        validated by the caller), sent as is after ``properties``: a caller that encodes a
        publisher's properties once reuses the block.
        """
        props: dict[str, str] = {}
        if light_queues:
            props[PROPERTY_INNER_MULTI_DISPATCH] = dispatch_property(light_queues)
        if properties:
            props.update(properties)
        props[PROPERTY_WAIT_STORE_MSG_OK] = "true" if wait_store else "false"
        fields = headers.send_message_v2(
            producer_group=self.producer_group,
            topic=topic,
            queue_id=queue_id,
            born_timestamp=int(time.time() * 1000),
            properties=encode_properties(props) + raw_properties,
            flag=flag,
        )
        answer = await self.invoke_broker(
            broker_addr, RequestCode.SEND_MESSAGE_V2, fields, body, timeout
        )
        return send_result(answer, broker_addr)

    async def pull(
        self,
        broker_addr: str,
        topic: str,
        offset: int,
        *,
        consumer_group: str,
        queue_id: int = LMQ_QUEUE_ID,
        max_messages: int = 32,
        suspend_timeout: float | None = None,
        commit_offset: int | None = None,
        check_crc: bool = True,
        timeout: float | None = None,
        wanted: Container[str] | None = None,
    ) -> PullResult:
        """PULL_MESSAGE (11) from ``offset``; with ``suspend_timeout`` a long poll.

        The subscription (``*``, TAG) travels with the request (PULL_SUBSCRIPTION), so the broker
        needs no consumer registration. With ``suspend_timeout`` the broker holds a pull that
        finds nothing until a message arrives in the queue (light queues included:
        ``LmqPullRequestHoldService``) or the timeout passes, then answers NOT_FOUND at its
        next hold check; unless told otherwise the client waits that long (suspend +
        HOLD_CHECK_S) plus ``request_timeout``.
        ``commit_offset`` also commits the group's offset (PULL_COMMIT_OFFSET).
        ``wanted``: only the records dispatched to one of these light queues are decoded and
        returned (``message.scan_records``; the answer's last CommitLog offset is kept).
        Raises :class:`OffsetMovedError` when the offset is outside the queue.
        """
        sys_flag = PULL_SUBSCRIPTION
        if suspend_timeout is not None:
            sys_flag |= PULL_SUSPEND
        if commit_offset is not None:
            sys_flag |= PULL_COMMIT_OFFSET
        suspend_ms = int((suspend_timeout or 0) * 1000)
        if timeout is None:
            # A held pull: the broker's whole hold (see HOLD_CHECK_S), then the usual margin.
            timeout = self.request_timeout
            if suspend_timeout is not None:
                timeout += suspend_timeout + HOLD_CHECK_S
        held = suspend_timeout is not None
        self.held_pulls += held
        try:
            if commit_offset is None:
                # The usual pull: its frame from the reader's template (only the offset varies).
                frames = self._pull_template(
                    consumer_group, topic, queue_id, max_messages, sys_flag, suspend_ms
                )
                answer = await self._request_frame(
                    broker_addr,
                    functools.partial(frames.frame, queue_offset=offset),
                    RequestCode.PULL_MESSAGE,
                    timeout,
                )
            else:
                fields = headers.pull_message(
                    consumer_group=consumer_group,
                    topic=topic,
                    queue_id=queue_id,
                    queue_offset=offset,
                    max_msg_nums=max_messages,
                    sys_flag=sys_flag,
                    commit_offset=commit_offset,
                    suspend_timeout_millis=suspend_ms,
                    subscription="*",
                )
                answer = await self.invoke_broker(
                    broker_addr, RequestCode.PULL_MESSAGE, fields, timeout=timeout
                )
        finally:
            self.held_pulls -= held
        return pull_result(answer, broker_addr, wanted, check_crc)

    def held_pull(
        self,
        broker_addr: str,
        topic: str,
        answered: Callable[[PullResult | RemotingError], None],
        *,
        consumer_group: str,
        max_messages: int,
        suspend_timeout: float,
        wanted: Container[str] | None = None,
    ) -> HeldPull[PullResult]:
        """The held pulls (`pull` with `suspend_timeout`, no commit) of one follower of
        `topic`'s end, sent one after another without a coroutine (held_pull.py): each
        `send(offset)` writes one on the broker's open connection (False when there is none:
        the caller pulls with `pull`, which opens one), and `answered` gets its PullResult, as
        `pull` returns it, or the RemotingError that ended it."""
        frames = self._pull_template(
            consumer_group,
            topic,
            LMQ_QUEUE_ID,
            max_messages,
            _HELD_PULL,
            int(suspend_timeout * 1000),
        )
        wait = self.request_timeout + suspend_timeout + HOLD_CHECK_S
        return HeldPull(self, broker_addr, frames, answered, wait, wanted, pull_result)

    def _pull_template(
        self,
        consumer_group: str,
        topic: str,
        queue_id: int,
        max_messages: int,
        sys_flag: int,
        suspend_ms: int,
    ) -> PullFrames:
        key = (consumer_group, topic, queue_id, max_messages, sys_flag, suspend_ms)
        frames = self._pull_frames.get(key)
        if frames is None:
            if len(self._pull_frames) >= PULL_TEMPLATES:
                self._pull_frames.clear()  # readers of many queues: start over
            frames = self._pull_frames[key] = PullFrames(
                consumer_group=consumer_group,
                topic=topic,
                queue_id=queue_id,
                max_msg_nums=max_messages,
                sys_flag=sys_flag,
                suspend_timeout_millis=suspend_ms,
            )
        return frames

    # -- broker: offsets ----------------------------------------------------------------------

    async def query_consumer_offset(
        self, broker_addr: str, consumer_group: str, topic: str, queue_id: int = LMQ_QUEUE_ID
    ) -> int | None:
        """QUERY_CONSUMER_OFFSET (14): the group's committed offset, None if it has none."""
        answer = await self.invoke_broker(
            broker_addr,
            RequestCode.QUERY_CONSUMER_OFFSET,
            headers.query_consumer_offset(consumer_group, topic, queue_id, False),
        )
        if answer.code == ResponseCode.QUERY_NOT_FOUND:
            return None
        raise_for(answer, broker_addr)
        return _int(answer, "offset")

    async def update_consumer_offset(
        self,
        broker_addr: str,
        consumer_group: str,
        topic: str,
        offset: int,
        queue_id: int = LMQ_QUEUE_ID,
        *,
        oneway: bool = False,
    ) -> None:
        """UPDATE_CONSUMER_OFFSET (15); ``oneway`` sends it without waiting (as Java clients do)."""
        fields = headers.update_consumer_offset(consumer_group, topic, queue_id, offset)
        if oneway:
            await self.invoke_oneway(broker_addr, RequestCode.UPDATE_CONSUMER_OFFSET, fields)
            return
        answer = await self.invoke_broker(broker_addr, RequestCode.UPDATE_CONSUMER_OFFSET, fields)
        raise_for(answer, broker_addr)

    async def search_offset(
        self,
        broker_addr: str,
        topic: str,
        timestamp_ms: int,
        queue_id: int = LMQ_QUEUE_ID,
        boundary: str = "lower",
    ) -> int:
        """SEARCH_OFFSET_BY_TIMESTAMP (29): the queue offset of the first message stored at or
        after ``timestamp_ms`` (``lower``) or the last at or before it (``upper``)."""
        answer = await self.invoke_broker(
            broker_addr,
            RequestCode.SEARCH_OFFSET_BY_TIMESTAMP,
            headers.search_offset(topic, queue_id, timestamp_ms, boundary),
        )
        raise_for(answer, broker_addr)
        return _int(answer, "offset")

    async def get_max_offset(
        self, broker_addr: str, topic: str, queue_id: int = LMQ_QUEUE_ID
    ) -> int:
        """GET_MAX_OFFSET (30): the offset the next message in the queue will get."""
        answer = await self.invoke_broker(
            broker_addr, RequestCode.GET_MAX_OFFSET, headers.get_max_offset(topic, queue_id)
        )
        raise_for(answer, broker_addr)
        return _int(answer, "offset")

    async def get_min_offset(
        self, broker_addr: str, topic: str, queue_id: int = LMQ_QUEUE_ID
    ) -> int:
        """GET_MIN_OFFSET (31): the oldest offset the queue still holds."""
        answer = await self.invoke_broker(
            broker_addr, RequestCode.GET_MIN_OFFSET, headers.get_min_offset(topic, queue_id)
        )
        raise_for(answer, broker_addr)
        return _int(answer, "offset")
