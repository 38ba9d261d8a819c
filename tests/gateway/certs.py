"""Test certificates made with the openssl command line: a CA, a server certificate for
127.0.0.1/localhost and client certificates, all signed by the CA (valid one day)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    dir: Path

    def client(self, cn: str) -> tuple[Path, Path]:
        """(certificate, key) of a client certificate with subject CN `cn`."""
        cert, key = self.dir / f"{cn}.crt", self.dir / f"{cn}.key"
        if not cert.exists():
            _issue(self.dir, cn, cert, key, ext=None)
        return cert, key


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(d: Path, cn: str, cert: Path, key: Path, ext: str | None) -> None:
    csr = d / f"{cn}.csr"
    _run("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
         "-subj", f"/CN={cn}", cwd=d)  # fmt: skip
    args = ["x509", "-req", "-in", str(csr), "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", str(cert)]  # fmt: skip
    if ext is not None:
        (d / f"{cn}.ext").write_text(ext)
        args += ["-extfile", f"{cn}.ext"]
    _run(*args, cwd=d)


def make_certs(d: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "1", "-subj", "/CN=lmqtt test CA", cwd=d)  # fmt: skip
    _issue(d, "localhost", d / "server.crt", d / "server.key",
           ext="subjectAltName=IP:127.0.0.1,DNS:localhost\n")  # fmt: skip
    return Certs(d / "ca.crt", d / "server.crt", d / "server.key", d)
