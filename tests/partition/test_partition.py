"""Cluster mode under network partitions: real `lmqtt serve` processes in network namespaces,
cut off from the brokers or from their clients by setting a veth link down
(tests/partition/netns.py), on a real RocketMQ cluster in a namespace of its own.

Every node runs with a short lease (LEASE_S) so that a cut node fences within seconds. The
clients are raw MQTT 5 clients in the test process (the root namespace) that follow the
receiver's rules of MQTT 4.3.3 (`Receiver`), so a QoS 2 message delivered twice is seen as
such, whatever the packet ids.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gateway.protocol import (
    ConnAck,
    Disconnect,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
)
from gateway.protocol import Properties as PProperties
from gateway.storage.rocketmq.broker import PULL_GROUP
from gateway.storage.rocketmq.fences import Fences
from gateway.storage.rocketmq.names import encode_lmq
from gateway.storage.rocketmq.state import NODE_PROPERTY, SNAPSHOT_PROPERTY
from rocketmq_remoting import RemotingClient
from tests.gateway.conftest import RawClient, wait_until
from tests.partition.netns import Network
from tests.rocketmq.cluster import RocketMQCluster
from tests.rocketmq.test_cluster_sessions import Nodes
from tests.rocketmq.test_gateway_rocketmq import ServeProcess
from topicmap.rocketmq import STATE_QUEUE, decode_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LEASE_S = 5.0
HEARTBEAT_S = 1.0
SERVER_SHUTTING_DOWN = 0x8B
FENCED = r"could not renew its lease .*: fenced"
LOST = r"cluster: node \S+ lost"


class NetNodes(Nodes):
    """Cluster-mode gateways, node `i` in namespace node<i>, listening on its client link."""

    def __init__(self, rmq: RocketMQCluster, net: Network, tmp_path: Path) -> None:
        super().__init__(rmq, tmp_path)
        self.net = net
        self.by_ns: dict[int, ServeProcess] = {}

    def start_pair(self) -> tuple[ServeProcess, ServeProcess]:
        """Nodes 1 and 2, started at the same time (as a deployment starts them)."""
        started: dict[int, ServeProcess] = {}
        threads = [
            threading.Thread(target=lambda i=i: started.update({i: self.start_in(i)}))
            for i in (1, 2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(started) == {1, 2}, "a node did not start"
        return started[1], started[2]

    def start_in(self, i: int) -> ServeProcess:
        g = ServeProcess(
            self.tmp_path / f"node{i}",
            "--store", "rocketmq", "--namesrv", self.namesrv, "--host", self.net.node_host(i),
            env={
                "LMQTT_ROCKETMQ_TOPIC": self.topic,
                "LMQTT_ROCKETMQ_BROKER": self.broker,
                "LMQTT_CLUSTER": "true",
                "LMQTT_CLUSTER_LEASE": str(LEASE_S),
                "LMQTT_CLUSTER_HEARTBEAT": str(HEARTBEAT_S),
                # A listener off loopback refuses anonymous clients unless told otherwise.
                "LMQTT_ALLOW_ANONYMOUS": "true",
            },
            wrap=self.net.wrap(f"node{i}"),
        )  # fmt: skip
        self.nodes.append(g)
        self.by_ns[i] = g
        return g.start()

    def client(self, i: int) -> RawClient:
        return RawClient(self.by_ns[i].port, level=5, host=self.net.node_host(i))


@pytest.fixture
def nodes(rmq: RocketMQCluster, net: Network, tmp_path: Path) -> Iterator[NetNodes]:
    made = NetNodes(rmq, net, tmp_path)
    try:
        yield made
    finally:
        net.heal_all()  # first: a fenced node still stopping finishes its writes at once
        made.stop()


def logged_at(node: ServeProcess, pattern: str) -> float | None:
    """When (epoch seconds, from the line's UTC timestamp) `node` first logged a line
    matching `pattern`; None: not (yet)."""
    for line in list(node.output):
        if re.search(pattern, line):
            stamp = line.split(" ", 1)[0]
            return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    return None


def node_id(node: ServeProcess) -> str:
    for line in list(node.output):
        m = re.search(r"cluster: node (\S+) joined; live nodes", line)
        if m:
            return m.group(1)
    raise AssertionError("no join line:\n" + "".join(node.output))


class Receiver:
    """A persistent MQTT 5 session on raw sockets that receives as MQTT 4.3.3 says: a QoS 2
    PUBLISH is delivered (to `delivered`) unless its packet id is held, i.e. PUBREC was sent for
    it and no PUBREL came yet; PUBREL releases the id. The held ids are session state: they
    survive a reconnect, as they must."""

    def __init__(self, client_id: str, expiry: int = 300, keep_alive: int = 60) -> None:
        self.client_id = client_id
        self.expiry = expiry
        self.keep_alive = keep_alive
        self.raw: RawClient | None = None
        self.held: set[int] = set()
        self.delivered: list[bytes] = []
        self.disconnect: Disconnect | None = None
        self.closed = False

    def connect(self, raw: RawClient) -> ConnAck:
        if self.raw is not None:
            self.raw.close()
        self.raw, self.closed, self.disconnect = raw, False, None
        props = PProperties(session_expiry_interval=self.expiry)
        ack = raw.connect(self.client_id, clean=False, keep_alive=self.keep_alive, properties=props)
        assert isinstance(ack, ConnAck) and ack.reason_code == 0, ack
        return ack

    def subscribe(self, topic_filter: str, qos: int) -> None:
        assert self.raw is not None
        self.raw.send(Subscribe(1, [Subscription(topic_filter, qos)]))
        ev = self.raw.recv()
        assert isinstance(ev, SubAck) and ev.reason_codes == [qos], ev

    def handle(self, ev: Any) -> None:
        raw = self.raw
        assert raw is not None
        if ev is None:
            self.closed = True
        elif isinstance(ev, Disconnect):
            self.disconnect = ev
        elif isinstance(ev, Publish):
            if ev.qos == 2:
                assert ev.packet_id is not None
                if ev.packet_id not in self.held:
                    self.delivered.append(ev.payload)
                    self.held.add(ev.packet_id)
                raw.send(PubRec(ev.packet_id))
            else:
                self.delivered.append(ev.payload)
                if ev.qos == 1:
                    assert ev.packet_id is not None
                    raw.send(PubAck(ev.packet_id))
        elif isinstance(ev, PubRel):
            self.held.discard(ev.packet_id)
            raw.send(PubComp(ev.packet_id))
        else:
            raise AssertionError(f"unexpected {ev}")

    def pump(self, until: Callable[[], bool], timeout: float, what: str) -> None:
        """Handle what arrives until `until()` holds (AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                raise AssertionError(
                    f"{self.client_id}: {what} not seen (closed={self.closed}); "
                    f"delivered {self.delivered}"
                )
            assert self.raw is not None
            try:
                self.handle(self.raw.recv(min(left, 0.5)))
            except TimeoutError:
                pass

    def quiet(self, seconds: float) -> None:
        """Handle whatever arrives for `seconds` (a check that nothing more comes)."""
        deadline = time.monotonic() + seconds
        assert self.raw is not None
        while (left := deadline - time.monotonic()) > 0 and not self.closed:
            try:
                self.handle(self.raw.recv(left))
            except TimeoutError:
                return


def publish_qos2(raw: RawClient, topic: str, payload: bytes, packet_id: int) -> None:
    """The whole QoS 2 flow of one PUBLISH (publisher side)."""
    raw.send(Publish(topic, payload, qos=2, packet_id=packet_id))
    assert raw.recv() == PubRec(packet_id)
    raw.send(PubRel(packet_id))
    assert raw.recv() == PubComp(packet_id)


def publisher(raw: RawClient, client_id: str) -> RawClient:
    props = PProperties(session_expiry_interval=300)
    ack = raw.connect(client_id, clean=False, properties=props)
    assert isinstance(ack, ConnAck) and ack.reason_code == 0, ack
    return raw


def test_a_node_cut_from_the_brokers_fences_and_its_clients_resume_elsewhere(
    nodes: NetNodes, net: Network
) -> None:
    """Node 1 loses the brokers, not its clients: it fences within its lease and before node 2
    declares it lost (no PUBREC for the PUBLISH it cannot store, its connections closed with
    0x8B); its publisher and subscriber resume on node 2. Nothing
    acknowledged is lost, and the QoS 2 PUBLISH re-sent through node 2 is stored once: the
    QoS 2 subscriber on node 2 gets every message exactly once."""
    a, b = nodes.start_pair()
    watcher = Receiver("w-cut")  # on the node that stays: counts what was stored
    watcher.connect(nodes.client(2))
    watcher.subscribe("p/#", 2)
    sub = Receiver("s-cut")  # on the node that is cut: resumes on node 2, QoS 1
    sub.connect(nodes.client(1))
    sub.subscribe("p/#", 1)
    pub = publisher(nodes.client(1), "p-cut")
    before = [f"m{i}".encode() for i in range(5)]
    for i, payload in enumerate(before):
        publish_qos2(pub, "p/t", payload, i + 1)
    sub.pump(lambda: len(sub.delivered) >= len(before), 20, "m0..m4")

    cut_at = time.time()
    net.cut("b1")
    # Sent after the cut: the node cannot store it, so it never answers PUBREC.
    pub.send(Publish("p/t", b"m5", qos=2, packet_id=6))
    ev = pub.recv(LEASE_S + 10)
    assert ev == Disconnect(SERVER_SHUTTING_DOWN), ev
    sub.pump(lambda: sub.disconnect is not None, LEASE_S + 10, "the fenced node's DISCONNECT")
    assert sub.disconnect is not None and sub.disconnect.reason_code == SERVER_SHUTTING_DOWN
    wait_until(lambda: logged_at(a, FENCED) is not None, 10, "the fenced line")
    fenced_at = logged_at(a, FENCED)
    assert fenced_at is not None
    assert fenced_at - cut_at <= LEASE_S, f"fenced {fenced_at - cut_at:.1f} s after the cut"
    # The survivor declares it lost only after it fenced.
    wait_until(lambda: logged_at(b, LOST) is not None, 2 * LEASE_S, "node 1 lost")
    lost_at = logged_at(b, LOST)
    assert lost_at is not None and lost_at >= fenced_at

    # Both clients resume on node 2; the publisher re-sends the PUBLISH never acknowledged.
    pub = RawClient(b.port, level=5, host=net.node_host(2))
    ack = pub.connect("p-cut", clean=False, properties=PProperties(session_expiry_interval=300))
    assert ack.reason_code == 0 and ack.session_present, ack
    pub.send(Publish("p/t", b"m5", qos=2, packet_id=6, dup=True))
    assert pub.recv() == PubRec(6)
    pub.send(PubRel(6))
    assert pub.recv() == PubComp(6)
    assert sub.connect(nodes.client(2)).session_present
    publish_qos2(pub, "p/t", b"m6", 7)
    everything = [*before, b"m5", b"m6"]
    sub.pump(lambda: b"m6" in sub.delivered, 20, "m6")
    watcher.pump(lambda: b"m6" in watcher.delivered and not watcher.held, 20, "m6 completed")
    watcher.quiet(0.5)
    assert watcher.delivered == everything
    # QoS 1: at least once (what it acknowledged on node 1 after its last commit comes again).
    assert set(sub.delivered) == set(everything), sub.delivered
    # Still cut, the fenced node takes ~10-15 s to exit (its stop waits for its state writes to
    # time out); its exit status is checked once the cut heals (the rejoin test).
    for c in (pub, sub.raw, watcher.raw):
        assert c is not None
        c.close()


def test_a_qos2_message_completed_through_a_cut_node_is_not_delivered_again(
    nodes: NetNodes, net: Network
) -> None:
    """The QoS 2 flow of a message to a subscriber on node 1 straddles the cut: PUBLISH before,
    PUBREC after (node 1 still reaches its client, not the brokers). Node 1 cannot record the
    PUBREC, so it sends no PUBREL; node 2, where the session resumes, sends the PUBLISH again
    with its packet id (a duplicate the client recognises) and completes it. Exactly once: the
    message is delivered once, whichever node sends the PUBREL."""
    _, b = nodes.start_pair()
    sub = Receiver("s-straddle")
    sub.connect(nodes.client(1))
    sub.subscribe("q/#", 2)
    pub = publisher(nodes.client(2), "p-straddle")
    publish_qos2(pub, "q/t", b"q0", 1)
    assert sub.raw is not None
    first = sub.raw.recv()
    assert isinstance(first, Publish) and first.payload == b"q0", first
    sub.delivered.append(first.payload)  # held: PUBREC not sent yet
    assert first.packet_id is not None
    sub.held.add(first.packet_id)
    net.cut("b1")
    sub.raw.send(PubRec(first.packet_id))
    sub.pump(lambda: sub.disconnect is not None or sub.closed, LEASE_S + 10, "node 1's DISCONNECT")
    wait_until(lambda: logged_at(b, LOST) is not None, 2 * LEASE_S, "node 1 lost")
    assert sub.connect(nodes.client(2)).session_present
    publish_qos2(pub, "q/t", b"q1", 2)
    sub.pump(lambda: b"q1" in sub.delivered and not sub.held, 20, "q1 completed")
    sub.quiet(0.5)
    pub.close()
    sub.raw.close()
    assert sub.delivered == [b"q0", b"q1"]


def test_a_qos2_publish_stored_but_not_acknowledged_before_a_cut_is_stored_once(
    nodes: NetNodes, net: Network
) -> None:
    """Node 1 loses only the brokers' answers: the QoS 2 PUBLISH it forwards is stored, but it
    never learns so and never answers PUBREC. Re-sent through node 2 after node 1 fenced (DUP,
    same packet id), it is found in the parent topic from the position node 1's last record of
    the session gave (`qos2_since`, gateway/session/qos2.py), acknowledged and not stored again:
    the subscriber gets it once."""
    _, b = nodes.start_pair()
    watcher = Receiver("w-oneway")
    watcher.connect(nodes.client(2))
    watcher.subscribe("o/#", 2)
    pub = publisher(nodes.client(1), "p-oneway")
    publish_qos2(pub, "o/t", b"o0", 1)
    net.drop_replies("b1")
    pub.send(Publish("o/t", b"o1", qos=2, packet_id=2))
    ev = pub.recv(LEASE_S + 10)
    assert ev == Disconnect(SERVER_SHUTTING_DOWN), ev  # fenced, never PUBREC
    wait_until(lambda: logged_at(b, LOST) is not None, 3 * LEASE_S, "node 1 lost")
    pub = RawClient(b.port, level=5, host=net.node_host(2))
    ack = pub.connect("p-oneway", clean=False, properties=PProperties(session_expiry_interval=300))
    assert ack.reason_code == 0 and ack.session_present, ack
    pub.send(Publish("o/t", b"o1", qos=2, packet_id=2, dup=True))
    assert pub.recv() == PubRec(2)
    # Recognised in the log (gateway/session/qos2.py), not stored again.
    assert logged_at(b, r"'p-oneway': QoS 2 PUBLISH 2 resent after an unknown outcome") is not None
    pub.send(PubRel(2))
    assert pub.recv() == PubComp(2)
    publish_qos2(pub, "o/t", b"o2", 3)
    watcher.pump(lambda: b"o2" in watcher.delivered and not watcher.held, 20, "o2 completed")
    watcher.quiet(0.5)
    pub.close()
    assert watcher.raw is not None
    watcher.raw.close()
    assert watcher.delivered == [b"o0", b"o1", b"o2"]


def test_a_node_cut_from_its_clients_keeps_the_brokers_and_sessions_follow_their_expiry(
    nodes: NetNodes, net: Network
) -> None:
    """Node 1 loses its clients, not the brokers: it stays in the cluster (no fencing). A
    session whose client reconnects through node 2 moves there with its message sent during
    the cut; a session whose client does not come back expires after its keep-alive and its
    expiry, on every node."""
    a, b = nodes.start_pair()
    mover = Receiver("y-move")
    mover.connect(nodes.client(1))
    mover.subscribe("y/#", 1)
    gone = Receiver("x-gone", expiry=2, keep_alive=2)
    gone.connect(nodes.client(1))
    gone.subscribe("x/#", 1)
    pub = publisher(nodes.client(2), "p-clients")
    pub.send(Publish("y/t", b"y0", qos=1, packet_id=1))
    assert pub.recv() == PubAck(1)
    mover.pump(lambda: mover.delivered == [b"y0"], 20, "y0")

    net.cut("c1")
    # Published while the mover's connection on node 1 is cut: node 1 sends it into the cut.
    pub.send(Publish("y/t", b"y1", qos=1, packet_id=2))
    assert pub.recv() == PubAck(2)
    assert mover.connect(nodes.client(2)).session_present
    mover.pump(lambda: b"y1" in mover.delivered, 20, "y1 on node 2")
    pub.send(Publish("y/t", b"y2", qos=1, packet_id=3))
    assert pub.recv() == PubAck(3)
    mover.pump(lambda: b"y2" in mover.delivered, 20, "y2 on node 2")
    assert mover.delivered == [b"y0", b"y1", b"y2"]

    # The other session: disconnected once 1.5 x its keep-alive passed, deleted 2 s later.
    nodes.wait_record("x-gone", lambda r: r.get("disconnected_at_ms") is not None, 20)
    nodes.wait_record("x-gone", None, 20)
    late = RawClient(b.port, level=5, host=net.node_host(2))
    ack = late.connect("x-gone", clean=False, properties=PProperties(session_expiry_interval=9))
    assert ack.reason_code == 0 and not ack.session_present, ack
    late.close()
    # Node 1 kept its lease all along, and serves clients again once the cut heals.
    assert a.proc is not None and a.proc.poll() is None
    assert logged_at(a, FENCED) is None and logged_at(b, LOST) is None
    net.heal("c1")
    again = Receiver("y-back")
    again.connect(nodes.client(1))
    again.subscribe("y/#", 1)
    pub.send(Publish("y/t", b"y3", qos=1, packet_id=4))
    assert pub.recv() == PubAck(4)
    again.pump(lambda: again.delivered == [b"y3"], 20, "y3 on node 1")
    mover.pump(lambda: b"y3" in mover.delivered, 20, "y3 on node 2")
    for c in (pub, again.raw, mover.raw):
        assert c is not None
        c.close()


def state_log(nodes: NetNodes) -> list[tuple[int, dict[str, str], list[Any]]]:
    """Every batch of the state log, in log order: (its offset, its properties, its records)."""

    async def read() -> list[tuple[int, dict[str, str], list[Any]]]:
        client = RemotingClient([nodes.namesrv], client_id=None, request_timeout=5.0)
        out: list[tuple[int, dict[str, str], list[Any]]] = []
        try:
            route = await client.get_cluster_info()
            addr = route.brokers[nodes.broker].master_addr
            assert addr is not None
            lmq = encode_lmq(STATE_QUEUE, nodes.topic)
            offset = await client.get_min_offset(addr, lmq)
            end = await client.get_max_offset(addr, lmq)
            while offset < end:
                res = await client.pull(addr, lmq, offset, consumer_group=PULL_GROUP)
                if not res.messages:
                    break
                for rec in res.messages:
                    at = rec.light_queue_offsets().get(lmq, offset)
                    props = {**rec.properties, "store_ms": str(rec.store_timestamp)}
                    out.append((at, props, decode_state(rec.body)[0]))
                    offset = at + 1
                offset = res.next_begin_offset
            return out
        finally:
            await client.close()

    return asyncio.run(read())


def cut_until_lost(nodes: NetNodes, net: Network, a: ServeProcess, b: ServeProcess) -> int:
    """Cut node 1 (`a`) from the brokers until it fenced and node 2 (`b`) declared it lost,
    then heal the cut; when (epoch ms) node 2 declared it lost."""
    net.cut("b1")
    wait_until(lambda: logged_at(a, FENCED) is not None, LEASE_S + 10, "node 1 fenced")
    wait_until(lambda: logged_at(b, LOST) is not None, 2 * LEASE_S, "node 1 lost")
    net.heal("b1")
    return int((logged_at(b, LOST) or 0) * 1000)


def test_a_fenced_node_restarts_after_the_cut_heals_and_rejoins(
    nodes: NetNodes, net: Network
) -> None:
    """The cut heals once node 1 fenced and node 2 declared it lost: node 1's session resumes on
    node 2, node 1 exits (status 1) and, started again (a new node id), rejoins the cluster:
    each node routes the other's publishes to its subscribers."""
    a, b = nodes.start_pair()
    old = node_id(a)
    mover = Receiver("r-move")
    mover.connect(nodes.client(1))
    mover.subscribe("j/#", 1)
    cut_until_lost(nodes, net, a, b)
    assert mover.connect(nodes.client(2)).session_present
    assert a.proc is not None and a.proc.wait(30) == 1
    a.start()
    new = node_id(a)
    assert new != old
    wait_until(lambda: logged_at(b, rf"cluster: node {re.escape(new)} joined") is not None,
               10, "the join seen by node 2")  # fmt: skip
    on_a = Receiver("r-rejoined")
    on_a.connect(nodes.client(1))
    on_a.subscribe("j/#", 1)
    for node in (1, 2):
        pub = publisher(nodes.client(node), f"p-rejoin-{node}")
        pub.send(Publish("j/t", f"from{node}".encode(), qos=1, packet_id=1))
        assert pub.recv() == PubAck(1), node
        pub.close()
    for r in (on_a, mover):
        r.pump(lambda r=r: len(r.delivered) >= 2, 20, "both nodes' messages")  # type: ignore[misc]
        assert sorted(r.delivered) == [b"from1", b"from2"]
        assert r.raw is not None
        r.raw.close()


def test_the_state_writes_of_a_fenced_node_stored_after_its_loss_are_ignored(
    nodes: NetNodes, net: Network
) -> None:
    """The state writes node 1 makes while it stops (its connections' disconnect records) wait
    in its TCP send buffers and land once the cut heals, after node 2 declared it lost: none is
    applied. Node 2's fence marker naming node 1 is in the log before any of them, and the
    readers' rule (gateway/storage/rocketmq/fences.py: a fenced node's batches after the first
    marker naming it are dropped, by every tail, replay and compaction) drops each of them; the
    session's newest record as every reader has it is not node 1's late one."""
    a, b = nodes.start_pair()
    old = node_id(a)
    stays = Receiver("r-stale")
    stays.connect(nodes.client(1))
    stays.subscribe("k/#", 1)
    lost_ms = cut_until_lost(nodes, net, a, b)
    assert a.proc is not None and a.proc.wait(30) == 1
    fences = Fences()
    late: list[tuple[int, bool]] = []  # node 1's batches stored after the loss: (offset, applied)
    newest: tuple[str, int] | None = None  # the session record as readers apply it
    for at, props, records in state_log(nodes):
        writer = props.get(NODE_PROPERTY, "")
        applied = fences.admits(writer, at, snapshot=SNAPSHOT_PROPERTY in props)
        if writer == old and int(props["store_ms"]) >= lost_ms:
            late.append((at, applied))
        if not applied:
            continue
        fences.read(records, at)
        if any(key == "session/r-stale" for key, _value in records):
            newest = (writer, at)
    assert old in fences.at, "no fence marker for the lost node"
    assert not [at for at, applied in late if applied], (
        f"node 1's records stored after it was declared lost and applied: {late}; "
        f"its marker at {fences.at[old]}"
    )
    assert newest is not None and not (newest[0] == old and newest[1] >= fences.at[old]), newest
