"""ACL parser and matcher (pure): Mosquitto syntax, deny precedence, patterns, the $ rule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.access.acl import AclError, AclRules, ClientAccess, filter_covers, topic_matches
from gateway.protocol import Publish, PubRec
from tests.gateway.conftest import Client, GatewayHarness, RawClient, wait_until

ACL = """
# anonymous clients
topic read public/#

user alice
topic readwrite alice/#
topic deny alice/secret
topic sensors/+/t
topic write cmd/all

user bob
topic read sensors/#

pattern read devices/%c/cmd
pattern write devices/%u/state/#
"""


def access(client_id: str, user: str | None) -> ClientAccess:
    return ClientAccess(AclRules.parse(ACL), client_id, user)


@pytest.mark.parametrize(
    ("flt", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("#", "a", True),
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("a/+/c", "a//c", True),
        ("a/b", "a/b/", False),
    ],
)
def test_topic_matches(flt: str, topic: str, expected: bool) -> None:
    assert topic_matches(flt, topic) is expected


@pytest.mark.parametrize(
    ("outer", "inner", "expected"),
    [
        ("a/#", "a/+/c", True),
        ("a/#", "a/#", True),
        ("a/#", "#", False),
        ("a/+", "a/b", True),
        ("a/+", "a/+", True),
        ("a/+", "a/#", False),
        ("a/b", "a/+", False),
        ("#", "$SYS/#", False),
        ("+/#", "+/x", True),
        ("a/+/c", "a/b/c", True),
    ],
)
def test_filter_covers(outer: str, inner: str, expected: bool) -> None:
    assert filter_covers(outer, inner) is expected


LEVEL = st.sampled_from(["a", "b", "", "$x"])
TOPIC = st.lists(LEVEL, min_size=1, max_size=4).map("/".join)
FILTER = st.lists(st.sampled_from(["a", "b", "", "+"]), min_size=1, max_size=4).flatmap(
    lambda levels: st.sampled_from(["/".join(levels), "/".join([*levels, "#"])])
)


@settings(max_examples=150, deadline=None)
@given(FILTER, FILTER, TOPIC)
def test_covers_is_consistent_with_matching(outer: str, inner: str, topic: str) -> None:
    # If outer covers inner, nothing inner matches may escape outer.
    if filter_covers(outer, inner) and topic_matches(inner, topic):
        assert topic_matches(outer, topic)


def test_user_rules() -> None:
    a = access("c1", "alice")
    assert a.may_write("alice/x") and a.may_read("alice/x/y")
    assert not a.may_read("alice/secret") and not a.may_write("alice/secret")
    assert a.may_read("sensors/1/t") and a.may_write("sensors/1/t")  # no word = readwrite
    assert a.may_write("cmd/all") and not a.may_read("cmd/all")
    assert not a.may_read("public/news")  # anonymous rules are not alice's
    assert not a.may_write("bob/x")


def test_subscribe_needs_a_covering_read_grant() -> None:
    a = access("c1", "alice")
    assert a.may_subscribe("alice/#")  # covered; the deny is enforced per message
    assert a.may_subscribe("sensors/+/t")
    assert not a.may_subscribe("sensors/#")
    assert not a.may_subscribe("#")
    assert not a.may_subscribe("alice/secret")  # wholly inside a deny rule
    assert not a.may_subscribe("cmd/all")  # write-only


def test_anonymous_and_patterns() -> None:
    anon = access("dev7", None)
    assert anon.may_read("public/a") and anon.may_subscribe("public/#")
    assert not anon.may_write("public/a")
    assert anon.may_read("devices/dev7/cmd")  # %c pattern applies to anonymous too
    assert not anon.may_write("devices/dev7/state/x")  # %u pattern: no user name
    bob = access("dev8", "bob")
    assert bob.may_read("devices/dev8/cmd") and not bob.may_read("devices/dev7/cmd")
    assert bob.may_write("devices/bob/state/temp")
    assert not bob.may_write("devices/alice/state/temp")


@pytest.mark.parametrize("cid", ["+", "#", "a/b", ""])
def test_wildcard_identities_never_widen_patterns(cid: str) -> None:
    a = access(cid, "bob")
    assert not a.may_read("devices/x/cmd")
    assert not a.may_subscribe("devices/+/cmd")
    assert not access("c", "a/b").may_write("devices/a/b/state/x")


def test_parse_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(AclError, match="line 2"):
        AclRules.parse("topic a\nfrobnicate x\n")
    with pytest.raises(AclError, match=r"line 1.*'#'"):
        AclRules.parse("topic read a/#/b\n")
    with pytest.raises(AclError, match=r"'\+'"):
        AclRules.parse("topic read a+/b\n")
    with pytest.raises(AclError, match="user name"):
        AclRules.parse("user\n")
    with pytest.raises(AclError, match="missing topic"):
        AclRules.parse("topic\n")
    with pytest.raises(AclError, match="no such file"):
        AclRules.load(tmp_path / "missing")
    path = tmp_path / "acl"
    path.write_text(ACL)
    assert set(AclRules.load(path).users) == {"alice", "bob"}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_parser_only_raises_acl_error(text: str) -> None:
    try:
        rules = AclRules.parse(text)
    except AclError:
        return
    ClientAccess(rules, "c", "u").may_read("a/b")


# ---------------------------------------------------------------- against a running gateway

E2E_ACL = """
user alice
topic readwrite sensors/#
topic write cmd/#

