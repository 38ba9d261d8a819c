"""The simulator's MQTT client: amqtt's MQTTClient behind a small surface.

amqtt quirks are contained here and nowhere else:
- it logs a warning for every disconnect and every late acknowledgement: its loggers are
  silenced (`silence_amqtt`), the simulator reports what matters itself;
- it auto-reconnects by default and loads a packet-logger plugin: both off;
- `connect()` creates a fresh amqtt Session, losing the messages it has acknowledged but the
  application has not read yet, so a subscriber returning from offline uses `reconnect()`, which
  keeps the Session and its delivery queue;
- `deliver_message()` bookkeeps its task in a shared deque that `disconnect()` cancels, so
  deliveries are read straight from the Session's queue instead, which survives reconnects;
- a QoS>0 publish raises `TimeoutError` after 5 s without acknowledgement, and errors of many
  types when the connection is gone: all become `PublishFailed`;
- `reconnect()` dials the Session's `broker_uri`: failing over to another gateway node keeps
  the Session (and its unread deliveries) by changing that URI first.

Several gateway addresses (nodes of one cluster): a client starts at the one it is given and,
when a connect there fails, tries the next ones in turn; the one that answered is where it
reconnects first next time (a node that died refuses at once, so failing over costs little).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from amqtt.client import MQTTClient
from amqtt.errors import AMQTTError, ClientError, ConnectError

from sim.errors import SimError

_NOISY_LOGGERS = ("amqtt", "transitions")
SUBACK_FAILURE = 0x80


def silence_amqtt() -> None:
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


class PublishFailed(SimError):
    """A QoS>0 publish was not acknowledged (timeout, refused, or the connection dropped)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    topic: str
    payload: bytes
    qos: int


def broker_uri(
    host: str, port: int, username: str | None = None, password: str | None = None
) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    credentials = ""
    if username:
        credentials = quote(username, safe="")
        if password:
            credentials += ":" + quote(password, safe="")
        credentials += "@"
    return f"mqtt://{credentials}{host}:{port}/"


class SimClient:
    """One MQTT connection of the simulator (a device or a subscriber)."""

    def __init__(
        self,
        client_id: str,
        host: str,
        port: int,
        *,
        clean_session: bool = True,
        keep_alive: int = 30,
        username: str | None = None,
        password: str | None = None,
        others: Sequence[tuple[str, int]] = (),
    ) -> None:
        """`others`: more gateway addresses to fail over to, tried in this order."""
        silence_amqtt()
        self.client_id = client_id
        addresses = [(host, port), *others]
        self._uris = [broker_uri(h, p, username, password) for h, p in addresses]
        self._wheres = [broker_uri(h, p) for h, p in addresses]  # without the password
        self._at = 0  # the address connected to (or tried) last
        self.failovers = 0  # connects that landed on another address than the previous one
        self._clean_session = clean_session
        config: dict[str, Any] = {
            "keep_alive": keep_alive,
            "ping_delay": 1,
            "auto_reconnect": False,
            "reconnect_retries": 0,
            "connection_timeout": 10,
            "plugins": {},
        }
        self._client = MQTTClient(client_id=client_id, config=config)
        self._has_session = False
        self.connected = False

    @property
    def address(self) -> str:
        """Where this client connects (first) now, without credentials."""
        return self._wheres[self._at]

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect, or reconnect keeping amqtt's Session (and its unread deliveries); with
        several addresses, the next ones are tried in turn when one fails."""
        start = self._at
        error: SimError | None = None
        for step in range(len(self._uris)):
            self._at = (start + step) % len(self._uris)
            try:
                await self._connect_once(timeout)
            except SimError as exc:
                error = exc
                continue
            if step:
                self.failovers += 1
            return
        assert error is not None
        raise error

    async def _connect_once(self, timeout: float) -> None:
        uri = self._uris[self._at]
        try:
            if self._has_session and self._client.session is not None:
                self._client.session.broker_uri = uri
                await asyncio.wait_for(self._client.reconnect(), timeout)
            else:
                await asyncio.wait_for(
                    self._client.connect(uri, cleansession=self._clean_session), timeout
                )
                self._has_session = True
        except (ConnectError, ClientError, AMQTTError, OSError, TimeoutError) as exc:
            where = self._wheres[self._at]
            raise SimError(f"{self.client_id}: cannot connect to {where}: {exc!r}") from exc
        self.connected = True

    async def subscribe(self, filters: tuple[str, ...], qos: int) -> None:
        try:
            codes = await asyncio.wait_for(
                self._client.subscribe([(f, qos) for f in filters]), timeout=10
            )
        except (ClientError, AMQTTError, OSError, TimeoutError) as exc:
            raise SimError(f"{self.client_id}: SUBSCRIBE failed: {exc!r}") from exc
        refused = [f for f, code in zip(filters, codes, strict=False) if code == SUBACK_FAILURE]
        if refused or len(codes) != len(filters):
            raise SimError(f"{self.client_id}: gateway refused subscriptions {refused or filters}")

    async def publish(self, topic: str, payload: bytes, qos: int, timeout: float = 10.0) -> None:
        # amqtt waits 5 s for a PUBACK, but waits without limit for a lost connection to come
        # back before even sending: hence the overall timeout.
        try:
            await asyncio.wait_for(self._client.publish(topic, payload, qos=qos), timeout)
        except (ClientError, AMQTTError, OSError, TimeoutError, ValueError) as exc:
            raise PublishFailed(f"{self.client_id}: publish to {topic!r} failed: {exc!r}") from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # amqtt raises bare exceptions from its handler internals
            raise PublishFailed(f"{self.client_id}: publish to {topic!r} failed: {exc!r}") from exc

    async def next_delivery(self) -> Delivery:
        """The next received PUBLISH, waiting while offline (the queue survives reconnects)."""
        session = self._client.session
        if session is None:
            raise SimError(f"{self.client_id}: not connected yet")
        message = await session.delivered_message_queue.get()
        return Delivery(message.topic, bytes(message.data or b""), message.qos or 0)

    @property
    def has_connected(self) -> bool:
        return self._has_session

    @property
    def alive(self) -> bool:
        """Whether the connection is up (False after the gateway dropped it)."""
        session = self._client.session
        return self.connected and session is not None and session.transitions.is_connected()

    @property
    def pending_deliveries(self) -> int:
        session = self._client.session
        return 0 if session is None else session.delivered_message_queue.qsize()

    async def disconnect(self, timeout: float = 5.0) -> None:
        """Send DISCONNECT and close; never raises (the connection may already be gone)."""
        if not self.connected:
            return
        self.connected = False
        try:
            await asyncio.wait_for(self._client.disconnect(), timeout)
        except asyncio.CancelledError:
            raise
        except Exception:  # a dead connection cannot be closed more than it is
            logging.getLogger(__name__).debug("disconnect of %s failed", self.client_id)
