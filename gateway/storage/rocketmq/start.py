"""Start-up of the RocketMQ storage: wait for the name server and the brokers, check each broker
the deployment stores on (the parent topic, light queues, its configuration), open the
RocketMqStorage (gateway/storage/rocketmq/adapter.py) and, when spread, add the other brokers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.storage.port import Storage, StorageUnavailable
from gateway.storage.rocketmq.adapter import RETAIN_QUEUE, RocketMqStorage
from gateway.storage.rocketmq.broker import Broker
from gateway.storage.rocketmq.names import PROBE_QUEUE
from gateway.storage.rocketmq.spread import SLOTS_KEY, slots_from_state
from gateway.storage.rocketmq.state import STATE_QUEUE
from gateway.storage.rocketmq.tail import TAIL_BATCH
from rocketmq_remoting import BrokerError, BrokerNotFoundError, RemotingClient, RemotingError
from rocketmq_remoting.admin import create_topic, get_broker_config
from topicmap.rocketmq import encode_lmq

if TYPE_CHECKING:
    from gateway.config import GatewaySettings

log = logging.getLogger("lmqtt.rocketmq")

#: %RETAIN% messages read at start for the retained index's catch-up (gateway/messages/retained.py).
RETAIN_PRELOAD = 20_000
START_RETRY_S = 0.5  # a start waiting for RocketMQ asks the name server again this often
START_LOG_S = 5.0  # ... and says what it waits for this often


async def open_rocketmq(
    settings: GatewaySettings, local: Storage, *, node_id: str = ""
) -> RocketMqStorage:
    """Connect to the cluster of `settings.namesrv`, check the broker, and return the storage.

    StorageUnavailable (with what to fix) when the name server does not answer, no broker is
    registered, or the broker does not index light queues (enableLmq / enableMultiDispatch).
    """
    namesrv = settings.namesrv
    if not namesrv:
        raise StorageUnavailable("store = rocketmq needs the name server address (--namesrv)")
    # Tried again every START_RETRY_S while the name server or a broker is not there yet, for
    # `rocketmq_start_timeout` seconds (the gateway and RocketMQ usually start together); what
    # it waits for is logged every START_LOG_S. Then the last reason, as StorageUnavailable.
    deadline = time.monotonic() + settings.rocketmq_start_timeout
    logged = -START_LOG_S
    # The client id names this process in consumer groups (the inbound topic's): unique per
    # node even for several gateways in one process.
    client_id = f"{socket.gethostname()}@{os.getpid()}@{node_id or 'lmqtt'}"
    while True:
        client = RemotingClient(
            [namesrv], client_id=client_id, request_timeout=5.0, connect_timeout=3.0
        )
        try:
            return await _open(client, settings, local, node_id)
        except _NotYet as exc:
            client.close_nowait()
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageUnavailable(str(exc)) from None
            if time.monotonic() - logged >= START_LOG_S:
                logged = time.monotonic()
                log.warning("waiting for RocketMQ (%.0f s left): %s", left, exc)
            await asyncio.sleep(min(START_RETRY_S, left))
        except BaseException:
            client.close_nowait()
            raise


class _NotYet(StorageUnavailable):
    """What a start waits for: the name server answering, the brokers registered."""


async def _open(
    client: RemotingClient, settings: GatewaySettings, local: Storage, node_id: str
) -> RocketMqStorage:
    namesrv = settings.namesrv
    topic = settings.rocketmq_topic
    try:
        home = await client.home_broker(topic, settings.rocketmq_broker)
    except BrokerNotFoundError as exc:
        raise _NotYet(str(exc)) from None
    except RemotingError as exc:
        raise _NotYet(f"RocketMQ name server {namesrv} unreachable: {exc}") from exc
    name, addr = home.name, home.addr
    if settings.rocketmq_spread and not settings.rocketmq_broker and len(home.serving) > 1:
        # Spread puts the topic on every broker: the home is the one holding the state.
        name, addr = await _state_holder(client, topic, home.serving, (name, addr))
    others = [b for b in home.serving if b != name]
    if others and not settings.rocketmq_spread:
        # A deployment reads and writes its home broker only (docs/rocketmq.md "Several
        # brokers"): what an earlier run stored elsewhere (another rocketmq_broker) is not read.
        log.warning(
            "topic %s is also on broker(s) %s: this gateway stores on and reads %s only;"
            " messages and sessions kept there are not read",
            topic, ", ".join(others), name,
        )  # fmt: skip
    await _prepare_broker(client, name, addr, topic, sync=settings.flush == "sync")
    storage = RocketMqStorage(
        _broker(client, name, addr, topic, settings),
        local,
        sync=settings.flush == "sync",
        node_id=node_id,
        notify_pulls=settings.rocketmq_notify_pulls,
    )
    try:
        await _probe_light_queues(client, name, addr, topic)
        await storage.preload(RETAIN_QUEUE, RETAIN_PRELOAD)
        await storage.load_state()
        if settings.rocketmq_spread:
            await _spread(client, storage, settings)
        # Saved replays resume with the queues' bounds.
        await storage.open_history(storage.history_queues(None), 0)  # type: ignore[arg-type]
    except _NotYet:
        storage.close(keep_local=True)  # tried again (open_rocketmq)
        raise
    except BaseException:
        storage.close()
        raise
    if settings.rocketmq_spread:
        log.info("storage: messages spread over brokers %s", ", ".join(storage.brokers))
        storage.poll_routes(
            lambda: _spread(client, storage, settings), settings.rocketmq_route_poll
        )
    log.info(
        "storage: RocketMQ broker %s (%s) via name server %s, topic %s, %s sends",
        name, addr, namesrv, topic, "sync" if settings.flush == "sync" else "async",
    )  # fmt: skip
    return storage


async def _spread(
    client: RemotingClient, storage: RocketMqStorage, settings: GatewaySettings
) -> None:
    """Add every registered master broker to the deployment (gateway/storage/rocketmq/spread.py):
    the slots recorded in the state (`meta/brokers`) in their order, then new ones by name; each
    gets the parent topic and the same checks as the home broker."""
    topic = settings.rocketmq_topic
    try:
        masters = (await client.get_cluster_info()).master_addrs()
    except RemotingError as exc:
        raise StorageUnavailable(f"RocketMQ name server {settings.namesrv}: {exc}") from exc
    home = storage.broker_name
    recorded = storage.state_value(SLOTS_KEY)
    try:
        names = slots_from_state(recorded, home, list(masters))
    except ValueError as exc:
        raise StorageUnavailable(str(exc)) from None
    if names[0] != home:
        raise StorageUnavailable(
            f"topic {topic!r} was spread with home broker {names[0]} (state record"
            f" {SLOTS_KEY}), not {home}: set rocketmq_broker = {names[0]}"
        )
    if names[: len(storage.brokers)] != storage.brokers:
        # Another node numbered brokers that joined at once in another order.
        raise StorageUnavailable(
            f"brokers of topic {topic!r} numbered {names} in the state, {storage.brokers} here"
        )
    for name in names[len(storage.brokers) :]:
        addr = masters.get(name)
        if addr is None:
            raise _NotYet(
                f"broker {name} holds part of topic {topic!r} (state record {SLOTS_KEY}) but is"
                " not registered with the name server: start it (or its slave) again"
            )
        await _prepare_broker(client, name, addr, topic, sync=settings.flush == "sync")
        await _probe_light_queues(client, name, addr, topic)
        storage.add_slot(_broker(client, name, addr, topic, settings))
        log.info("broker %s (%s) holds part of topic %s now", name, addr, topic)
    storage.routing.set_registered(masters)
    with contextlib.suppress(RemotingError):
        route = await client.get_route(topic)
        writable = route.writable_brokers()
        drained = [q.broker_name for q in route.queues if q.broker_name not in writable]
        storage.routing.set_drained(drained)
    value = json.dumps(names).encode()
    if recorded != value:
        await storage.wait_state_durable(storage.append_state([(SLOTS_KEY, value)]))


async def _state_holder(
    client: RemotingClient, topic: str, serving: Sequence[str], default: tuple[str, str]
) -> tuple[str, str]:
    """The broker of `serving` whose %STATE% light queue holds records (the first by name),
    else `default`: a spread deployment's topic is on every broker, so "the broker already
    holding the topic" no longer tells the home broker apart (a broker added later whose
    name sorts first would become it, and the sessions stay behind)."""
    try:
        masters = (await client.get_cluster_info()).master_addrs()
    except RemotingError:
        return default
    lmq = encode_lmq(STATE_QUEUE, topic)
    for name in sorted(serving):
        addr = masters.get(name)
        if addr is None:
            continue
        with contextlib.suppress(RemotingError):
            if await client.get_max_offset(addr, lmq) > 0:
                return name, addr
    return default


def _broker(
    client: RemotingClient, name: str, addr: str, topic: str, settings: GatewaySettings
) -> Broker:
    """A broker the deployment stores on (the home broker or a spread slot), with the
    settings every one of them sends by."""
    return Broker(
        client, name, addr, topic, settings.rocketmq_topic_property, settings.rocketmq_send_retry
    )


async def _prepare_broker(
    client: RemotingClient, name: str, addr: str, topic: str, *, sync: bool
) -> None:
    """The parent topic created on a broker the deployment stores on, and its configuration
    checked (light queues on, the send thread count): the home broker and every spread slot."""
    try:
        await create_topic(client, addr, topic, queues=1)
    except RemotingError as exc:
        raise StorageUnavailable(
            f"broker {name} ({addr}) refused to create topic {topic!r}: {exc}"
        ) from exc
    await _check_broker_config(client, name, addr, sync=sync)


async def _check_broker_config(client: RemotingClient, name: str, addr: str, *, sync: bool) -> None:
    """Refuse a broker whose configuration says light queues are off; warn when sync mode
    runs on a broker that acknowledges before its disk does. (The probe after this is the
    proof; the configuration gives the clearer message.)"""
    try:
        config = await get_broker_config(client, addr)
    except RemotingError as exc:
        log.debug("broker %s: configuration not readable (%s)", name, exc)
        return
    off = [k for k in ("enableLmq", "enableMultiDispatch") if config.get(k, "").lower() != "true"]
    if off:
        raise StorageUnavailable(
            f"broker {name} ({addr}) does not index light queues ({', '.join(off)} not true):"
            " set enableLmq=true and enableMultiDispatch=true in its broker.conf and restart it"
        )
    threads = config.get("sendMessageThreadPoolNums", "1")
    if threads.isdigit() and int(threads) > 1:
        # Sends are pipelined: with several send threads the broker may append two messages
        # in flight in either order, and MQTT keeps one publisher's messages in order.
        log.warning(
            "broker %s has sendMessageThreadPoolNums=%s: messages a client publishes back to"
            " back may be stored (and delivered) out of order; set sendMessageThreadPoolNums=1",
            name, threads,
        )  # fmt: skip
    if config.get("timerWheelEnable", "").lower() != "true":
        # The broker refuses timer messages then (WHEEL_TIMER_NOT_ENABLE): each is a failed
        # PUBLISH (0x80), never an early delivery.
        log.warning(
            "broker %s has timerWheelEnable=%s: delayed publishes ($delayed/...) will fail;"
            " set timerWheelEnable=true (and timerMaxDelaySec >= max_delay) there",
            name, config.get("timerWheelEnable", "?"),
        )  # fmt: skip
    most = config.get("maxTransferCountOnMessageInMemory", "")
    if most.isdigit() and int(most) < TAIL_BATCH:
        # The parent topic's tail then reads fewer messages per round trip than it asks for:
        # behind by a burst, it catches up that many at a time.
        log.warning(
            "broker %s has maxTransferCountOnMessageInMemory=%s: the parent topic's tail reads"
            " at most that many messages per pull; set it to %d or more",
            name, most, TAIL_BATCH,
        )  # fmt: skip
    flush = config.get("flushDiskType", "")
    if sync and flush != "SYNC_FLUSH":
        log.warning(
            "--flush sync on broker %s with flushDiskType=%s: its SEND_OK does not wait for"
            " the disk, so an acknowledged message can be lost with the broker's machine;"
            " set flushDiskType=SYNC_FLUSH there",
            name, flush or "?",
        )  # fmt: skip
    if flush == "SYNC_FLUSH" and config.get("readUnCommitted", "").lower() != "true":
        # The broker then dispatches (consume queues, light queues, held pulls woken) only
        # what is flushed: every delivery waits for the fsync, and its reput thread re-reads
        # the offset after the flushed one until the flush moves, a core while sends flow.
        log.warning(
            "broker %s has flushDiskType=SYNC_FLUSH and readUnCommitted=%s: deliveries wait"
            " for its disk flush and its dispatch thread spins between flushes; set"
            " readUnCommitted=true there (SEND_OK still waits for the flush)",
            name, config.get("readUnCommitted", "?"),
        )  # fmt: skip


async def _probe_light_queues(client: RemotingClient, name: str, addr: str, topic: str) -> None:
    """Send one message to PROBE_QUEUE and wait until the broker indexed it there: a broker
    without enableLmq/enableMultiDispatch stores it and silently indexes nothing."""
    try:
        before: int | None = await client.get_max_offset(addr, PROBE_QUEUE)
    except BrokerError:  # a broker without LMQ has no such topic
        before = None
    try:
        await client.send_message(addr, topic, b"lmqtt probe", light_queues=[PROBE_QUEUE])
    except RemotingError as exc:
        raise StorageUnavailable(f"broker {name} ({addr}): light-queue probe: {exc}") from exc
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with contextlib.suppress(RemotingError):
            if await client.get_max_offset(addr, PROBE_QUEUE) > (before or 0):
                return
        await asyncio.sleep(0.05)
    raise StorageUnavailable(
        f"broker {name} ({addr}) does not index light queues: set enableLmq=true and"
        " enableMultiDispatch=true in its broker.conf and restart it"
    )
