"""What can go wrong talking to RocketMQ, as exception types a caller can act on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from rocketmq_remoting.codes import ResponseCode


class RemotingError(Exception):
    """Base of every error this package raises."""


class BrokerNotFoundError(RemotingError):
    """The name server knows no (master of the) broker a deployment needs; the message names
    the registered ones."""


class RemotingConnectError(RemotingError):
    """The TCP connection to a name server or broker could not be opened."""

    def __init__(self, addr: str, cause: BaseException | str) -> None:
        super().__init__(f"cannot connect to {addr}: {cause}")
        self.addr = addr


class RemotingClosedError(RemotingError):
    """The connection closed (or was dropped) before the answer arrived."""

    def __init__(self, addr: str, detail: str = "connection closed") -> None:
        super().__init__(f"{addr}: {detail}")
        self.addr = addr


class RemotingTimeoutError(RemotingError):
    """No answer within the request's timeout; the connection stays usable."""

    def __init__(self, addr: str, code: int, timeout: float) -> None:
        super().__init__(f"{addr}: no answer to request code {code} within {timeout:.3f}s")
        self.addr = addr
        self.code = code
        self.timeout = timeout


class ProtocolError(RemotingError):
    """A frame or header that does not follow the protocol."""


class BrokerError(RemotingError):
    """The server answered with a non-success code; ``code`` and ``remark`` are its own."""

    def __init__(self, code: int, remark: str | None, addr: str = "") -> None:
        super().__init__(f"{addr or 'server'} answered code {code}: {remark or ''}".rstrip(": "))
        self.code = code
        self.remark = remark
        self.addr = addr


class TopicNotExistError(BrokerError):
    """TOPIC_NOT_EXIST (17): the topic is unknown and was not (or may not be) auto-created."""


class BrokerBusyError(BrokerError):
    """SYSTEM_BUSY (2) or FLOW_CONTROL (215): the broker shed the request before handling it.

    Its fast-failure check answers this for requests that waited in its queue longer than
    ``waitTimeMillsInSendQueue`` (``[TIMEOUT_CLEAN_QUEUE]broker busy``) or when the page cache
    is busy (``[PCBUSY_CLEAN_QUEUE]``): nothing was stored, so the request may be retried.
    """


class OffsetMovedError(BrokerError):
    """PULL_OFFSET_MOVED (21): the requested offset is outside the queue; restart elsewhere.

    ``next_begin_offset`` is where the broker suggests to continue; ``min_offset`` and
    ``max_offset`` bound what the queue holds now (data is deleted by age on a broker).
    """

    def __init__(
        self,
        code: int,
        remark: str | None,
        addr: str,
        next_begin_offset: int,
        min_offset: int,
        max_offset: int,
    ) -> None:
        super().__init__(code, remark, addr)
        self.next_begin_offset = next_begin_offset
        self.min_offset = min_offset
        self.max_offset = max_offset


class Answer(Protocol):
    """What raise_for reads of an answer (a RemotingCommand)."""

    @property
    def code(self) -> int: ...

    @property
    def remark(self) -> str | None: ...


def raise_for(cmd: Answer, addr: str, ok: Iterable[int] = (ResponseCode.SUCCESS,)) -> None:
    """Raise the typed error for an answer whose code is not in ``ok``."""
    if cmd.code in ok:
        return
    if cmd.code == ResponseCode.TOPIC_NOT_EXIST:
        raise TopicNotExistError(cmd.code, cmd.remark, addr)
    if cmd.code in (ResponseCode.SYSTEM_BUSY, ResponseCode.FLOW_CONTROL):
        raise BrokerBusyError(cmd.code, cmd.remark, addr)
    raise BrokerError(cmd.code, cmd.remark, addr)
