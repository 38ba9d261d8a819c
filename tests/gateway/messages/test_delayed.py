"""Delayed publish on the embedded store (gateway/messages/delayed.py, store/timer.py).

On real `lmqtt serve` processes: delivery on time across a SIGKILL and a graceful restart,
never twice (delayed_scenario.py). In process, with real clients: what is refused (a bad delay
or topic: 0x90 on MQTT 5, dropped on 3.1.1 with the connection kept; the ACL on the target
topic: 0x87) and what `lmqtt inspect` lists.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from gateway.ops.inspection import DelayedInfo, StoreReport, inspect_data_dir, render_text
from gateway.protocol import PubAck, Publish, SubAck, Subscribe, Subscription
from tests.crash.gateway_proc import GatewayProcess
from tests.gateway.conftest import GatewayHarness, RawClient, wait_until
from tests.gateway.messages import delayed_scenario


def test_delayed_across_restart_and_sigkill(tmp_path: Path) -> None:
    """Over 10 s: three gateway processes, a restart costing seconds on a loaded host."""
    data = tmp_path / "data"
    # The default segment size: `lmqtt replay` opens the store with it (a store of one
    # smaller segment is refused: "size 1048576 != 1073741824").
    delayed_scenario.run(
        lambda: GatewayProcess(data, segment_size=1 << 30), ["--data-dir", str(data)]
    )


@pytest.fixture(scope="module")
def acl_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHarness]:
    root = tmp_path_factory.mktemp("delayed")
    (root / "acl").write_text(delayed_scenario.ACL)
    h = GatewayHarness(root / "data", acl_file=root / "acl", max_delay=60).start()
    try:
        yield h
    finally:
        h.stop()


@pytest.mark.parametrize("level", [5, 4])
def test_bad_delay_or_topic_and_acl(acl_gateway: GatewayHarness, level: int) -> None:
    delayed_scenario.check_refusals(acl_gateway.port, level)


def test_inspect_lists_pending(acl_gateway: GatewayHarness) -> None:
    """`lmqtt inspect` (read-only, next to the running gateway) lists what is still due.
    Before test_bad_delay_or_topic_and_acl would not do: that one leaves nothing pending."""
    c = RawClient(acl_gateway.port, level=5)
    assert c.connect("inspected", username="bob").reason_code == 0
    c.send(Publish("$delayed/50/cmd/later", b"12345", qos=1, packet_id=1))
    assert isinstance(c.recv(), PubAck)
    c.close()

    # A moment's picture of a live store: its queue files are written within a second (one
    # that fired in an earlier test may still look pending for as long).
    def later() -> list[DelayedInfo]:
        report = reports[-1] = inspect_data_dir(acl_gateway.settings.data_dir)
        return [d for d in report.delayed if d.topic == "cmd/later"]

    reports = [StoreReport("")]
    wait_until(later)
    (pending,) = later()
    assert (pending.client_id, pending.qos, pending.bytes) == ("inspected", 1, 5)
    assert abs(pending.due_ms - (time.time() + 50) * 1000) < 5000
    out = io.StringIO()
    render_text(reports[-1], Console(file=out, width=200))
    assert "pending)" in out.getvalue()
    assert "cmd/later" in out.getvalue()


def test_routed_when_it_fires(acl_gateway: GatewayHarness) -> None:
    """The embedded store routes a delayed message when it fires: a filter first subscribed
    while it waits gets it (on RocketMQ the light queues are those of the publish time)."""
    c = RawClient(acl_gateway.port, level=5)
    assert c.connect("router", username="bob").reason_code == 0
    c.send(Publish("$delayed/1/cmd/routed/late", b"late", qos=1, packet_id=1))
    assert isinstance(c.recv(), PubAck)
    acked = time.monotonic()
    c.send(Subscribe(2, [Subscription("cmd/routed/+", 1)]))  # a filter nobody held
    assert isinstance(c.recv(), SubAck)
    got = c.recv_until(Publish)
    assert (got.topic, got.payload) == ("cmd/routed/late", b"late")
    assert abs(time.monotonic() - acked - 1) <= 1.0
    c.close()
