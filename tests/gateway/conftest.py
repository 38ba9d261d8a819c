"""Fixtures for end-to-end gateway tests.

The Gateway runs on its own event loop in a background thread (`GatewayHarness`), so tests
drive it with ordinary blocking clients (paho-mqtt's threads, raw sockets) or with amqtt on the
test's own loop, exactly like devices would. Every wait is on a condition with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway import app
from gateway.app import Gateway
from gateway.config import GatewaySettings, load_settings
from gateway.delivery.account import DeliveryAccount
from gateway.protocol import Connect, decode_packet, encode
from gateway.protocol import Properties as PProperties

T = TypeVar("T")
TIMEOUT = 10.0


def wait_until(cond: Callable[[], object], timeout: float = TIMEOUT, what: str = "") -> None:
    """Poll `cond` until it is truthy; fail after `timeout` seconds. The first looks come
    0.5 ms apart, doubling up to 5 ms: most conditions hold within a few milliseconds, and a
    fixed 5 ms tick added its wait to every one."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def quick_account(
    monkeypatch: pytest.MonkeyPatch, record_s: float = 0.5, sample_s: float = 0.5
) -> None:
    """In-process gateways started by this test write their delivery account's periodic
    records every `record_s` and sample every `sample_s` (the constructor's parameters;
    defaults 5 s and 10 s), for a test that waits for those records: same records, sooner."""
    monkeypatch.setattr(
        app,
        "DeliveryAccount",
        functools.partial(DeliveryAccount, record_s=record_s, sample_s=sample_s),
    )


class GatewayHarness:
    """A Gateway on port 0 in its own thread and event loop; restartable on the same data."""

    def __init__(self, data_dir: Path, **overrides: Any) -> None:
        self.data_dir = data_dir
        self.overrides: dict[str, Any] = {"sys_interval": 0, **overrides}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.gw: Gateway | None = None

    @property
    def settings(self) -> GatewaySettings:
        return load_settings(host="127.0.0.1", port=0, data_dir=self.data_dir, **self.overrides)

    def start(self, **overrides: Any) -> GatewayHarness:
        self.overrides.update(overrides)
        # The production loop (uvloop) unless unavailable.
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self.loop = loop
        self.thread = threading.Thread(target=loop.run_forever, name="gateway", daemon=True)
        self.thread.start()
        self.gw = Gateway(self.settings)
        self.run(self.gw.start())
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = TIMEOUT) -> T:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the gateway's loop (to read its state safely)."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())

    @property
    def port(self) -> int:
        assert self.gw is not None
        return self.gw.port

    @property
    def running(self) -> Gateway:
        """The started Gateway (`gw`, known not None: for a test reading its state)."""
        assert self.gw is not None
        return self.gw

    def stop(self) -> None:
        if self.gw is None or self.loop is None:
            return
        try:
            self.run(self.gw.stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            assert self.thread is not None
            self.thread.join(10)
            self.loop.close()
            self.gw = None
            self.loop = None

    def restart(self, **overrides: Any) -> GatewayHarness:
        self.stop()
        return self.start(**overrides)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayHarness]:
    """A running Gateway on 127.0.0.1 port 0 with its data in tmp_path; stopped afterwards."""
    h = GatewayHarness(tmp_path / "data").start()
    try:
        yield h
    finally:
        h.stop()


def paho_property(msg: mqtt.MQTTMessage, name: str) -> Any:
    """Property `name` (e.g. "UserProperty") of a message a v5 paho client received: paho sets
    each property read from the packet as an attribute of that name, which its types omit."""
    assert msg.properties is not None, "no properties: not an MQTT 5 message"
    return getattr(msg.properties, name)


