"""TLS for the MQTT (tls_port) and WebSocket (wss_port) listeners: one server SSLContext.

TLS 1.2 or newer. With tls_cafile, clients may present a certificate signed by that CA
(required when tls_require_certificate); with tls_use_identity_as_username its subject CN
becomes the client's user name (gateway/access/control.py), as Mosquitto's use_identity_as_username.
"""

from __future__ import annotations

import ssl

from gateway.access.auth import SecurityError
from gateway.config import GatewaySettings

__all__ = ["TlsConfigError", "server_context"]


class TlsConfigError(SecurityError):
    """A certificate, key or CA file that cannot be loaded (names the file)."""


def server_context(settings: GatewaySettings) -> ssl.SSLContext:
    s = settings
    if s.tls_certfile is None or s.tls_keyfile is None:
        raise TlsConfigError("TLS listeners need tls_certfile and tls_keyfile")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(s.tls_certfile, s.tls_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(
            f"cannot load tls_certfile {s.tls_certfile} / tls_keyfile {s.tls_keyfile}: {exc}"
        ) from None
    if s.tls_cafile is not None:
        try:
            ctx.load_verify_locations(cafile=s.tls_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"cannot load tls_cafile {s.tls_cafile}: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if s.tls_require_certificate else ssl.CERT_OPTIONAL
    return ctx
