"""`lmqtt serve` as a subprocess on a data directory, port 0, optionally under the shim."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess:
    """The real gateway process; ``kill()`` is a SIGKILL (nothing flushed, nothing closed)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        flush: str = "sync",
        segment_size: int,
        env: dict[str, str] | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        full_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "LMQTT_SEGMENT_SIZE": str(segment_size),
            **(env or {}),
        }
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", "0", "--host", "127.0.0.1",
             "--data-dir", str(data_dir), "--flush", flush, "--sys-interval", "0"],
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self._port: list[int] = []
        self._started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # Set by the reader at the "listening" line, or when the output ends (process gone).
        self._started.wait(start_timeout)
        if not self._port:
            self.kill()
            self._reader.join(5)
            raise RuntimeError(
                f"gateway did not start (exit {self.proc.returncode}):\n{self.log_tail()}"
            )
        self.port = self._port[0]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            m = re.search(r"listening on [^:]+:(\d+)", line)
            if m and not self._port:
                self._port.append(int(m.group(1)))
                self._started.set()
        self._started.set()

    def log_tail(self, n: int = 30) -> str:
        return "".join(self.output[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
