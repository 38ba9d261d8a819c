"""The listen backlog (settings.listen_backlog): a fleet reconnecting while the event loop is busy
waits in the kernel, completed, instead of being dropped."""

from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.gateway.conftest import GatewayHarness, wait_until

DEVICES = 300  # three times asyncio's default backlog of 100


def _somaxconn() -> int:
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(_somaxconn() <= DEVICES, reason="net.core.somaxconn caps the backlog")
def test_a_reconnect_storm_while_the_loop_is_busy_waits_in_the_backlog(tmp_path: Path) -> None:
    """300 devices connect while the gateway's event loop is held (it accepts nothing): the
    kernel completes every handshake and keeps it in the listen backlog. With asyncio's
    default of 100 it completed 101 and dropped the others' SYNs, each of those devices then
    waiting a 1 s retransmission (and, behind a loop busy longer, 3 s more). Once the loop is
    free, the gateway accepts them all."""
    h = GatewayHarness(tmp_path / "data").start()
    held = threading.Event()
    release = threading.Event()

    def hold_the_loop() -> None:
        held.set()
        release.wait(30)

    holder = threading.Thread(target=h.call, args=(hold_the_loop,))
    holder.start()
    socks: list[socket.socket] = []
    try:
        assert held.wait(10)
        for _ in range(DEVICES):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", h.port))  # EINPROGRESS: the handshake is the kernel's
            socks.append(s)
        # Well within the first SYN retransmission (1 s): a handshake not completed by then
        # had its SYN dropped.
        deadline = time.monotonic() + 0.8
        pending = {s.fileno(): s for s in socks}
        completed = 0
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], deadline - time.monotonic())
            for fd in writable:
                s = pending.pop(fd)
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                completed += 1
        assert completed == DEVICES, f"{completed} of {DEVICES} handshakes completed"
        release.set()
        holder.join()
        gw = h.gw
        assert gw is not None
        wait_until(lambda: h.call(lambda: len(gw.connections)) == DEVICES, what="all accepted")
    finally:
        release.set()
        holder.join()
        for s in socks:
            s.close()
        h.stop()
