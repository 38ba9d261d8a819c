"""The delayed-publish scenario both backends must pass, on real `lmqtt serve` processes.

`$delayed/{s}/d/...` publishes acknowledged once stored; the gateway SIGKILLed right after one
fired and before another is due, then stopped gracefully before a third is due. A watching
subscriber gets those due while a gateway runs under their own topic `s` seconds after their
PUBLISH was acknowledged (+- 1 s); those due while none runs are delivered when one is back: a
persistent QoS 2 subscriber, offline throughout, finds each exactly once, then a probe
published last: nothing was lost or fired twice.

(The persistent subscriber stays offline because of a gap of the delivery side, not of the
timer: a QoS 2 delivery completed (PUBCOMP) within a second before a SIGKILL is sent again
after it, the committed offset being made durable by the next full flush, not at PUBCOMP.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

from gateway.protocol import (
    ConnAck,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
)
from tests.crash.gateway_proc import ROOT, GatewayProcess
from tests.gateway.conftest import RawClient

TOLERANCE_S = 1.0
#: For check_refusals: bob may write and read cmd/# only.
ACL = """
user bob
topic write cmd/#
topic read cmd/#
"""


def _connect(port: int, cid: str, level: int = 5, clean: bool = True) -> RawClient:
    c = RawClient(port, level=level)
    props = Properties(session_expiry_interval=3600) if level == 5 else None
    ack = c.connect(cid, clean=clean, properties=props)
    assert isinstance(ack, ConnAck) and ack.reason_code == 0, ack
    return c


def _subscriber(port: int, cid: str, clean: bool) -> RawClient:
    c = _connect(port, cid, clean=clean)
    if clean:
        c.send(Subscribe(1, [Subscription("d/#", 2)]))
        assert isinstance(c.recv(), SubAck)
    return c


def publish_delayed(port: int, topic: str, qos: int, level: int = 5) -> float:
    """PUBLISH `topic` from a fresh client; the monotonic time its acknowledgement came."""
    c = _connect(port, f"delayed-pub-{time.monotonic_ns()}", level)
    try:
        c.send(Publish(topic, topic.encode(), qos=qos, packet_id=7))
        if qos == 1:
            ack = c.recv()
            assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
        else:
            rec = c.recv()
            assert isinstance(rec, PubRec) and rec.reason_code == 0, rec
            c.send(PubRel(7))
            assert isinstance(c.recv(), PubComp)
        return time.monotonic()
    finally:
        c.close()


def _next(c: RawClient, kind: type, deadline: float, held: list[Publish]) -> object:
    """The next packet of `kind`; PUBLISH packets read meanwhile go to `held`."""
    while True:
        ev = c.recv(max(0.01, deadline - time.monotonic()))
        assert ev is not None, "connection closed"
        if isinstance(ev, kind):
            return ev
        if isinstance(ev, Publish):
            held.append(ev)


_HELD: dict[int, list[Publish]] = {}


def receive(c: RawClient, timeout: float = 20.0) -> tuple[Publish, float]:
    """The next PUBLISH, fully acknowledged (QoS 1 or 2), and when it came."""
    deadline = time.monotonic() + timeout
    held = _HELD.setdefault(id(c), [])
    ev = held.pop(0) if held else _next(c, Publish, deadline, held)
    assert isinstance(ev, Publish)
    at = time.monotonic()
    if ev.qos == 1:
        c.send(PubAck(ev.packet_id or 0))
    elif ev.qos == 2:
        c.send(PubRec(ev.packet_id or 0))
        _next(c, PubRel, deadline, held)
        c.send(PubComp(ev.packet_id or 0))
    return ev, at


def expect(c: RawClient, topic: str, due: float, passing: str | None = None) -> None:
    """The next message is `topic`, at `due` (+- TOLERANCE_S); one `passing` may come first."""
    ev, at = receive(c)
    if passing is not None and ev.topic == passing:
        ev, at = receive(c)
    assert (ev.topic, ev.qos) == (topic, 2), f"got {ev}, expected {topic!r} at QoS 2"
    assert ev.payload.endswith(b"/" + topic.encode()), ev.payload
    assert abs(at - due) <= TOLERANCE_S, f"{topic} came {at - due:+.2f} s from its due time"


def replayed(store_args: list[str]) -> list[dict[str, object]]:
    """`lmqtt replay --filter d/# --since earliest` (the real command) as rows."""
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", *store_args, "--filter", "d/#",
         "--since", "earliest"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines()]


def run(start: Callable[[], GatewayProcess], replay_args: list[str]) -> None:
    """The scenario; `replay_args` select the store for `lmqtt replay` at the end."""
    gw = start()
    try:
        # The persistent subscriber is offline from here to the end, when it must find each
        # message once; the watcher (a clean session, subscribed again after each restart)
        # times those due while the gateway runs.
        _subscriber(gw.port, "delayed-keeper", clean=True).close()
        _connect(gw.port, "delayed-keeper", clean=False).close()
        watch = _subscriber(gw.port, "delayed-watch", clean=True)
        # QoS 2 end to end: a second delivery of any of them is a failure, not QoS 1's right.
        published = {}  # topic -> wall-clock time its PUBLISH was acknowledged + its delay
        a = publish_delayed(gw.port, "$delayed/2/d/a", 2, level=4)  # from MQTT 3.1.1
        published["d/a"] = time.time() + 2
        publish_delayed(gw.port, "$delayed/3/d/b", 2)
        published["d/b"] = time.time() + 3
        expect(watch, "d/a", a + 2)
        # Right after a fired (its checkpoint most likely not yet written), before b is due.
        gw.kill()
        watch.close()
        gw = start()
        watch = _subscriber(gw.port, "delayed-watch", clean=True)
        c = publish_delayed(gw.port, "$delayed/1/d/c", 2)
        published["d/c"] = time.time() + 1
        # b falls due about a second after the kill: a fast restart has the watcher subscribed
        # by then, and it gets b first (a slow one fired b before it subscribed).
        expect(watch, "d/c", c + 1, passing="d/b")
        publish_delayed(gw.port, "$delayed/2/d/d", 2)
        published["d/d"] = time.time() + 2
        watch.close()
        gw.terminate()  # before d is due: a graceful stop
        gw = start()
        keeper = _connect(gw.port, "delayed-keeper", clean=False)
        got = [receive(keeper)[0].topic for _ in range(4)]  # d fires once it is due
        probe = _connect(gw.port, "delayed-probe")
        probe.send(Publish("d/probe", b"probe", qos=1, packet_id=1))
        assert isinstance(probe.recv(), PubAck)
        probe.close()
        got.append(receive(keeper)[0].topic)  # nothing a second time before the probe
        assert got == ["d/a", "d/b", "d/c", "d/d", "d/probe"], got
        keeper.close()
        # Replay (and the report, reading the same records) see each once, under its topic,
        # stored when it was delivered (not when published). Stopped first: a replay beside a
        # running gateway sees what it has flushed, and the probe may not be yet.
        gw.terminate()
        rows = replayed(replay_args)
        assert [r["topic"] for r in rows] == got, rows
        for r in rows[:-1]:
            stored = int(str(r["store_timestamp_ms"])) / 1000
            assert stored >= published[str(r["topic"])] - TOLERANCE_S, (r, published)
            assert r["client_id"] != "" and r["qos"] == 2
    finally:
        gw.terminate()


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


def check_refusals(port: int, level: int) -> None:
    """A gateway with ACL (max_delay 60): bad delays and topics get 0x90 on MQTT 5 and are
    dropped with a positive PUBACK on 3.1.1, the connection kept; the ACL of the target topic
    applies (0x87); then a good one arrives 1 s later."""
    sub = _bob(port, 5)
    sub.send(Subscribe(1, [Subscription("cmd/#", 1)]))
    assert isinstance(sub.recv(), SubAck)
    c = _bob(port, level)
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
