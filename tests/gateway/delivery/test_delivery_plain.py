"""The delivery loop's plain send paths (gateway/delivery/send.py: the plain run and the plain
path of `Sender._deliver`) send exactly what the general path (`decide` + `send`) sends: the
same bytes, packet ids and flags, for MQTT 3.1.1 and 5, QoS 0 and 1, retained messages,
no-local and a fan-out (the encoded-packet cache). Each level runs twice on one gateway, once
with the plain paths turned off for the subscribers (`_plain = False`, what an ACL or a
topic-alias maximum does), and the wire must not tell them apart."""

from __future__ import annotations

import pytest

from gateway.connection.client import ClientConnection
from gateway.delivery import run as delivery
from gateway.protocol import PubAck, Publish, Subscribe, Subscription, encode
from tests.gateway.conftest import GatewayHarness, RawClient

# (topic, payload, qos, retain, published by the first subscriber itself). Subscriber 0 reads
# "<prefix>/#", subscriber 1 "<prefix>/t/#": "t/..." is a fan-out (two queues, the encoded
# packet cached), "solo" is read by one loop from one queue (encoded without the cache).
TRAFFIC = [
    ("t/a", b"zero", 0, False, False),
    ("t/a", b"one", 1, False, False),
    ("solo", b"solo-1", 1, False, False),
    ("t/b", b"retained", 1, True, False),
    ("t/c", b"mine", 1, False, True),  # not back to its publisher with no-local (MQTT 5)
    ("t/d", b"q0-retained", 0, True, False),
    ("solo", b"solo-0", 0, False, False),
    ("t/a", b"last", 1, False, False),
]
FILTERS = ["#", "t/#"]


def _expected(level: int) -> list[int]:
    """How many PUBLISHes each subscriber receives."""
    first = sum(1 for *_, own in TRAFFIC if not (own and level == 5))
    second = sum(1 for topic, *_ in TRAFFIC if topic.startswith("t/"))
    return [first, second]


def _subscriber(gateway: GatewayHarness, level: int, cid: str, topic_filter: str) -> RawClient:
    c = RawClient(gateway.port, level)
    c.connect(cid)
    options = {"no_local": True, "retain_as_published": True} if level == 5 else {}
    c.send(Subscribe(1, [Subscription(topic_filter, 1, **options)]))
    c.recv()  # SUBACK
    return c


def _set_plain(gateway: GatewayHarness, client_ids: list[str], plain: bool) -> None:
    gw = gateway.gw
    assert gw is not None

    async def switch() -> int:
        n = 0
        for conn in list(gw.connections):
            assert isinstance(conn, ClientConnection)
            if conn.client_id in client_ids:
                # Started now rather than at the first message (gateway/delivery/loop.py,
                # "Standby"), as that message would start it.
                loop = conn.ctx.packets.subscribe.delivery_loop(conn)
                assert loop._plain, "the fixture's connections must allow the plain path"
                loop._plain = plain
                n += 1
        return n

    assert gateway.run(switch()) == len(client_ids)


def _run(gateway: GatewayHarness, level: int, plain: bool) -> list[list[bytes]]:
    prefix = f"{'plain' if plain else 'general'}{level}/"
    ids = [f"{prefix}s0", f"{prefix}s1"]
    subs = [
        _subscriber(gateway, level, cid, prefix + f) for cid, f in zip(ids, FILTERS, strict=True)
    ]
    _set_plain(gateway, ids, plain)
    pub = RawClient(gateway.port, level)
    pub.connect(f"{prefix}pub")
    # PUBLISHes a subscriber received while it waited for the PUBACK of its own.
    early: list[list[Publish]] = [[] for _ in subs]
    for n, (topic, payload, qos, retain, own) in enumerate(TRAFFIC, start=1):
        sender = subs[0] if own else pub
        sender.send(Publish(prefix + topic, payload, qos, retain, packet_id=n if qos else None))
        # Stored before the next one (one order in both runs: the publish before the
        # subscriber's own is QoS 1, and so is its own).
        while qos:
            ev = sender.recv()
            if isinstance(ev, PubAck):
                break
            assert isinstance(ev, Publish) and own, ev
            early[0].append(ev)
    received: list[list[bytes]] = []
    for i, (c, want) in enumerate(zip(subs, _expected(level), strict=True)):
        got: list[bytes] = []
        while len(got) < want:
            ev = early[i].pop(0) if early[i] else c.recv()
            assert ev is not None, f"closed after {got}"
            if not isinstance(ev, Publish):
                continue
            # The runs differ in the topics' prefix: everything else must be the same bytes.
            ev.topic = ev.topic.removeprefix(prefix)
            got.append(encode(ev, level))
            if ev.qos:
                c.send(PubAck(ev.packet_id or 0))
        received.append(got)
    for c in [*subs, pub]:
        c.sock.close()
    return received


@pytest.mark.parametrize("run", ["loaded", "reference"])
@pytest.mark.parametrize("level", [4, 5])
def test_the_plain_path_sends_what_the_general_path_sends(
    gateway: GatewayHarness, level: int, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loaded`: the plain runs as the gateway loads them (the C `plain_run` when built);
    `reference`: its Python reference, `plain_run_py`."""
    if run == "reference":
        monkeypatch.setattr(delivery, "PLAIN_RUN", delivery.plain_run_py)
    plain = _run(gateway, level, plain=True)
    general = _run(gateway, level, plain=False)
    assert plain == general
    assert [len(got) for got in plain] == _expected(level)
    assert any(b"mine" in p for p in plain[1])  # no-local drops it for its publisher only
    assert any(b"mine" in p for p in plain[0]) == (level != 5)
