"""Access control lists in Mosquitto's syntax, and a pure matcher.

File format (the subset of mosquitto.conf(5) "acl_file" that applies to one broker)::

    # lines before the first `user` line apply to anonymous clients
    topic read public/#
    user alice                      # following `topic` lines apply to alice only
    topic readwrite alice/#
    topic deny alice/secret         # deny wins over any grant
    topic sensors/+/t               # no access word = readwrite
    pattern read devices/%c/cmd     # every client; %c = client id, %u = user name
    pattern write devices/%u/#

Decisions, as in Mosquitto:
- A `deny` rule matching the topic refuses, whatever grants it; otherwise any matching grant of
  the right kind allows; no matching grant refuses.
- `pattern` rules apply to all clients, wherever they stand in the file. A pattern whose %c or
  %u would be substituted with a value holding `+`, `#` or `/` is skipped (a client id like
  `+` must not turn `devices/%c/cmd` into a wildcard), and so is a %u pattern for anonymous.
- Publish checks the topic for write access. Subscribe checks that the filter lies inside some
  read grant (`sensors/#` allows subscribing to `sensors/+/t`, not to `#`). Every delivered
  message is then checked for read access on its topic, so deny rules and patterns hold for
  wildcard subscriptions too.
- Wildcards at the first level never match topics starting with `$` (the MQTT rule), so
  `topic read #` does not grant `$SYS/...`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gateway.access.auth import SecurityError
from topicmap import matches_levels

__all__ = [
    "AclError",
    "AclRule",
    "AclRules",
    "ClientAccess",
    "Grant",
    "filter_covers",
    "topic_matches",
]

Grant = Literal["read", "write", "readwrite", "deny"]
ACCESS_WORDS: frozenset[str] = frozenset({"read", "write", "readwrite", "deny"})
READ = "read"
WRITE = "write"


class AclError(SecurityError):
    """An ACL file that cannot be read or has a malformed line (names file and line)."""


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether `topic` (no wildcards) matches `topic_filter` (spec 4.7, with the $ rule): the
    same reading of the spec the Router is tested against, applied to an ACL rule's filter."""
    return matches_levels(topic_filter.split("/"), topic.split("/"))


def filter_covers(outer: str, inner: str) -> bool:
    """Whether every topic matching filter `inner` also matches filter `outer`."""
    o = outer.split("/")
    n = inner.split("/")
    if n[0].startswith("$") and o[0] in ("+", "#"):
        return False
    for i, level in enumerate(o):
        if level == "#":
            return True
        if i >= len(n):
            return False
        sub = n[i]
        if sub == "#":
            return False  # inner reaches deeper or shallower than outer allows
        if level == "+":
            continue
        if sub == "+" or sub != level:
            return False
    return len(o) == len(n)


@dataclass(frozen=True, slots=True)
class AclRule:
    grant: Grant
    topic: str
    pattern: bool = False  # %c / %u substituted per client

    def allows(self, kind: str) -> bool:
        return self.grant == "readwrite" or self.grant == kind

    def resolve(self, client_id: str, username: str | None) -> str | None:
        """The rule's filter for this client, or None when the rule cannot apply to it."""
        if not self.pattern:
            return self.topic
        text = self.topic
        if "%c" in text:
            if _unsafe(client_id):
                return None
            text = text.replace("%c", client_id)
        if "%u" in text:
            if username is None or _unsafe(username):
                return None
            text = text.replace("%u", username)
        return text


def _unsafe(value: str) -> bool:
    return not value or "+" in value or "#" in value or "/" in value


@dataclass
class AclRules:
    """Parsed ACL file: rules for anonymous clients, per user, and patterns for everyone."""

    anonymous: list[AclRule] = field(default_factory=list)
    users: dict[str, list[AclRule]] = field(default_factory=dict)
    patterns: list[AclRule] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> AclRules:
        try:
            text = path.read_text("utf-8")
        except FileNotFoundError:
            raise AclError(f"ACL file {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise AclError(f"ACL file {path}: cannot read it ({exc})") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<acl>") -> AclRules:
        rules = cls()
        current: list[AclRule] = rules.anonymous
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            word, _, rest = line.partition(" ")
            rest = rest.strip()
            where = f"ACL file {source} line {lineno}"
            if word == "user":
                if not rest:
                    raise AclError(f"{where}: 'user' needs a user name")
                current = rules.users.setdefault(rest, [])
            elif word in ("topic", "pattern"):
                rule = _parse_rule(rest, word == "pattern", where)
                (rules.patterns if rule.pattern else current).append(rule)
            else:
                raise AclError(
                    f"{where}: unknown keyword {word!r} (expected user, topic or pattern)"
                )
        return rules

    def rules_for(self, client_id: str, username: str | None) -> list[tuple[AclRule, str]]:
        """The (rule, resolved filter) pairs that apply to one client."""
        own = self.anonymous if username is None else self.users.get(username, [])
        out = [(r, r.topic) for r in own]
        for r in self.patterns:
            resolved = r.resolve(client_id, username)
            if resolved is not None:
                out.append((r, resolved))
        return out


def _parse_rule(rest: str, pattern: bool, where: str) -> AclRule:
    word, _, topic = rest.partition(" ")
    grant: str = "readwrite"
    if word in ACCESS_WORDS and topic.strip():
        grant, topic = word, topic.strip()
    else:
        topic = rest
    if not topic:
        raise AclError(f"{where}: missing topic")
    if word in ACCESS_WORDS and not topic.strip():
        raise AclError(f"{where}: missing topic after {word!r}")
    _check_filter(topic, where)
    return AclRule(grant=grant, topic=topic, pattern=pattern)  # type: ignore[arg-type]


def _check_filter(text: str, where: str) -> None:
    levels = text.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise AclError(f"{where}: '#' must be a whole last level in {text!r}")
        if "+" in level and level != "+":
            raise AclError(f"{where}: '+' must be a whole level in {text!r}")


class ClientAccess:
    """One client's view of the rules: cheap repeated checks (results cached per topic)."""

    CACHE_SIZE = 1024

    def __init__(self, rules: AclRules, client_id: str, username: str | None) -> None:
        self.applicable = rules.rules_for(client_id, username)
        self._read: dict[str, bool] = {}

    def _check(self, kind: str, topic: str) -> bool:
        allowed = False
        for rule, flt in self.applicable:
            if not topic_matches(flt, topic):
                continue
            if rule.grant == "deny":
                return False
            if rule.allows(kind):
                allowed = True
        return allowed

    def may_write(self, topic: str) -> bool:
        return self._check(WRITE, topic)

    def may_read(self, topic: str) -> bool:
        hit = self._read.get(topic)
        if hit is None:
            if len(self._read) >= self.CACHE_SIZE:
                self._read.clear()
            hit = self._read[topic] = self._check(READ, topic)
        return hit

    def may_subscribe(self, topic_filter: str) -> bool:
        """The filter lies inside a read grant and is not wholly inside a deny rule."""
        granted = False
        for rule, flt in self.applicable:
            if rule.grant == "deny":
                if filter_covers(flt, topic_filter):
                    return False
            elif rule.allows(READ) and filter_covers(flt, topic_filter):
                granted = True
        return granted