user bob
topic read sensors/#
topic deny sensors/secret
topic write bob/out

pattern readwrite devices/%c/#
"""


def _user(port: int, user: str, *, v5: bool, client_id: str = "") -> Client:
    c = Client(port, client_id, v5=v5, connect=False)
    c.c.username_pw_set(user, None)
    c.connect()
    assert c.connack == (False, 0)
    return c


def _ack_codes(c: Client) -> dict[int, int]:
    """Record the reason code of every PUBACK/PUBREC paho reports (mid -> code)."""
    codes: dict[int, int] = {}

    def on_publish(_c: Any, _u: Any, mid: int, rc: Any, _props: Any = None) -> None:
        codes[mid] = int(rc.value)
        c.acked.add(mid)

    c.c.on_publish = on_publish
    return codes


@pytest.fixture
def acl_gateway(tmp_path: Path) -> Iterator[GatewayHarness]:
    acl = tmp_path / "acl"
    acl.write_text(E2E_ACL)
    # No password file: user names are taken as given and select ACL rules (Mosquitto's way).
    h = GatewayHarness(tmp_path / "data", acl_file=acl).start()
    try:
        yield h
    finally:
        h.stop()


@pytest.mark.parametrize("v5", [True, False])
def test_subscribe_acl(acl_gateway: GatewayHarness, clients: list[Client], v5: bool) -> None:
    bob = _user(acl_gateway.port, "bob", v5=v5)
    clients.append(bob)
    denied = 0x87 if v5 else 0x80
    assert bob.subscribe("sensors/#", 1) == [1]
    assert bob.subscribe("cmd/#", 1) == [denied]  # write-only
    assert bob.subscribe("#", 0) == [denied]  # wider than the grant
    assert bob.subscribe("sensors/secret", 0) == [denied]  # wholly denied
    assert bob.subscribe([("sensors/+/t", 0), ("bob/out", 0)]) == [0, denied]


@pytest.mark.parametrize("v5", [True, False])
def test_publish_acl(acl_gateway: GatewayHarness, clients: list[Client], v5: bool) -> None:
    port = acl_gateway.port
    alice = _user(port, "alice", v5=True)
    clients.append(alice)
    alice.subscribe([("bob/out", 1), ("sensors/#", 1)])  # not alice's to read bob/out: refused
    bob = _user(port, "bob", v5=v5)
    clients.append(bob)
    codes = _ack_codes(bob)
    denied = 0x87 if v5 else 0  # 3.1.1 has no negative acknowledgement: dropped silently
    m1 = bob.publish("sensors/x", b"not bob's to write", 1).mid
    m2 = bob.publish("sensors/y", b"nor this", 2).mid
    m3 = bob.publish("bob/out", b"allowed", 1).mid
    wait_until(lambda: {m1, m2, m3} <= set(codes), what="acks")
    assert codes[m1] == denied and codes[m3] == 0
    # paho reports the PUBCOMP's code for QoS 2 (it sends PUBREL even after a failed PUBREC).
    assert codes[m2] == (0x92 if v5 else 0)
    if v5:  # the PUBREC itself, byte-exact
        raw = RawClient(port, level=5)
        try:
            assert raw.connect("raw-bob", username="bob").reason_code == 0
            raw.send(Publish(topic="sensors/y", payload=b"x", qos=2, packet_id=7))
            rec = raw.recv_until(PubRec)
            assert rec is not None and (rec.packet_id, rec.reason_code) == (7, 0x87)
        finally:
            raw.close()
    alice.publish("sensors/z", b"alice's", 1)
    # alice sees her own sensor message and nothing bob tried to write.
    assert [m.payload for m in alice.wait_messages(1)] == [b"alice's"]
    bob.c.publish("sensors/x", b"qos0 denied", 0)
    alice.publish("sensors/z", b"second", 1)
    assert [m.payload for m in alice.wait_messages(2)] == [b"alice's", b"second"]
    assert bob.disconnected is None  # denial is not a disconnect


def test_delivery_never_crosses_read_acl(
    acl_gateway: GatewayHarness, clients: list[Client]
) -> None:
    """bob's wildcard subscription is allowed; messages he may not read are still not sent."""
    port = acl_gateway.port
    alice = _user(port, "alice", v5=True)
    clients.append(alice)
    alice.publish("sensors/secret", b"retained secret", 1, retain=True)
    alice.publish("sensors/open", b"retained open", 1, retain=True)
    bob = _user(port, "bob", v5=True)
    clients.append(bob)
    assert bob.subscribe("sensors/#", 2) == [2]
    wait_until(lambda: len(bob.payloads()) >= 1, what="retained open")
    for i in range(3):
        alice.publish("sensors/secret", f"s{i}".encode(), 1)
        alice.publish("sensors/open", f"o{i}".encode(), 2)
    msgs = bob.wait_messages(4)
    assert [m.payload for m in msgs] == [b"retained open", b"o0", b"o1", b"o2"]
    alice.publish("sensors/open", b"last", 1)
    assert bob.wait_messages(5)[-1].payload == b"last"
    assert all(m.topic != "sensors/secret" for m in bob.messages)


