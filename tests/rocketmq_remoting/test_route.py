"""The name server's answers read as routes, and the broker-choice rules every reader and
writer of a deployment shares (rocketmq_remoting/route.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rocketmq_remoting import BrokerNotFoundError, ClusterInfo, TopicRoute, broker_for

# GET_BROKER_CLUSTER_INFO as a 5.3.3 name server writes it: bare integer keys (quirk 1).
CLUSTER = (
    b'{"brokerAddrTable":{"broker-b":{"brokerAddrs":{0:"127.0.0.1:20021"},'
    b'"brokerName":"broker-b","cluster":"c1"},"broker-a":{"brokerAddrs":{0:"127.0.0.1:20011"},'
    b'"brokerName":"broker-a","cluster":"c1"},"broker-s":{"brokerAddrs":{1:"127.0.0.1:20031"},'
    b'"brokerName":"broker-s","cluster":"c1"}},"clusterAddrTable":{"c1":["broker-a","broker-b",'
    b'"broker-s"]}}'
)


def test_choose_broker_named_else_first_master_by_name() -> None:
    info = ClusterInfo.from_body(CLUSTER)
    # broker-s has a slave only: not a candidate.
    assert info.master_addrs() == {"broker-a": "127.0.0.1:20011", "broker-b": "127.0.0.1:20021"}
    assert info.choose_broker(None, "ns") == ("broker-a", "127.0.0.1:20011")
    assert info.choose_broker("broker-b", "ns") == ("broker-b", "127.0.0.1:20021")
    # A deployment whose parent topic is on broker-b stays there; brokers without a master
    # online in its route do not count.
    assert info.choose_broker(None, "ns", ["broker-s", "broker-b"]) == (
        "broker-b",
        "127.0.0.1:20021",
    )
    assert info.choose_broker(None, "ns", ["broker-s"])[0] == "broker-a"
    assert info.choose_broker("broker-a", "ns", ["broker-b"])[0] == "broker-a"
    with pytest.raises(
        BrokerNotFoundError,
        match=r"'broker-s' is not registered at ns \(registered: broker-a, broker-b\)",
    ):
        info.choose_broker("broker-s", "ns")
    with pytest.raises(
        BrokerNotFoundError, match="no RocketMQ broker is registered at name server x"
    ):
        ClusterInfo.from_body(b'{"brokerAddrTable":{},"clusterAddrTable":{}}').choose_broker(
            None, "name server x"
        )


def test_writable_and_readable_brokers_of_a_route() -> None:
    route = TopicRoute.from_body(
        json.dumps(
            {
                "brokerDatas": [
                    {"brokerName": n, "cluster": "c1", "brokerAddrs": {"0": f"127.0.0.1:{p}"}}
                    for n, p in (("broker-c", 3), ("broker-a", 1), ("broker-b", 2))
                ]
                + [{"brokerName": "broker-d", "cluster": "c1", "brokerAddrs": {"1": "h:4"}}],
                "queueDatas": [
                    {"brokerName": "broker-c", "perm": 6, "readQueueNums": 1, "writeQueueNums": 1},
                    {"brokerName": "broker-a", "perm": 6, "readQueueNums": 1, "writeQueueNums": 1},
                    # read-only: being emptied
                    {"brokerName": "broker-b", "perm": 4, "readQueueNums": 1, "writeQueueNums": 1},
                    # no master online
                    {"brokerName": "broker-d", "perm": 6, "readQueueNums": 1, "writeQueueNums": 1},
                ],
            }
        ).encode()
    )
    assert route.writable_brokers() == ["broker-a", "broker-c"]
    assert route.readable_brokers() == ["broker-a", "broker-b", "broker-c"]


def test_broker_for_is_stable_spread_and_moves_few_keys() -> None:
    two = ["broker-a", "broker-b"]
    three = [*two, "broker-c"]
    keys = [f"site/{i}/temp".encode() for i in range(3000)]
    # Pinned values: every gateway, `lmqtt replay` and the report must agree, across versions.
    assert [broker_for(k, two) for k in keys[:8]] == [
        *("broker-b", "broker-a", "broker-b", "broker-b"),
        *("broker-a", "broker-a", "broker-a", "broker-b"),
    ]
    assert [broker_for(k, three) for k in keys[:8]] == [
        *("broker-b", "broker-a", "broker-b", "broker-c"),
        *("broker-a", "broker-c", "broker-a", "broker-b"),
    ]
    # The order the brokers are listed in does not matter.
    assert all(broker_for(k, two) == broker_for(k, two[::-1]) for k in keys)
    assert broker_for(b"", ["only"]) == "only"
    spread = Counter(broker_for(k, two) for k in keys)
    assert min(spread.values()) > 0.4 * len(keys), spread
    spread3 = Counter(broker_for(k, three) for k in keys)
    assert min(spread3.values()) > 0.25 * len(keys), spread3
    # A broker added: only the keys it wins move, and they move to it.
    moved = [k for k in keys if broker_for(k, two) != broker_for(k, three)]
    assert all(broker_for(k, three) == "broker-c" for k in moved)
    assert len(moved) == spread3["broker-c"]
