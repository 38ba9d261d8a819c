"""The pipelined connection and the client's reconnect/failover, against a scripted TCP peer.

The peer is a real asyncio server on 127.0.0.1 port 0 speaking the remoting frame format; each
test scripts what it answers and when, which a real broker cannot be made to do (answer out of
order on demand, stay silent, send garbage). Behaviour against real RocketMQ is in
tests/rocketmq/.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from rocketmq_remoting import (
    RemotingClient,
    RemotingClosedError,
    RemotingCommand,
    RemotingError,
    RemotingTimeoutError,
    decode_frame,
)
from rocketmq_remoting.client import PullResult, pull_result
from rocketmq_remoting.codes import FLAG_ONEWAY, FLAG_RESPONSE, RequestCode, ResponseCode
from rocketmq_remoting.connection import Connection
from rocketmq_remoting.held_pull import HeldPull
from rocketmq_remoting.pull_frames import PullFrames

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Serve = Callable[[Handler], Awaitable[str]]


async def read_cmd(reader: asyncio.StreamReader) -> RemotingCommand:
    (length,) = struct.unpack(">i", await reader.readexactly(4))
    return decode_frame(await reader.readexactly(length))


def answer(request: RemotingCommand, code: int = 0, remark: str | None = None) -> bytes:
    return RemotingCommand(
        code=code,
        opaque=request.opaque,
        flag=FLAG_RESPONSE,
        remark=remark,
        ext_fields={"echo": str(request.code)},
        language="JAVA",
    ).encode()


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_answers_out_of_order_reach_their_requests(serve: Serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = [await read_cmd(reader) for _ in range(3)]
        for req in reversed(requests):
            writer.write(answer(req, remark=f"for {req.code}"))
        await writer.drain()
        await reader.read()  # until the client closes

    addr = await serve(handler)
    conn = await Connection.open(addr, 1.0)
    try:
        results = await asyncio.gather(
            *(conn.request(RemotingCommand(code=c), 2.0) for c in (30, 31, 14))
        )
        assert [r.remark for r in results] == ["for 30", "for 31", "for 14"]
        assert [r.ext_fields["echo"] for r in results] == ["30", "31", "14"]
        assert len({r.opaque for r in results}) == 3 and conn.in_flight == 0
    finally:
        await conn.close()


async def test_answers_split_across_reads_or_joined_in_one_all_arrive(serve: Serve) -> None:
    """The reader hands out every whole frame of what one read brought and keeps the rest:
    three answers in one write, then one (a body bigger than a read) in pieces down to its
    length field's bytes, with pauses between them."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = [await read_cmd(reader) for _ in range(4)]
        writer.write(b"".join(answer(req, remark=f"for {req.code}") for req in requests[:3]))
        await writer.drain()
        last = RemotingCommand(
            code=0, opaque=requests[3].opaque, flag=FLAG_RESPONSE, body=bytes(range(256)) * 2048
        ).encode()
        cuts = [0, 2, 4, 9, 70_000, 300_000, len(last)]
        for start, end in itertools.pairwise(cuts):
            await asyncio.sleep(0.02)
            writer.write(last[start:end])
            await writer.drain()
        await reader.read()  # until the client closes

    addr = await serve(handler)
    conn = await Connection.open(addr, 1.0)
    try:
        results = await asyncio.gather(
            *(conn.request(RemotingCommand(code=c), 2.0) for c in (30, 31, 14, 11))
        )
        assert [r.remark for r in results[:3]] == ["for 30", "for 31", "for 14"]
        assert results[3].body == bytes(range(256)) * 2048 and conn.in_flight == 0
    finally:
        await conn.close()


