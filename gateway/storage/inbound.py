"""Inbound messages: what a backend's own producers send for MQTT subscribers.

A backend that has producers of its own (RocketMQ: any application's producer, through the
inbound topic) hands each of their messages to an `InboundHandler`, which stores it as an MQTT
publish (gateway/messages/inbound.py). The backend's side is `InboundSource.open_inbound`
(gateway/storage/rocketmq/inbound.py); it resumes after the last message the handler accepted
or rejected, so a message the handler was given but had not finished is given again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class InboundMessage:
    """One message of the backend's producers: its body and its sender's own properties
    (system properties left out), the producer's group when the message carries it (RocketMQ:
    a transactional message's PGROUP; "" otherwise), the producer's host address and the
    backend's message id."""

    body: bytes
    properties: Mapping[str, str]
    producer_group: str
    born_host: str
    msg_id: str


class Rejected(Exception):
    """The message cannot be an MQTT publish (`reason` says why): the backend moves it to its
    dead-letter place instead of delivering it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InboundHandler(Protocol):
    async def handle(self, message: InboundMessage) -> None:
        """Store `message`; returns once it is stored (then it is never handed over again).
        Raises Rejected for a message that will never be stored, StoreError for one that may
        be later (it is handed over again)."""

    def dead_lettered(self, message: InboundMessage, reason: str) -> None:
        """`message` was moved to the dead-letter place (counted, logged)."""


class InboundFeed(Protocol):
    """A running consumer of inbound messages."""

    @property
    def queues(self) -> int:
        """How many of the inbound queues this gateway consumes now."""

    async def stop(self) -> None:
        """Stop consuming; what was handled is committed before this returns."""


class InboundSource(Protocol):
    async def open_inbound(
        self, handler: InboundHandler, *, topic: str, dead_letter_topic: str, group: str
    ) -> InboundFeed:
        """Create `topic` (and `dead_letter_topic`) if needed and consume `topic` as a member
        of consumer group `group`, handing each message to `handler`."""


def supports_inbound(store: object) -> bool:
    return callable(getattr(store, "open_inbound", None))
