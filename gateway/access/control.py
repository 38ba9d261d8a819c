"""AccessControl: who may connect and what each client may publish, subscribe and read.

The gateway holds one AccessControl (`gateway.access.control`). ClientConnection asks it once per
CONNECT (`check_connect`: bans, rate limit, connection limit, credentials, then flapping) and
keeps the answer as `client.username` and `client.acl` (a ClientAccess, None when there is no
ACL file), which the publish, subscribe and delivery paths consult. `reload()` (SIGHUP)
re-reads the password and ACL files and swaps every connected client's ClientAccess in place:
nobody is disconnected, and a file with an error is refused as a whole (the previous rules
stay) and logged.

Anonymous access (no user name in CONNECT):

    allow_anonymous  password_file  listeners        anonymous clients
    ---------------  -------------  ---------------  -------------------------------------
    true             any            any              allowed
    false            any            any              refused (0x87 / 5)
    unset            none           loopback only    allowed (`make run` needs no config)
    unset            none           non-loopback     gateway refuses to start
    unset            set            any              refused (0x87 / 5)

With a password file, a user name must come with its password (0x86 / 4 otherwise). Without
one, a user name is taken as given (as Mosquitto does) and only selects ACL rules. With
tls_use_identity_as_username, the client certificate's CN is the user name and CONNECT's
credentials are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from gateway.access.acl import AclRules, ClientAccess
from gateway.access.auth import PasswordFile, SecurityError
from gateway.access.bans import Ban, BanList
from gateway.access.flapping import FlappingDetector
from gateway.access.limits import ConnectRateLimiter, is_loopback, topic_limit_error
from gateway.access.quotas import PublishQuotas
from gateway.config import GatewaySettings
from gateway.protocol import Connect, ReasonCode
from topicmap import TopicError

__all__ = ["AccessControl", "certificate_cn"]

log = logging.getLogger("lmqtt.access")


class Client(Protocol):
    """The connection asking (gateway/connection/client.py ClientConnection)."""

    acl: ClientAccess | None  # replaced in place by reload()

    @property
    def client_id(self) -> str: ...

    @property
    def username(self) -> str | None: ...

    @property
    def peer(self) -> str: ...

    @property
    def transport(self) -> asyncio.BaseTransport: ...

    @property
    def session(self) -> object | None: ...


# Source addresses whose loopback-ness is remembered (parsing one with ipaddress costs more
# than the rest of the connect checks).
LOOPBACK_CACHE_SIZE = 4096
TOPIC_CACHE_SIZE = 16_384


def certificate_cn(peercert: Any) -> str | None:
    """The commonName of a certificate as ssl.SSLSocket.getpeercert() returns it."""
    if not isinstance(peercert, dict):
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and isinstance(value, str):
                return value
    return None


class AccessControl:
    """Authentication, ACL and connect limits for one gateway (see the module docstring)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        s = settings
        if s.allow_anonymous is None and s.password_file is None and not is_loopback(s.host):
            raise SecurityError(
                f"refusing to listen on {s.host} without authentication: set password_file "
                "(create it with 'lmqtt passwd FILE USER'), or allow_anonymous = true to "
                "accept anyone who can reach the port"
            )
        if s.allow_anonymous is not None:
            self.allow_anonymous = s.allow_anonymous
        else:
            self.allow_anonymous = s.password_file is None
        self.passwords: PasswordFile | None = None
        self.acl: AclRules | None = None
        # The loopback exemption is decided here, with a cache by host string; the limiter
        # then applies to every address it is asked about.
        self.rate = ConnectRateLimiter(s.connect_rate, s.connect_burst, limit_loopback=True)
        self._exempt_loopback = not s.connect_rate_loopback
        self._loopback: dict[str, bool] = {}
        # Topic names published to and found within the length/level limits (which are
        # fixed for the gateway's life), so a flood checks each name once.
        self._within_limits: set[str] = set()
        # Per-client publish quotas: a bucket per connection, given at CONNECT.
        self.quotas = PublishQuotas(s)
        # Bans (the settings' now, the durable ones once the store is open) and the flapping
        # detection that adds some (gateway/access/bans.py, flapping.py).
        self.bans = BanList(s.bans)
        self.flapping = FlappingDetector(s.flapping_max_connects, s.flapping_window)
        self.refused_connects = 0
        self.denied_publishes = 0
        self.denied_subscriptions = 0
        self.reloads = 0
        self._load()  # errors at start-up are fatal (SecurityError names file and line)

    def _load(self) -> None:
        s = self.settings
        passwords = PasswordFile.load(s.password_file) if s.password_file else None
        acl = AclRules.load(s.acl_file) if s.acl_file else None
        self.passwords, self.acl = passwords, acl

    def reload(self, clients: Sequence[Client] | None = None) -> bool:
        """Re-read the password and ACL files (SIGHUP); False (and old rules kept) on error."""
        try:
            self._load()
        except SecurityError as exc:
            log.error("reload refused, previous rules stay in force: %s", exc)
            return False
        self.reloads += 1
        for client in clients or ():
            if client.session is not None:
                client.acl = self.client_access(client.client_id, client.username)
        log.warning(
            "reloaded security files (%d users, ACL %s)",
            len(self.passwords.users) if self.passwords else 0,
            "on" if self.acl is not None else "off",
        )
        return True

    def client_access(self, client_id: str, username: str | None) -> ClientAccess | None:
        return None if self.acl is None else ClientAccess(self.acl, client_id, username)

    # -- CONNECT -----------------------------------------------------------------------------

    def connect_waits(self, ev: Connect) -> bool:
        """Whether check_connect would wait for something: a password's hash (in a worker
        thread), or the durable ban of a client id found flapping. Counts nothing: when False,
        check_connect_now gives check_connect's answer without an await."""
        if ev.username is not None and self.passwords is not None:
            return True
        return bool(ev.client_id) and self.flapping.would_ban(ev.client_id)

    async def check_connect(
        self, ev: Connect, client: Client, connected: int
    ) -> tuple[int, str | None]:
        """(reason code, user name): 0 = accept. `connected` = clients connected now."""
        code = self._admit(ev, client, connected)
        if code:
            return code, None
        code, user = await self._authenticate(ev, client)
        if code:
            return code, None
        code = self._admit_user(ev, client, user)
        if code:
            return code, None
        # Counted once the client proved who it is: CONNECTs refused above (bad credentials,
        # the connect rate) do not count, or anyone reaching the port could have any client
        # id banned by connecting with it.
        if ev.client_id and self.flapping.enabled:
            count = self.flapping.connecting(ev.client_id)
            if count:
                return self._banned(client, await self._ban_flapping(ev.client_id, count))
        return self._admit_will(ev, client, user), user

    def check_connect_now(
        self, ev: Connect, client: Client, connected: int
    ) -> tuple[int, str | None]:
        """check_connect's answer for a CONNECT that connect_waits() found needs no wait
        (no password to verify, not flapping): the same checks in the same order."""
        code = self._admit(ev, client, connected)
        if code:
            return code, None
        code, user = self._identify(ev, client)
        if code:
            return code, None
        if user is not None and user != ev.username:
            code = self._admit_user(ev, client, user)
            if code:
                return code, None
        flapping = self.flapping
        if ev.client_id and flapping.max_connects > 0:
            # Not flapping (connect_waits asked, counting nothing): this count stays under
            # the bound, as the clock only moves on.
            flapping.connecting(ev.client_id)
        return self._admit_will(ev, client, user) if ev.will is not None else 0, user

    def _admit(self, ev: Connect, client: Client, connected: int) -> int:
        """Bans, the connect rate and max_connections: a refusal's reason code, or 0."""
        peer = client.transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else client.peer
        ban = self.bans.check(ev.client_id or None, ev.username, host)
        if ban is not None:
            return self._banned(client, ban)[0]
        rate = self.rate
        exempt = rate.rate <= 0 or (self._exempt_loopback and self._is_loopback(host))
        if not exempt and not rate.allow(host):
            return self._refused(
                client, ReasonCode.CONNECTION_RATE_EXCEEDED, "connect rate exceeded"
            )[0]
        if connected >= self.settings.max_connections:
            return self._refused(client, ReasonCode.QUOTA_EXCEEDED, "max_connections reached")[0]
        return 0

    def _admit_user(self, ev: Connect, client: Client, user: str | None) -> int:
        """A user name other than CONNECT's (the certificate's) checked against the bans."""
        if user is not None and user != ev.username:
            ban = self.bans.check(None, user, None)
            if ban is not None:
                return self._banned(client, ban)[0]
        return 0

    def _admit_will(self, ev: Connect, client: Client, user: str | None) -> int:
        """The will is published for this client later, so it needs the right to publish
        there now (Mosquitto 2 refuses such a CONNECT the same way)."""
        will = ev.will
        if will is None:
            return 0
        s = self.settings
        why = topic_limit_error(will.topic, s.max_topic_length, s.max_topic_levels)
        if why is not None:
            return self._refused(client, ReasonCode.TOPIC_NAME_INVALID, f"will topic: {why}")[0]
        acl = self.client_access(client.client_id, user)
        if acl is not None and not acl.may_write(will.topic):
            return self._refused(client, ReasonCode.NOT_AUTHORIZED, "will topic not authorized")[0]
        return 0

    def _is_loopback(self, host: str) -> bool:
        known = self._loopback.get(host)
        if known is None:
            known = is_loopback(host)
            if len(self._loopback) >= LOOPBACK_CACHE_SIZE:
                self._loopback.clear()  # bounded; parsing a few again is cheap
            self._loopback[host] = known
        return known

    async def _authenticate(self, ev: Connect, client: Client) -> tuple[int, str | None]:
        passwords = self.passwords
        if passwords is None or ev.username is None or self._certificate_user(client):
            return self._identify(ev, client)
        user = ev.username
        password = ev.password or b""
        # scrypt takes ~50 ms of CPU: in a worker thread, so the event loop keeps serving.
        ok = await asyncio.get_running_loop().run_in_executor(
            None, passwords.verify, user, password
        )
        if not ok:
            return self._refused(
                client, ReasonCode.BAD_USER_NAME_OR_PASSWORD, f"bad password for {user!r}"
            )
        return 0, user

    def _certificate_user(self, client: Client) -> str | None:
        """The client certificate's CN when it is the user name (tls_use_identity_as_username)."""
        if not self.settings.tls_use_identity_as_username:
            return None
        return certificate_cn(client.transport.get_extra_info("peercert"))

    def _identify(self, ev: Connect, client: Client) -> tuple[int, str | None]:
        """Who the client is where no password is verified: the certificate's name, or
        CONNECT's user name taken as given (no password file), or anonymous if allowed."""
        if self.settings.tls_use_identity_as_username:
            cn = self._certificate_user(client)
            if cn is not None:
                return 0, cn
        user = ev.username
        if user is None:
            if self.allow_anonymous:
                return 0, None
            return self._refused(
                client, ReasonCode.NOT_AUTHORIZED, "anonymous clients are not allowed"
            )
        return 0, user

    async def _ban_flapping(self, client_id: str, count: int) -> Ban:
        s = self.settings
        log.warning(
            "%r connected %d times within %g s (flapping_max_connects = %d): banned for %g s",
            client_id, count, s.flapping_window, s.flapping_max_connects, s.flapping_ban,
        )  # fmt: skip
        return await self.bans.add(
            "client_id", client_id, reason="flapping", duration_s=s.flapping_ban, source="flapping"
        )

    def _banned(self, client: Client, ban: Ban) -> tuple[int, None]:
        self.refused_connects += 1
        self.bans.refused_by(ban)
        log.info("%s: CONNECT refused (0x8A): %s", client.peer, ban.describe())
        return ReasonCode.BANNED, None

    def _refused(self, client: Client, code: int, why: str) -> tuple[int, None]:
        self.refused_connects += 1
        log.warning("%s: CONNECT refused (0x%02X): %s", client.peer, code, why)
        return code, None

    # -- PUBLISH / SUBSCRIBE -----------------------------------------------------------------

    def check_publish(self, client: Client, topic: str) -> None:
        """Raise TopicError when `client` may not publish to `topic`: reason 0x90 for the
        length/level limits (the client is disconnected), 0x87 for the ACL (dropped)."""
        if topic not in self._within_limits:
            s = self.settings
            why = topic_limit_error(topic, s.max_topic_length, s.max_topic_levels)
            if why is not None:
                raise TopicError(why, value=topic, reason_code=ReasonCode.TOPIC_NAME_INVALID)
            if len(self._within_limits) >= TOPIC_CACHE_SIZE:
                self._within_limits.clear()
            self._within_limits.add(topic)
        acl = client.acl
        if acl is not None and not acl.may_write(topic):
            self.denied_publishes += 1
            raise TopicError(
                "not authorized by the ACL", value=topic, reason_code=ReasonCode.NOT_AUTHORIZED
            )

    def subscribe_refusal(
        self, client: Client, topic_filter: str, text: str, new: bool, count: int
    ) -> int:
        """MQTT 5 reason code refusing one SUBSCRIBE entry, or 0. `topic_filter` is the filter
        without any $share/group/ prefix, `text` the full one, `count` the client's current
        number of subscriptions."""
        s = self.settings
        why = topic_limit_error(text, s.max_topic_length, s.max_topic_levels)
        code = 0
        if why is not None:
            code = ReasonCode.TOPIC_FILTER_INVALID
        elif new and count >= s.max_subscriptions:
            why, code = f"more than {s.max_subscriptions} subscriptions", ReasonCode.QUOTA_EXCEEDED
        elif client.acl is not None and not client.acl.may_subscribe(topic_filter):
            why, code = "not authorized", ReasonCode.NOT_AUTHORIZED
            self.denied_subscriptions += 1
        if code:
            log.info("%r: SUBSCRIBE %r refused (0x%02X): %s", client.client_id, text, code, why)
        return code
