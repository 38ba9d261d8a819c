"""The simulator as a library, against amqtt's broker (an independent MQTT server).

The zero-loss run with the whole subscriber mix (persistent subscribers going offline and
coming back) is in test_demo.py against the lmqtt gateway: amqtt's broker forgets a QoS 1
message that is in flight to a subscriber at the moment it disconnects (its inflight entry is
dropped when the PUBACK wait is cancelled), so here the subscribers stay connected.
"""

from __future__ import annotations

import asyncio

import pytest

from sim import SimConfig, SimError, Simulation, run_simulation
from tests.sim.conftest import SIM_USER, closed_port, start_amqtt_broker


def config(port: int, **overrides: object) -> SimConfig:
    settings: dict[str, object] = {
        "port": port,
        "devices": 4,
        "rate": 10.0,
        "duration": 1.5,
        "subscribers": 1,
        "drain_timeout": 10.0,
        "username": SIM_USER,
        "seed": 1,
    }
    settings.update(overrides)
    return SimConfig(**settings)  # type: ignore[arg-type]


async def test_every_acknowledged_message_reaches_a_wildcard_subscriber(amqtt_broker: int) -> None:
    report = await run_simulation(config(amqtt_broker))

    assert report.ok and report.exit_code == 0
    assert report.sent == report.acknowledged > 0
    assert report.failed == 0
    # Devices d0001 and d0003 publish temperatures (thermostat, air); d0002/d0004 do not.
    (subscriber,) = report.subscribers
    assert subscriber.filters == ("site/+/dev/+/temperature",)
    assert 0 < subscriber.expected < report.acknowledged
    assert subscriber.received >= subscriber.expected
    assert report.lost == 0 and subscriber.lost == 0


async def test_loss_is_reported_and_fails_the_run() -> None:
    # amqtt's ACL plugin lets this user publish only temperatures, yet amqtt acknowledges the
    # other publishes too and drops them: the "site-archive" subscriber misses acknowledged ones.
    acl = {"acl": {SIM_USER: ["#"]}, "publish_acl": {SIM_USER: ["site/+/dev/+/temperature"]}}
    broker, port = await start_amqtt_broker(
        {"amqtt.plugins.topic_checking.TopicAccessControlListPlugin": acl}
    )
    try:
        report = await run_simulation(config(port, subscribers=2, drain_timeout=1.0))
    finally:
        await broker.shutdown()

    temperatures, archive = report.subscribers
    assert temperatures.lost == 0 and temperatures.expected > 0
    assert archive.lost > 0 and archive.lost == archive.expected - archive.received
    assert report.lost == archive.lost
    assert not report.ok and report.exit_code == 1


async def test_qos0_runs_count_what_arrives_and_expect_nothing(amqtt_broker: int) -> None:
    report = await run_simulation(config(amqtt_broker, qos=0))
    assert report.sent > 0 and report.acknowledged == 0
    assert report.expected == 0 and report.lost == 0 and report.ok


async def test_the_message_budget_bounds_a_run(amqtt_broker: int) -> None:
    report = await run_simulation(config(amqtt_broker, max_messages=7, duration=30.0))
    assert report.sent == 7 == report.acknowledged
    assert report.elapsed < 30


async def test_stop_ends_publishing_early_and_still_reports(amqtt_broker: int) -> None:
    sim = Simulation(config(amqtt_broker, duration=60.0))
    run = asyncio.create_task(sim.run())
    while sim.snapshot().acknowledged < 5:
        await asyncio.wait([run], timeout=0.05)
        assert not run.done()
    sim.stop()
    report = await asyncio.wait_for(run, 20)
    assert report.interrupted and report.ok and report.exit_code == 130
    assert report.elapsed < 60


async def test_an_unreachable_gateway_is_a_sim_error() -> None:
    with pytest.raises(SimError, match="cannot connect"):
        await run_simulation(config(closed_port(), connect_timeout=5.0))


async def test_a_server_that_never_answers_connect_is_a_sim_error_not_a_hang() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def swallow(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(SimError, match="cannot connect"):
            await run_simulation(config(port, connect_timeout=1.0))
        assert accepted
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "bad",
    [
        {"devices": -1},
        {"devices": 10_001},
        {"subscribers": 1_001},
        {"rate": 0.0},
        {"duration": 0.0},
        {"duration": 90_000.0},
        {"qos": 3},
        {"max_messages": 0},
        {"port": 70_000},
        {"name": "two words"},
        {"name": ""},
    ],
)
def test_settings_outside_the_bounds_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(SimError):
        SimConfig(**bad).check()  # type: ignore[arg-type]
