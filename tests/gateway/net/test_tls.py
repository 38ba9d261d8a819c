"""MQTT over TLS with real paho clients: server authentication, client certificates, the
certificate's CN as user name (with ACL), and plain or unverified clients refused."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.config import load_settings
from gateway.net.tls import TlsConfigError
from tests.gateway.certs import Certs, make_certs
from tests.gateway.conftest import Client, GatewayHarness


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_client(port: int, certs: Certs, cn: str | None = None, **kw: Any) -> Client:
    c = Client(port, connect=False, **kw)
    if cn is None:
        c.c.tls_set(ca_certs=str(certs.ca))
    else:
        cert, key = certs.client(cn)
        c.c.tls_set(ca_certs=str(certs.ca), certfile=str(cert), keyfile=str(key))
    return c


@pytest.fixture
def tls_gateway(tmp_path: Path, certs: Certs) -> Iterator[GatewayHarness]:
    h = GatewayHarness(
        tmp_path / "data",
        tls_port=0,
        tls_certfile=certs.server_cert,
        tls_keyfile=certs.server_key,
    ).start()
    try:
        yield h
    finally:
        h.stop()


def _tls_port(h: GatewayHarness, name: str = "mqtts") -> int:
    assert h.gw is not None
    return h.gw.listeners.port(name)


def test_tls_publish_subscribe(
    tls_gateway: GatewayHarness, certs: Certs, clients: list[Client]
) -> None:
    port = _tls_port(tls_gateway)
    sub = tls_client(port, certs, v5=True)
    clients.append(sub)
    sub.connect()
    assert sub.connack == (False, 0)
    sub.subscribe("secure/#", 1)
    plain = Client(tls_gateway.port)  # the plain listener serves the same broker
    clients.append(plain)
    plain.publish("secure/a", b"over tcp", 1)
    pub = tls_client(port, certs)
    clients.append(pub)
    pub.connect()
    pub.publish("secure/b", b"over tls", 1)
    assert sorted(m.payload for m in sub.wait_messages(2)) == [b"over tcp", b"over tls"]


def test_plain_mqtt_on_tls_port_is_refused(tls_gateway: GatewayHarness) -> None:
    port = _tls_port(tls_gateway)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\x10\x10\x00\x04MQTT\x04\x02\x00\x3c\x00\x04abcd")
        data = b""
        try:
            while chunk := sock.recv(1024):
                data += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the TLS port neither answered nor closed in 10 s (got {data!r})")
        assert not data.startswith(b"\x20")  # never a CONNACK


def test_untrusted_server_certificate_fails_client_side(tls_gateway: GatewayHarness) -> None:
    ctx = ssl.create_default_context()  # system CAs: our test CA is unknown
    with (
        socket.create_connection(("127.0.0.1", _tls_port(tls_gateway)), timeout=10) as sock,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ctx.wrap_socket(sock, server_hostname="localhost")


def test_client_certificate_cn_is_user_name(
    tmp_path: Path, certs: Certs, clients: list[Client]
) -> None:
    acl = tmp_path / "acl"
    acl.write_text("user device-42\ntopic readwrite devices/42/#\n")
    passwd = tmp_path / "passwd"
    passwd.write_text("")  # no password users at all: only certificates get in
    h = GatewayHarness(
        tmp_path / "data",
        tls_port=0,
        tls_certfile=certs.server_cert,
        tls_keyfile=certs.server_key,
        tls_cafile=certs.ca,
        tls_require_certificate=True,
        tls_use_identity_as_username=True,
        password_file=passwd,
        acl_file=acl,
    ).start()
    try:
        port = _tls_port(h)
        dev = tls_client(port, certs, "device-42", v5=True)
        clients.append(dev)
        dev.connect()
        assert dev.connack == (False, 0)
        assert dev.subscribe("devices/42/#", 1) == [1]
        assert dev.subscribe("devices/43/#", 1) == [0x87]  # ACL of user "device-42"
        dev.publish("devices/42/t", b"21.5", 1)
        assert dev.wait_messages(1)[0].payload == b"21.5"
        # Without a client certificate the TLS handshake itself fails.
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
            ctx.wrap_socket(sock, server_hostname="localhost") as tls,
            pytest.raises((ssl.SSLError, ConnectionResetError, OSError)),
        ):
            tls.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")
            if not tls.recv(4):
                raise ConnectionResetError("closed")
        # The plain listener has no certificate: password rules apply, and there are no users.
        anon = Client(h.port, connect=False)
        clients.append(anon)
        anon.connect()
        assert anon.connack is not None and anon.connack[1] == 0x87
    finally:
        h.stop()


def test_bad_certificate_files_stop_start(tmp_path: Path, certs: Certs) -> None:
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate\n")
    settings = load_settings(
        port=0,
        data_dir=tmp_path / "d",
        tls_port=0,
        tls_certfile=bogus,
        tls_keyfile=certs.server_key,
    )
    with pytest.raises(TlsConfigError, match=r"bogus\.pem"):
        Gateway(settings)
    assert not (tmp_path / "d").exists()
