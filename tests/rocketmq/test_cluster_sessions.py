"""Several gateway processes on one RocketMQ deployment (issue #18, points 2 and 4): a persistent
session resumes on another node (session present, its backlog, in-flight QoS 1 messages re-sent
with DUP), with the first node running or stopped; a retained message set through one node
reaches a new subscriber on another. Real `lmqtt serve` processes sharing one `rocketmq_topic`
on the session's RocketMQ cluster, real MQTT clients.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.cluster.bus import CLUSTER_QUEUE
from gateway.protocol import (
    Connect,
    Disconnect,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
    Will,
)
from gateway.protocol import Properties as PProperties
from gateway.storage.rocketmq.broker import PULL_GROUP
from gateway.storage.rocketmq.names import encode_lmq
from rocketmq_remoting import RemotingClient
from tests.gateway.conftest import Client, RawClient, stop_clients, wait_until
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_cluster import HEARTBEAT_S, LEASE_S
from tests.rocketmq.test_gateway_rocketmq import ServeProcess
from topicmap.rocketmq import STATE_QUEUE, decode_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class Nodes:
    """Gateway processes in cluster mode on one namespace (`rocketmq_topic`) of one broker."""

    def __init__(self, rocketmq: RocketMQCluster, tmp_path: Path, broker: str = "broker-a") -> None:
        self.namesrv = rocketmq.namesrv_addr
        self.broker = broker
        self.topic = f"c{uuid.uuid4().hex[:12]}"
        self.tmp_path = tmp_path
        self.nodes: list[ServeProcess] = []

    def start(self, *args: str, node_id: str | None = None) -> ServeProcess:
        """`node_id`: the leader is the live node with the smallest id."""
        g = ServeProcess(
            self.tmp_path / f"node{len(self.nodes)}",
            "--store", "rocketmq", "--namesrv", self.namesrv, *args,
            env={
                "LMQTT_ROCKETMQ_TOPIC": self.topic,
                "LMQTT_ROCKETMQ_BROKER": self.broker,
                "LMQTT_CLUSTER": "true",
                "LMQTT_CLUSTER_LEASE": str(LEASE_S),
                "LMQTT_CLUSTER_HEARTBEAT": str(HEARTBEAT_S),
                **({"LMQTT_NODE_ID": node_id} if node_id else {}),
            },
        )  # fmt: skip
        self.nodes.append(g)
        return g.start()

    def stop(self) -> None:
        for g in self.nodes:
            g.stop()

    def bodies(self, queue: str) -> list[bytes]:
        """The bodies of every message of this namespace's light queue `queue`, read from the
        broker."""

        async def read() -> list[bytes]:
            client = RemotingClient([self.namesrv], client_id=None, request_timeout=5.0)
            try:
                route = await client.get_cluster_info()
                addr = route.brokers[self.broker].master_addr
                assert addr is not None
                lmq = encode_lmq(queue, self.topic)
                offset = await client.get_min_offset(addr, lmq)
                end = await client.get_max_offset(addr, lmq)
                out: list[bytes] = []
                while offset < end:
                    res = await client.pull(addr, lmq, offset, consumer_group=PULL_GROUP)
                    if not res.messages:
                        break
                    out += [rec.body for rec in res.messages]
                    offset = res.next_begin_offset
                return out
            finally:
                await client.close()

        return asyncio.run(read())

    def session_record(self, client_id: str) -> dict[str, Any] | None:
        """The newest record of `client_id`'s session in the state log, read from the broker."""
        found: bytes | None = None
        for body in self.bodies(STATE_QUEUE):
            for key, value in decode_state(body)[0]:
                if key == "session/" + client_id:
                    found = value
        return None if found is None else json.loads(found)

    def bus_records(self, kind: str) -> list[dict[str, object]]:
        """The cluster bus records of `kind` (gateway/cluster/bus.py), in the bus's order."""
        return [
            r for body in self.bodies(CLUSTER_QUEUE) for r in json.loads(body) if r["k"] == kind
        ]

    def wait_record(
        self,
        client_id: str,
        cond: Callable[[dict[str, object]], bool] | None,
        timeout: float = 20,
    ) -> None:
        """Until `client_id`'s newest record satisfies `cond` (None: until it is deleted)."""

        def ok() -> bool:
            rec = self.session_record(client_id)
            return rec is None if cond is None else rec is not None and cond(rec)

        wait_until(ok, timeout, f"{client_id}'s session record in the state log")


