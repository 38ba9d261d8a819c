"""A client of the admin API (gateway/ops/admin_api.py) for the `lmqtt` commands that act on a
running gateway (`lmqtt ban`, `lmqtt top`).

    lmqtt ban list --admin http://127.0.0.1:9100 --token-file /etc/lmqtt/admin.token
    lmqtt ban list --config gateway.toml            # admin_host/admin_port/admin_token_file
    lmqtt ban list --admin http://gw:9100 --user ops   # password from $LMQTT_ADMIN_PASSWORD
                                                        # or asked on the terminal

`add_admin_flags` puts --admin, --token-file, --user and --config on a command's parser;
`client_from_args` resolves them (flags > the gateway's settings) into an AdminClient. Every
failure (unreachable, refused, a 4xx with the gateway's message) is an AdminClientError whose
text is one line for the operator.
"""

from __future__ import annotations

import argparse
import base64
import getpass
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from gateway.config import SettingsError, load_settings

__all__ = ["AdminClient", "AdminClientError", "add_admin_flags", "client_from_args"]

PASSWORD_ENV = "LMQTT_ADMIN_PASSWORD"
TIMEOUT_S = 10.0


class AdminClientError(Exception):
    """A request that did not succeed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminClient:
    """JSON requests to one gateway's admin API."""

    def __init__(
        self, base_url: str, *, token: str | None = None, basic: tuple[str, str] | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._auth: str | None = None
        if token is not None:
            self._auth = f"Bearer {token}"
        elif basic is not None:
            pair = f"{basic[0]}:{basic[1]}".encode()
            self._auth = "Basic " + base64.b64encode(pair).decode()

    def request(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None = None,
        body: Any = None,
    ) -> Any:
        """The decoded JSON answer; AdminClientError when the status is not 2xx."""
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._auth is not None:
            req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise AdminClientError(exc.code, _error_text(exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminClientError(0, f"cannot reach {self.base_url}: {reason}") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            raise AdminClientError(0, f"{url}: the answer is not JSON") from None

    def get(self, path: str, query: dict[str, str] | None = None) -> Any:
        return self.request("GET", path, query)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body=body)

    def delete(self, path: str, query: dict[str, str] | None = None) -> Any:
        return self.request("DELETE", path, query)


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        message = json.loads(exc.read()).get("error")
    except (ValueError, AttributeError, OSError):
        message = None
    return f"{exc.code} {exc.reason}: {message}" if message else f"{exc.code} {exc.reason}"


def add_admin_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin",
        metavar="URL",
        help="the gateway's admin listener, e.g. http://127.0.0.1:9100 "
        "(default: admin_host and admin_port of the settings)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding the admin token (default: admin_token_file of the settings)",
    )
    parser.add_argument(
        "--user",
        metavar="USER",
        help=f"HTTP basic auth as USER of the password file (password: ${PASSWORD_ENV} "
        "or asked on the terminal)",
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="the gateway's TOML settings")


def client_from_args(args: argparse.Namespace) -> AdminClient:
    """The client the flags name (see add_admin_flags); AdminClientError when they do not
    say where the gateway is, or the token file cannot be read."""
    url: str | None = args.admin
    token_file: Path | None = args.token_file
    if url is None or (token_file is None and args.user is None):
        try:
            settings = load_settings(args.config)
        except SettingsError as exc:
            raise AdminClientError(0, str(exc)) from None
        if url is None:
            if settings.admin_port is None:
                raise AdminClientError(
                    0, "where is the gateway? give --admin URL, or --config with admin_port"
                )
            host = settings.admin_host
            host = f"[{host}]" if ":" in host else host
            url = f"http://{host}:{settings.admin_port}"
        if token_file is None and args.user is None:
            token_file = settings.admin_token_file
    if "://" not in url:
        url = "http://" + url
    token = None
    if token_file is not None:
        try:
            token = token_file.read_text("utf-8").strip()
        except OSError as exc:
            raise AdminClientError(0, f"token file {token_file}: {exc.strerror}") from None
    basic = None
    if token is None and args.user is not None:
        password = os.environ.get(PASSWORD_ENV)
        if password is None:
            password = getpass.getpass(f"password of {args.user}: ")
        basic = (args.user, password)
    return AdminClient(url, token=token, basic=basic)
