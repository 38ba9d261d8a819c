"""A real `lmqtt serve` process for end-to-end tests: a TOML file, free ports, the admin port."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedGateway:
    """`python -m gateway serve --config FILE` with an MQTT and an admin port; stopped with
    SIGTERM (a graceful stop) on exit."""

    def __init__(self, tmp: Path, toml: str = "", *, admin: bool = True) -> None:
        self.port = free_port()
        self.admin_port = free_port() if admin else None
        self.config = tmp / "lmqtt.toml"
        self.config.write_text(toml)
        args = [
            sys.executable, "-m", "gateway", "serve", "--config", str(self.config),
            "--port", str(self.port), "--data-dir", str(tmp / "data"), "--sys-interval", "0",
        ]  # fmt: skip
        if self.admin_port is not None:
            args += ["--admin-port", str(self.admin_port)]
        # The log goes to a file: a pipe nobody reads would stop the gateway once full.
        self.log = tmp / "stderr.log"
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening" not in line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"lmqtt serve did not start: {line!r} {self.log.read_text()}")

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def stop(self) -> str:
        """Stop gracefully; returns its log (stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=30)
        return self.log.read_text()

    def __enter__(self) -> ServedGateway:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