@pytest.fixture
def nodes(rocketmq: RocketMQCluster, tmp_path: Path) -> Iterator[Nodes]:
    made = Nodes(rocketmq, tmp_path)
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    stop_clients(made)


def _publish(port: int, topic: str, payloads: list[bytes]) -> None:
    pub = RawClient(port, level=4)
    try:
        assert pub.connect(f"pub-{uuid.uuid4().hex[:6]}").reason_code == 0
        for i, payload in enumerate(payloads):
            pub.send(Publish(topic, payload, qos=1, packet_id=i + 1))
            assert pub.recv() == PubAck(i + 1)
    finally:
        pub.close()


def _subscribed_with_two_unacked(port: int, client_id: str) -> list[Publish]:
    """A persistent session on `port` subscribed to m/# that got m0..m2 and acknowledged m0."""
    sub = RawClient(port, level=4)
    assert sub.connect(client_id, clean=False).reason_code == 0
    sub.send(Subscribe(1, [Subscription("m/#", 1)]))
    assert isinstance(sub.recv(), SubAck)
    _publish(port, "m/t", [b"m0", b"m1", b"m2"])
    first = [sub.recv() for _ in range(3)]
    assert [m.payload for m in first] == [b"m0", b"m1", b"m2"]
    sub.send(PubAck(first[0].packet_id))
    sub.close()
    return first


def _resumed_elsewhere(port: int, client_id: str, first: list[Publish], backlog: int) -> RawClient:
    again = RawClient(port, level=4)
    ack = again.connect(client_id, clean=False)
    assert ack.reason_code == 0 and ack.session_present
    resent = [again.recv() for _ in range(2)]
    assert [(m.payload, m.dup) for m in resent] == [(b"m1", True), (b"m2", True)]
    assert [m.packet_id for m in resent] == [first[1].packet_id, first[2].packet_id]
    for m in resent:
        again.send(PubAck(m.packet_id))
    rest = [again.recv() for _ in range(backlog)]
    assert [(m.payload, m.dup) for m in rest] == [(f"b{i}".encode(), False) for i in range(backlog)]
    for m in rest:
        again.send(PubAck(m.packet_id))
    return again


def test_a_session_resumes_on_another_node_while_the_first_runs(nodes: Nodes) -> None:
    a = nodes.start()
    b = nodes.start()
    first = _subscribed_with_two_unacked(a.port, "mover")
    # A writes the record at the disconnect; B reads the state log to its end before CONNACK.
    nodes.wait_record("mover", lambda r: r.get("disconnected_at_ms") is not None)
    _publish(a.port, "m/t", [f"b{i}".encode() for i in range(5)])  # the backlog, through A
    again = _resumed_elsewhere(b.port, "mover", first, backlog=5)
    # Live on B, published through A and through B (B registered the session's filter).
    _publish(a.port, "m/x", [b"live-a"])
    _publish(b.port, "m/y", [b"live-b"])
    live = [again.recv() for _ in range(2)]
    assert [m.payload for m in live] == [b"live-a", b"live-b"]
    again.send(PubAck(live[0].packet_id))  # live-b stays in flight
    again.close()
    # B wrote where the session went; A's copy follows it (no expiry, no rewrite by A).
    nodes.wait_record("mover", lambda r: r.get("disconnected_at_ms") is not None)
    back = RawClient(a.port, level=4)
    ack = back.connect("mover", clean=False)
    assert ack.reason_code == 0 and ack.session_present
    resent = back.recv()
    assert (resent.payload, resent.dup) == (b"live-b", True)  # in flight when it left B
    back.send(PubAck(resent.packet_id))
    _publish(a.port, "m/z", [b"home"])
    got = back.recv()
    assert (got.payload, got.dup) == (b"home", False)  # nothing B had acknowledged again
    back.close()


