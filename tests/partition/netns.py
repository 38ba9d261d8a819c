"""Network namespaces joined by veth pairs, for cutting real processes off from each other.

One `Network` per test module: a namespace for the RocketMQ cluster (`rmq`) and one per gateway
node. Every link is a veth pair between two namespaces (no forwarding anywhere, so the root
namespace's `ip_forward` is left alone); the test process, in the root namespace, is the MQTT
clients' side::

      root namespace (test process: MQTT clients, RemotingClient)
        |  r: .1 -- .2        c1: .5 -- .6          c2: .9 -- .10
        |                          |                     |
      [rmq] RocketMQ on .254    [node1] gateway       [node2] gateway
        |                          |                     |
        +-- b1: .133 ------------ .134                   |
        +-- b2: .137 ---------------------------------- .138

All addresses are in one /24 drawn from 198.18.0.0/15 (RFC 2544, benchmarking: not routed
anywhere) that no route or address of the root namespace overlaps; each link is a /30. The
RocketMQ address (.254/32) sits on `rmq`'s loopback, on no link, so cutting one node's link
leaves it to the others; every namespace routes to it over its own link to `rmq`.

A cut sets the link's *far* end down, the one outside the cut node's namespace: the node's own
interface stays up (no carrier), so its packets vanish and nothing answers, as behind a failed
switch port; no error reaches its sockets at once. `heal` sets it up again. `drop_replies`
cuts one way only: a blackhole route in the far namespace swallows what goes back to the node.

Names carry the creating process's id (namespaces) and a random token (interfaces, at most 15
characters), so concurrent runs (pytest-xdist workers, several checkouts) never collide;
`destroy` removes everything, and a namespace left by a run that was killed (its process gone)
is removed by the next run.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

#: Namespaces of this suite: lmqtt-<pid of the creating process>-<token>-<role>.
_NS_NAME = re.compile(r"^lmqtt-(\d+)-[0-9a-f]+-\w+$")
#: The pool the suite's /24 is drawn from.
_POOL = ipaddress.IPv4Network("198.18.0.0/15")
RMQ_HOST = 254  # the RocketMQ address's last octet (on rmq's loopback)


def ip_command() -> str | None:
    """The `ip` executable of iproute2 (Debian's is in /usr/sbin, /sbin on older releases)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return shutil.which("ip", path=path)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    ip = ip_command()
    if ip is None:
        return "iproute2's `ip` is not installed (Debian: apt-get install iproute2)"
    probe = f"lmqtt-{os.getpid()}-{secrets.token_hex(3)}-probe"
    done = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` is not allowed here: {done.stderr.strip()}"
    subprocess.run([ip, "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Link:
    """A veth pair: end `a` in namespace `ns_a` (None: the root namespace), end `b` in `ns_b`.
    `far` ("a" or "b") is the end a cut sets down."""

    name_a: str
    ns_a: str | None
    addr_a: str
    name_b: str
    ns_b: str | None
    addr_b: str
    far: str

    def end(self, which: str) -> tuple[str, str | None]:
        return (self.name_a, self.ns_a) if which == "a" else (self.name_b, self.ns_b)


@dataclass
class Network:
    """The namespaces and links of the module docstring, for `nodes` gateway nodes."""

    nodes: int
    ip: str = field(default_factory=lambda: ip_command() or "ip")
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    block: ipaddress.IPv4Network | None = None
    namespaces: list[str] = field(default_factory=list)
    links: dict[str, Link] = field(default_factory=dict)  # "r", "c1", "b1", ...
    blackholes: list[tuple[str | None, str]] = field(default_factory=list)  # (namespace, addr)

    # -- names and addresses -----------------------------------------------------------------

    def ns(self, role: str) -> str:
        """The namespace of `role`: "rmq", or "node1", "node2", ..."""
        return f"lmqtt-{os.getpid()}-{self.token}-{role}"

    def addr(self, last: int) -> str:
        assert self.block is not None
        return str(self.block.network_address + last)

    @property
    def rmq_host(self) -> str:
        """The address the RocketMQ cluster binds and advertises."""
        return self.addr(RMQ_HOST)

    def node_host(self, i: int) -> str:
        """Node `i`'s address on its client link (where it listens for MQTT clients)."""
        return self.links[f"c{i}"].addr_b

    def wrap(self, role: str) -> tuple[str, ...]:
        """The command prefix that runs a program in `role`'s namespace."""
        return (self.ip, "netns", "exec", self.ns(role))

    # -- making and removing -----------------------------------------------------------------

    def create(self) -> Network:
        """Make everything (on failure, what was made is removed again)."""
        self._sweep()
        self.block = self._free_block()
        try:
            self._make()
        except BaseException:
            self.destroy()
            raise
        return self

    def _make(self) -> None:
        for role in ["rmq", *(f"node{i}" for i in range(1, self.nodes + 1))]:
            self._run("netns", "add", self.ns(role))
            self.namespaces.append(self.ns(role))
            self._run("-n", self.ns(role), "link", "set", "lo", "up")
        rmq = self.ns("rmq")
        self._run("-n", rmq, "addr", "add", f"{self.rmq_host}/32", "dev", "lo")
        # The test process reaches the cluster over its own link, never cut.
        self._link("r", None, 1, rmq, 2, far="b")
        self._run("route", "add", f"{self.rmq_host}/32", "via", self.addr(2))
        for i in range(1, self.nodes + 1):
            node = self.ns(f"node{i}")
            self._link(f"c{i}", None, 4 * i + 1, node, 4 * i + 2, far="a")  # cut at the root end
            b = self._link(f"b{i}", rmq, 128 + 4 * i + 1, node, 128 + 4 * i + 2, far="a")
            self._run("-n", node, "route", "add", f"{self.rmq_host}/32", "via", b.addr_a)

    def _link(
        self, key: str, ns_a: str | None, last_a: int, ns_b: str | None, last_b: int, far: str
    ) -> Link:
        link = Link(
            f"lm{self.token}{key}a", ns_a, self.addr(last_a),
            f"lm{self.token}{key}b", ns_b, self.addr(last_b), far,
        )  # fmt: skip
        self.links[key] = link
        cmd = ["link", "add", link.name_a]
        if ns_a is not None:
            cmd += ["netns", ns_a]
        cmd += ["type", "veth", "peer", "name", link.name_b]
        if ns_b is not None:
            cmd += ["netns", ns_b]
        self._run(*cmd)
        for name, ns, addr in ((link.name_a, ns_a, link.addr_a), (link.name_b, ns_b, link.addr_b)):
            self._run(*self._in(ns), "addr", "add", f"{addr}/30", "dev", name)
            self._run(*self._in(ns), "link", "set", name, "up")
        return link

    def destroy(self) -> None:
        """Remove the links and namespaces (after the processes in them were stopped)."""
        # Deleting a root-namespace end removes its pair (and the routes through it) even if
        # a namespace outlives this call because something still runs in it.
        for link in self.links.values():
            for name, ns in (link.end("a"), link.end("b")):
                if ns is None:
                    self._run("link", "del", name, check=False)
        for ns in self.namespaces:
            self._run("netns", "del", ns, check=False)
        self.links.clear()
        self.namespaces.clear()

    def _sweep(self) -> None:
        """Remove the namespaces of runs whose process is gone (killed before its cleanup)."""
        listed = subprocess.run([self.ip, "netns", "list"], capture_output=True, text=True)
        for line in listed.stdout.splitlines():
            name = line.split(" ", 1)[0]
            m = _NS_NAME.match(name)
            if m is None:
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                self._run("netns", "del", name, check=False)
            except PermissionError:
                pass  # alive, another user's

    def _free_block(self) -> ipaddress.IPv4Network:
        """A /24 of the pool that no address or route of the root namespace overlaps."""
        taken: list[ipaddress.IPv4Network] = []
        for cmd in (["-4", "-o", "addr", "show"], ["-4", "route", "show", "table", "all"]):
            out = subprocess.run([self.ip, *cmd], capture_output=True, text=True).stdout
            for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", out):
                net = ipaddress.IPv4Network(word, strict=False)
                if net.prefixlen > 0:
                    taken.append(net)
        blocks = list(_POOL.subnets(new_prefix=24))
        for block in random.sample(blocks, len(blocks)):
            if not any(block.overlaps(net) for net in taken):
                return block
        raise RuntimeError(f"no /24 of {_POOL} is free in the root namespace")

    # -- cuts --------------------------------------------------------------------------------

    def cut(self, key: str) -> None:
        """Cut link `key` ("c1": node 1 from its clients, "b1": node 1 from the brokers)."""
        self._set(key, "down")

    def drop_replies(self, key: str) -> None:
        """Cut link `key` one way: what the node sends still arrives, nothing comes back (a
        blackhole route to the node's address in the far namespace), so a request reaches
        the brokers and is carried out but its answer is lost."""
        link = self.links[key]
        _, ns = link.end(link.far)
        near = link.addr_b if link.far == "a" else link.addr_a
        self._run(*self._in(ns), "route", "add", "blackhole", f"{near}/32")
        self.blackholes.append((ns, near))

    def heal(self, key: str) -> None:
        self._set(key, "up")

    def heal_all(self) -> None:
        for key in self.links:
            self._set(key, "up")
        while self.blackholes:
            ns, addr = self.blackholes.pop()
            self._run(*self._in(ns), "route", "del", "blackhole", f"{addr}/32", check=False)

    def _set(self, key: str, state: str) -> None:
        link = self.links[key]
        name, ns = link.end(link.far)
        self._run(*self._in(ns), "link", "set", name, state)

    # -- running ip --------------------------------------------------------------------------

    @staticmethod
    def _in(ns: str | None) -> list[str]:
        return [] if ns is None else ["-n", ns]

    def _run(self, *args: str, check: bool = True) -> None:
        done = subprocess.run([self.ip, *args], capture_output=True, text=True)
        if check and done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def network(nodes: int) -> Iterator[Network]:
    net = Network(nodes).create()
    try:
        yield net
    finally:
        net.destroy()
