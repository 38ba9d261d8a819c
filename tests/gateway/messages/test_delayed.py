"""Delayed publish on the embedded store (gateway/messages/delayed.py, store/timer.py).

On real `lmqtt serve` processes: delivery on time across a SIGKILL and a graceful restart,
never twice (delayed_scenario.py). In process, with real clients: what is refused (a bad delay
or topic: 0x90 on MQTT 5, dropped on 3.1.1 with the connection kept; the ACL on the target
topic: 0x87) and what `lmqtt inspect` lists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.protocol import PingReq, PingResp, PubAck, Publish, SubAck, Subscribe, Subscription
from tests.crash.gateway_proc import GatewayProcess
from tests.gateway.conftest import GatewayHarness, RawClient
from tests.gateway.messages import delayed_scenario

ACL = """
user bob
topic write cmd/#
topic read cmd/#
"""


def test_delayed_across_restart_and_sigkill(tmp_path: Path) -> None:
    """Over 10 s: the delays must outlast a gateway process's restart (twice)."""
    delayed_scenario.run(lambda: GatewayProcess(tmp_path / "data", segment_size=1 << 20))


@pytest.fixture(scope="module")
def acl_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHarness]:
    root = tmp_path_factory.mktemp("delayed")
    (root / "acl").write_text(ACL)
    h = GatewayHarness(root / "data", acl_file=root / "acl", max_delay=60).start()
    try:
        yield h
    finally:
        h.stop()


def _bob(port: int, level: int) -> RawClient:
    c = RawClient(port, level=level)
    assert c.connect(f"bob{level}-{time.monotonic_ns()}", username="bob").reason_code == 0
    return c


# Delays 0, over max_delay (60 here), not a number; no topic, a $-topic. (A wildcard in a
# PUBLISH topic is malformed whatever the prefix: the decoder refuses it.)
BAD = [
    "$delayed/0/cmd/x",
    "$delayed/61/cmd/x",
    "$delayed/abc/cmd/x",
    "$delayed/-1/cmd/x",
    "$delayed//cmd/x",
    "$delayed/5",
    "$delayed/5/",
    "$delayed/5/$SYS/x",
]


@pytest.mark.parametrize("level", [5, 4])
def test_bad_delay_or_topic_and_acl(acl_gateway: GatewayHarness, level: int) -> None:
    sub = _bob(acl_gateway.port, 5)
    sub.send(Subscribe(1, [Subscription("cmd/#", 1)]))
    assert isinstance(sub.recv(), SubAck)
    c = _bob(acl_gateway.port, level)
    invalid = 0x90 if level == 5 else 0
    for pid, topic in enumerate(BAD, 1):
        c.send(Publish(topic, b"bad", qos=1, packet_id=pid))
        ack = c.recv()
        assert isinstance(ack, PubAck) and ack.reason_code == invalid, (topic, ack)
    c.send(Publish("$delayed/0/cmd/x", b"bad", qos=0))  # no ack to carry a code: dropped
    # The ACL of the target topic: bob may not write other/x.
    c.send(Publish("$delayed/1/other/x", b"denied", qos=1, packet_id=100))
    ack = c.recv()
    assert isinstance(ack, PubAck) and ack.reason_code == (0x87 if level == 5 else 0), ack
    # The connection stayed; a good one goes through, 1 s later.
    c.send(PingReq())
    assert isinstance(c.recv(), PingResp)
    c.send(Publish("$delayed/1/cmd/x", b"good", qos=1, packet_id=101))
    assert isinstance(c.recv(), PubAck)
    acked = time.monotonic()
    got = sub.recv_until(Publish)
    assert (got.topic, got.payload) == ("cmd/x", b"good")
    assert abs(time.monotonic() - acked - 1) <= 1.0
    c.close()
    sub.close()
