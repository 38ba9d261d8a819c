"""Password file: users and salted scrypt hashes, edited by `lmqtt passwd`.

One user per line, like Mosquitto's password file (its `$7$` PBKDF2 hashes are not read: run
`lmqtt passwd` to re-enter those users)::

    alice:$scrypt$16384$8$1$<salt, base64>$<hash, base64>
    # comments and blank lines are kept out of the way

    field      meaning
    ---------  ------------------------------------------------------------------
    16384      scrypt N (CPU/memory cost, a power of two); 8 = r, 1 = p
    salt       16 random bytes per entry, so equal passwords hash differently
    hash       32 bytes of hashlib.scrypt(password, salt, N, r, p)

Verification costs ~50 ms of CPU and 16 MiB on purpose (a stolen file resists guessing), so
the gateway runs it in a worker thread, never on the event loop, and the connect-rate limit
(gateway/access/limits.py) bounds how many guesses one address gets. An unknown user costs the same
as a wrong password, so the timing does not tell which user names exist.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import SettingsError

__all__ = [
    "PasswordFile",
    "PasswordFileError",
    "SecurityError",
    "hash_password",
    "verify_password",
]

SCHEME = "$scrypt$"
SCRYPT_N = 1 << 14
SCRYPT_R = 8
SCRYPT_P = 1
SALT_BYTES = 16
HASH_BYTES = 32
# scrypt needs 128 * N * r bytes; allow up to N = 2^17 from a hand-edited file, no more.
SCRYPT_MAXMEM = 256 * 1024 * 1024
MAX_N = 1 << 17


class SecurityError(SettingsError):
    """Root of the security files' errors; str() names the file and line at fault."""


class PasswordFileError(SecurityError):
    """A password file that cannot be read or has a malformed line (names file and line)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def hash_password(password: str | bytes, *, n: int = SCRYPT_N) -> str:
    """The encoded salted hash of `password` (the part after `user:`)."""
    secret = password.encode("utf-8") if isinstance(password, str) else password
    salt = secrets.token_bytes(SALT_BYTES)
    digest = hashlib.scrypt(
        secret, salt=salt, n=n, r=SCRYPT_R, p=SCRYPT_P, maxmem=SCRYPT_MAXMEM, dklen=HASH_BYTES
    )
    return f"{SCHEME}{n}${SCRYPT_R}${SCRYPT_P}${_b64(salt)}${_b64(digest)}"


def _parse_hash(encoded: str) -> tuple[int, int, int, bytes, bytes]:
    """(n, r, p, salt, digest); ValueError when `encoded` is not our scheme."""
    if not encoded.startswith(SCHEME):
        raise ValueError("unknown hash scheme (expected $scrypt$...; use lmqtt passwd)")
    parts = encoded[len(SCHEME) :].split("$")
    if len(parts) != 5:
        raise ValueError("malformed $scrypt$ hash")
    n, r, p = (int(x) for x in parts[:3])
    if n < 2 or n > MAX_N or n & (n - 1) or not 1 <= r <= 32 or not 1 <= p <= 16:
        raise ValueError("scrypt parameters out of range")
    salt = base64.b64decode(parts[3], validate=True)
    digest = base64.b64decode(parts[4], validate=True)
    if not salt or len(digest) < 16:
        raise ValueError("salt or hash too short")
    return n, r, p, salt, digest


def verify_password(encoded: str, password: str | bytes) -> bool:
    """Constant-time check of `password` against an encoded hash; False if malformed."""
    secret = password.encode("utf-8") if isinstance(password, str) else password
    try:
        n, r, p, salt, digest = _parse_hash(encoded)
    except ValueError:
        return False
    got = hashlib.scrypt(secret, salt=salt, n=n, r=r, p=p, maxmem=SCRYPT_MAXMEM, dklen=len(digest))
    return hmac.compare_digest(got, digest)


# Verified against when the user does not exist, so unknown users cost a full hash too.
_DUMMY_HASH = hash_password(secrets.token_bytes(16))


def _check_user(user: str) -> None:
    if not user or ":" in user or any(ch in user for ch in "\r\n\0") or user != user.strip():
        raise ValueError(
            f"invalid user name {user!r}: must be non-empty, without ':', newlines or"
            " surrounding spaces"
        )
    if len(user.encode("utf-8")) > 65535:
        raise ValueError("user name longer than MQTT allows (65535 bytes)")


@dataclass
class PasswordFile:
    """The users of one password file; `load`, `verify`, `set`/`delete`, `save`."""

    users: dict[str, str] = field(default_factory=dict)  # user -> encoded hash
    path: Path | None = None

    @classmethod
    def load(cls, path: Path) -> PasswordFile:
        try:
            text = path.read_text("utf-8")
        except FileNotFoundError:
            raise PasswordFileError(f"password file {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PasswordFileError(f"password file {path}: cannot read it ({exc})") from None
        users: dict[str, str] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, encoded = line.partition(":")
            if not sep:
                raise PasswordFileError(f"password file {path} line {lineno}: expected user:hash")
            try:
                _check_user(user)
                _parse_hash(encoded)
            except ValueError as exc:
                raise PasswordFileError(f"password file {path} line {lineno}: {exc}") from None
            users[user] = encoded
        return cls(users, path)

    def verify(self, user: str, password: bytes | str) -> bool:
        """True when `user` exists and `password` is theirs. Slow on purpose (see above)."""
        encoded = self.users.get(user)
        if encoded is None:
            verify_password(_DUMMY_HASH, password)
            return False
        return verify_password(encoded, password)

    def set(self, user: str, password: str | bytes) -> None:
        _check_user(user)
        self.users[user] = hash_password(password)

    def delete(self, user: str) -> bool:
        return self.users.pop(user, None) is not None

    def save(self, path: Path | None = None) -> None:
        """Write atomically (temp file + rename), readable by the owner only."""
        target = path or self.path
        if target is None:
            raise ValueError("no path to save the password file to")
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        data = "".join(f"{user}:{encoded}\n" for user, encoded in sorted(self.users.items()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.path = target
