"""A real Apache RocketMQ cluster on loopback for the tests: one name server, two brokers.

The jars come from Maven Central through ``pom.xml`` beside this file (``mvn -q
dependency:copy-dependencies`` into ``lib/``, git-ignored), fetched once and reused while the
pom is unchanged. Each JVM runs with a small heap, the serial collector, the C1 compiler only and
one visible processor, so three JVMs stay light on a shared 2-core machine.

Everything a process writes (stores, configs, logs: ``user.home`` and ``ROCKETMQ_HOME`` point
into the temporary directory) lives under one temporary directory. Every listener binds
127.0.0.1 except the brokers' HA listener (``DefaultHAService`` binds the wildcard address and
has no setting for it; nothing connects to it without slaves). Nothing is fetched or contacted
outside loopback: ``fetchNamesrvAddrByAddressServer`` stays off (default), metrics export stays
DISABLE (default), ``brokerIP1``/``brokerIP2`` are 127.0.0.1 instead of the first LAN address.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rocketmq_remoting import RemotingClient, RemotingError
from rocketmq_remoting.admin import wait_for_brokers

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
LIB = HERE / "lib"
STAMP = LIB / ".pom-sha256"
#: The version pinned in pom.xml (the one these tests were written and run against).
ROCKETMQ_VERSION = "5.3.3"
REQUIRE_ENV = "LMQTT_REQUIRE_ROCKETMQ"
CLUSTER_NAME = "lmqtt-test"
#: broker name -> (autoCreateTopicEnable, flushDiskType). broker-a auto-creates topics on first
#: send and flushes asynchronously; broker-b is configured like production for lmqtt's sync mode:
#: no auto-creation (so the tests see TOPIC_NOT_EXIST) and SYNC_FLUSH (SEND_OK after the flush).
BROKERS = {"broker-a": (True, "ASYNC_FLUSH"), "broker-b": (False, "SYNC_FLUSH")}

JVM_OPTS = [
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:ActiveProcessorCount=1",
    "-XX:-UsePerfData",
    "-Djava.net.preferIPv4Stack=true",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-exports=java.base/sun.nio.ch=ALL-UNNAMED",
]
NAMESRV_HEAP = ["-Xms256m", "-Xmx256m"]
BROKER_HEAP = ["-Xms384m", "-Xmx384m", "-XX:MaxDirectMemorySize=256m"]

#: The flags of a production broker (RocketMQ's own bin/runbroker.sh for JDK 9+, heaps sized to
#: this 24 GiB host instead of its 8 GiB): G1, both JIT tiers (C2 compiles the hot paths), every
#: processor visible. Only `python -m bench --rocketmq-jvm production` starts a cluster with
#: them (the JVM CPU per publish of both sets: docs/rocketmq.md); the tests keep the test flags.
PRODUCTION_JVM_OPTS = [
    "-server",
    "-XX:+UseG1GC",
    "-XX:G1HeapRegionSize=16m",
    "-XX:G1ReservePercent=25",
    "-XX:InitiatingHeapOccupancyPercent=30",
    "-XX:SoftRefLRUPolicyMSPerMB=0",
    "-XX:-OmitStackTraceInFastThrow",
    "-XX:+AlwaysPreTouch",
    "-XX:-UseLargePages",
    "-XX:-UsePerfData",
    *JVM_OPTS[JVM_OPTS.index("-Djava.net.preferIPv4Stack=true") :],
]
PRODUCTION_NAMESRV_HEAP = ["-Xms512m", "-Xmx512m"]
PRODUCTION_BROKER_HEAP = ["-Xms2g", "-Xmx2g", "-XX:MaxDirectMemorySize=2g"]
#: A pull the broker holds (RocketMQCluster.held_pulls counts its instances).
HELD_PULL_CLASS = "org.apache.rocketmq.broker.longpolling.PullRequest"
#: `RocketMQCluster.jvm`: (flags, name server heap, broker heap) by name.
JVM_SETS = {
    "test": (JVM_OPTS, NAMESRV_HEAP, BROKER_HEAP),
    "production": (PRODUCTION_JVM_OPTS, PRODUCTION_NAMESRV_HEAP, PRODUCTION_BROKER_HEAP),
}


def class_archive(main: str) -> Path:
    """The class-data sharing archive of the JVMs running `main` (name server or broker).

    A JVM maps the classes an earlier run of its kind loaded from this archive instead of
    loading and verifying them from the jars again, which is most of a broker's start on a
    small host. The first cluster started without one dumps it (``-XX:ArchiveClassesAtExit``,
    written at that JVM's graceful stop). Its name depends on the jars (the pom's digest) and on
    the JDK; a JVM whose archive does not match anyway ignores it (``-Xshare:auto``, the
    default) and starts without it.
    """
    java = os.path.realpath(shutil.which("java") or "java")
    pom = STAMP.read_text().strip() if STAMP.exists() else ""
    mtime = os.stat(java).st_mtime_ns if os.path.exists(java) else 0
    key = hashlib.sha256(f"{pom}|{java}|{mtime}".encode()).hexdigest()[:16]
    return LIB / f"cds-{main.rsplit('.', 1)[-1]}-{key}.jsa"


class ClusterUnavailable(Exception):
    """Java, Maven or the jars are missing: the RocketMQ tests cannot run here."""


def ensure_jars(timeout: float = 900.0) -> None:
    """Fetch the name server and broker jars once (re-fetch when pom.xml changes).

    Under a lock on ``lib/``: every pytest-xdist worker calls this after its collection, and
    the first to come fetches while the others wait for it, then find the jars in place.
    """
    LIB.mkdir(exist_ok=True)
    with (LIB / ".lock").open("wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _fetch_jars(timeout)


def fetch_jars_for(selected: Iterable[Path], folder: Path) -> str | None:
    """After collection, outside any test's timeout: fetch the jars when a selected test file
    lies under `folder` (a fresh machine downloads ~85 MB from Maven Central, a minute or more,
    which would not fit in the first test's timeout). Returns why they are missing; None: they
    are there, or no test needs them, or Java is missing (the fixtures say so)."""
    if shutil.which("java") is None:
        return None
    if not any(path.is_relative_to(folder) for path in selected):
        return None
    try:
        ensure_jars()
    except ClusterUnavailable as exc:
        return str(exc)
    return None


def _fetch_jars(timeout: float) -> None:
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text().strip() == digest:
        return
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ClusterUnavailable("Maven (mvn) is not installed: cannot fetch RocketMQ's jars")
    try:
        subprocess.run(
            [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies"],
            check=True,
            capture_output=True,
            timeout=timeout,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stdout + exc.stderr).strip().splitlines()[-5:]
        msg = "mvn dependency:copy-dependencies failed: " + " | ".join(tail)
        raise ClusterUnavailable(msg) from exc
    except subprocess.TimeoutExpired as exc:
        raise ClusterUnavailable(f"mvn did not finish within {timeout:.0f}s") from exc
    STAMP.write_text(digest)


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


#: Ports are drawn below the kernel's ephemeral range (32768-60999 by default): a port taken
#: from bind(0) is free on 127.0.0.1 only, and the brokers' HA listener binds the wildcard
#: address, which then collides with any connection (or TIME_WAIT) on another loopback address
#: that happens to use that port, as the busy shared host showed.
_PORTS = random.Random(os.getpid() ^ time.time_ns())
#: Every port handed out by this process, never handed out again: a cluster in a network
#: namespace (tests/partition) binds its ports there, where the checks below, made in this
#: process's namespace, cannot see them, so its second broker could otherwise draw the first
#: one's ports.
_HANDED_OUT: set[int] = set()


def _pick(ports: Callable[[int], tuple[int, ...]], ports_ok: Callable[[int], bool]) -> int:
    for _ in range(500):
        port = _PORTS.randrange(20000, 32000)
        if _HANDED_OUT.isdisjoint(ports(port)) and ports_ok(port):
            _HANDED_OUT.update(ports(port))
            return port
    raise RuntimeError("no free ports for RocketMQ")


def namesrv_port() -> int:
    return _pick(lambda p: (p,), _bindable)


def broker_port() -> int:
    """A port P with P-2 (the second, "fast" remoting server) and P+1 (HA, wildcard) free."""
    return _pick(
        lambda p: (p - 2, p, p + 1),
        lambda p: _bindable(p) and _bindable(p - 2) and _bindable(p + 1, "0.0.0.0"),
    )


@dataclass
class RocketMQCluster:
    """Processes and addresses of the running cluster.

    `host`: the address every process binds and the brokers advertise (brokerIP1/2); `wrap`: a
    command each JVM is started through, e.g. ``ip netns exec NS`` (tests/partition runs the
    cluster in a network namespace of its own, on an address of that namespace). By default
    127.0.0.1 and no wrapper: the cluster of every other test. `jvm`: a key of JVM_SETS, the
    test flags unless the bench asks for the production ones.
    """

    root: Path
    host: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()
    jvm: str = "test"
    namesrv_addr: str = ""
    brokers: dict[str, str] = field(default_factory=dict)  # broker name -> host:port
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: process name -> (the archive it is dumping at its exit, where that goes once complete)
    dumps: dict[str, tuple[Path, Path]] = field(default_factory=dict)

    @property
    def cluster_name(self) -> str:
        return CLUSTER_NAME

    def client(self, **kwargs: object) -> RemotingClient:
        return RemotingClient([self.namesrv_addr], **kwargs)  # type: ignore[arg-type]

    def _spawn(self, name: str, main: str, conf: Path) -> None:
        opts, namesrv_heap, broker_heap = JVM_SETS[self.jvm]
        heap = namesrv_heap if name == "namesrv" else broker_heap
        java = shutil.which("java")
        assert java is not None
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "ROCKETMQ_HOME": str(home)}
        log = (self.root / f"{name}.out").open("wb")
        archive = class_archive(main)
        if self.jvm != "test":
            cds = []  # the archives hold the test flags' classes (another collector)
        elif archive.exists():
            cds = [f"-XX:SharedArchiveFile={archive}"]
        elif all(final != archive for _, final in self.dumps.values()):
            # One JVM per kind dumps; a name unique to it, renamed once it is complete.
            partial = archive.with_name(f"{archive.name}.{os.getpid()}.{name}.tmp")
            self.dumps[name] = (partial, archive)
            cds = [f"-XX:ArchiveClassesAtExit={partial}"]
        else:
            cds = []
        cmd = [
            *self.wrap,
            java,
            *heap,
            *opts,
            *cds,
            f"-Duser.home={home}",
            "-cp",
            f"{LIB}/*",
            main,
            "-c",
            str(conf),
        ]
        self.procs[name] = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def start_namesrv(self, port: int | None = None, timeout: float = 180.0) -> str:
        """Start the name server (on `port`, else a free one); its address once it listens."""
        port = port or namesrv_port()
        self.root.mkdir(parents=True, exist_ok=True)
        self.namesrv_addr = f"{self.host}:{port}"
        conf = self.root / "namesrv.conf"
        conf.write_text(
            f"listenPort={port}\nbindAddress={self.host}\n"
            f"kvConfigPath={self.root / 'namesrv' / 'kvConfig.json'}\n"
        )
        self._spawn("namesrv", "org.apache.rocketmq.namesrv.NamesrvStartup", conf)
        self._wait_listening("namesrv", port, timeout)
        return self.namesrv_addr

    def start(self, ready_timeout: float = 180.0) -> None:
        # The brokers once the name server listens: a broker registers at its start, then every
        # 30 s after a first 10 s; one that boots before the name server (as fast as it, with
        # the class archives) would wait those 10 s unregistered.
        self.start_namesrv(timeout=ready_timeout)
        for name, (auto_create, flush) in BROKERS.items():
            self._spawn_broker(name, auto_create, flush)
        asyncio.run(self._wait_ready(ready_timeout))

    def _wait_listening(self, name: str, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((self.host, port), timeout=1.0).close()
                return
            except OSError:
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name} not listening in {timeout:.0f}s:\n{self.log_tail(name)}"
                    ) from None
                time.sleep(0.02)

    def restart_broker(self, name: str, timeout: float = 180.0, sig: int = signal.SIGTERM) -> None:
        """Stop broker `name` (SIGTERM, as an operator would, unless told otherwise) and start
        it again on the same port and store; returns once it is registered again."""
        addr = self.stop_broker(name, sig)
        self.start_broker_again(name, addr, timeout)

    def start_broker_again(self, name: str, addr: str, timeout: float = 180.0) -> None:
        """Start stopped broker `name` again on its address and store; returns once it is
        registered: once the name server has dropped the stopped process's registration
        (gone with its connection, within milliseconds; up to 120 s if that connection hangs),
        then lists the new one. Without the first wait a registration still listed for the
        stopped process passed for the new one's, which can take seconds more to listen."""
        self._wait_unregistered(name, timeout)
        conf = self.root / f"{name}.conf"
        self._spawn(name, "org.apache.rocketmq.broker.BrokerStartup", conf)
        self.brokers[name] = addr
        self._wait_registered(name, timeout)

    def _wait_unregistered(self, name: str, timeout: float) -> None:
        async def unregistered() -> None:
            deadline = time.monotonic() + timeout
            async with self.client(connect_timeout=1.0, request_timeout=2.0) as client:
                while True:
                    broker = (await client.get_cluster_info()).brokers.get(name)
                    if broker is None or not broker.master_addr:
                        return
                    if time.monotonic() > deadline:
                        raise RemotingError(f"still registered after {timeout:.0f}s")
                    await asyncio.sleep(0.05)

        try:
            asyncio.run(unregistered())
        except Exception as exc:
            raise RuntimeError(f"stopped broker {name} stays registered: {exc}") from exc

    def _wait_registered(self, name: str, timeout: float) -> None:
        async def registered() -> None:
            async with self.client(connect_timeout=1.0, request_timeout=2.0) as client:
                await wait_for_brokers(client, CLUSTER_NAME, [name], timeout=timeout)

        try:
            asyncio.run(registered())
        except Exception as exc:
            raise RuntimeError(f"{name} did not register: {exc}\n{self.log_tail(name)}") from exc

    def _spawn_broker(
        self, name: str, auto_create: bool, flush: str, lmq: bool = True, extra: Sequence[str] = ()
    ) -> None:
        port = broker_port()
        store = self.root / name / "store"
        conf = self.root / f"{name}.conf"
        on = "true" if lmq else "false"
        conf.write_text(
            "\n".join(
                [
                    f"brokerClusterName={CLUSTER_NAME}",
                    f"brokerName={name}",
                    "brokerId=0",
                    "brokerRole=ASYNC_MASTER",
                    f"flushDiskType={flush}",
                    f"namesrvAddr={self.namesrv_addr}",
                    f"brokerIP1={self.host}",
                    f"brokerIP2={self.host}",
                    f"bindAddress={self.host}",
                    f"listenPort={port}",
                    f"haListenPort={port + 1}",
                    f"storePathRootDir={store}",
                    f"storePathCommitLog={store / 'commitlog'}",
                    f"enableLmq={on}",
                    f"enableMultiDispatch={on}",
                    f"autoCreateTopicEnable={'true' if auto_create else 'false'}",
                    "autoCreateSubscriptionGroup=true",
                    # SQL92 property filters of native consumers (docs/rocketmq-apps.md).
                    "enablePropertyFilter=true",
                    "mappedFileSizeCommitLog=33554432",
                    "mappedFileSizeConsumeQueue=60000",
                    # Timer messages (TIMER_DELIVER_MS): the RocketMQ backend's delayed publish.
                    "timerWheelEnable=true",
                    "timerMaxDelaySec=604800",  # lmqtt's max_delay default: 7 days
                    # Fire within 0.1 s of the due time (default 1 s: up to 1 s late).
                    "timerPrecisionMs=100",
                    # The wheel is 7 days of 1 s slots whatever the above (38.7 MB), and each
                    # flush compares all of it byte by byte: every second (the default) that
                    # is a fifth of a core per idle broker under the C1-only JIT. The wheel's
                    # flush is for a broker crash (recovered from the timer log); the tests
                    # never kill a broker with timers pending.
                    "timerFlushIntervalMs=30000",
                    "fetchNamesrvAddrByAddressServer=false",
                    "metricsExporterType=DISABLE",
                    # The default 200 ms suits a dedicated broker; on a shared 2-core host a
                    # burst of pipelined sends would be shed as SYSTEM_BUSY
                    # ([TIMEOUT_CLEAN_QUEUE]), which the client reports as BrokerBusyError.
                    "waitTimeMillsInSendQueue=3000",
                    # A pull answers at most 32 messages from memory by default: the parent
                    # topic's tail (gateway/storage/rocketmq/tail.py) asks for 256, so that a
                    # tail behind by a burst catches up in a few round trips.
                    "maxTransferCountOnMessageInMemory=256",
                    # One send thread, as lmqtt needs (pipelined sends of one publisher stored
                    # in order; the gateway warns otherwise): the test flags' one visible
                    # processor gives 1 anyway, the production flags' two would give 2.
                    "sendMessageThreadPoolNums=1",
                    # Dispatch (the consume queues, the light queues, the held pulls' wake-up)
                    # at the append, not after the flush: a SYNC_FLUSH broker's SEND_OK still
                    # waits for the flush. With the default (false) 5.3.3's reput thread spins
                    # while it has dispatched all that is flushed and more is written (its loop
                    # re-reads the same offset until the flush moves), a core on a busy
                    # SYNC_FLUSH broker, and every delivery waits for the fsync.
                    "readUnCommitted=true",
                    # A test's own settings (a later line wins over an earlier one).
                    *extra,
                    "",
                ]
            )
        )
        self._spawn(name, "org.apache.rocketmq.broker.BrokerStartup", conf)
        self.brokers[name] = f"{self.host}:{port}"

    def start_extra_broker(
        self,
        name: str,
        *,
        lmq: bool = True,
        flush: str = "ASYNC_FLUSH",
        timeout: float = 180.0,
        extra: Sequence[str] = (),
    ) -> str:
        """Start one more broker in the cluster (e.g. without light queues, or with `extra`
        settings lines); its address once registered. Stop it with stop_broker()."""
        self._spawn_broker(name, True, flush, lmq=lmq, extra=extra)
        self._wait_registered(name, timeout)
        return self.brokers[name]

    def stop_broker(self, name: str, sig: int = signal.SIGTERM) -> str:
        """Stop broker `name`: SIGTERM (graceful, ~10 s for a broker) unless told otherwise;
        SIGKILL suits a broker a test is done with (its store is thrown away), or a crash.
        Returns the address it had (start_broker_again)."""
        proc = self.procs.pop(name)
        addr = self.brokers.pop(name, "")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, self._stop_signal(name, sig))
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        self._keep_archive(name, proc)
        return addr

    def _stop_signal(self, name: str, sig: int) -> int:
        """A JVM dumping its class archive writes it at a graceful exit only: it gets SIGTERM
        while the archive is still missing (another JVM, of this cluster or of another
        worker's, may have written it meanwhile: then there is nothing to wait for)."""
        dump = self.dumps.get(name)
        return signal.SIGTERM if dump is not None and not dump[1].exists() else sig

    def _keep_archive(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        dump = self.dumps.pop(name, None)
        if dump is None:
            return
        partial, final = dump
        if proc.returncode != -signal.SIGKILL and partial.exists() and partial.stat().st_size:
            os.replace(partial, final)
        else:
            partial.unlink(missing_ok=True)

    async def _wait_ready(self, timeout: float) -> None:
        """Ready = the name server lists both brokers of the cluster with a master address."""
        deadline = time.monotonic() + timeout
        async with self.client(connect_timeout=1.0, request_timeout=2.0) as client:
            while True:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}"
                        )
                try:
                    info = await wait_for_brokers(client, CLUSTER_NAME, BROKERS, timeout=1.0)
                except Exception as exc:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"cluster not ready in {timeout:.0f}s ({exc}); logs:\n"
                            + "\n".join(self.log_tail(n) for n in self.procs)
                        ) from exc
                    continue
                for name in BROKERS:
                    addr = self.brokers[name]
                    registered = info.brokers[name].master_addr
                    assert registered == addr, f"{name} registered {registered}, expected {addr}"
                return

    def held_pulls(self) -> dict[str, int | None]:
        """The pulls each broker holds now, as the broker itself counts them: the live
        ``PullRequest`` objects of its JVM (PullRequestHoldService and its light-queue twin keep
        one per held pull and drop it when the pull is answered), from ``jcmd
        GC.class_histogram`` (a full collection first, so only live ones count; the broker
        pauses for it). None for a broker jcmd could not read."""
        out: dict[str, int | None] = {}
        jcmd = shutil.which("jcmd")
        for name, proc in self.procs.items():
            if name == "namesrv" or proc.poll() is not None:
                continue
            out[name] = None
            if jcmd is None:
                continue
            try:
                done = subprocess.run(
                    [*self.wrap, jcmd, str(proc.pid), "GC.class_histogram"],
                    capture_output=True, text=True, timeout=60, check=True,
                )  # fmt: skip
            except (OSError, subprocess.SubprocessError):
                continue
            out[name] = 0
            for line in done.stdout.splitlines():
                # " 123:   <instances>   <bytes>  <class name> (<module>)"
                cols = line.split()
                if len(cols) >= 4 and cols[3] == HELD_PULL_CLASS:
                    out[name] = int(cols[1])
        return out

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last `lines` lines of `name`'s output, without the class archive's warnings: a
        JVM that dumps its archive at exit writes hundreds of ``[cds]`` lines after the line
        that says why it exited."""
        path = self.root / f"{name}.out"
        if not path.exists():
            return f"[{name}: no output]"
        text = path.read_text(errors="replace").splitlines()
        kept = [line for line in text if "][cds" not in line]
        left_out = len(text) - len(kept)
        note = f" ({left_out} class archive lines left out; {path})" if left_out else ""
        return f"[{name}{note}]\n" + "\n".join(kept[-lines:])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to every process (whole process group; SIGTERM to one dumping its class
        archive), SIGKILL what is left after 20 s. The tests' cluster is thrown away: the
        session fixture stops it with SIGKILL (a broker's graceful stop takes seconds)."""
        for name, proc in self.procs.items():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, self._stop_signal(name, sig))
        deadline = time.monotonic() + 20.0
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            self._keep_archive(name, proc)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> None:
    """Return once `check()` is true; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def dispatched(client: RemotingClient, broker: str, queue: str, count: int) -> None:
    """Wait until the broker's dispatch thread has indexed ``count`` messages in ``queue``.

    A send is answered once the CommitLog append is done; the consume-queue units (the light
    queues' included) are written by a separate thread right after, so a pull issued at once
    may not see the message yet.
    """

    async def reached() -> bool:
        return await client.get_max_offset(broker, queue) >= count

    await eventually(reached)


def main() -> int:
    """`python -m tests.rocketmq.cluster [DIR]`: the test cluster for development (README's
    cluster mode on one machine): fetches the jars, starts it in DIR (default a temporary
    directory), prints the name server's address, and stops everything on Ctrl-C / SIGTERM."""
    import sys
    import tempfile

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="lmqtt-rmq-"))
    root.mkdir(parents=True, exist_ok=True)
    ensure_jars()
    cluster = RocketMQCluster(root)
    stop = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
        brokers = ", ".join(f"{n} {a}" for n, a in cluster.brokers.items())
        print(f"name server {cluster.namesrv_addr} (brokers: {brokers}; in {root})", flush=True)
        print(f"lmqtt serve --store rocketmq --namesrv {cluster.namesrv_addr}", flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