def test_pattern_client_id(acl_gateway: GatewayHarness, clients: list[Client]) -> None:
    port = acl_gateway.port
    d1 = _user(port, "nobody", v5=True, client_id="dev1")
    clients.append(d1)
    assert d1.subscribe("devices/dev1/#", 1) == [1]
    assert d1.subscribe("devices/dev2/#", 1) == [0x87]
    assert d1.subscribe("devices/+/cmd", 1) == [0x87]
    codes = _ack_codes(d1)
    ok = d1.publish("devices/dev1/state", b"mine", 1).mid
    bad = d1.publish("devices/dev2/state", b"not mine", 1).mid
    wait_until(lambda: {ok, bad} <= set(codes), what="acks")
    assert (codes[ok], codes[bad]) == (0, 0x87)
    assert d1.wait_messages(1)[0].payload == b"mine"


def test_acl_reload_applies_to_connected_clients(
    tmp_path: Path, acl_gateway: GatewayHarness, clients: list[Client]
) -> None:
    port = acl_gateway.port
    alice = _user(port, "alice", v5=True)
    bob = _user(port, "bob", v5=True)
    clients += [alice, bob]
    assert bob.subscribe("sensors/#", 1) == [1]
    alice.publish("sensors/a", b"before", 1)
    assert bob.wait_messages(1)[0].payload == b"before"
    gw = acl_gateway.gw
    assert gw is not None
    (tmp_path / "acl").write_text(E2E_ACL + "\nuser bob\ntopic deny sensors/a\n")
    assert acl_gateway.call(lambda: gw.access.reload(list(gw.connections)))
    alice.publish("sensors/a", b"after", 1)
    alice.publish("sensors/b", b"still readable", 1)
    msgs = bob.wait_messages(2)
    assert [m.payload for m in msgs] == [b"before", b"still readable"]
    assert bob.disconnected is None
    # A broken file is refused as a whole: the rules in force stay.
    (tmp_path / "acl").write_text("topic read a/#/b\n")
    assert acl_gateway.call(lambda: gw.access.reload(list(gw.connections))) is False
    alice.publish("sensors/a", b"still denied", 1)
    alice.publish("sensors/b", b"end", 1)
    assert bob.wait_messages(3)[-1].payload == b"end"
    assert b"still denied" not in bob.payloads()


def test_acl_reload_revokes_the_write_right_of_a_connected_publisher(
    tmp_path: Path, acl_gateway: GatewayHarness, clients: list[Client]
) -> None:
    """A device publishing to one topic again and again is refused the first publish after a
    reload took its right away (the gateway keeps the verdict of the topic it publishes to
    only while the client's rules stay the ones in force)."""
    port = acl_gateway.port
    alice = _user(port, "alice", v5=True)
    bob = _user(port, "bob", v5=True)
    clients += [alice, bob]
    assert bob.subscribe("sensors/#", 1) == [1]
    codes = _ack_codes(alice)
    before = [alice.publish("sensors/a", b"before%d" % i, 1).mid for i in range(2)]
    assert [m.payload for m in bob.wait_messages(2)] == [b"before0", b"before1"]
    gw = acl_gateway.gw
    assert gw is not None
    (tmp_path / "acl").write_text(
        E2E_ACL.replace("topic readwrite sensors/#", "topic read sensors/#")
    )
    assert acl_gateway.call(lambda: gw.access.reload(list(gw.connections)))
    after = alice.publish("sensors/a", b"after", 1).mid
    wait_until(lambda: set(before) | {after} <= set(codes), what="acks")
    assert [codes[m] for m in (*before, after)] == [0, 0, 0x87]
    assert b"after" not in bob.payloads()


@pytest.mark.parametrize("v5", [True, False])
def test_will_topic_needs_write_access(
    acl_gateway: GatewayHarness, clients: list[Client], v5: bool
) -> None:
    port = acl_gateway.port
    refused = Client(port, "w1", v5=v5, will=("sensors/x", b"gone", 1, False), connect=False)
    clients.append(refused)
    refused.c.username_pw_set("bob")
    refused.connect()
    assert refused.connack is not None and refused.connack[1] == 0x87
    ok = Client(port, "w2", v5=v5, will=("bob/out", b"gone", 1, False), connect=False)
    clients.append(ok)
    ok.c.username_pw_set("bob")
    ok.connect()
    assert ok.connack == (False, 0)
