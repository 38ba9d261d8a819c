"""SIGKILL of a gateway process with flush=sync loses no acknowledged message."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gateway.protocol import PubAck, Publish, Subscribe, Subscription
from tests.gateway.conftest import GatewayHarness, RawClient

ROOT = Path(__file__).resolve().parents[3]
SEGMENT = 4 << 20


def _spawn(data_dir: Path) -> tuple[subprocess.Popen[str], int]:
    # Small segments: recovery after the kill zeroes the tail of the active segment.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMQTT_SEGMENT_SIZE": str(SEGMENT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", "0", "--data-dir", str(data_dir),
         "--flush", "sync", "--sys-interval", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    port: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"listening on [^:]+:(\d+)", line)
            if m and not port:
                port.append(int(m.group(1)))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    # Generous: on a host loaded by the rest of the suite a start took over 20 s once. A start
    # that fails takes its process with it, so no gateway outlives the test.
    deadline = time.monotonic() + 60
    while not port and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    if not port:
        proc.kill()
        proc.wait(10)
    assert port, "gateway subprocess did not start"
    return proc, port[0]


def test_sigkill_with_sync_flush_loses_no_acknowledged_message(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc, port = _spawn(data)
    acked: list[bytes] = []
    try:
        sub = RawClient(port, level=4)
        assert sub.connect("keeper", clean=False).reason_code == 0
        sub.send(Subscribe(1, [Subscription("crash/#", 1)]))
        assert sub.recv().reason_codes == [1]
        sub.close()  # offline: everything waits in the store
        pub = RawClient(port, level=4)
        pub.connect("writer")
        # Pipeline publishes; whatever got a PUBACK before the kill must survive it.
        for i in range(1, 201):
            pub.send(Publish("crash/t", f"m{i}".encode(), qos=1, packet_id=i))
        while len(acked) < 120:
            ev = pub.recv()
            assert isinstance(ev, PubAck)
            acked.append(f"m{ev.packet_id}".encode())
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        pub.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    h = GatewayHarness(data, flush="sync", segment_size=SEGMENT).start()
    try:
        sub = RawClient(h.port, level=4)
        ack = sub.connect("keeper", clean=False)
        assert ack.session_present
        got: list[bytes] = []
        while True:
            try:
                ev = sub.recv(timeout=0.5 if len(got) >= len(acked) else 5)
            except TimeoutError:
                break
            if ev is None:
                break
            assert isinstance(ev, Publish) and ev.packet_id is not None
            got.append(ev.payload)
            sub.send(PubAck(ev.packet_id))
        missing = [m for m in acked if m not in got]
        assert not missing, f"acknowledged but lost: {missing[:5]}..."
        assert got == sorted(got, key=lambda p: int(p[1:]))  # in publish order
        sub.close()
    finally:
        h.stop()


def test_sigkill_loses_no_subscribed_persistent_session(tmp_path: Path) -> None:
    """A SUBACK means the session's state record is in the log: a kill right after it loses
    none of them (the state log's tail is recovered, a torn record cut off)."""
    data = tmp_path / "data"
    proc, port = _spawn(data)
    try:
        for i in range(40):
            c = RawClient(port, level=4)
            assert c.connect(f"dev-{i}", clean=False).reason_code == 0
            c.send(Subscribe(1, [Subscription(f"dev/{i}/cmd", 1)]))
            assert c.recv().reason_codes == [1]
            c.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    h = GatewayHarness(data, flush="sync", segment_size=SEGMENT).start()
    try:
        pub = RawClient(h.port, level=4)
        pub.connect("pub")
        for i in range(40):
            pub.send(Publish(f"dev/{i}/cmd", f"to-{i}".encode(), qos=1, packet_id=i + 1))
            assert isinstance(pub.recv(), PubAck)
        pub.close()
        for i in range(40):
            c = RawClient(h.port, level=4)
            assert c.connect(f"dev-{i}", clean=False).session_present
            msg = c.recv()
            assert isinstance(msg, Publish) and msg.payload == f"to-{i}".encode()
            c.close()
    finally:
        h.stop()