async def test_server_request_is_refused_and_oneway_needs_no_answer(serve: Serve) -> None:
    seen: asyncio.Queue[RemotingCommand] = asyncio.Queue()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The server asks the client something (as a broker asks for consumer running info).
        writer.write(RemotingCommand(code=307, opaque=77, language="JAVA").encode())
        await writer.drain()
        await seen.put(await read_cmd(reader))  # the client's refusal
        await seen.put(await read_cmd(reader))  # the client's one-way request
        await reader.read()

    addr = await serve(handler)
    conn = await Connection.open(addr, 1.0)
    try:
        refusal = await asyncio.wait_for(seen.get(), 2.0)
        assert refusal.is_response and refusal.opaque == 77
        assert refusal.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
        await conn.oneway(RemotingCommand(code=RequestCode.UPDATE_CONSUMER_OFFSET))
        oneway = await asyncio.wait_for(seen.get(), 2.0)
        assert oneway.flag & FLAG_ONEWAY and oneway.code == RequestCode.UPDATE_CONSUMER_OFFSET
        assert conn.in_flight == 0
    finally:
        await conn.close()


async def test_timeout_then_late_answer_is_dropped(serve: Serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        slow = await read_cmd(reader)
        fast = await read_cmd(reader)
        writer.write(answer(slow, remark="late"))  # after the client gave up on it
        writer.write(answer(fast, remark="fast"))
        await writer.drain()
        await reader.read()

    addr = await serve(handler)
    conn = await Connection.open(addr, 1.0)
    try:
        with pytest.raises(RemotingTimeoutError, match="code 30"):
            await conn.request(RemotingCommand(code=30), 0.2)
        result = await conn.request(RemotingCommand(code=31), 2.0)
        assert result.remark == "fast" and not conn.closed
    finally:
        await conn.close()


async def test_peer_close_fails_waiters_and_client_reconnects(serve: Serve) -> None:
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        req = await read_cmd(reader)
        if accepted == 1:
            writer.close()  # drop the first connection with the request unanswered
            return
        writer.write(answer(req, remark="second connection"))
        await writer.drain()
        await reader.read()

    addr = await serve(handler)
    async with RemotingClient([addr], request_timeout=2.0) as client:
        with pytest.raises(RemotingClosedError):
            await client.invoke(addr, 30)
        result = await client.invoke(addr, 30)
        assert result.remark == "second connection" and accepted == 2


async def test_garbage_frame_drops_the_connection(serve: Serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_cmd(reader)
        writer.write(struct.pack(">i", 64 * 1024 * 1024))  # over the 16 MiB frame cap
        await writer.drain()
        await reader.read()

    addr = await serve(handler)
    conn = await Connection.open(addr, 1.0)
    with pytest.raises(RemotingClosedError, match="out of range"):
        await conn.request(RemotingCommand(code=30), 2.0)
    assert conn.closed
    await conn.close()


async def test_name_servers_are_tried_in_turn(serve: Serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = await read_cmd(reader)
        writer.close()  # this name server accepts and hangs up
        del req

    async def good(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = await read_cmd(reader)
        body = b'{"brokerAddrTable":{},"clusterAddrTable":{"c":[]}}'
        frame = RemotingCommand(code=0, opaque=req.opaque, flag=FLAG_RESPONSE, body=body)
        writer.write(frame.encode())
        await writer.drain()
        await reader.read()

    bad_addr = await serve(handler)
    good_addr = await serve(good)
    async with RemotingClient([bad_addr, good_addr], request_timeout=2.0) as client:
        info = await client.get_cluster_info()
        assert info.clusters == {"c": []}
        assert client.namesrv_addrs == [good_addr, bad_addr]  # the failing one goes last


async def test_expected_answers_reach_their_callbacks_beside_requests(serve: Serve) -> None:
    # Frames written with `write` and answered by callback (a producer's sends) share the
    # connection with coroutine requests; answers in any order reach the right one.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = [await read_cmd(reader) for _ in range(3)]
        for req in reversed(requests):
            writer.write(answer(req, remark=f"for {req.opaque}"))
        await writer.drain()
        await reader.read()

    addr = await serve(handler)
    conn = await Connection.open(addr, 1.0)
    got: dict[int, RemotingCommand | RemotingError] = {}
    try:
        first = conn.reserve_opaques(2)
        opaques = [first, first + 1]
        conn.expect_all(first, 2, got.__setitem__)  # one callback, told each opaque
        conn.write(b"".join(RemotingCommand(code=310, opaque=op).encode() for op in opaques))
        plain = await conn.request(RemotingCommand(code=31), 2.0)
        assert plain.remark == f"for {plain.opaque}"
        await wait_until(lambda: len(got) == 2)
        for op in opaques:
            reply = got[op]
            assert isinstance(reply, RemotingCommand) and reply.remark == f"for {op}"
        assert conn.in_flight == 0
    finally:
        await conn.close()


async def test_expected_answers_expire_and_fail_when_the_connection_drops(serve: Serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_cmd(reader)
        await read_cmd(reader)
        await reader.read(1)  # silent; the client drops the connection

    addr = await serve(handler)
    conn = await Connection.open(addr, 1.0)
    got: dict[int, RemotingCommand | RemotingError] = {}
    first, second = conn.next_opaque(), conn.next_opaque()
    for op in (first, second):
        conn.expect(op, got.__setitem__)
        conn.write(RemotingCommand(code=310, opaque=op).encode())
    conn.expire([first], 310, 0.5)  # the caller's timer ran out for `first` only
    assert isinstance(got.pop(first), RemotingTimeoutError) and not got
    conn.expire([first], 310, 0.5)  # called once: nothing more
    assert not got
    await conn.close()
    assert isinstance(got.pop(second), RemotingClosedError) and conn.in_flight == 0
    with pytest.raises(RemotingClosedError):
        conn.expect(conn.next_opaque(), got.__setitem__)


async def test_reserved_opaques_are_consecutive_and_never_wrap_inside(serve: Serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    conn = await Connection.open(await serve(handler), 1.0)
    try:
        first = conn.reserve_opaques(3)
        assert conn.next_opaque() == first + 3
        conn._opaque = 0x7FFFFFFF - 2  # near the end of the int32 range: starts over
        first = conn.reserve_opaques(3)
        assert first == 1 and conn.next_opaque() == 4
    finally:
        await conn.close()


async def wait_until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_held_pulls_follow_one_another_and_one_timer_ends_the_unanswered(
    serve: Serve,
) -> None:
    """HeldPull (the parent topic's tail): each pull from the offset given, on the broker's
    open connection, answered by callback as `pull` parses it; the pull nobody answers ends in
    a RemotingTimeoutError from the one deadline timer (re-armed, not one timer per pull)."""
    seen: list[RemotingCommand] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(await read_cmd(reader)))  # the broker call that opens the connection
        pull = await read_cmd(reader)
        seen.append(pull)
        fields = {"nextBeginOffset": "5", "minOffset": "0", "maxOffset": "5"}
        writer.write(
            RemotingCommand(
                code=ResponseCode.PULL_NOT_FOUND,
                opaque=pull.opaque,
                flag=FLAG_RESPONSE,
                ext_fields=fields,
            ).encode()
        )
        await writer.drain()
        seen.append(await read_cmd(reader))
        await reader.read()  # silent from now on

    addr = await serve(handler)
    got: list[PullResult | RemotingError] = []
    async with RemotingClient([addr], request_timeout=1.0) as client:
        frames = PullFrames(
            consumer_group="g",
            topic="%LMQ%held",
            queue_id=0,
            max_msg_nums=32,
            sys_flag=0x6,
            suspend_timeout_millis=100,
        )
        held = HeldPull(client, addr, frames, got.append, 0.3, None, pull_result)
        assert not held.send(0)  # no broker connection open yet: nothing sent
        await client.invoke_broker(addr, RequestCode.GET_MAX_OFFSET)
        assert held.send(0) and held.waiting and client.held_pulls == 1
        await wait_until(lambda: len(got) == 1)
        (first,) = got
        assert isinstance(first, PullResult) and first.code == ResponseCode.PULL_NOT_FOUND
        assert first.next_begin_offset == 5 and not held.waiting and client.held_pulls == 0
        assert held.send(first.next_begin_offset)
        await wait_until(lambda: len(got) == 2)
        assert isinstance(got[1], RemotingTimeoutError) and client.held_pulls == 0
        assert [cmd.ext_fields["queueOffset"] for cmd in seen] == ["0", "5"]
        held.close()