class Client:
    """A paho-mqtt 2.x client (v3.1.1 or v5) that records what it receives."""

    def __init__(
        self,
        port: int,
        client_id: str = "",
        *,
        v5: bool = False,
        clean: bool = True,
        session_expiry: int | None = None,
        keepalive: int = 60,
        will: tuple[str, bytes, int, bool] | None = None,
        will_props: Properties | None = None,
        connect_props: Properties | None = None,
        connect: bool = True,
        auto_ack: bool = True,
        host: str = "127.0.0.1",
    ) -> None:
        self.v5 = v5
        self.host = host
        self.port = port
        proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        kwargs: dict[str, Any] = {"client_id": client_id, "protocol": proto}
        if not v5:
            kwargs["clean_session"] = clean
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **kwargs)
        self.c.manual_ack_set(not auto_ack)
        self.messages: list[mqtt.MQTTMessage] = []
        self.lock = threading.RLock()  # a wait_for condition may take it (payloads())
        # Notified by every callback below: a wait wakes when its packet is read, not at the
        # next tick of a polling loop (a few ms per CONNACK, SUBACK or message, thousands of
        # times a run, on a loaded host far more).
        self.changed = threading.Condition(self.lock)
        self.connack: tuple[bool, int] | None = None
        self.connack_props: Any = None
        self.disconnected: Any = None
        self.disconnect_props: Any = None
        self.subacks: dict[int, list[int]] = {}
        self.unsubacks: dict[int, list[int]] = {}
        self.acked: set[int] = set()
        self.clean = clean
        self.session_expiry = session_expiry
        self.keepalive = keepalive
        self.connect_props = connect_props
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.on_disconnect = self._on_disconnect
        self.c.on_subscribe = self._on_subscribe
        self.c.on_unsubscribe = self._on_unsubscribe
        self.c.on_publish = self._on_publish
        if will is not None:
            self.c.will_set(will[0], will[1], will[2], will[3], properties=will_props)
        if connect:
            self.connect()

    # callbacks (paho's thread)
    def _on_connect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any = None) -> None:
        with self.changed:
            self.connack = (bool(flags.session_present), int(rc.value))
            self.connack_props = props
            self.changed.notify_all()

    def _on_message(self, c: Any, u: Any, msg: mqtt.MQTTMessage) -> None:
        with self.changed:
            self.messages.append(msg)
            self.changed.notify_all()

    def _on_disconnect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any = None) -> None:
        with self.changed:
            self.disconnected = rc
            self.disconnect_props = props
            self.changed.notify_all()

    def _on_subscribe(self, c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
        with self.changed:
            self.subacks[mid] = [int(r.value) for r in rcs]
            self.changed.notify_all()

    def _on_unsubscribe(self, c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
        with self.changed:
            self.unsubacks[mid] = [int(r.value) for r in rcs]
            self.changed.notify_all()

    def _on_publish(self, c: Any, u: Any, mid: int, rc: Any, props: Any = None) -> None:
        with self.changed:
            self.acked.add(mid)
            self.changed.notify_all()

    def wait_for(
        self, cond: Callable[[], object], timeout: float = TIMEOUT, what: str = ""
    ) -> None:
        """Wait until `cond` holds, woken by this client's callbacks; fail after `timeout`.
        Checked at least every 50 ms too, for a state a test's own callback changes."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not cond():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what or cond}")
                self.changed.wait(min(left, 0.05))

    # actions (test thread)
    def connect(self, wait: bool = True) -> tuple[bool, int] | None:
        self.connack = None
        self.disconnected = None
        props = self.connect_props
        if self.v5:
            if self.session_expiry is not None:
                props = props or Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = self.session_expiry
            self.c.connect(
                self.host,
                self.port,
                keepalive=self.keepalive,
                clean_start=self.clean,
                properties=props,
            )
        else:
            self.c.connect(self.host, self.port, keepalive=self.keepalive)
        self.c.loop_start()
        if wait:
            self.wait_for(lambda: self.connack is not None, what="CONNACK")
        return self.connack

    def subscribe(self, topic: str | list[tuple[str, Any]], qos: int = 0, **kw: Any) -> list[int]:
        if isinstance(topic, list) or (self.v5 and ("options" in kw or "properties" in kw)):
            rc, mid = self.c.subscribe(topic, **kw)
        else:
            rc, mid = self.c.subscribe(topic, qos, **kw)
        assert rc == mqtt.MQTT_ERR_SUCCESS and mid is not None
        self.wait_for(lambda: mid in self.subacks, what="SUBACK")
        return self.subacks[mid]

    def unsubscribe(self, topic: str) -> None:
        _rc, mid = self.c.unsubscribe(topic)
        self.wait_for(lambda: mid in self.unsubacks or not self.v5, what="UNSUBACK")

    def publish(
        self, topic: str, payload: bytes | str, qos: int = 0, retain: bool = False, **kw: Any
    ) -> mqtt.MQTTMessageInfo:
        info = self.c.publish(topic, payload, qos, retain, **kw)
        if qos:
            info.wait_for_publish(TIMEOUT)
            assert info.is_published()
        return info

    def wait_messages(self, n: int, timeout: float = TIMEOUT) -> list[mqtt.MQTTMessage]:
        self.wait_for(lambda: len(self.messages) >= n, timeout, f"{n} messages")
        with self.lock:
            return list(self.messages)

    def payloads(self) -> list[bytes]:
        with self.lock:
            return [bytes(m.payload) for m in self.messages]

    def disconnect(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()

    def drop(self) -> None:
        """Close the socket without DISCONNECT (an abnormal end: the will is published)."""
        self.c.loop_stop()
        sock = self.c.socket()
        if sock is not None:
            sock.close()


def stop_clients(made: Iterable[Client]) -> None:
    """Stops the network threads of clients a test made (already closed ones included).

    All at once: the thread of a client the server closed sleeps in paho's reconnect wait (up
    to 1 s, not woken by anything) before it sees the stop, so one after the other a test's
    teardown took a second per such client."""

    def stop(c: Client) -> None:
        try:
            c.c.disconnect()  # wakes paho's select, so loop_stop returns at once
            c.c.loop_stop()
        except Exception:
            pass

    threads = [threading.Thread(target=stop, args=(c,)) for c in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    """Collects clients made by a test and stops their network threads afterwards."""
    made: list[Client] = []
    yield made
    stop_clients(made)


class RawClient:
    """A blocking MQTT client on a plain socket, built from the protocol core's codec: exact
    control over every byte (malformed input, abrupt closes, manual acks)."""

    def __init__(self, port: int, level: int = 4, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=TIMEOUT)
        self.level = level
        self._buf = b""

    def send(self, event: Any) -> None:
        self.sock.sendall(encode(event, self.level))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _read(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                # Silence is not a close: socket.timeout is an OSError, and treating it as
                # one made is_closed() true for a server that never closed.
                raise
            except OSError:
                return None
            if not chunk:
                return None
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def recv(self, timeout: float = TIMEOUT) -> Any:
        """The next packet as an event, or None when the server closed the connection;
        TimeoutError when nothing came within `timeout`."""
        self.sock.settimeout(timeout)
        first = self._read(1)
        if first is None:
            return None
        header = bytearray(first)
        while True:
            b = self._read(1)
            if b is None:
                return None
            header += b
            if not b[0] & 0x80:
                break
        length = 0
        for i, byte in enumerate(header[1:]):
            length |= (byte & 0x7F) << (7 * i)
        body = self._read(length) if length else b""
        if body is None:
            return None
        return decode_packet(bytes(header) + body, self.level)

    def recv_until(self, kind: type, timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            ev = self.recv(max(0.01, deadline - time.monotonic()))
            if ev is None or isinstance(ev, kind):
                return ev

    def connect(self, client_id: str, clean: bool = True, keep_alive: int = 60, **kw: Any) -> Any:
        props = kw.pop("properties", None) or PProperties()
        self.send(Connect(self.level, client_id, clean, keep_alive, properties=props, **kw))
        return self.recv()

    def is_closed(self, timeout: float = TIMEOUT) -> bool:
        """True once the server has closed the connection (packets before that are skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.recv(max(0.01, deadline - time.monotonic())) is None:
                    return True
            except TimeoutError:
                return False
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