def test_a_session_resumes_on_another_node_after_the_first_stopped(nodes: Nodes) -> None:
    a = nodes.start()
    b = nodes.start()
    first = _subscribed_with_two_unacked(a.port, "survivor")
    _publish(a.port, "m/t", [f"b{i}".encode() for i in range(3)])
    a.stop()
    again = _resumed_elsewhere(b.port, "survivor", first, backlog=3)
    _publish(b.port, "m/t", [b"after"])
    assert again.recv().payload == b"after"
    again.close()


def test_a_session_taken_over_by_another_node_resumes_there(nodes: Nodes) -> None:
    """Points 2 and 3: the same persistent session connecting on B while connected on A: A's
    connection is closed (0x8E), B's CONNACK has session present, the messages A had in
    flight come again on B with DUP (A handed the session over), and A writes nothing after
    the takeover (the newest record is B's, connected), so publishes through A keep reaching
    the session on B."""
    a = nodes.start()
    b = nodes.start()
    old = RawClient(a.port, level=5)
    assert old.connect("taken", clean=False, properties=_expiry(3600)).reason_code == 0
    old.send(Subscribe(1, [Subscription("m/#", 1)]))
    assert isinstance(old.recv(), SubAck)
    _publish(a.port, "m/t", [b"m0", b"m1"])
    inflight = [old.recv() for _ in range(2)]
    assert [m.payload for m in inflight] == [b"m0", b"m1"]
    new = RawClient(b.port, level=5)
    ack = new.connect("taken", clean=False, properties=_expiry(3600))
    assert ack.reason_code == 0 and ack.session_present
    ev = old.recv()
    assert isinstance(ev, Disconnect) and ev.reason_code == 0x8E
    assert old.is_closed()
    resent = [new.recv() for _ in range(2)]
    assert [(m.payload, m.dup) for m in resent] == [(b"m0", True), (b"m1", True)]
    for m in resent:
        new.send(PubAck(m.packet_id))
    _publish(a.port, "m/x", [b"through-a"])
    got = new.recv()
    assert (got.payload, got.dup) == (b"through-a", False)
    new.send(PubAck(got.packet_id))
    record = nodes.session_record("taken")
    assert record is not None and record.get("disconnected_at_ms") is None, record
    old.close()
    new.close()


def test_a_session_taken_over_while_connected_resumes_exactly(
    nodes: Nodes, clients: list[Client]
) -> None:
    """Takeover with the client still connected on A (gateway/cluster/handover.py): A closes the
    connection and hands the session as it stands to B, so B resends exactly what was in
    flight, with DUP, nothing already acknowledged, then the backlog. (A's newest record was
    written at SUBACK: resuming from it would send m0..m9 again, without DUP.)"""
    a = nodes.start()
    b = nodes.start()
    window = Properties(PacketTypes.CONNECT)
    window.ReceiveMaximum = 4  # A holds back the rest once 4 are in flight
    old = Client(
        a.port, "exact", v5=True, clean=False, session_expiry=3600, connect_props=window,
        auto_ack=False,
    )  # fmt: skip
    clients.append(old)
    old.c.reconnect_delay_set(60, 120)  # told 0x8E, it must not come back within the test
    assert old.subscribe("e/#", 1) == [1]
    _publish(a.port, "e/t", [f"m{i}".encode() for i in range(10)])
    first = old.wait_messages(4)
    assert [bytes(m.payload) for m in first] == [b"m0", b"m1", b"m2", b"m3"]
    old.c.ack(first[0].mid, 1)
    old.c.ack(first[1].mid, 1)
    sent = old.wait_messages(6)  # the two acknowledgements freed the window for m4, m5
    assert [bytes(m.payload) for m in sent[4:]] == [b"m4", b"m5"]
    new = Client(b.port, "exact", v5=True, clean=False, session_expiry=3600)
    clients.append(new)
    assert new.connack == (True, 0)
    got = new.wait_messages(8)
    assert [(bytes(m.payload), bool(m.dup)) for m in got] == [
        *[(f"m{i}".encode(), True) for i in range(2, 6)],
        *[(f"m{i}".encode(), False) for i in range(6, 10)],
    ]
    wait_until(lambda: old.disconnected is not None, what="A's connection closed")
    assert old.disconnected.value == 0x8E
    _publish(b.port, "e/t", [b"marker"])
    got = new.wait_messages(9)
    assert len(got) == 9 and bytes(got[8].payload) == b"marker", [m.payload for m in got]
    assert len(old.messages) == 6  # A sent nothing after the takeover


