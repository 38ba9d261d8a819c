r"""Connection: the server side of one MQTT connection, without I/O.

Theory of operation
-------------------
Bytes go in with `receive_data`; `next_event` / `events` frame them and hand back events.
Events go out with `send`, which returns bytes. Everything that affects the state machine lives
in this module:

    receiving  AWAIT_CONNECT --CONNECT--> CONNECTED --DISCONNECT, EOF--> CLOSED
                     \________ any RemoteProtocolError ___________________> ERROR
    sending    nothing before CONNECT; only CONNACK / AUTH before CONNACK; nothing after
               our DISCONNECT, a refusing CONNACK (>= 0x80) or `error_packet`.

* The two sides are separate (as in h11): a batch from `events()` may end in DISCONNECT, and
  the caller can still answer the packets that came before it.
* The protocol level comes from the CONNECT and governs both directions afterwards.
* Decoding: the fast decoder (`fast_decoder.decode_batch`) decodes runs of plain PUBLISH and
  PUBACK packets inline, the hot path, and hands every other packet to the general path here
  (`Connection._next_one`), which applies the receiving rules: `_on_publish`, `_on_packet` and the
  `_INBOUND` table. `send` applies the sending rules of the `_OUTBOUND` table.
* Receive buffer: the caller's `bytes` plus a read offset. When everything was consumed the
  next chunk is kept as is (no copy; slicing bytes copies once). A leftover partial packet is
  joined to the next chunk only if it is shorter than the chunk (the copy is paid for by new
  bytes); a longer one (a large body trickling in) moves to a bytearray that grows in place
  and drops its consumed prefix once that is more than half of it. Every byte is thus copied
  O(1) times however the input is split, and a huge declared length costs O(1) per call until
  the body is complete. A packet above `max_packet_size` is refused from its header (0x95).
* Packet identifiers and Receive Maximum quotas: see `packet_ids.py`; the sending side's state
  and the sends that need only it (a delivery run's prepared PUBLISHes, an error's answer):
  `sending.py`, the base of Connection.
* Timers belong to the caller: `keep_alive` and `keep_alive_timeout` are plain data.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from gateway.protocol import packet_types as pt
from gateway.protocol import wire
from gateway.protocol.errors import LocalProtocolError, RemoteProtocolError
from gateway.protocol.events import (
    Auth,
    ConnAck,
    Connect,
    ConnectionClosed,
    Disconnect,
    Event,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
)
from gateway.protocol.fast_decoder import (
    FAST_PUBLISH_QOS,
    PUBACKS,
    SCAN,
    TAKE_PLAIN,
    decode_batch,
)
from gateway.protocol.phases import (
    AWAIT_CONNECT,
    CLOSED,
    CONNECTED,
    ERROR,
    NEED_DATA,
    Phase,
    Sentinel,
)
from gateway.protocol.readers import (
    READERS,
    TOPIC_CACHE,
    check_fixed_flags,
    check_message_properties,
    connect_level,
    read_connect,
    read_publish,
)
from gateway.protocol.reason_codes import ReasonCode
from gateway.protocol.sending import CONNACK_311_CODES, PACKET_TOO_LARGE, ConnectionSending
from gateway.protocol.wire import PACKET_ID_BYTES
from gateway.protocol.writers import WRITERS, write_publish

# Every change of phase the state machine makes, with its cause. `_enter` refuses any other, so
# a new code path that moves the phase must be added here, where the whole machine is visible.
TRANSITIONS: dict[tuple[Phase, Phase], str] = {
    (AWAIT_CONNECT, CONNECTED): "CONNECT",
    (AWAIT_CONNECT, CLOSED): "EOF before CONNECT",
    (AWAIT_CONNECT, ERROR): "malformed or refused CONNECT",
    (CONNECTED, CLOSED): "DISCONNECT or EOF",
    (CONNECTED, ERROR): "protocol error",
    (CLOSED, CLOSED): "EOF after DISCONNECT",
    (CLOSED, ERROR): "bytes after DISCONNECT",
    (ERROR, ERROR): "a second error while failing",
    (ERROR, CLOSED): "EOF after an error",
}

# Packet types a server may receive; the others (CONNACK, SUBACK, ...) are a Protocol Error.
SERVER_RECEIVES = frozenset(
    {pt.CONNECT, pt.PUBLISH, pt.PUBACK, pt.PUBREC, pt.PUBREL, pt.PUBCOMP, pt.SUBSCRIBE}
    | {pt.UNSUBSCRIBE, pt.PINGREQ, pt.DISCONNECT, pt.AUTH}
)
SERVER_SENDS = frozenset(
    {ConnAck, Publish, PubAck, PubRec, PubRel, PubComp, SubAck, UnsubAck, PingResp}
    | {Disconnect, Auth}
)

_PUBACK_HEADER = b"\x40\x02"  # PUBACK, remaining length 2: packet id only
TOPIC_ALIAS_INVALID = ReasonCode.TOPIC_ALIAS_INVALID
RETAIN_NOT_SUPPORTED = ReasonCode.RETAIN_NOT_SUPPORTED
QOS_NOT_SUPPORTED = ReasonCode.QOS_NOT_SUPPORTED
SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED
# Packets that must not carry a Reason String or User Properties when the client set
# Request Problem Information to 0 (MQTT-3.1.2-29).
_PROBLEM_INFORMATION_PACKETS = frozenset({PubAck, PubRec, PubRel, PubComp, SubAck, UnsubAck, Auth})


class Connection(ConnectionSending):
    """Server side of one MQTT 3.1 / 3.1.1 / 5.0 connection. Not thread-safe.

    A gateway holds one per client, most of them idle: slots instead of an instance dict, and
    the containers (event queue, topic aliases, packet-id sets) are made on first use.
    """

    __slots__ = (
        "_aliases",
        "_auth_method",
        "_buf",
        "_connect_session_expiry",
        "_eof",
        "_off",
        "_pending_error",
        "_phase",
        "_problem_information",
        "_queue",
        "client_id",
        "client_topic_alias_maximum",
        "keep_alive",
        "max_packet_size",
        "maximum_qos",
        "protocol_level",
        "receive_maximum",
        "retain_available",
        "subscription_identifier_available",
        "topic_alias_maximum",
    )

    def __init__(self, max_packet_size: int = 1_048_576) -> None:
        if max_packet_size < 2:
            raise ValueError("max_packet_size must allow at least a fixed header")
        super().__init__()
        self.max_packet_size = max_packet_size
        self._buf: bytes | bytearray = b""
        self._off = 0
        self._eof = False
        self._phase = AWAIT_CONNECT  # the receiving side (their state): see TRANSITIONS
        self._pending_error: RemoteProtocolError | None = None
        self._queue: deque[Event] | None = None  # decoded, not yet returned by next_event
        self.protocol_level: int | None = None
        self.client_id: str | None = None
        self.keep_alive = 0
        self.client_topic_alias_maximum = 0
        self._connect_session_expiry = 0
        self._auth_method: str | None = None
        self._problem_information = True  # Request Problem Information from CONNECT
        # What we announced in CONNACK (defaults apply until then).
        self.receive_maximum = 65535
        self.topic_alias_maximum = 0
        self.maximum_qos = 2
        self.retain_available = True
        self.subscription_identifier_available = True
        self._aliases: dict[int, str] | None = None  # inbound topic aliases (MQTT 5)

    # ----------------------------------------------------------------- data as data

    @property
    def keep_alive_timeout(self) -> float | None:
        """Seconds of silence after which the client is gone (1.5 x keep alive), or None."""
        return self.keep_alive * 1.5 if self.keep_alive else None

    # ----------------------------------------------------------------- receiving

    def receive_data(self, data: bytes) -> None:
        """Add bytes from the peer; `b""` means the peer closed its side."""
        if self._eof:
            raise LocalProtocolError("receive_data after EOF")
        if not data:
            self._eof = True
            return
        buf = self._buf
        off = self._off
        left = len(buf) - off
        if not left:
            # Common case: everything before was consumed. Keep the caller's bytes as they
            # are; slicing bytes copies once, slicing a bytearray would copy twice.
            self._buf = bytes(data)
            self._off = 0
        elif type(buf) is bytes and left <= len(data):
            # A partial packet no longer than the new data: copying it is paid for by `data`.
            self._buf = buf[off:] + data
            self._off = 0
        else:
            # A long partial packet (a large body trickling in): append in place, dropping
            # the consumed prefix once it is more than half of the buffer.
            if type(buf) is bytes:
                buf = bytearray(memoryview(buf)[off:])
                off = 0
            elif off * 2 > len(buf):
                del buf[:off]  # type: ignore[union-attr]
                off = 0
            buf += data
            self._buf = buf
            self._off = off

    def next_event(self) -> Event | Literal[Sentinel.NEED_DATA]:
        """The next event, or NEED_DATA. Raises RemoteProtocolError on a broken peer.

        Decodes everything complete in the buffer at once (the fast path of `events`) and
        hands the events out one by one. A batch ends after a CONNECT, so that what the
        caller does on CONNECT (restore_*, CONNACK limits) applies to the packets after it.
        """
        queue = self._queue
        if queue:
            return queue.popleft()
        if (
            self._off == len(self._buf)
            and self._phase is CONNECTED
            and not self._eof
            and self._pending_error is None
        ):
            # Drained: a device's one packet per read was handed out; skip the decoder's setup.
            return NEED_DATA
        buf = self._buf
        off = self._off
        if (
            off < len(buf)
            and buf[off] >> 4 not in BATCHED
            and (self._phase is CONNECTED or self._phase is AWAIT_CONNECT)
            and not self._eof
            and self._pending_error is None
        ):
            # A control packet (CONNECT, SUBSCRIBE, DISCONNECT, PINGREQ, ...) first:
            # decode_batch would take it through the general path before anything else (and
            # stop after a CONNECT), so take it there directly, without the batch's setup;
            # what follows it is the next call's.
            event = self._next_one()
            if self._off == len(self._buf):
                self._buf = b""  # as in decode_batch: an idle connection keeps no old chunk
                self._off = 0
            return event
        scan = SCAN
        ids = self._ids
        if (
            scan is not None
            and ids is not None
            and type(buf) is bytes
            and self._phase is CONNECTED
            and not self._eof
            and self._pending_error is None
            and self.max_packet_size >= 130
        ):
            # A device read in one C call, without the decoder's setup; what scan leaves (an
            # unusual or partial packet) goes on through decode_batch, which handles it.
            out: list[Event] = []
            in_qos1 = ids.inbound_qos1
            off = scan(
                buf, self._off, FAST_PUBLISH_QOS[self.maximum_qos >= 1, self.retain_available],
                self.max_packet_size, self.protocol_level == 5, TOPIC_CACHE, in_qos1,
                ids.outbound, self.receive_maximum, ids.inbound_in_flight() - len(in_qos1), out,
            )  # fmt: skip
            if out:
                if off == len(buf):
                    self._buf = b""
                    self._off = 0
                else:
                    self._off = off
                    try:
                        out += decode_batch(self, True)
                    except RemoteProtocolError as err:
                        self._pending_error = err
                if len(out) > 1:
                    if queue is None:
                        queue = self._queue = deque()
                    queue.extend(out[1:])
                return out[0]
        batch = decode_batch(self, True)
        if not batch:
            return NEED_DATA
        if len(batch) > 1:
            if queue is None:
                queue = self._queue = deque()
            queue.extend(batch)
            return queue.popleft()
        return batch[0]

    def take_plain(
        self,
        data: bytes,
        topic: str | None,
        pubs: list[Publish],
        owners: list[Any],
        owner: object,
        blocks: list[Any],
        owner_blocks: object,
        acked: list[int],
        other: list[Publish],
    ) -> int:
        """Receive `data` (as `receive_data`), first taking from it, in one C call, what
        `next_event` would hand out first of these: plain PUBLISHes (QoS 0/1, not RETAIN, no
        properties) on `topic` (None: none), each appended to `pubs`, with `owner` to `owners`
        and `owner_blocks` to `blocks` (the caller's ingest batch); PUBACKs without reason
        code, their packet ids appended to `acked` (and no longer in flight); then the plain
        PUBLISH on another topic (a device's first: `topic` None), if that is what ends the
        run, appended to `other` (empty on entry) for the caller to check before anything
        after it. Returns how many bytes of `data` it left buffered for `next_event` (0: it
        took all). Takes nothing (only buffers `data`) unless the buffer is drained and the
        fast decoder reads `data` now; it decides nothing `next_event` would not
        (tests/gateway/protocol/test_protocol_take_plain.py holds the two together).
        """
        take = TAKE_PLAIN
        if (
            take is None
            or self._off != len(self._buf)
            or self._queue
            or self._phase is not CONNECTED
            or self._eof
            or self._pending_error is not None
            or self.max_packet_size < 130
            or type(data) is not bytes
        ):
            self.receive_data(data)
            return len(data)
        ids = self._ids  # kernel_ids(), inlined: this runs once per read of a device
        if ids is None:
            in_qos1 = out_flight = None
            others = 0
        else:
            in_qos1 = ids.inbound_qos1
            out_flight = ids.outbound
            others = (
                ids.inbound_in_flight() - len(in_qos1)
                if ids.inbound_qos2 or ids.inbound_released
                else 0
            )
        off = take(
            data, FAST_PUBLISH_QOS[self.maximum_qos >= 1, self.retain_available],
            self.max_packet_size, self.protocol_level == 5, TOPIC_CACHE, in_qos1, out_flight,
            self.receive_maximum, others, topic, pubs, owners, owner, blocks, owner_blocks, acked,
            other,
        )  # fmt: skip
        if other and ids is None and other[0].qos:
            # Taken before the connection had packet ids: made now, as decode_batch makes them
            # at a first QoS 1 PUBLISH, with its id in flight.
            self._packet_ids().inbound_qos1.add(other[0].packet_id)  # type: ignore[arg-type]
        left = len(data) - off
        if left:
            self._buf = data
            self._off = off
        return left

    def take_pubacks(self, out: list[int], limit: int) -> int:
        """Move the ids of the (at most `limit`) PUBACKs heading the decoded queue to `out`, and
        return how many: what the next `next_event` calls would hand out, in one call."""
        queue, n = self._queue, 0
        while n < limit and queue and type(queue[0]) is PubAck:
            out.append(queue.popleft().packet_id)  # type: ignore[union-attr,arg-type]
            n += 1
        return n

    def events(self) -> list[Event]:
        """Every event available now. An error after some events is raised on the next call.

        Packets pipelined after a CONNECT are decoded before the caller has seen the CONNECT;
        a caller that must `restore_inbound_qos2` first should use `next_event`.
        """
        queue = self._queue
        if not queue:
            return decode_batch(self)
        out = list(queue)
        queue.clear()
        try:
            out += decode_batch(self)
        except RemoteProtocolError as err:
            self._pending_error = err
        return out

    def _next_one(self) -> Event | Literal[Sentinel.NEED_DATA]:
        """One packet through the general path, which applies every rule."""
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err
        if self._phase == ERROR:
            raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, "connection already failed")
        try:
            buf = self._buf
            off = self._off
            avail = len(buf) - off
            if avail < 2:
                return self._short(avail)
            length = buf[off + 1]
            if length < 128:
                header = 2
            else:
                length, header = wire.read_remaining_length(buf, off)
                if not header:
                    return self._short(avail)
            total = header + length
            if total > self.max_packet_size:
                raise RemoteProtocolError(
                    PACKET_TOO_LARGE, f"packet of {total} bytes exceeds {self.max_packet_size}"
                )
            if avail < total:
                return self._short(avail)
            end = off + total
            self._off = end
            first = buf[off]
            if first >> 4 == pt.PUBLISH and self._phase == CONNECTED:
                level = self.protocol_level or 4
                return _on_publish(self, read_publish(first & 0x0F, buf, off + header, end, level))
            return _on_packet(self, first >> 4, first & 0x0F, bytes(buf[off + header : end]))
        except RemoteProtocolError as err:
            _fail(self, err)
            raise

    def _short(self, avail: int) -> Event | Literal[Sentinel.NEED_DATA]:
        if not self._eof:
            return NEED_DATA
        if avail:
            raise RemoteProtocolError(
                ReasonCode.MALFORMED_PACKET, f"connection closed inside a packet ({avail} bytes)"
            )
        self._enter(CLOSED)
        return ConnectionClosed()

    def _enter(self, phase: Phase) -> None:
        if (self._phase, phase) not in TRANSITIONS:
            raise LocalProtocolError(f"no transition {self._phase.value} -> {phase.value}")
        self._phase = phase

    # ----------------------------------------------------------------- sending

    def send(self, event: Event) -> bytes:
        """Bytes for `event`; LocalProtocolError if the server may not send it now."""
        kind = type(event)
        if kind is Publish and self._connack_sent and not self._sending_closed:
            # The hot path, with the checks of the general one below: CONNACK sent (so the
            # level is known), the client's maximum packet size, its topic alias maximum,
            # and (in publish_sent) packet ids in use and its Receive Maximum.
            data = write_publish(event, self.protocol_level)  # type: ignore[arg-type]
            limit = self.client_max_packet_size
            if limit is not None and len(data) > limit:
                raise LocalProtocolError(
                    f"Publish of {len(data)} bytes exceeds the client's maximum {limit}",
                    PACKET_TOO_LARGE,
                )
            _out_publish(self, event)  # type: ignore[arg-type]
            return data
        if kind is PubAck and self._connack_sent and not self._sending_closed:
            # The other hot path: every inbound QoS 1 PUBLISH is answered with a plain PUBACK
            # (code 0, no properties: the same 4 bytes at every level). Same checks and the
            # same state change as the general path below; anything else takes that path.
            ack: PubAck = event  # type: ignore[assignment]
            packet_id = ack.packet_id
            if (
                ack.reason_code == 0
                and ack.properties is None
                and type(packet_id) is int
                and 0 < packet_id < 0x10000
            ):
                limit = self.client_max_packet_size
                if limit is None or limit >= 4:
                    ids = self._ids
                    if ids is not None:
                        ids.inbound_qos1.discard(packet_id)
                    return _PUBACK_HEADER + PACKET_ID_BYTES[packet_id]
        if kind not in SERVER_SENDS:
            raise LocalProtocolError(f"a server does not send {kind.__name__}")
        level = self.protocol_level
        if level is None:
            raise LocalProtocolError("nothing can be sent before CONNECT is received")
        if self._sending_closed:
            raise LocalProtocolError(f"cannot send {kind.__name__}: connection is closed")
        if self._connack_sent:
            if kind is ConnAck:
                raise LocalProtocolError("CONNACK was already sent")
        elif kind is not ConnAck and kind is not Auth:
            raise LocalProtocolError(f"cannot send {kind.__name__} before CONNACK")
        if kind is Disconnect and level < 5:
            self._sending_closed = True  # 3.1.1 servers never send DISCONNECT: they just close
            return b""
        if not self._problem_information and kind in _PROBLEM_INFORMATION_PACKETS:
            event = _without_problem_information(event)
        data = WRITERS[kind](event, level)
        limit = self.client_max_packet_size
        if limit is not None and len(data) > limit:
            raise LocalProtocolError(
                f"{kind.__name__} of {len(data)} bytes exceeds the client's maximum {limit}",
                PACKET_TOO_LARGE,
            )
        handler = _OUTBOUND.get(kind)
        if handler is not None:
            handler(self, event)
        return data

    def pubacks(self, packet_ids: list[int]) -> bytes:
        """PUBACK (code 0, no properties) for each inbound QoS 1 id, in order: the batch form
        of `send(PubAck(id))` for a run of stored publishes, with one check for the run."""
        limit = self.client_max_packet_size
        if self._connack_sent and not self._sending_closed and (limit is None or limit >= 4):
            ids = self._ids
            build = PUBACKS
            if build is not None and type(packet_ids) is list:
                return build(packet_ids, ids.inbound_qos1 if ids is not None else None)
            if ids is not None and ids.inbound_qos1:
                discard = ids.inbound_qos1.discard
                for packet_id in packet_ids:
                    discard(packet_id)
            # Ids come from decoded PUBLISH packets: ints in 1..65535 (the readers check).
            return b"".join([_PUBACK_HEADER + PACKET_ID_BYTES[i] for i in packet_ids])
        return b"".join([self.send(PubAck(i)) for i in packet_ids])


def _without_problem_information(event: Event) -> Event:
    props = getattr(event, "properties", None)
    if props is None or (props.reason_string is None and props.user_properties is None):
        return event
    stripped = dataclasses.replace(props, reason_string=None, user_properties=None)
    return dataclasses.replace(event, properties=stripped)


# ----------------------------------------------------------------- receiving rules
# What each packet the client sends does to the connection once its reader has checked the
# bytes: `Connection._next_one` hands PUBLISH to `_on_publish` and every other packet to
# `_on_packet`, which checks that it may come now and runs its rule (CONNECT's or the table's).
# A RemoteProtocolError on the way ends the receiving side in `_fail`.


#: Packet types decode_batch and the C scan decode in a batch (the rest go one by one through
#: the general path). A read whose first byte is not one of theirs goes to the general path
#: (ClientConnection.feed): a control packet, which take_plain would only buffer, or the rest
#: of a buffered packet, which either path reads on from the buffer.
BATCHED = frozenset({pt.PUBLISH, pt.PUBACK})


_MQTT_NAME = b"\x00\x04MQTT"  # a CONNECT body's start: the protocol name of 3.1.1 and 5


def _on_packet(conn: Connection, ptype: int, flags: int, body: bytes) -> Event:
    phase = conn._phase
    if ptype not in SERVER_RECEIVES:
        if ptype == 0:
            raise wire.malformed("reserved packet type 0")
        raise wire.protocol_error(f"a client must not send {pt.NAMES[ptype]}")
    if phase == AWAIT_CONNECT:
        if ptype != pt.CONNECT:
            raise wire.protocol_error(f"{pt.NAMES[ptype]} before CONNECT")
        # The level the CONNECT claims, to answer even a malformed one in its own version:
        # read from its place when the protocol name is "MQTT" (read_connect checks it all).
        claimed = body[6] if body[:6] == _MQTT_NAME and len(body) > 6 else connect_level(body)
        if claimed is not None:
            conn._answer_level = claimed if claimed in (3, 4, 5) else 4
        check_fixed_flags(ptype, flags, conn._answer_level or 4)
        return _on_connect(conn, read_connect(flags, body, 0))
    if phase != CONNECTED:
        raise wire.protocol_error(f"{pt.NAMES[ptype]} after the connection was closed")
    if ptype == pt.CONNECT:
        raise wire.protocol_error("second CONNECT")
    level = conn.protocol_level or 4
    check_fixed_flags(ptype, flags, level)
    event = READERS[ptype](flags, body, level)
    handler = _INBOUND.get(ptype)
    if handler is not None:
        handler(conn, event)
    return event


def _on_connect(conn: Connection, event: Connect) -> Connect:
    conn.protocol_level = event.protocol_level
    conn._answer_level = event.protocol_level
    conn.client_id = event.client_id
    conn.keep_alive = event.keep_alive
    props = event.properties
    if props.receive_maximum is not None:
        conn.client_receive_maximum = props.receive_maximum
    conn.client_max_packet_size = props.maximum_packet_size
    if props.topic_alias_maximum is not None:
        conn.client_topic_alias_maximum = props.topic_alias_maximum
    conn._connect_session_expiry = props.session_expiry_interval or 0
    conn._problem_information = props.request_problem_information != 0
    conn._auth_method = props.authentication_method
    conn._enter(CONNECTED)
    return event


def _on_publish(conn: Connection, event: Publish) -> Publish:
    qos = event.qos
    if qos:
        if qos > conn.maximum_qos:
            raise RemoteProtocolError(QOS_NOT_SUPPORTED, f"QoS {qos} above maximum QoS")
        packet_id = event.packet_id
        assert packet_id is not None
        if conn._packet_ids().publish_received(qos, packet_id, conn.receive_maximum):
            event.dup = True  # resent before PUBREL: the gateway must not store it twice
    if event.retain and not conn.retain_available:
        raise RemoteProtocolError(RETAIN_NOT_SUPPORTED, "retain is not available")
    if conn.protocol_level == 5:
        props = event.properties
        if props is not None:
            if props.subscription_identifiers is not None:
                raise wire.protocol_error("a client PUBLISH must not carry subscription ids")
            check_message_properties(props, event.payload)
            if props.topic_alias is not None:
                _resolve_alias(conn, event, props.topic_alias)
                props.topic_alias = None
                return event
        if not event.topic:
            raise wire.protocol_error("empty PUBLISH topic without a topic alias")
    return event


def _resolve_alias(conn: Connection, event: Publish, alias: int) -> None:
    if alias > conn.topic_alias_maximum:
        raise RemoteProtocolError(
            TOPIC_ALIAS_INVALID, f"topic alias {alias} above {conn.topic_alias_maximum}"
        )
    aliases = conn._aliases
    if event.topic:
        if aliases is None:
            aliases = conn._aliases = {}
        aliases[alias] = event.topic
        return
    topic = aliases.get(alias) if aliases is not None else None
    if topic is None:
        raise wire.protocol_error(f"topic alias {alias} was never set")
    event.topic = topic


def _in_puback(conn: Connection, event: PubAck) -> None:
    conn._packet_ids().puback_received(event.packet_id)


def _in_pubrec(conn: Connection, event: PubRec) -> None:
    conn._packet_ids().pubrec_received(event.packet_id, event.reason_code)


def _in_pubrel(conn: Connection, event: PubRel) -> None:
    conn._packet_ids().pubrel_received(event.packet_id)


def _in_pubcomp(conn: Connection, event: PubComp) -> None:
    conn._packet_ids().pubcomp_received(event.packet_id)


def _in_subscribe(conn: Connection, event: Subscribe) -> None:
    props = event.properties
    if (
        props is not None
        and props.subscription_identifiers
        and not conn.subscription_identifier_available
    ):
        raise RemoteProtocolError(
            SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, "subscription identifiers not available"
        )


def _in_disconnect(conn: Connection, event: Disconnect) -> None:
    props = event.properties
    if props is not None and props.session_expiry_interval and not conn._connect_session_expiry:
        # MQTT-3.14.2-2: zero session expiry in CONNECT cannot be raised at DISCONNECT.
        raise wire.protocol_error("DISCONNECT sets a session expiry after CONNECT had 0")
    conn._enter(CLOSED)


def _in_auth(conn: Connection, event: Auth) -> None:
    if conn._auth_method is None:
        raise wire.protocol_error("AUTH without an authentication method in CONNECT")
    if event.reason_code not in (
        ReasonCode.CONTINUE_AUTHENTICATION,
        ReasonCode.RE_AUTHENTICATE,
    ):
        raise wire.protocol_error(f"a client AUTH must not carry 0x{event.reason_code:02X}")
    method = event.properties.authentication_method if event.properties else None
    if method != conn._auth_method:
        raise wire.protocol_error("AUTH with another authentication method than CONNECT")


_INBOUND: dict[int, Callable[[Connection, Any], None]] = {
    pt.PUBACK: _in_puback,
    pt.PUBREC: _in_pubrec,
    pt.PUBREL: _in_pubrel,
    pt.PUBCOMP: _in_pubcomp,
    pt.SUBSCRIBE: _in_subscribe,
    pt.DISCONNECT: _in_disconnect,
    pt.AUTH: _in_auth,
}


def _fail(conn: Connection, err: RemoteProtocolError) -> None:
    """Record the error and decide what may be sent before closing."""
    level = conn._answer_level
    if conn._connack_sent:
        err.send_connack = False
        err.send_disconnect = level == 5 and not conn._sending_closed
    elif level == 5:
        err.send_connack = True
    else:
        # 3.1.1 answers only a bad protocol level or client identifier (MQTT-3.2.2-5).
        err.send_connack = level is not None and err.reason_code in CONNACK_311_CODES
    conn._enter(ERROR)


# ----------------------------------------------------------------- sending rules
# What each event we send does to the connection, once `Connection.send` has checked that it
# may go now and its writer has made the bytes.


def _out_connack(conn: Connection, event: ConnAck) -> None:
    conn._connack_sent = True
    if event.reason_code >= 0x80:
        conn._sending_closed = True
        return
    props = event.properties
    if props is None or conn.protocol_level != 5:
        return
    if props.server_keep_alive is not None:
        conn.keep_alive = props.server_keep_alive
    if props.receive_maximum is not None:
        conn.receive_maximum = props.receive_maximum
    if props.topic_alias_maximum is not None:
        conn.topic_alias_maximum = props.topic_alias_maximum
    if props.maximum_qos is not None:
        conn.maximum_qos = props.maximum_qos
    if props.retain_available is not None:
        conn.retain_available = bool(props.retain_available)
    if props.subscription_identifier_available is not None:
        conn.subscription_identifier_available = bool(props.subscription_identifier_available)


def _out_publish(conn: Connection, event: Publish) -> None:
    # Checked before the id is recorded, so a refused PUBLISH leaves no id in flight.
    props = event.properties
    if (
        props is not None
        and props.topic_alias is not None
        and props.topic_alias > conn.client_topic_alias_maximum
    ):
        raise LocalProtocolError(
            f"topic alias {props.topic_alias} above the client's maximum "
            f"{conn.client_topic_alias_maximum}"
        )
    if event.qos:
        ids = conn._ids
        if ids is None:
            ids = conn._packet_ids()
        # The writer has checked that a QoS 1/2 PUBLISH has an id.
        ids.publish_sent(event.packet_id, event.dup, conn.client_receive_maximum)  # type: ignore[arg-type]


def _out_puback(conn: Connection, event: PubAck) -> None:
    conn._packet_ids().puback_sent(event.packet_id)


def _out_pubrec(conn: Connection, event: PubRec) -> None:
    conn._packet_ids().pubrec_sent(event.packet_id, event.reason_code)


def _out_pubrel(conn: Connection, event: PubRel) -> None:
    conn._packet_ids().pubrel_sent(event.packet_id)


def _out_pubcomp(conn: Connection, event: PubComp) -> None:
    conn._packet_ids().pubcomp_sent(event.packet_id)


def _out_disconnect(conn: Connection, event: Disconnect) -> None:
    conn._sending_closed = True


# Handlers take the event type they are registered for.
_OUTBOUND: dict[type, Callable[[Connection, Any], None]] = {
    ConnAck: _out_connack,
    Publish: _out_publish,
    PubAck: _out_puback,
    PubRec: _out_pubrec,
    PubRel: _out_pubrel,
    PubComp: _out_pubcomp,
    Disconnect: _out_disconnect,
}
