"""Errors of the protocol core: one root, two kinds of blame.

`RemoteProtocolError` means the peer sent bytes that break the MQTT rules; it carries the
MQTT 5 reason code to answer with and whether a CONNACK or a DISCONNECT may be sent before the
connection is closed (3.1.1 has no DISCONNECT from the server, so there the flags are usually
both false: close only). `LocalProtocolError` means our own code asked for something the
protocol forbids (sending a packet in the wrong state, a packet id already in use, ...).
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Root of every error raised by `gateway.protocol`."""

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(0x{self.reason_code:02X}, {self.message!r})"


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; close the connection after sending `conn.error_packet(err)`.

    `send_connack` / `send_disconnect` are filled in by the `Connection` from its state when the
    error is raised: a CONNACK when no CONNACK was sent yet, a DISCONNECT when MQTT 5 is in use
    and the connection had been accepted.
    """

    def __init__(
        self,
        reason_code: int,
        message: str,
        *,
        send_connack: bool = False,
        send_disconnect: bool = False,
    ) -> None:
        super().__init__(reason_code, message)
        self.send_connack = send_connack
        self.send_disconnect = send_disconnect


class LocalProtocolError(ProtocolError):
    """Our side tried to send something the protocol (or the connection state) forbids."""

    def __init__(self, message: str, reason_code: int = 0x83) -> None:
        super().__init__(reason_code, message)
