"""The admin API: authenticated JSON under `/api/` on the admin HTTP listener.

The listener (gateway/ops/admin_server.py) hands every `/api/...` request to `AdminApi.handle`;
`/metrics` and `/health` stay unauthenticated there. The composition root (gateway/app.py)
registers the routes, each a `Route(method, pattern, handler)`:

    pattern    "/api/bans", "/api/clients/{id}": literal segments and `{name}` parameters,
               one path segment each (percent-decoded into ApiRequest.params)
    handler    async (ApiRequest) -> ApiResponse; raise ApiError(status, message) to refuse

Answers are JSON. An ApiError is `{"error": message}` with its status; an unknown path 404,
a known path with another method 405 (with an Allow header), an exception in a handler 500
with the traceback in the gateway's log only, never in the answer.

Authentication, checked before routing (so an unauthenticated caller learns nothing of the
routes):

    admin_token_file  password_file  Authorization accepted
    ----------------  -------------  ----------------------------------------------------
    set               any            Bearer <the file's token>; and Basic if password_file
    unset             set            Basic <user>:<password> of a user of the password file
                                     (only the users in admin_users, when that is set)
    unset             unset          none: every /api request is refused with 403 and a
                                     message saying how to configure one (logged at start)

No or wrong credentials: 401 with a WWW-Authenticate header. The token is compared in constant
time; a Basic password is checked with the password file's scrypt (in a worker thread), and a
verified Authorization header is remembered for VERIFIED_TTL_S so a terminal polling each
second (`lmqtt top`) does not cost a hash per request.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from gateway.access.auth import PasswordFile, SecurityError

__all__ = [
    "AdminApi",
    "ApiAuth",
    "ApiError",
    "ApiRequest",
    "ApiResponse",
    "Handler",
    "Route",
]

log = logging.getLogger("lmqtt.admin")

#: How long a verified Basic Authorization header is taken without hashing it again.
VERIFIED_TTL_S = 60.0
VERIFIED_MAX = 256
#: Methods the API may route (the listener refuses others before reading a body).
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})


class ApiError(Exception):
    """A refusal: answered `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One authenticated request, as a handler sees it."""

    method: str
    path: str  # percent-decoded
    query: dict[str, str] = field(default_factory=dict)  # the last value of each name
    body: bytes = b""
    params: dict[str, str] = field(default_factory=dict)  # from the route's {name} segments
    user: str = ""  # who was authenticated ("token" for the token file)

    def json(self) -> Any:
        """The body as JSON; ApiError 400 with the parser's complaint when it is not."""
        if not self.body:
            raise ApiError(400, "this request needs a JSON body")
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None


@dataclass(frozen=True, slots=True)
class ApiResponse:
    """A handler's answer: `body` is serialised as JSON."""

    status: int = 200
    body: Any = None


Handler = Callable[[ApiRequest], Awaitable[ApiResponse]]


class Route(NamedTuple):
    method: str  # GET, POST, PUT, PATCH or DELETE
    pattern: str  # "/api/clients/{id}"
    handler: Handler


def _segments(path: str) -> list[str]:
    return path.strip("/").split("/")


class _Compiled(NamedTuple):
    method: str
    parts: tuple[str, ...]  # literal segments, or "{name}"
    handler: Handler

    def match(self, raw: list[str]) -> dict[str, str] | None:
        """The parameters when the raw (still percent-encoded) segments fit the pattern."""
        if len(raw) != len(self.parts):
            return None
        params: dict[str, str] = {}
        for part, seg in zip(self.parts, raw, strict=True):
            if part.startswith("{") and part.endswith("}"):
                value = urllib.parse.unquote(seg)
                if not value:
                    return None
                params[part[1:-1]] = value
            elif urllib.parse.unquote(seg) != part:
                return None
        return params


class ApiAuth:
    """Who may use the API (see the module docstring)."""

    def __init__(
        self,
        token: str | None,
        passwords: Callable[[], PasswordFile | None],
        users: Iterable[str] | None = None,
    ) -> None:
        """`passwords`: the password file now (it is reloaded on SIGHUP); `users`: who of it
        may use the API (None: every user)."""
        self._token = token.encode() if token is not None else None
        self._passwords = passwords
        self._users = None if users is None else frozenset(users)
        self._verified: dict[bytes, tuple[float, str]] = {}  # sha256(header) -> (until, user)

    @classmethod
    def from_files(
        cls,
        token_file: Path | None,
        passwords: Callable[[], PasswordFile | None],
        users: Iterable[str] | None = None,
    ) -> ApiAuth:
        """Read the token file now: SecurityError when it is unreadable or empty."""
        token = None
        if token_file is not None:
            try:
                token = token_file.read_text("utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise SecurityError(
                    f"admin_token_file {token_file}: cannot read it ({exc})"
                ) from None
            if not token or any(ch.isspace() for ch in token):
                raise SecurityError(
                    f"admin_token_file {token_file}: must hold one token without spaces "
                    "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
        return cls(token, passwords, users)

    @property
    def configured(self) -> bool:
        return self._token is not None or self._passwords() is not None

    def describe(self) -> str:
        """How callers authenticate, for the start-up log line."""
        ways = []
        if self._token is not None:
            ways.append("bearer token (admin_token_file)")
        if self._passwords() is not None:
            who = "admin_users" if self._users is not None else "any user of password_file"
            ways.append(f"basic auth ({who})")
        if not ways:
            return (
                "refused: set admin_token_file (a file holding one token) or password_file "
                "to use the admin API"
            )
        return " or ".join(ways)

    async def check(self, authorization: str | None) -> str:
        """The caller's name; ApiError 401 (or 403 when the API has no credentials at all)."""
        if not self.configured:
            raise ApiError(
                403,
                "the admin API is off: set admin_token_file (a file with one token) or "
                "password_file in the gateway's settings",
            )
        if not authorization:
            raise ApiError(401, "credentials required (Authorization: Bearer or Basic)")
        scheme, _, value = authorization.strip().partition(" ")
        scheme = scheme.lower()
        value = value.strip()
        if scheme == "bearer" and self._token is not None:
            if hmac.compare_digest(value.encode(), self._token):
                return "token"
            raise ApiError(401, "wrong token")
        if scheme == "basic" and self._passwords() is not None:
            return await self._basic(value)
        raise ApiError(401, f"unsupported authorization scheme {scheme!r}")

    async def _basic(self, value: str) -> str:
        digest = hashlib.sha256(value.encode()).digest()
        now = time.monotonic()
        known = self._verified.get(digest)
        if known is not None and known[0] > now:
            return known[1]
        try:
            user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise ApiError(401, "malformed basic credentials") from None
        passwords = self._passwords()
        if not sep or passwords is None:
            raise ApiError(401, "malformed basic credentials")
        allowed = self._users is None or user in self._users
        ok = await asyncio.get_running_loop().run_in_executor(
            None, passwords.verify, user, password
        )
        if not ok or not allowed:
            log.warning("admin API: refused basic credentials of %r", user)
            raise ApiError(401, "wrong user name or password, or not an admin user")
        if len(self._verified) >= VERIFIED_MAX:
            self._verified.clear()
        self._verified[digest] = (now + VERIFIED_TTL_S, user)
        return user


class AdminApi:
    """The routes and their authentication; `handle` answers one request."""

    def __init__(self, auth: ApiAuth) -> None:
        self.auth = auth
        self._routes: list[_Compiled] = []

    def add(self, routes: Iterable[Route]) -> None:
        """Register routes (the composition root does, at start)."""
        for method, pattern, handler in routes:
            if method not in METHODS or not pattern.startswith("/api/"):
                raise ValueError(f"bad route {method} {pattern}")
            self._routes.append(_Compiled(method, tuple(_segments(pattern)), handler))

    @property
    def routes(self) -> list[Route]:
        return [Route(r.method, "/" + "/".join(r.parts), r.handler) for r in self._routes]

    async def handle(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[ApiResponse, dict[str, str]]:
        """The answer to one request (`target`: path and query as sent; `headers` with
        lower-case names) and extra response headers. Never raises."""
        extra: dict[str, str] = {}
        try:
            user = await self.auth.check(headers.get("authorization"))
            raw_path, _, raw_query = target.partition("?")
            raw = _segments(raw_path)
            allowed: list[str] = []
            for route in self._routes:
                params = route.match(raw)
                if params is None:
                    continue
                if route.method != method:
                    allowed.append(route.method)
                    continue
                query = dict(urllib.parse.parse_qsl(raw_query, keep_blank_values=True))
                request = ApiRequest(
                    method, urllib.parse.unquote(raw_path), query, body, params, user
                )
                return await route.handler(request), extra
            if allowed:
                extra["Allow"] = ", ".join(sorted(set(allowed)))
                raise ApiError(405, f"{method} is not allowed here (allowed: {extra['Allow']})")
            raise ApiError(404, f"no such API path: {raw_path}")
        except ApiError as exc:
            if exc.status == 401:
                extra["WWW-Authenticate"] = 'Bearer realm="lmqtt", Basic realm="lmqtt"'
            return ApiResponse(exc.status, {"error": exc.message}), extra
        except Exception:
            log.exception("admin API: %s %s failed", method, target)
            return ApiResponse(500, {"error": "internal error (see the gateway's log)"}), extra
