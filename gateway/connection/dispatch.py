"""PacketDispatch: which handler each packet the reader task reads goes to.

One handler per packet family, each shared by every connection and handed what it uses:
CONNECT and DISCONNECT (gateway/connection/connect.py), PUBLISH, PUBREL and PUBREC
(gateway/connection/publish.py), SUBSCRIBE and UNSUBSCRIBE (gateway/connection/subscribe.py).
The acknowledgements of what the gateway sent (PUBACK, PUBCOMP) go to the connection's delivery
loop, PINGREQ is answered here.
"""

from __future__ import annotations

from typing import Protocol

from gateway.connection.connect import ConnectHandler, Connecting
from gateway.connection.publish import PublishHandler, Publishing
from gateway.connection.subscribe import SubscribeHandler, Subscribing
from gateway.protocol import (
    Auth,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    Subscribe,
    Unsubscribe,
)

__all__ = ["Handled", "PacketDispatch"]


class Handled(Connecting, Publishing, Subscribing, Protocol):
    """The connection as the packet handlers see it (gateway/connection/client.py
    ClientConnection)."""


class PacketDispatch:
    """Hands each packet to its handler."""

    __slots__ = ("connect", "publish", "subscribe")

    def __init__(
        self, connect: ConnectHandler, publish: PublishHandler, subscribe: SubscribeHandler
    ) -> None:
        self.connect = connect
        self.publish = publish
        self.subscribe = subscribe

    async def dispatch(self, client: Handled, ev: object) -> None:
        kind = type(ev)
        if kind is Publish:
            assert isinstance(ev, Publish)
            await self.publish.on_publish(client, ev)
        elif kind is PubAck:
            assert isinstance(ev, PubAck)
            if client.delivery is not None:
                client.delivery.on_puback(ev.packet_id)
        elif kind is PubRec:
            assert isinstance(ev, PubRec)
            await self.publish.on_pubrecs(client, [ev])
        elif kind is PubComp:
            assert isinstance(ev, PubComp)
            if client.delivery is not None:
                client.delivery.on_puback(ev.packet_id)
        elif kind is PubRel:
            assert isinstance(ev, PubRel)
            await self.publish.on_pubrel(client, ev)
        elif kind is Subscribe:
            assert isinstance(ev, Subscribe)
            await self.subscribe.on_subscribe(client, ev)
        elif kind is Unsubscribe:
            assert isinstance(ev, Unsubscribe)
            self.subscribe.on_unsubscribe(client, ev)
        elif kind is PingReq:
            client.write(client.conn.send(PingResp()))
        elif kind is Connect:
            assert isinstance(ev, Connect)
            await self.connect.on_connect(client, ev)
        elif kind is Disconnect:
            assert isinstance(ev, Disconnect)
            self.connect.on_disconnect(client, ev)
        elif kind is Auth:
            client.fail(
                ReasonCode.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not supported"
            )
