"""The brokers under test, each started as its own process on a free loopback port.

Every broker gets a fresh working directory (data dir, config, log) unless a scenario restarts
one on the directory it already has (durability). ``BrokerUnavailable`` carries the note shown
in the table when a broker cannot run here (Mosquitto not installed, lmqtt not serving yet).

``lmqtt-rocketmq`` is the same gateway with ``--store rocketmq``: its messages go to a real
Apache RocketMQ cluster (a name server and two brokers, JVMs) that the bench starts once for the
whole run with the test suite's launcher (tests/rocketmq/cluster.py: the pinned version, small
heaps, loopback only; bench/rocketmq_remoting_bench.py uses it the same way). Each run gets a
fresh ``rocketmq_topic``, so no run replays an earlier one's state. The JVMs' CPU is measured
beside the gateway's (``store_cpu_seconds``): on this backend the work is split between them.

``lmqtt-rocketmq-2n`` and ``lmqtt-rocketmq-3n`` are two and three such gateway processes (nodes)
in cluster mode (``LMQTT_CLUSTER``) on one ``rocketmq_topic`` of the same cluster:
clients are spread over their ports (``ports``), a message published on one node reaches
subscribers on another through the broker, and the CPU, RSS and exit figures are the sum over
the nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from bench.realtime import make_realtime

if TYPE_CHECKING:
    from tests.rocketmq.cluster import RocketMQCluster

BROKERS = ("lmqtt", "mosquitto", "amqtt")
#: lmqtt with its delivery account turned off (--no-delivery-account): `bench --account-cost`
#: runs it beside lmqtt to price the account.
LMQTT_NO_ACCOUNT = "lmqtt-noaccount"
#: The gateway on RocketMQ with 1, 2 or 3 nodes (gateway processes sharing one namespace).
ROCKETMQ_NODES = {"lmqtt-rocketmq": 1, "lmqtt-rocketmq-2n": 2, "lmqtt-rocketmq-3n": 3}
#: Brokers run only when named in --brokers (they need Java and Maven: RocketMQ's JVMs).
OPTIONAL_BROKERS = tuple(ROCKETMQ_NODES)
LMQTT_BROKERS = ("lmqtt", *ROCKETMQ_NODES, LMQTT_NO_ACCOUNT)
#: The sessions bench's floor (bench/session_floor.py): answers CONNECT, SUBSCRIBE and
#: DISCONNECT, nothing else; named in `sessions_bench create --brokers` only.
SESSION_FLOOR = "session-floor"


class BrokerUnavailable(Exception):
    """The broker cannot be started on this machine; the message says why."""


@dataclass(frozen=True, slots=True)
class BrokerOptions:
    flush: str = "async"  # lmqtt only: "async" or "sync"
    persistence: bool = False  # Mosquitto only: lmqtt always stores, amqtt never does
    admin: bool = False  # lmqtt only: serve /metrics (GC pause figures) on a free port
    delivery_account: bool = True  # lmqtt only: keep the delivery account (its default)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class BrokerProcess:
    """One broker process: start, wait until it accepts connections, stop or SIGKILL."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        options: BrokerOptions,
        *,
        realtime: bool = False,
        rocketmq: RocketMQCluster | None = None,
    ) -> None:
        self.name = name
        #: The RocketMQ cluster ``lmqtt-rocketmq`` stores on (started by the caller).
        self.rocketmq = rocketmq
        self.workdir = workdir
        self.options = options
        #: Run the broker (and the scenario's generator processes) under SCHED_FIFO
        #: (bench.realtime); ``realtime_applied`` says whether the kernel allowed it.
        self.realtime = realtime
        self.realtime_applied = False
        self.nodes = ROCKETMQ_NODES.get(name, 1)
        #: Where clients connect: one port per node (clients are spread over them).
        self.ports = [free_port() for _ in range(self.nodes)]
        self.port = self.ports[0]
        self.admin_port = free_port() if options.admin and name in LMQTT_BROKERS else None
        self.processes: list[asyncio.subprocess.Process] = []
        self.pss: list[psutil.Process] = []

    @property
    def process(self) -> asyncio.subprocess.Process | None:
        """The first node's process (the only one but for the multi-node brokers)."""
        return self.processes[0] if self.processes else None

    @property
    def ps(self) -> psutil.Process | None:
        return self.pss[0] if self.pss else None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def command(self, node: int = 0) -> list[str]:
        """The command line of node `node` (0: the only one of a single-process broker)."""
        if self.name in LMQTT_BROKERS:
            exe = Path(sys.executable).parent / "lmqtt"
            if not exe.exists():
                raise BrokerUnavailable("lmqtt console script not installed")
            admin = ["--admin-port", str(self.admin_port)] if self.admin_port and not node else []
            if not self.options.delivery_account or self.name == LMQTT_NO_ACCOUNT:
                admin.append("--no-delivery-account")
            store: list[str] = []
            if self.name in ROCKETMQ_NODES:
                if self.rocketmq is None:
                    raise BrokerUnavailable("no RocketMQ cluster (needs Java and Maven)")
                store = ["--store", "rocketmq", "--namesrv", self.rocketmq.namesrv_addr]
            return [
                str(exe),
                "serve",
                *admin,
                *store,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.ports[node]),
                "--data-dir",
                str(self.workdir / ("data" if not node else f"data{node}")),
                "--flush",
                self.options.flush,
                "--log-level",
                "WARNING",
            ]
        if self.name == "amqtt":
            return [sys.executable, "-m", "bench.amqtt_broker", str(self.port)]
        if self.name == SESSION_FLOOR:
            return [sys.executable, "-m", "bench.session_floor", str(self.port)]
        if self.name == "mosquitto":
            found = shutil.which("mosquitto") or (
                "/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None
            )
            if found is None:
                raise BrokerUnavailable("mosquitto not installed (apt-get install mosquitto)")
            return [found, "-c", str(self.mosquitto_config())]
        raise BrokerUnavailable(f"unknown broker {self.name}")

    def mosquitto_config(self) -> Path:
        store = self.workdir / "mosquitto-data"
        store.mkdir(parents=True, exist_ok=True)
        lines = [
            f"listener {self.port} 127.0.0.1",
            "allow_anonymous true",
            # Unlimited queues: by default Mosquitto drops QoS 1 messages beyond 1,000 queued
            # per client, which would count as loss rather than as slower delivery.
            "max_queued_messages 0",
            # Like lmqtt and amqtt (asyncio sets TCP_NODELAY); without it Nagle plus delayed
            # ACKs hold PUBACKs for ~40 ms whenever no other traffic flows.
            "set_tcp_nodelay true",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
        ]
        if os.geteuid() == 0:
            # Keep access to our temp dir instead of dropping privileges to user "mosquitto".
            lines.append("user root")
        if self.options.persistence:
            lines += [
                "persistence true",
                f"persistence_location {store}/",
                # The most frequent save Mosquitto offers; its default is every 30 minutes.
                "autosave_interval 1",
            ]
        path = self.workdir / "mosquitto.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.name in ROCKETMQ_NODES:
            # Sync mode on the SYNC_FLUSH broker (SEND_OK after its flush), async mode on the
            # ASYNC_FLUSH one, as an operator would pair them (tests/rocketmq/cluster.py).
            sync = self.options.flush == "sync"
            env["LMQTT_ROCKETMQ_BROKER"] = "broker-b" if sync else "broker-a"
            env["LMQTT_ROCKETMQ_TOPIC"] = f"bench-{os.getpid()}-{self.port}"
            if self.nodes > 1:
                env["LMQTT_CLUSTER"] = "true"  # several nodes on one namespace: cluster mode
        return env

    @property
    def store_pids(self) -> list[int]:
        """The processes the broker stores through (RocketMQ's name server and brokers for the
        ``lmqtt-rocketmq`` brokers; none for the brokers that store in their own process)."""
        if self.rocketmq is None or self.name not in ROCKETMQ_NODES:
            return []
        return [proc.pid for proc in self.rocketmq.procs.values() if proc.poll() is None]

    def store_cpu_seconds(self) -> float:
        """CPU time of the processes the broker stores through (RocketMQ's name server and
        brokers for ``lmqtt-rocketmq``; 0 for the brokers that store in their own process)."""
        if self.rocketmq is None or self.name not in ROCKETMQ_NODES:
            return 0.0
        total = 0.0
        for proc in self.rocketmq.procs.values():
            try:
                times = psutil.Process(proc.pid).cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    async def start(self, timeout: float = 20.0) -> None:
        if self.name in ROCKETMQ_NODES:
            # Topic creation, the light-queue probe and the state replay go through the broker.
            timeout = max(timeout, 60.0)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes, self.pss = [], []  # a restart (durability) replaces ended ones
        for node in range(self.nodes):
            await self._start_node(node, timeout)

    async def _start_node(self, node: int, timeout: float) -> None:
        log = open(self.workdir / f"{self.name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = self.environment()
        process = await asyncio.create_subprocess_exec(
            *self.command(node),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
        log.close()
        self.processes.append(process)
        self.pss.append(psutil.Process(process.pid))
        if self.realtime:
            self.realtime_applied = make_realtime(process.pid)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if process.returncode is not None:
                break
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.ports[node])
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            if self.realtime_applied:
                make_realtime(process.pid)  # threads started during startup
            return
        await self.stop()
        tail = self.log_tail()
        raise BrokerUnavailable(f"{self.name} did not accept connections: {tail}")

    def log_tail(self, lines: int = 5) -> str:
        path = self.workdir / f"{self.name}.log"
        if not path.exists():
            return ""
        text = path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])[-600:]

    def rss(self) -> int:
        """Resident memory, summed over the nodes."""
        total = 0
        for ps in self.pss:
            with contextlib.suppress(psutil.Error):
                total += int(ps.memory_info().rss)
        return total

    def anon(self) -> int:
        """Anonymous resident memory (heap, stacks): RSS minus file-backed and shared pages,
        summed over the nodes.

        lmqtt maps its CommitLog segments; the pages it writes count in RSS but are page cache
        the kernel can write back and drop, unlike heap.
        """
        total = 0
        for ps in self.pss:
            with contextlib.suppress(psutil.Error):
                info = ps.memory_info()
                total += int(info.rss - getattr(info, "shared", 0))
        return total

    def cpu_seconds(self) -> float:
        """CPU time of the broker's processes (every node's), with their children's once
        waited for (lmqtt's state-log compaction runs in a child process)."""
        user, system = self.cpu_split()
        return user + system

    def cpu_split(self) -> tuple[float, float]:
        """`cpu_seconds` as (user, system): the broker's own code (for lmqtt the interpreter
        and its C kernels) against the kernel's work for it (syscalls, the TCP stack)."""
        user = system = 0.0
        for ps in self.pss:
            with contextlib.suppress(psutil.Error):
                times = ps.cpu_times()
                user += float(times.user) + float(getattr(times, "children_user", 0.0))
                system += float(times.system) + float(getattr(times, "children_system", 0.0))
        return user, system

    def kill(self, node: int | None = None) -> None:
        """SIGKILL every node (or node `node`)."""
        for i, process in enumerate(self.processes):
            if (node is None or i == node) and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGKILL)

    async def wait(self) -> None:
        for process in self.processes:
            await process.wait()

    async def stop(self, timeout: float = 10.0) -> None:
        running = [p for p in self.processes if p.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in running:
            try:
                await asyncio.wait_for(process.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGKILL)
                await process.wait()