def test_a_lost_nodes_sessions_are_disconnected_and_expire_on_every_node(nodes: Nodes) -> None:
    """Sessions connected on a node that dies (no will): the leader rewrites them as
    disconnected at the loss (gateway/cluster/node_wills.py), so every node runs their expiry: a
    clean one ends at once, one with a 4 s expiry ends on every node 4 s later, a long one stays and
    resumes on another node. (Before, they stayed connected copies for ever.)"""
    lead = nodes.start(node_id="n1")
    a = nodes.start(node_id="n2")
    c = nodes.start(node_id="n3")
    socks = []
    for cid, level, clean, expiry in [
        ("keep", 5, False, 3600), ("short", 5, False, 4), ("clean", 4, True, 0),
    ]:  # fmt: skip
        sock = RawClient(a.port, level=level)
        props = _expiry(expiry) if level == 5 else None
        assert sock.connect(cid, clean=clean, properties=props).reason_code == 0
        sock.send(Subscribe(1, [Subscription(f"{cid}/#", 1)]))
        assert isinstance(sock.recv(), SubAck)
        socks.append(sock)
    a.stop(signal.SIGKILL)
    timeout = LEASE_S * 2 + 10
    nodes.wait_record("clean", None, timeout)  # ended with its node
    nodes.wait_record("keep", lambda r: r.get("disconnected_at_ms") is not None, timeout)
    nodes.wait_record("short", None, timeout + 4)  # expired
    for g in (lead, c):  # each node ended its copy when due, not only the leader

        def expired(g: ServeProcess = g) -> bool:
            return any("'short' expired" in x for x in g.output)

        wait_until(expired, 10, "expiry")
    for port, cid, present in [(c.port, "keep", True), (lead.port, "short", False)]:
        again = RawClient(port, level=5)
        ack = again.connect(cid, clean=False, properties=_expiry(3600))
        assert (ack.reason_code, ack.session_present) == (0, present), cid
        again.close()
    for sock in socks:
        sock.close()


def test_a_will_pending_on_a_leader_that_dies_is_published_by_the_next_once(
    nodes: Nodes, clients: list[Client]
) -> None:
    """Node A dies with a client whose will has a 20 s delay; the leader takes the will over
    (its record rewritten with the due time, gateway/cluster/node_wills.py) and dies too before it
    is due: the survivor, leader now, publishes it when due, once."""
    delay = 20
    lead = nodes.start(node_id="n1")
    a = nodes.start(node_id="n2")
    survivor = nodes.start(node_id="n3")
    watcher = Client(survivor.port, "lw-watcher")
    clients.append(watcher)
    assert watcher.subscribe("lw/#", 1) == [1]
    dev = RawClient(a.port, level=5)
    will = Will("lw/dev", b"gone", qos=1, properties=PProperties(will_delay_interval=delay))
    assert dev.connect("lw-dev", clean=False, properties=_expiry(60), will=will).reason_code == 0
    killed = time.monotonic()
    a.stop(signal.SIGKILL)
    nodes.wait_record("lw-dev", lambda r: r.get("will_due_ms") is not None, LEASE_S * 2 + 5)
    assert time.monotonic() - killed < delay - LEASE_S, "too late to kill the leader in time"
    lead.stop(signal.SIGKILL)
    watcher.wait_messages(1, timeout=delay + LEASE_S * 2 + 10)
    assert time.monotonic() - killed >= delay
    pub = Client(survivor.port, "lw-pub")
    clients.append(pub)
    pub.publish("lw/marker", b"after", 1)
    got = watcher.wait_messages(2)
    assert [(m.topic, bytes(m.payload)) for m in got] == [
        ("lw/dev", b"gone"),
        ("lw/marker", b"after"),
    ]
    dev.close()


