"""Fixtures for the simulator's tests: brokers to run it against.

`amqtt_broker` is amqtt's broker in-process on port 0, a second, independent MQTT server that
keeps the simulator honest about MQTT rather than about lmqtt. It queues messages for offline
persistent sessions only for authenticated clients, hence anonymous access off and the
simulator logging in with a user name.

`lmqtt_gateway` is the real lmqtt Gateway in-process on port 0 over a tmp_path store.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from amqtt.broker import Broker

from gateway.app import Gateway
from gateway.config import load_settings
from sim.client import silence_amqtt

SIM_USER = "sim"


async def start_amqtt_broker(plugins: dict[str, object] | None = None) -> tuple[Broker, int]:
    silence_amqtt()
    config = {
        "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:0"}},
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False},
            **(plugins or {}),
        },
    }
    broker = Broker(config)
    await broker.start()
    sockets = broker._servers["default"].instance.sockets  # amqtt has no public bound-port API
    return broker, sockets[0].getsockname()[1]


@pytest.fixture
async def amqtt_broker() -> AsyncIterator[int]:
    broker, port = await start_amqtt_broker()
    yield port
    await broker.shutdown()


@pytest.fixture
async def lmqtt_gateway(tmp_path: Path) -> AsyncIterator[int]:
    settings = load_settings(host="127.0.0.1", port=0, data_dir=tmp_path / "data", sys_interval=0)
    gateway = Gateway(settings)
    await gateway.start()
    yield gateway.port
    await gateway.stop()


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
