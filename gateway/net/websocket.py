"""MQTT over WebSocket (RFC 6455, subprotocol `mqtt`), as an asyncio Protocol.

    TCP/TLS bytes -> WebSocketMqttProtocol -> websockets' sans-IO ServerProtocol
                        |  handshake (HTTP upgrade, `Sec-WebSocket-Protocol: mqtt` required)
                        |  binary frames: payloads are a byte stream of MQTT packets
                        v
                     MqttServerProtocol (the same as plain TCP) over a WebSocketTransport,
                     whose write() wraps what the gateway sends into binary frames

MQTT packets may span frames and frames may hold several packets ([MQTT-6.0.0-2]), so frame
payloads are fed to the MQTT parser as a stream; text frames are a protocol error and close the
connection ([MQTT-6.0.0-1]). websockets answers pings and runs the closing handshake. A socket
that never completes the HTTP upgrade is closed after connect_timeout, like one that never
sends CONNECT.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from websockets.exceptions import InvalidState
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from gateway.connection.context import ClientContext
from gateway.net.server import MqttServerProtocol, ServerState

__all__ = ["WebSocketMqttProtocol", "WebSocketTransport"]

log = logging.getLogger("lmqtt.websocket")

SUBPROTOCOL = Subprotocol("mqtt")
# Frame payload limit beyond the largest MQTT packet we accept (one packet per frame is usual).
FRAME_SLACK = 64 * 1024
CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED_DATA = 1003


class WebSocketTransport(asyncio.Transport):
    """What MqttServerProtocol sees: writes become binary frames on the real transport."""

    def __init__(self, owner: WebSocketMqttProtocol, raw: asyncio.Transport) -> None:
        super().__init__()
        self._owner = owner
        self._raw = raw
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        try:
            self._owner.ws.send_binary(bytes(data))
        except InvalidState:
            return
        self._owner.flush()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._owner.close(CLOSE_NORMAL)

    def abort(self) -> None:
        self._closing = True
        self._raw.abort()

    def is_closing(self) -> bool:
        return self._closing or self._raw.is_closing()

    def pause_reading(self) -> None:
        self._raw.pause_reading()

    def resume_reading(self) -> None:
        self._raw.resume_reading()

    def is_reading(self) -> bool:
        return self._raw.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._raw.get_write_buffer_size()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._raw.get_extra_info(name, default)

    def can_write_eof(self) -> bool:
        return False


class WebSocketMqttProtocol(asyncio.Protocol):
    def __init__(self, context: ClientContext, state: ServerState) -> None:
        self.ctx = context
        self.state = state
        self.ws = ServerProtocol(
            subprotocols=[SUBPROTOCOL],
            max_size=context.settings.max_packet_size + FRAME_SLACK,
        )
        self.raw: asyncio.Transport | None = None
        self.mqtt: MqttServerProtocol | None = None
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.raw = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(
            self.ctx.settings.connect_timeout, self._handshake_timeout
        )

    def data_received(self, data: bytes) -> None:
        self.ws.receive_data(data)
        self._process()

    def eof_received(self) -> bool:
        self.ws.receive_eof()
        self._process()
        if self.mqtt is not None:
            return self.mqtt.eof_received()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.mqtt is not None:
            self.mqtt.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.mqtt is not None:
            self.mqtt.pause_writing()

    def resume_writing(self) -> None:
        if self.mqtt is not None:
            self.mqtt.resume_writing()

    # -- websockets events -------------------------------------------------------------------

    def _process(self) -> None:
        for event in self.ws.events_received():
            if isinstance(event, Request):
                self._handshake(event)
            elif isinstance(event, Frame):
                if event.opcode in (Opcode.BINARY, Opcode.CONT):
                    if self.mqtt is not None and event.data:
                        self.mqtt.data_received(bytes(event.data))
                elif event.opcode is Opcode.TEXT:
                    log.info("websocket text frame: closing ([MQTT-6.0.0-1])")
                    self.close(CLOSE_UNSUPPORTED_DATA)
        self.flush()

    def _handshake(self, request: Request) -> None:
        response = self.ws.accept(request)
        self.ws.send_response(response)
        if self.ws.handshake_exc is not None or response.status_code != 101:
            log.info("websocket handshake refused: %s", self.ws.handshake_exc)
            return  # the error response is sent by flush(), then the connection closes
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        assert self.raw is not None
        self.mqtt = MqttServerProtocol(self.ctx, self.state)
        self.mqtt.connection_made(WebSocketTransport(self, self.raw))

    def flush(self) -> None:
        raw = self.raw
        if raw is None:
            return
        for chunk in self.ws.data_to_send():
            if chunk:
                raw.write(chunk)
            else:  # websockets asks for the TCP connection to end
                raw.close()
                return
        if self.ws.state is State.CLOSED and not raw.is_closing():
            raw.close()

    def close(self, code: int) -> None:
        raw = self.raw
        if raw is None or raw.is_closing():
            return
        if self.ws.state is State.OPEN:
            try:
                self.ws.send_close(code)
            except InvalidState:
                pass
            self.flush()
        # The peer's close frame would be polite, but a hostile peer may never send it.
        if not raw.is_closing():
            raw.close()

    def _handshake_timeout(self) -> None:
        self._timer = None
        if self.mqtt is None and self.raw is not None:
            log.info("websocket handshake not completed in time; closing")
            self.raw.abort()
