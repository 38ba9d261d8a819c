"""One TCP connection to a name server or broker: requests pipelined, answers matched by opaque.

Any number of requests may be in flight on a connection: each gets a fresh ``opaque``, its frame
is queued and the frames of one event-loop turn leave in one write (one send() system call for a
burst of pipelined sends instead of one per frame), and the reader task completes the waiting
future whose opaque the answer carries, in whatever order the server answers (a long-polling
pull held for seconds does not hold up the sends behind it). A one-way request (flag bit 1)
gets no answer. Requests the server sends us (it may ask a client for its running info, or
notify it) are answered with REQUEST_CODE_NOT_SUPPORTED unless they are one-way, so the server
never waits on us.

When the connection drops, every waiting request fails with :class:`RemotingClosedError`; the
client above opens a new connection for the next request (nothing is retried blindly: a send
may or may not have been stored).

The connection is the socket's asyncio protocol itself: each socket read is handed to
``data_received``, which hands out every whole frame in it there and then (no stream reader
buffering it, no reader task woken per read), and frames leave through the transport.

A caller that sends many requests at once (a producer's sends of one loop turn) may skip the
coroutine per request: ``next_opaque`` + ``expect`` + ``write`` queue a frame it encoded itself
and register a callback, called once per request with its opaque and the answer or the
RemotingError that ended the wait (connection lost, or ``expire`` when the caller's own timer
ran out). A batch takes ``reserve_opaques(n)`` (n consecutive opaques), writes its frames at
once and registers one callback for all of them with ``expect_all``.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Iterable
from typing import Final

from rocketmq_remoting.codes import FLAG_ONEWAY, FLAG_RESPONSE, ResponseCode
from rocketmq_remoting.command import FRAME_MAX, RemotingCommand, decode_frame_at
from rocketmq_remoting.errors import (
    ProtocolError,
    RemotingClosedError,
    RemotingConnectError,
    RemotingError,
    RemotingTimeoutError,
)

#: Called once per request: its opaque, and its answer or the error that ended the wait for it.
AnswerCallback = Callable[[int, "RemotingCommand | RemotingError"], None]

log = logging.getLogger(__name__)
_LEN: Final = struct.Struct(">i")


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class Connection(asyncio.Protocol):
    """A connected, pipelined remoting channel. Create with :meth:`open`."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self._callbacks: dict[int, AnswerCallback] = {}  # requests sent with `expect`
        self._opaque = 0
        self._closed = False
        self._close_reason = "connection closed"
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []  # frames of this loop turn, written by _flush_out
        self._buf = bytearray()  # the start of a frame not whole yet
        self._paused = False  # the transport's write buffer is full (pause_writing)
        self._writable: list[asyncio.Future[None]] = []  # who waits for resume_writing
        self._lost: asyncio.Future[None] = self._loop.create_future()

    @classmethod
    async def open(cls, addr: str, timeout: float) -> Connection:
        host, port = split_addr(addr)
        loop = asyncio.get_running_loop()
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: cls(addr), host, port), timeout
            )
        except (OSError, TimeoutError) as exc:
            raise RemotingConnectError(addr, exc or "timeout") from exc
        return conn

    # -- the protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._abort(f"connection lost: {exc}" if exc is not None else "closed by peer")
        self._wake_writers()
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writers()

    def _wake_writers(self) -> None:
        writable, self._writable = self._writable, []
        for fut in writable:
            if not fut.done():
                fut.set_result(None)

    async def _drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark."""
        while self._paused and not self._closed:
            fut: asyncio.Future[None] = self._loop.create_future()
            self._writable.append(fut)
            await fut
        if self._closed:
            raise ConnectionResetError(self._close_reason)

    def data_received(self, data: bytes) -> None:
        """Hand out every whole frame of what the socket had (a pull answer and the send
        answers of a burst often arrive in one read); keep the start of the next."""
        if self._closed:
            return
        buf = self._buf
        if buf:
            buf += data
            view: bytes | bytearray = buf
        else:
            view = data
        pos, have = 0, len(view)
        unpack = _LEN.unpack_from
        decode = decode_frame_at
        try:
            while have - pos >= 4:
                (length,) = unpack(view, pos)
                if length < 4 or length > FRAME_MAX:
                    raise ProtocolError(f"frame length {length} out of range")
                if have - pos - 4 < length:
                    break
                self._received(decode(view, pos + 4, pos + 4 + length))
                pos += 4 + length
        except ProtocolError as exc:
            log.warning("rocketmq %s: %s; dropping the connection", self.addr, exc)
            self._abort(str(exc))
            return
        if buf:
            del buf[:pos]
        elif pos < have:
            buf += data[pos:]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._callbacks)

    def write(self, frame: bytes) -> None:
        """Queue an encoded frame; the frames of one loop turn leave in one write."""
        self._write(frame)

    def expect(self, opaque: int, callback: AnswerCallback) -> None:
        """Call `callback` with `opaque` and the answer to the request `opaque` (from
        `next_opaque`, its frame queued with `write`), or the error that ended the wait. The
        connection must be open (check `closed` first): a closed one raises
        RemotingClosedError."""
        if self._closed:
            raise RemotingClosedError(self.addr, self._close_reason)
        self._callbacks[opaque] = callback

    def expect_all(self, first: int, count: int, callback: AnswerCallback) -> None:
        """`expect` for the `count` requests of opaques `first` on (`reserve_opaques`), one
        callback for all of them: called once per request."""
        if self._closed:
            raise RemotingClosedError(self.addr, self._close_reason)
        self._callbacks.update(dict.fromkeys(range(first, first + count), callback))

    def expire(self, opaques: Iterable[int], code: int, timeout: float) -> None:
        """The requests of `opaques` still waiting get a RemotingTimeoutError (their
        caller's timer ran out); a late answer is then dropped."""
        callbacks = self._callbacks
        for opaque in opaques:
            callback = callbacks.pop(opaque, None)
            if callback is not None:
                self._call(callback, opaque, RemotingTimeoutError(self.addr, code, timeout))

    def _write(self, frame: bytes) -> None:
        if not self._out:
            self._loop.call_soon(self._flush_out)
        self._out.append(frame)

    def _flush_out(self) -> None:
        out, self._out = self._out, []
        if out and not self._closed and self._transport is not None:
            try:
                self._transport.write(out[0] if len(out) == 1 else b"".join(out))
            except (ConnectionError, OSError) as exc:
                self._abort(f"write failed: {exc}")

    @staticmethod
    def _expire(future: asyncio.Future[RemotingCommand]) -> None:
        if not future.done():
            future.set_exception(TimeoutError())

    def next_opaque(self) -> int:
        self._opaque = (self._opaque + 1) & 0x7FFFFFFF
        return self._opaque

    def reserve_opaques(self, count: int) -> int:
        """The first of `count` consecutive opaques for the caller's requests (never wrapping
        past the largest int32 inside them)."""
        if self._opaque + count > 0x7FFFFFFF:
            self._opaque = 0
        first = self._opaque + 1
        self._opaque += count
        return first

    async def request(self, cmd: RemotingCommand, timeout: float) -> RemotingCommand:
        """Send ``cmd`` and wait for its answer (any code: the caller interprets it)."""
        cmd.flag &= ~(FLAG_RESPONSE | FLAG_ONEWAY)

        def encode(opaque: int) -> bytes:
            cmd.opaque = opaque
            return cmd.encode()

        return await self.request_frame(encode, cmd.code, timeout)

    async def request_frame(
        self, encode: Callable[[int], bytes], code: int, timeout: float
    ) -> RemotingCommand:
        """Send the request frame `encode(opaque)` (a template's, e.g. pull_frames.py) and wait
        for its answer (any code); `code` names the request in a timeout's error."""
        if self._closed:
            raise RemotingClosedError(self.addr, self._close_reason)
        opaque = self.next_opaque()
        future: asyncio.Future[RemotingCommand] = self._loop.create_future()
        self._pending[opaque] = future
        # One timer handle per request (wait_for + shield cost a task and two futures more).
        timer = self._loop.call_later(timeout, self._expire, future)
        try:
            self._write(encode(opaque))
            if self._paused:
                await self._drain()
            return await future
        except TimeoutError:
            raise RemotingTimeoutError(self.addr, code, timeout) from None
        except (ConnectionError, OSError) as exc:
            self._abort(f"write failed: {exc}")
            raise RemotingClosedError(self.addr, self._close_reason) from exc
        finally:
            timer.cancel()
            self._pending.pop(opaque, None)
            if not future.done():
                future.cancel()

    async def oneway(self, cmd: RemotingCommand) -> None:
        """Send ``cmd`` flagged one-way: the server executes it and answers nothing."""
        if self._closed:
            raise RemotingClosedError(self.addr, self._close_reason)
        cmd.opaque = self.next_opaque()
        cmd.flag = (cmd.flag | FLAG_ONEWAY) & ~FLAG_RESPONSE
        try:
            self._write(cmd.encode())
            if self._paused:
                await self._drain()
        except (ConnectionError, OSError) as exc:
            self._abort(f"write failed: {exc}")
            raise RemotingClosedError(self.addr, self._close_reason) from exc

    def _received(self, cmd: RemotingCommand) -> None:
        if cmd.flag & FLAG_RESPONSE:  # RemotingCommand.is_response, inlined: once per answer
            opaque = cmd.opaque
            callback = self._callbacks.pop(opaque, None)
            if callback is not None:
                try:
                    callback(opaque, cmd)
                except Exception:  # a caller's bug must not take the connection down with it
                    log.exception("rocketmq %s: answer callback failed", self.addr)
                return
            future = self._pending.get(opaque)
            if future is not None and not future.done():
                future.set_result(cmd)
        elif not cmd.is_oneway:
            self._answer_unsupported(cmd)

    def _call(
        self, callback: AnswerCallback, opaque: int, answer: RemotingCommand | RemotingError
    ) -> None:
        try:
            callback(opaque, answer)
        except Exception:  # a caller's bug must not take the connection down with it
            log.exception("rocketmq %s: answer callback failed", self.addr)

    def _answer_unsupported(self, request: RemotingCommand) -> None:
        answer = RemotingCommand(
            code=ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
            opaque=request.opaque,
            flag=FLAG_RESPONSE,
            remark=f"request code {request.code} not supported by this client",
        )
        self._write(answer.encode())

    def _abort(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RemotingClosedError(self.addr, reason))
        self._pending.clear()
        callbacks, self._callbacks = self._callbacks, {}
        for opaque, callback in callbacks.items():
            self._call(callback, opaque, RemotingClosedError(self.addr, reason))
        if self._transport is not None:
            self._transport.close()

    def close_nowait(self) -> None:
        """Drop the connection without waiting for its reader to finish (frames queued in
        this loop turn, one-way ones included, are written first)."""
        self._flush_out()
        self._abort("closed")

    async def close(self) -> None:
        self._flush_out()
        self._abort("closed")
        if self._transport is not None:
            await asyncio.shield(self._lost)
