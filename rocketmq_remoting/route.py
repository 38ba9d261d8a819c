"""What the name server knows: which brokers serve a topic, and which brokers a cluster has.

GET_ROUTEINFO_BY_TOPIC (105) answers a ``TopicRouteData`` body::

    {"brokerDatas":[{"brokerAddrs":{"0":"127.0.0.1:10911"},"brokerName":"broker-a",
                     "cluster":"c1","enableActingMaster":false}],
     "filterServerTable":{},
     "queueDatas":[{"brokerName":"broker-a","perm":6,"readQueueNums":4,"topicSysFlag":0,
                    "writeQueueNums":4}]}

``brokerAddrs`` maps a broker id (0 = master) to ``host:port``. fastjson writes those Long keys
bare (``{0:"..."}``) unless asked for standard JSON, which a route request does
(``acceptStandardJsonOnly``) but GET_BROKER_CLUSTER_INFO (106) cannot: so bodies are read with
:func:`loads_lenient`, which quotes bare integer keys first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MASTER_ID = 0


def loads_lenient(raw: bytes | str) -> Any:
    """``json.loads`` that also accepts fastjson's bare integer object keys."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    try:
        return json.loads(text)
    except ValueError:
        pass
    out: list[str] = []
    i, n = 0, len(text)
    in_string = False
    expect_key = False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            expect_key = False
            out.append(ch)
        elif expect_key and (ch.isdigit() or ch == "-"):
            j = i + 1
            while j < n and text[j].isdigit():
                j += 1
            out.append(f'"{text[i:j]}"')
            expect_key = False
            i = j
            continue
        else:
            if ch in "{,":
                expect_key = True
            elif not ch.isspace():
                expect_key = False
            out.append(ch)
        i += 1
    return json.loads("".join(out))


@dataclass(slots=True)
class BrokerData:
    broker_name: str
    cluster: str
    addrs: dict[int, str] = field(default_factory=dict)

    @property
    def master_addr(self) -> str | None:
        return self.addrs.get(MASTER_ID)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BrokerData:
        return cls(
            broker_name=str(raw.get("brokerName", "")),
            cluster=str(raw.get("cluster", "")),
            addrs={int(k): str(v) for k, v in (raw.get("brokerAddrs") or {}).items()},
        )


@dataclass(slots=True)
class QueueData:
    broker_name: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int
    topic_sys_flag: int = 0


@dataclass(slots=True)
class TopicRoute:
    """Where a topic lives: its brokers and how many queues each holds."""

    brokers: list[BrokerData]
    queues: list[QueueData]

    @classmethod
    def from_body(cls, body: bytes) -> TopicRoute:
        raw = loads_lenient(body)
        return cls(
            brokers=[BrokerData.from_json(b) for b in raw.get("brokerDatas") or []],
            queues=[
                QueueData(
                    broker_name=str(q.get("brokerName", "")),
                    read_queue_nums=int(q.get("readQueueNums", 0)),
                    write_queue_nums=int(q.get("writeQueueNums", 0)),
                    perm=int(q.get("perm", 0)),
                    topic_sys_flag=int(q.get("topicSysFlag", 0)),
                )
                for q in raw.get("queueDatas") or []
            ],
        )

    def master_addrs(self) -> dict[str, str]:
        """Broker name -> master address, for the brokers that have a master online."""
        return {b.broker_name: a for b in self.brokers if (a := b.master_addr) is not None}


@dataclass(slots=True)
class ClusterInfo:
    """GET_BROKER_CLUSTER_INFO: every broker the name server knows, by cluster."""

    brokers: dict[str, BrokerData]
    clusters: dict[str, list[str]]

    @classmethod
    def from_body(cls, body: bytes) -> ClusterInfo:
        raw = loads_lenient(body)
        return cls(
            brokers={
                name: BrokerData.from_json(b)
                for name, b in (raw.get("brokerAddrTable") or {}).items()
            },
            clusters={
                name: sorted(members)
                for name, members in (raw.get("clusterAddrTable") or {}).items()
            },
        )
