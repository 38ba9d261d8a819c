"""Cross-check with a real client: paho-mqtt (3.1.1 and 5.0) against our Connection.

A tiny blocking server on 127.0.0.1 (port 0) runs our Connection in a thread, records every
event and answers like a broker would. The client subscribes, publishes at QoS 0/1/2 and
receives a QoS 1 message we encode, so both directions go through an independent codec.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from gateway.protocol import (
    ConnAck,
    Connect,
    Connection,
    ConnectionClosed,
    Disconnect,
    Event,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)

TIMEOUT = 10.0


class RecordingServer:
    """Accept one client, feed its bytes to a Connection, answer, record events."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.events: list[Event] = []
        self.raw = bytearray()
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.listener.settimeout(TIMEOUT)
            sock, _ = self.listener.accept()
            sock.settimeout(TIMEOUT)
            with sock:
                self._run(sock)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.listener.close()
            self.done.set()

    def _run(self, sock: socket.socket) -> None:
        conn = Connection()
        while True:
            data = sock.recv(65536)
            self.raw += data
            conn.receive_data(data)
            for event in conn.events():
                self.events.append(event)
                if isinstance(event, (Disconnect, ConnectionClosed)):
                    return
                sock.sendall(self._answer(conn, event))

    @staticmethod
    def _answer(conn: Connection, event: Event) -> bytes:
        v5 = conn.protocol_level == 5
        if isinstance(event, Connect):
            props = Properties(topic_alias_maximum=4, receive_maximum=20) if v5 else None
            return conn.send(ConnAck(False, 0, props))
        if isinstance(event, Publish):
            if event.qos == 1:
                return conn.send(PubAck(event.packet_id or 0))
            if event.qos == 2:
                return conn.send(PubRec(event.packet_id or 0))
            return b""
        if isinstance(event, PubRel):
            return conn.send(PubComp(event.packet_id))
        if isinstance(event, Subscribe):
            grant = conn.send(SubAck(event.packet_id, [s.qos for s in event.subscriptions]))
            props = Properties(user_properties=[("from", "gateway")]) if v5 else None
            down = Publish("cmd/dev-1", b"reboot", 1, False, False, 42, props)
            return grant + conn.send(down)
        if isinstance(event, Unsubscribe):
            return conn.send(UnsubAck(event.packet_id, [0] * len(event.topic_filters)))
        if isinstance(event, PingReq):
            return conn.send(PingResp())
        return b""


def run_client(protocol: int, server: RecordingServer) -> list[Any]:
    v5 = protocol == paho.MQTTv5
    client = paho.Client(
        paho.CallbackAPIVersion.VERSION2,
        client_id="paho-dev-1",
        protocol=paho.MQTTProtocolVersion(protocol),
    )
    received: list[Any] = []
    got_message = threading.Event()
    subscribed = threading.Event()

    def on_message(_c: Any, _u: Any, message: Any) -> None:
        received.append(message)
        got_message.set()

    client.on_message = on_message
    client.on_subscribe = lambda *args: subscribed.set()
    client.username_pw_set("alice", "pw")
    will_props = None
    if v5:
        will_props = PahoProperties(PacketTypes.WILLMESSAGE)
        will_props.WillDelayInterval = 30
    client.will_set("dev/1/status", b"offline", 1, True, properties=will_props)
    connect_props = None
    if v5:
        connect_props = PahoProperties(PacketTypes.CONNECT)
        connect_props.SessionExpiryInterval = 600
        connect_props.ReceiveMaximum = 10
    if v5:
        client.connect("127.0.0.1", server.port, keepalive=30, properties=connect_props)
    else:
        client.connect("127.0.0.1", server.port, keepalive=30)
    client.loop_start()
    try:
        assert client.subscribe("cmd/#", qos=1)[0] == paho.MQTT_ERR_SUCCESS
        assert subscribed.wait(TIMEOUT)
        publish_props = None
        if v5:
            publish_props = PahoProperties(PacketTypes.PUBLISH)
            publish_props.MessageExpiryInterval = 60
            publish_props.ContentType = "application/json"
            publish_props.ResponseTopic = "reply/dev-1"
            publish_props.CorrelationData = b"\x01\x02"
            publish_props.UserProperty = [("unit", "C"), ("unit", "F")]
        infos = [
            client.publish("dev/1/temp", b"21.5", 0),
            client.publish("dev/1/temp", b"x" * 300, 1, retain=True, properties=publish_props),
            client.publish("dev/1/temp", b"exactly-once", 2),
        ]
        for info in infos:
            info.wait_for_publish(TIMEOUT)
            assert info.is_published()
        assert got_message.wait(TIMEOUT)
        client.unsubscribe("cmd/#")
    finally:
        client.disconnect()
        client.loop_stop()
    assert server.done.wait(TIMEOUT)
    if server.error is not None:
        raise server.error
    return received


@pytest.mark.parametrize("protocol", [paho.MQTTv311, paho.MQTTv5], ids=["3.1.1", "5.0"])
def test_paho_client_against_connection(protocol: int) -> None:
    server = RecordingServer()
    received = run_client(protocol, server)
    v5 = protocol == paho.MQTTv5
    level = 5 if v5 else 4
    events = server.events

    connect = events[0]
    assert isinstance(connect, Connect)
    assert (connect.protocol_level, connect.client_id, connect.keep_alive) == (
        level,
        "paho-dev-1",
        30,
    )
    assert (connect.username, connect.password) == ("alice", b"pw")
    assert connect.will is not None
    assert (connect.will.topic, connect.will.payload, connect.will.qos, connect.will.retain) == (
        "dev/1/status",
        b"offline",
        1,
        True,
    )
    if v5:
        assert connect.properties.session_expiry_interval == 600
        assert connect.properties.receive_maximum == 10
        assert connect.will.properties.will_delay_interval == 30

    subscribes = [e for e in events if isinstance(e, Subscribe)]
    assert [(s.topic_filter, s.qos) for s in subscribes[0].subscriptions] == [("cmd/#", 1)]

    publishes = [e for e in events if isinstance(e, Publish)]
    assert [(p.topic, p.payload, p.qos) for p in publishes] == [
        ("dev/1/temp", b"21.5", 0),
        ("dev/1/temp", b"x" * 300, 1),
        ("dev/1/temp", b"exactly-once", 2),
    ]
    assert publishes[1].retain
    if v5:
        props = publishes[1].properties
        assert props is not None
        assert props.message_expiry_interval == 60
        assert props.content_type == "application/json"
        assert props.response_topic == "reply/dev-1"
        assert props.correlation_data == b"\x01\x02"
        assert props.user_properties == [("unit", "C"), ("unit", "F")]

    # QoS 2 handshake and the client's PUBACK for our downstream message.
    assert any(isinstance(e, PubRel) for e in events)
    assert PubAck(42) in events
    assert any(isinstance(e, Unsubscribe) and e.topic_filters == ["cmd/#"] for e in events)
    assert isinstance(events[-1], Disconnect)

    # paho decoded what we encoded.
    assert len(received) == 1
    message = received[0]
    assert (message.topic, message.payload, message.qos) == ("cmd/dev-1", b"reboot", 1)
    if v5:
        assert message.properties.UserProperty == [("from", "gateway")]

    # Re-decoding the captured client stream in one piece gives the same events.
    replay = Connection()
    replay.receive_data(bytes(server.raw))
    assert replay.events() == events
