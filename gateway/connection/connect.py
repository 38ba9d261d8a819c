"""ConnectHandler: a client's CONNECT (the CONNACK, the session start) and DISCONNECT.

CONNECT: the will checked, the client authenticated (gateway/access/control.py), its session
taken up or created (gateway/lifecycle/sessions.py; in cluster mode claimed on every node, a
takeover closing the connection that had it), then the CONNACK, keep-alive and, for a session
with something to receive, its delivery loop. Where nothing of that can wait (a single node,
no password to verify, no flapping ban to write, no resumed session to read first),
`connect_now` does it in the transport's read callback, without a reader task; otherwise the
reader task runs `on_connect`, where each await may end with the connection closed meanwhile
(a takeover, the socket lost): the handler looks before going on. Both take the same steps:
`_start`, access control, `_authorized`, the session, `_accept`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Protocol

from gateway.access.acl import ClientAccess
from gateway.access.control import AccessControl, Client
from gateway.access.quotas import QuotaBucket
from gateway.config import GatewaySettings
from gateway.connection.node import ClusterLink, ServerStatus, SingleNode
from gateway.delivery.loop import DeliveryContext, DeliveryLoop
from gateway.lifecycle.sessions import SessionLifecycle
from gateway.lifecycle.subscriptions import SubscriptionLifecycle
from gateway.protocol import (
    ConnAck,
    Connect,
    Connection,
    Disconnect,
    LocalProtocolError,
    Properties,
    ReasonCode,
    Will,
)
from gateway.session.model import Connected, Session
from gateway.stats import GatewayStats
from gateway.storage.port import StoreError
from topicmap import Topic, TopicError

__all__ = ["Closable", "ConnectHandler", "Connecting", "closed_now"]

log = logging.getLogger("lmqtt.gateway")

# What ConnectHandler._start hands on: the client id assigned (MQTT 5, an empty one asked
# for), the session expiry granted and the one requested.
_Start = tuple[str | None, int, int]


class Closable(Protocol):
    closed: bool


def closed_now(client: Closable) -> bool:
    """`client.closed`, read again after an await. Through a call, because mypy keeps what an
    earlier `if client.closed` found across the await and reports the second check as
    unreachable, which `make lint` and the mypyc build treat as an error (pyproject.toml)."""
    return client.closed


class Connecting(Client, Connected, Protocol):
    """The connection as ConnectHandler sees it (gateway/connection/client.py
    ClientConnection): what CONNECT learns of the client is kept on it."""

    conn: Connection
    closed: bool
    writable: bool
    client_id: str
    username: str | None  # authenticated (or asserted, without password file)
    acl: ClientAccess | None  # None: no ACL file, everything allowed
    quota: QuotaBucket | None  # None: no publish quota
    session: Session | None
    will: Will | None
    delivery: DeliveryLoop | None

    def write(self, data: bytes) -> None: ...

    def abort(self, reason: int) -> None: ...

    def start_keep_alive(self) -> None:
        """The CONNECT was answered: the keep-alive deadline runs from now."""


class ConnectHandler:
    """Starts a client's session at CONNECT; ends the connection at DISCONNECT, and the
    session's connection when it closes."""

    __slots__ = (
        "_access",
        "_cluster",
        "_delivery",
        "_loop",
        "_server",
        "_sessions",
        "_settings",
        "_stats",
        "_subscriptions",
    )

    def __init__(
        self,
        settings: GatewaySettings,
        server: ServerStatus,
        access: AccessControl,
        stats: GatewayStats,
        sessions: SessionLifecycle,
        subscriptions: SubscriptionLifecycle,
        delivery: DeliveryContext,
        cluster: ClusterLink,
    ) -> None:
        """`delivery`: what a connection's delivery loop uses."""
        self._settings = settings
        self._server = server
        self._access = access
        self._stats = stats
        self._sessions = sessions
        self._subscriptions = subscriptions
        self._delivery = delivery
        self._cluster = cluster
        self._loop: asyncio.AbstractEventLoop | None = None  # the gateway's, once running

    def connect_now(self, client: Connecting, ev: Connect) -> bool:
        """Handle `ev` at once, in the transport's callback (no reader task), when nothing it
        does can wait: a single node, no password to verify, no flapping client's ban to
        write, no session resumed that needs reading first (see SessionLifecycle.resume_waits).
        False: nothing was done (on_connect is for it)."""
        if (
            not isinstance(self._cluster, SingleNode)
            or self._access.connect_waits(ev)
            or self._sessions.resume_waits(ev.client_id, ev.clean_start)
        ):
            return False
        start = self._start(client, ev)
        if start is None:
            return True
        code, client.username = self._access.check_connect_now(
            ev, client, self._stats.clients_connected
        )
        if code:
            self._refuse(client, code)
            return True
        self._authorized(client)
        session, present = self._sessions.connect(
            client.client_id, ev.protocol_level, start[1], ev.clean_start, client, ev.will
        )
        client.session = session
        client.will = ev.will
        self._accept(client, ev, session, present, start)
        return True

    async def on_connect(self, client: Connecting, ev: Connect) -> None:
        start = self._start(client, ev)
        if start is None:
            return
        sessions = self._sessions
        cid = client.client_id
        code, client.username = await self._access.check_connect(
            ev, client, self._stats.clients_connected
        )
        if client.closed:
            return
        if code:
            self._refuse(client, code)
            return
        self._authorized(client)
        cluster = self._cluster
        clustered = not isinstance(cluster, SingleNode)
        if clustered:
            # The session as another node left it (or hands it over).
            await cluster.before_connect(cid, client, ev.clean_start)
            if closed_now(client):
                cluster.released(cid, client)  # a claim made while it waited for a hand-over
                return
        will = ev.will
        session, present = sessions.connect(
            cid, ev.protocol_level, start[1], ev.clean_start, client, will
        )
        client.session = session
        client.will = will
        if present and session.behind:
            # From the record of a node that crashed: acknowledged since are not sent again,
            # and a QoS 2 PUBLISH it stored after that record is recognised when resent.
            sessions.registry.qos2.resumed_behind(session)
            await sessions.skip_acknowledged(session)
            if closed_now(client):
                return
        if present and session.inflight and not clustered:
            # Cluster mode reads them when the node claims the session (below).
            await sessions.read_inflight(session)
            if closed_now(client):
                return
        if clustered:
            try:
                await cluster.connected(cid, client, ev.clean_start, session)
            except (StoreError, TimeoutError) as exc:
                log.error("%r: CONNECT not announced to the cluster: %s", cid, exc)
                self._refuse(client, ReasonCode.SERVER_UNAVAILABLE)
                return
            if closed_now(client):
                return
        self._accept(client, ev, session, present, start)

    def _start(self, client: Connecting, ev: Connect) -> _Start | None:
        """The client id (assigned when empty) and session expiry CONNECT asks for; None:
        refused before access control (its will, or the gateway stopping)."""
        s = self._settings
        level = ev.protocol_level
        cid = ev.client_id
        assigned: str | None = None
        if not cid:
            cid = "lmqtt-" + secrets.token_hex(8)
            if level == 5:
                assigned = cid
        client.client_id = cid
        if level == 5:
            requested = ev.properties.session_expiry_interval or 0
            expiry = min(requested, s.max_session_expiry)
        else:
            requested = expiry = 0 if ev.clean_start else s.default_session_expiry
        will = ev.will
        if will is not None:
            code = self._check_will(will)
            if code:
                self._refuse(client, code)
                return None
        if self._server.stopping:
            code = ReasonCode.SERVER_BUSY if level == 5 else ReasonCode.SERVER_UNAVAILABLE
            self._refuse(client, code)
            return None
        return assigned, expiry, requested

    def _authorized(self, client: Connecting) -> None:
        """Access control accepted the client: its ACL and publish quota."""
        access = self._access
        client.acl = access.client_access(client.client_id, client.username)
        client.quota = access.quotas.bucket(client.client_id, client.username, self._loop_time())

    def _accept(
        self, client: Connecting, ev: Connect, session: Session, present: bool, start: _Start
    ) -> None:
        """The session is the client's: CONNACK, keep-alive, and a delivery loop for a session
        with something to receive."""
        assigned, expiry, requested = start
        stats = self._stats
        cid = client.client_id
        level = ev.protocol_level
        props = self._connack_properties(ev, assigned, expiry, requested) if level == 5 else None
        conn = client.conn
        client.write(conn.send(ConnAck(session_present=present, reason_code=0, properties=props)))
        stats.clients_connected += 1
        stats.clients_total += 1
        if log.isEnabledFor(logging.INFO):  # the peer's address is asked of the transport
            log.info(
                "%r connected from %s (level %d, clean %s, keep-alive %d, expiry %d, present %s)",
                cid,
                client.peer,
                level,
                ev.clean_start,
                conn.keep_alive,
                expiry,
                present,
            )
        # The state machine must accept acks for ids of a previous connection of this session.
        # A session with none leaves the connection without packet-id sets until its first
        # QoS 1/2 packet (a device that only subscribes never needs them).
        if session.qos2_inbound:
            conn.restore_inbound_qos2(session.qos2_inbound)
        if session.inflight:
            conn.restore_outbound(
                [i.packet_id for i in session.inflight.values() if not i.pubrel],
                [i.packet_id for i in session.inflight.values() if i.pubrel],
            )
        client.start_keep_alive()
        if session.subscriptions or session.inflight:
            # A session with nothing to receive gets its loop at its first SUBSCRIBE.
            delivery = client.delivery = DeliveryLoop(self._delivery, session, client)
            self._subscriptions.attach(session, delivery)
            delivery.start()
        self._sessions.registry.touch(session)
        self._cluster.answered(cid, client)  # cluster mode: a takeover read meanwhile is done now

    def _loop_time(self) -> float:
        loop = self._loop
        if loop is None:  # asked once: get_running_loop() makes a getpid() system call
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    def _connack_properties(
        self, ev: Connect, assigned: str | None, expiry: int, requested: int
    ) -> Properties:
        """An MQTT 5 CONNACK's properties: the server's limits, and what it chose for the
        client (identifier, keep-alive, session expiry) where that differs from the request."""
        s = self._settings
        server_ka: int | None = None
        if s.server_keep_alive is not None:
            server_ka = s.server_keep_alive
        elif ev.keep_alive > s.max_keep_alive or (ev.keep_alive == 0 and s.max_keep_alive):
            server_ka = s.max_keep_alive if ev.keep_alive > s.max_keep_alive else None
        props = Properties(
            receive_maximum=s.receive_maximum,
            maximum_packet_size=s.max_packet_size,
            topic_alias_maximum=s.topic_alias_maximum,
            retain_available=1 if s.retain_available else 0,
            wildcard_subscription_available=1,
            subscription_identifier_available=1,
            shared_subscription_available=1,
        )
        if s.max_qos < 2:
            props.maximum_qos = s.max_qos
        if assigned is not None:
            props.assigned_client_identifier = assigned
        if server_ka is not None:
            props.server_keep_alive = server_ka
        if expiry != requested:
            props.session_expiry_interval = expiry
        return props

    def _check_will(self, will: Will) -> int:
        s = self._settings
        try:
            Topic(will.topic)
        except TopicError:
            return ReasonCode.TOPIC_NAME_INVALID
        if will.topic.startswith("$"):
            return ReasonCode.TOPIC_NAME_INVALID
        if will.qos > s.max_qos:
            return ReasonCode.QOS_NOT_SUPPORTED
        if will.retain and not s.retain_available:
            return ReasonCode.RETAIN_NOT_SUPPORTED
        return 0

    def _refuse(self, client: Connecting, code: int) -> None:
        log.info("%s: CONNECT refused with 0x%02X", client.peer, code)
        try:
            client.write(client.conn.send(ConnAck(reason_code=code)))
        except LocalProtocolError:
            pass
        client.close()

    def connection_ended(self, client: Connecting, session: Session, will: Will | None) -> None:
        """`client`, closed or lost, held `session` until now: the session lifecycle (which
        publishes `will`, given for an abnormal end) and the other nodes learn it."""
        self._cluster.released(session.client_id, client)
        self._stats.clients_connected -= 1
        self._sessions.connection_ended(session, will)
        self._cluster.connection_ended(session)

    def on_disconnect(self, client: Connecting, ev: Disconnect) -> None:
        session = client.session
        if session is not None and ev.properties is not None:
            new_expiry = ev.properties.session_expiry_interval
            if new_expiry is not None:
                session.set_expiry(min(new_expiry, self._settings.max_session_expiry))
        abnormal = ev.reason_code == ReasonCode.DISCONNECT_WITH_WILL_MESSAGE
        if log.isEnabledFor(logging.INFO):  # one call, not Logger.info's two
            log.info("%r disconnected (0x%02X)", client.client_id, ev.reason_code)
        client.close(abnormal=abnormal, linger=False)