def test_acknowledged_messages_do_not_come_again_after_a_crash(nodes: Nodes) -> None:
    """SIGKILL of node A after its client acknowledged messages its session record does not
    know of yet (records of connected sessions are rewritten every 10 s): B resumes the session
    from the broker's committed offsets where they are fresher (sent every second), so the
    messages acknowledged more than ~1.5 s before the crash are not delivered again; the ones
    in flight at the crash come again, then the rest."""
    a = nodes.start()
    b = nodes.start()
    sub = RawClient(a.port, level=4)
    assert sub.connect("crashed", clean=False).reason_code == 0
    sub.send(Subscribe(1, [Subscription("k/#", 1)]))
    assert isinstance(sub.recv(), SubAck)
    acked = 0
    for _ in range(3):  # until A's record lags the acknowledgements (a progress pass may not)
        _publish(a.port, "k/t", [f"k{acked + i}".encode() for i in range(4)])
        for _ in range(4):
            sub.send(PubAck(sub.recv().packet_id))
        acked += 4
        time.sleep(1.5)  # the broker has the committed offset (sent every second)
        rec = nodes.session_record("crashed")
        assert rec is not None
        (sd,) = rec["subscriptions"]
        pending = [i["offset"] for i in rec["inflight"]]
        if min([sd["next_offset"], *pending]) < acked:
            break
    else:
        pytest.fail("A's record kept up with the acknowledgements: nothing to test")
    _publish(a.port, "k/t", [b"open0", b"open1"])  # in flight at the crash: not acknowledged
    assert [sub.recv().payload for _ in range(2)] == [b"open0", b"open1"]
    a.stop(signal.SIGKILL)
    sub.close()
    _publish(b.port, "k/t", [b"after"])
    again = RawClient(b.port, level=4)
    ack = again.connect("crashed", clean=False)
    assert ack.reason_code == 0 and ack.session_present
    got = [again.recv() for _ in range(3)]
    assert [m.payload for m in got] == [b"open0", b"open1", b"after"]
    again.close()


def _expiry(seconds: int) -> PProperties:
    return PProperties(session_expiry_interval=seconds)


def test_a_retained_message_set_through_one_node_reaches_a_subscriber_on_another(
    nodes: Nodes, clients: list[Client]
) -> None:
    a = nodes.start()
    b = nodes.start()
    setter = Client(a.port, "setter")
    clients.append(setter)
    for i in range(20):
        topic = f"r/{i}"
        setter.publish(topic, f"kept {i}", 1, retain=True)  # PUBACKed by A
        late = Client(b.port, f"late{i}")  # at once, on B
        clients.append(late)
        late.subscribe(topic, 1)
        got = late.wait_messages(1)
        assert [(m.topic, bytes(m.payload), m.retain) for m in got] == [
            (topic, f"kept {i}".encode(), True)
        ]
        late.disconnect()
    setter.publish("r/0", "", 1, retain=True)  # deleted through A
    late = Client(b.port, "after-delete")
    clients.append(late)
    late.subscribe("r/#", 1)
    got = late.wait_messages(19)
    assert sorted(m.topic for m in got) == sorted(f"r/{i}" for i in range(1, 20))


