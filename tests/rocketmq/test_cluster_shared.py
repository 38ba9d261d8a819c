"""Shared subscriptions across cluster nodes (issue #18, point 5; gateway/cluster/shared.py):
members of one `$share` group on different real `lmqtt serve` processes get each message of
the group once, and the messages a member held unacknowledged go to the other members when it
leaves or its node is killed. Real RocketMQ, real paho clients.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.gateway.conftest import Client, wait_until
from tests.rocketmq.test_cluster import LEASE_S, Nodes, clients, nodes  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GROUP = "$share/g/site/#"


def _publish(pubs: list[Client], per_node: int, tag: str = "m", qos: int = 1) -> list[bytes]:
    """`per_node` messages through each publisher, interleaved; returns the payloads."""
    sent = []
    infos = []
    for i in range(per_node):
        for n, pub in enumerate(pubs):
            payload = f"{tag}-{n}-{i}".encode()
            infos.append(pub.c.publish(f"site/{n}/{i}", payload, qos))
            sent.append(payload)
    wait_until(lambda: all(info.is_published() for info in infos), 60, "every PUBACK")
    return sent


def _all(members: list[Client]) -> list[bytes]:
    return [p for m in members for p in m.payloads()]


def _each_once(members: list[Client], sent: list[bytes]) -> None:
    got = Counter(_all(members))
    twice = [p for p, n in got.items() if n > 1]
    assert not twice, f"{len(twice)} delivered more than once, e.g. {twice[:5]}"
    assert set(got) == set(sent), f"missing: {sorted(set(sent) - set(got))[:5]}"


def test_members_on_three_nodes_get_each_message_of_the_group_once(
    nodes: Nodes,  # noqa: F811
    clients: list[Client],  # noqa: F811
) -> None:
    """Messages published on every node, one member per node: each message reaches exactly
    one member of the group, and every member gets some."""
    started = nodes(3)
    members = [Client(g.port, f"member-{i}") for i, g in enumerate(started)]
    pubs = [Client(g.port, f"pub-{i}") for i, g in enumerate(started)]
    clients += members + pubs
    for m in members:
        assert m.subscribe(GROUP, 1) == [1]
    sent = _publish(pubs, 100)
    wait_until(lambda: len(_all(members)) >= len(sent), 60, f"{len(sent)} messages")
    # More traffic after: a duplicate of the first round would be in by the time it is.
    sent += _publish(pubs, 10, "late")
    wait_until(lambda: len(_all(members)) >= len(sent), 60, f"{len(sent)} messages")
    _each_once(members, sent)
    assert all(m.payloads() for m in members), [len(m.payloads()) for m in members]


@pytest.mark.parametrize("how", ["disconnect", "unsubscribe"])
def test_a_member_that_leaves_hands_its_unacknowledged_messages_to_the_others(
    how: str,
    nodes: Nodes,  # noqa: F811
    clients: list[Client],  # noqa: F811
) -> None:
    """A member on node B that never acknowledges disconnects or unsubscribes: what it held
    goes to the member on node A, so A's member ends up with every message."""
    a, b = nodes(2)
    acking = Client(a.port, "acking")
    silent = Client(b.port, "silent", auto_ack=False, v5=True)
    pub = Client(a.port, "pub")
    clients += [acking, silent, pub]
    for m in (acking, silent):
        assert m.subscribe(GROUP, 1) == [1]
    sent = _publish([pub], 60)
    wait_until(lambda: len(_all([acking, silent])) >= len(sent), 60, "every message once")
    assert silent.payloads(), "the silent member got nothing to hold"
    _each_once([acking, silent], sent)
    if how == "disconnect":
        silent.disconnect()
    else:
        silent.unsubscribe(GROUP)
    wait_until(lambda: set(acking.payloads()) >= set(sent), 60, "the held messages at A")
    assert set(acking.payloads()) == set(sent)


