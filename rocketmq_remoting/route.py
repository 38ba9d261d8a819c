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
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rocketmq_remoting.codes import PERM_READ, PERM_WRITE
from rocketmq_remoting.errors import BrokerNotFoundError

MASTER_ID = 0
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: the multiplier of Fibonacci hashing
_MASK64 = (1 << 64) - 1


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

    def writable_brokers(self) -> list[str]:
        """The names, sorted, of the brokers a message of this topic can be sent to now: a
        master online and write permission (an operator empties a broker by taking its
        PERM_WRITE away, `mqadmin updateBrokerConfig -k brokerPermission -v 4`)."""
        masters = self.master_addrs()
        return sorted(
            q.broker_name
            for q in self.queues
            if q.perm & PERM_WRITE and q.write_queue_nums > 0 and q.broker_name in masters
        )

    def readable_brokers(self) -> list[str]:
        """The names, sorted, of the brokers whose copy of this topic can be read now (a broker
        that stopped taking writes still serves what it holds)."""
        masters = self.master_addrs()
        return sorted(
            q.broker_name
            for q in self.queues
            if q.perm & PERM_READ and q.read_queue_nums > 0 and q.broker_name in masters
        )


@dataclass(slots=True)
class ClusterInfo:
    """GET_BROKER_CLUSTER_INFO: every broker the name server knows, by cluster."""

    brokers: dict[str, BrokerData]
    clusters: dict[str, list[str]]

    def master_addrs(self) -> dict[str, str]:
        """Broker name -> master address, for the brokers that have a master online."""
        return {name: a for name, b in self.brokers.items() if (a := b.master_addr) is not None}

    def choose_broker(
        self, preferred: str | None, where: str, serving: Sequence[str] = ()
    ) -> tuple[str, str]:
        """(name, master address) of a deployment's home broker, the one rule the gateway,
        `lmqtt replay` and the fan-out report share so they agree without configuration:
        `preferred` when named; else the first by name of the brokers already `serving` the
        deployment's parent topic (its route), so a deployment stays where its data is when
        a broker whose name sorts first joins the cluster; else (a new deployment) the first
        registered master by name. BrokerNotFoundError (naming `where`, e.g. "name server
        127.0.0.1:9876", and the registered brokers) when there is none."""
        masters = self.master_addrs()
        if not masters:
            raise BrokerNotFoundError(f"no RocketMQ broker is registered at {where}")
        home = [b for b in serving if b in masters]
        name = preferred or (min(home) if home else min(masters))
        addr = masters.get(name)
        if addr is None:
            raise BrokerNotFoundError(
                f"broker {name!r} is not registered at {where}"
                f" (registered: {', '.join(sorted(masters))})"
            )
        return name, addr

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


def _weight(key_hash: int, broker: str) -> int:
    x = ((key_hash ^ zlib.crc32(broker.encode())) * _GOLDEN) & _MASK64
    return x ^ (x >> 29)


def broker_for(key: bytes, brokers: Sequence[str]) -> str:
    """The broker, among `brokers`, that the messages keyed by `key` go to (rendezvous hashing:
    each broker's weight is a hash of the key and the broker's name, the heaviest wins).

    Every caller that knows the same brokers picks the same one, with no shared table; adding
    a broker moves only the keys it now wins (about 1/N of them) and removing one moves only
    its own keys, where `hash % N` would move most keys on any change. The weights are
    zlib.crc32 mixed by Fibonacci hashing: stable across processes and Python versions
    (unlike `hash()`), and cheap enough per message."""
    if len(brokers) == 1:
        return brokers[0]
    h = zlib.crc32(key)
    return max(brokers, key=lambda b: _weight(h, b))