def test_a_burst_of_connects_shares_state_log_messages(nodes: Nodes) -> None:
    """Each CONNECT writes its session's record before CONNACK; records made while a state
    send is in flight join one message (group commit), so a fleet reconnecting at once (a
    node died) costs a few round trips, not one per device."""
    a = nodes.start()
    state = encode_lmq(STATE_QUEUE, nodes.topic)

    async def state_end() -> int:
        client = RemotingClient([nodes.namesrv], client_id=None, request_timeout=5.0)
        try:
            info = await client.get_cluster_info()
            addr = info.brokers[nodes.broker].master_addr
            assert addr is not None
            return await client.get_max_offset(addr, state)
        finally:
            await client.close()

    before = asyncio.run(state_end())
    socks = [RawClient(a.port, level=4) for _ in range(60)]
    try:
        for i, sock in enumerate(socks):  # all CONNECTs on the wire before any CONNACK
            sock.send(Connect(4, f"burst-{i}", False, 60))
        assert all(s.recv().reason_code == 0 for s in socks)
    finally:
        for sock in socks:
            sock.close()
    assert nodes.session_record("burst-0") is not None
    assert nodes.session_record("burst-59") is not None
    written = asyncio.run(state_end()) - before
    assert 0 < written < 30, f"{written} state messages for 60 CONNECTs"


def test_three_racing_connects_resume_from_the_latest_holder(
    nodes: Nodes, clients: list[Client]
) -> None:
    """A persistent QoS 2 session on A; A stalls (SIGSTOP, within its lease), the client
    connects on B (B's claim waits for A's hand-over), then on C, whose node still sees A's
    record (B has written none). Once A runs again the session goes A -> B -> C: A hands it to
    B only, B (superseded by C's claim) resumes it, is closed with 0x8E and hands it on, and
    C resumes what B left (gateway/cluster/handover.py): never A's older state beside B's.
    Every message published meanwhile reaches the client once, on C (the client stopped
    reading its connection to A when it moved on)."""
    a = nodes.start(node_id="n1")
    b = nodes.start(node_id="n2")
    c = nodes.start(node_id="n3")

    def session(port: int, connect: bool = True) -> Client:
        made = Client(port, "three", v5=True, clean=False, session_expiry=3600, connect=connect)
        clients.append(made)
        return made

    pub = Client(c.port, "three-pub")
    clients.append(pub)
    first = session(a.port)
    first.c.reconnect_delay_set(60, 120)  # told 0x8E, it must not come back within the test
    assert first.subscribe("three/#", 2) == [2]
    for payload in (b"m0", b"m1"):
        pub.publish("three/t", payload, 2)
    first.wait_messages(2)
    # The client has moved on: it reads its connection to A no more. Running again, A may
    # send m2..m4 there before it reads B's claim (that broker answer races A's QoS 2 state
    # write); had `first` answered PUBREC, the session would move on with them at their
    # PUBREL stage and C re-send only the PUBRELs (MQTT-4.4.0-1), which `third`, a client
    # object without `first`'s state, never counts as messages.
    first.c.loop_stop()
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        for payload in (b"m2", b"m3", b"m4"):  # for B, then C, to deliver
            pub.publish("three/t", payload, 2)
        second = session(b.port, connect=False)
        second.c.reconnect_delay_set(60, 120)
        second.connect(wait=False)

        def claims() -> list[object]:
            return [r["n"] for r in nodes.bus_records("conn") if r["c"] == "three"]

        wait_until(lambda: "n2" in claims(), 20, "B's claim on the bus")
        third = session(c.port, connect=False)
        third.connect(wait=False)
        wait_until(lambda: "n3" in claims(), 20, "C's claim on the bus")
        assert claims()[-2:] == ["n2", "n3"]
    finally:
        a.proc.send_signal(signal.SIGCONT)
    third.wait_for(lambda: third.connack is not None, 30, "C's CONNACK")
    assert third.connack == (True, 0)
    got = third.wait_messages(3, timeout=30)
    assert sorted(bytes(m.payload) for m in got) == [b"m2", b"m3", b"m4"]
    wait_until(lambda: any("handed over to node n3" in line for line in b.output), 10, "B's hand")
    assert not any("handed over to node n3" in line for line in a.output)
    # Once: the takeover's close ends A's connection, which hands the session as it stands;
    # the same claim read next must not hand A's last record of it after that.
    assert sum("handed over to node n2" in line for line in a.output) == 1, a.output
    everything = [p for cl in (first, second, third) for p in cl.payloads()]
    assert sorted(everything) == [b"m0", b"m1", b"m2", b"m3", b"m4"], everything