@pytest.mark.parametrize("victim", ["dispatcher", "other"])
def test_a_killed_nodes_unacknowledged_messages_go_to_the_surviving_members(
    victim: str,
    nodes: Nodes,  # noqa: F811
    clients: list[Client],  # noqa: F811
) -> None:
    """SIGKILL of the node of a member that holds messages without PUBACK: the member on the
    surviving node gets them (once the killed node's lease ran out), so nothing is lost. The
    first node started dispatches the group (the oldest live node): killed too, the survivor
    takes the dispatch over."""
    (first,) = nodes(1)
    (second,) = nodes(1)
    doomed, survivor = (first, second) if victim == "dispatcher" else (second, first)
    silent = Client(doomed.port, "silent", auto_ack=False)
    acking = Client(survivor.port, "acking")
    pub = Client(survivor.port, "pub")
    clients += [silent, acking, pub]
    for m in (silent, acking):
        assert m.subscribe(GROUP, 1) == [1]
    sent = _publish([pub], 60)
    wait_until(lambda: len(_all([acking, silent])) >= len(sent), 60, "every message once")
    assert silent.payloads(), "the silent member got nothing to hold"
    _each_once([acking, silent], sent)
    doomed.stop(signal.SIGKILL)
    wait_until(lambda: set(acking.payloads()) >= set(sent), LEASE_S * 3 + 30, "the held messages")
    # The group goes on: new messages reach the surviving member.
    more = _publish([pub], 5, "after")
    wait_until(lambda: set(acking.payloads()) >= set(more), 30, "messages after the kill")


def test_the_dispatchers_death_keeps_what_live_members_hold(
    nodes: Nodes,  # noqa: F811
    clients: list[Client],  # noqa: F811
) -> None:
    """Three nodes; the first (the dispatcher) is killed while a member on the second holds
    messages without PUBACK. The new dispatcher leaves them with it (no second delivery to the
    member on the third node) and dispatches new messages; once the holder disconnects, the
    other member gets what it held."""
    (first,) = nodes(1)
    second, third = nodes(2)
    silent = Client(second.port, "silent", auto_ack=False)
    acking = Client(third.port, "acking")
    pub = Client(third.port, "pub")
    clients += [silent, acking, pub]
    for m in (silent, acking):
        assert m.subscribe(GROUP, 1) == [1]
    sent = _publish([pub], 60)
    wait_until(lambda: len(_all([acking, silent])) >= len(sent), 60, "every message once")
    held = silent.payloads()
    assert held, "the silent member got nothing to hold"
    first.stop(signal.SIGKILL)
    # Dispatched by the survivors once the first node's lease ran out.
    sent += _publish([pub], 10, "after")
    wait_until(lambda: len(_all([acking, silent])) >= len(sent), LEASE_S * 3 + 30, "new ones")
    _each_once([acking, silent], sent)
    silent.disconnect()
    wait_until(lambda: set(acking.payloads()) >= set(sent), 60, "the held messages")
    assert set(held) <= set(acking.payloads())


def test_a_new_dispatcher_does_not_deliver_again_what_was_completed_before_it_joined(
    nodes: Nodes,  # noqa: F811
    clients: list[Client],  # noqa: F811
) -> None:
    """QoS 2 in a group: a member on the first node (the dispatcher) completes its messages
    while a QoS 1 member there holds its own without PUBACK (the group's committed position
    stays at the first of them). A second node joins after, with a member, and the first is
    killed: the second node dispatches and hands the held messages to its member, but none
    that was completed before it joined (it reads the bus back from the first assignment
    above the committed position instead of taking every offset above it as undelivered)."""
    (first,) = nodes(1)
    silent = Client(first.port, "silent", auto_ack=False)
    early = Client(first.port, "early")
    pub = Client(first.port, "pub")
    clients += [silent, early, pub]
    assert silent.subscribe(GROUP, 1) == [1]
    assert early.subscribe(GROUP, 2) == [2]
    sent = _publish([pub], 60, qos=2)
    wait_until(lambda: len(_all([early, silent])) >= len(sent), 60, "every message once")
    _each_once([early, silent], sent)
    held, completed = silent.payloads(), early.payloads()
    assert held, "the silent member got nothing to hold"
    (second,) = nodes(1)
    late = Client(second.port, "late")
    clients.append(late)
    assert late.subscribe(GROUP, 2) == [2]
    first.stop(signal.SIGKILL)
    pub2 = Client(second.port, "pub2")
    clients.append(pub2)
    more = _publish([pub2], 5, "after", qos=2)
    want = set(held) | set(more)
    wait_until(lambda: set(late.payloads()) >= want, LEASE_S * 3 + 30, "held and new messages")
    again = sorted(set(late.payloads()) & set(completed))
    assert not again, f"{len(again)} completed QoS 2 messages delivered again, e.g. {again[:5]}"
    assert Counter(late.payloads()).most_common(1)[0][1] == 1
