"""The connections of a :class:`~rocketmq_remoting.client.RemotingClient`: at most one pipelined
connection per address, opened on first use and re-opened on the next request after it dropped
(reconnect), requests over them, and the HEART_BEAT every ``heartbeat_interval`` seconds to the
brokers among them (it registers the producer group and the consumer groups this client joined,
and keeps the broker from closing the channel as idle, 120 s by default)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Self

from rocketmq_remoting.codes import RequestCode
from rocketmq_remoting.command import RemotingCommand
from rocketmq_remoting.connection import Connection
from rocketmq_remoting.consumer_group import ConsumerGroups
from rocketmq_remoting.errors import RemotingError, raise_for

if TYPE_CHECKING:
    from rocketmq_remoting.pull_frames import PullFrames

log = logging.getLogger(__name__)


class Connections:
    """The name servers in ``namesrv_addrs`` and any broker address, one connection each."""

    def __init__(
        self,
        namesrv_addrs: Iterable[str] = (),
        *,
        client_id: str | None = None,
        producer_group: str = "lmqtt-producer",
        request_timeout: float = 3.0,
        connect_timeout: float = 3.0,
        heartbeat_interval: float = 30.0,
    ) -> None:
        self.namesrv_addrs = list(namesrv_addrs)
        self.client_id = client_id or f"{socket.gethostname()}@{os.getpid()}@lmqtt"
        self.producer_group = producer_group
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.heartbeat_interval = heartbeat_interval
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._brokers: set[str] = set()
        #: Frame templates of the pulls made (pull_frames.py), by their constant fields.
        self._pull_frames: dict[tuple[str, str, int, int, int, int], PullFrames] = {}
        # Consumer groups this client is a member of, announced in every heartbeat
        # (consumer_group.py).
        self.groups = ConsumerGroups()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._closed = False
        #: Pulls with the suspend flag in flight now: what this client keeps held on brokers.
        self.held_pulls = 0

    # -- connections ------------------------------------------------------------------------

    async def connection(self, addr: str) -> Connection:
        """The open connection to ``addr``, (re)connecting if there is none."""
        conn = self._conns.get(addr)
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise RemotingError("client closed")
        lock = self._connecting.setdefault(addr, asyncio.Lock())
        async with lock:
            conn = self._conns.get(addr)
            if conn is None or conn.closed:
                if conn is not None:
                    log.info("rocketmq %s: reconnecting", addr)
                conn = await Connection.open(addr, self.connect_timeout)
                self._conns[addr] = conn
        return conn

    def open_broker_connection(self, addr: str) -> Connection | None:
        """The open connection to the broker at `addr` (one a broker call opened, so the
        heartbeats visit it), None if there is none now: for a caller that writes frames
        itself (Connection.expect) and makes the first call, or one after a drop, with the
        coroutine calls."""
        conn = self._conns.get(addr)
        if conn is None or conn.closed or addr not in self._brokers:
            return None
        return conn

    async def invoke(
        self,
        addr: str,
        code: int,
        ext_fields: Mapping[str, str] | None = None,
        body: bytes = b"",
        timeout: float | None = None,
    ) -> RemotingCommand:
        """Send one request to ``addr`` and return the answer, whatever its code."""
        conn = await self.connection(addr)
        cmd = RemotingCommand(code=code, ext_fields=dict(ext_fields or {}), body=body)
        return await conn.request(cmd, self.request_timeout if timeout is None else timeout)

    async def invoke_oneway(
        self, addr: str, code: int, ext_fields: Mapping[str, str] | None = None, body: bytes = b""
    ) -> None:
        conn = await self.connection(addr)
        await conn.oneway(RemotingCommand(code=code, ext_fields=dict(ext_fields or {}), body=body))

    async def invoke_broker(
        self,
        addr: str,
        code: int,
        ext_fields: Mapping[str, str] | None = None,
        body: bytes = b"",
        timeout: float | None = None,
    ) -> RemotingCommand:
        """invoke() to a broker, which the heartbeats visit from now on."""
        if addr not in self._brokers:
            self._brokers.add(addr)
            self._start_heartbeats()
        return await self.invoke(addr, code, ext_fields, body, timeout)

    async def _request_frame(
        self, addr: str, encode: Callable[[int], bytes], code: int, timeout: float
    ) -> RemotingCommand:
        """invoke_broker() of a frame made by `encode(opaque)` (a template's)."""
        if addr not in self._brokers:
            self._brokers.add(addr)
            self._start_heartbeats()
        conn = await self.connection(addr)
        return await conn.request_frame(encode, code, timeout)

    async def _invoke_namesrv(
        self, code: int, ext_fields: Mapping[str, str]
    ) -> tuple[str, RemotingCommand]:
        """Ask the name servers in turn until one answers (any code)."""
        if not self.namesrv_addrs:
            raise RemotingError("no name server address configured")
        last: RemotingError | None = None
        for addr in list(self.namesrv_addrs):
            try:
                return addr, await self.invoke(addr, code, ext_fields)
            except RemotingError as exc:
                last = exc
                # Try the next one first next time.
                self.namesrv_addrs.remove(addr)
                self.namesrv_addrs.append(addr)
        assert last is not None
        raise last

    async def close(self) -> None:
        self._closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            await conn.close()

    def close_nowait(self) -> None:
        """close() for a caller that cannot await: drops every connection now (their waiting
        requests fail with RemotingClosedError) and stops the heartbeats."""
        self._closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close_nowait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- heartbeats ---------------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(), name="rocketmq-remoting-heartbeat"
            )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            for addr in list(self._brokers):
                try:
                    await self.heartbeat(addr)
                except RemotingError as exc:
                    log.warning("rocketmq %s: heartbeat failed: %s", addr, exc)

    async def heartbeat(self, broker_addr: str) -> None:
        """HEART_BEAT (34): ``HeartbeatData`` JSON naming this client, its producer group and
        the consumer groups it joined (consumer_group.py), which the broker lists to the
        group's members."""
        body = json.dumps(
            {
                "clientID": self.client_id,
                "producerDataSet": [{"groupName": self.producer_group}],
                "consumerDataSet": self.groups.consumer_data(),
            },
            separators=(",", ":"),
        ).encode()
        answer = await self.invoke_broker(broker_addr, RequestCode.HEART_BEAT, {}, body)
        raise_for(answer, broker_addr)
