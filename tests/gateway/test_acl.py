"""ACL parser and matcher (pure): Mosquitto syntax, deny precedence, patterns, the $ rule."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.acl import AclError, AclRules, ClientAccess, filter_covers, topic_matches

ACL = """
# anonymous clients
topic read public/#

user alice
topic readwrite alice/#
topic deny alice/secret
topic sensors/+/t
topic write cmd/all

user bob
topic read sensors/#

pattern read devices/%c/cmd
pattern write devices/%u/state/#
"""


def access(client_id: str, user: str | None) -> ClientAccess:
    return ClientAccess(AclRules.parse(ACL), client_id, user)


@pytest.mark.parametrize(
    ("flt", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("#", "a", True),
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("a/+/c", "a//c", True),
        ("a/b", "a/b/", False),
    ],
)
def test_topic_matches(flt: str, topic: str, expected: bool) -> None:
    assert topic_matches(flt, topic) is expected


@pytest.mark.parametrize(
    ("outer", "inner", "expected"),
    [
        ("a/#", "a/+/c", True),
        ("a/#", "a/#", True),
        ("a/#", "#", False),
        ("a/+", "a/b", True),
        ("a/+", "a/+", True),
        ("a/+", "a/#", False),
        ("a/b", "a/+", False),
        ("#", "$SYS/#", False),
        ("+/#", "+/x", True),
        ("a/+/c", "a/b/c", True),
    ],
)
def test_filter_covers(outer: str, inner: str, expected: bool) -> None:
    assert filter_covers(outer, inner) is expected


LEVEL = st.sampled_from(["a", "b", "", "$x"])
TOPIC = st.lists(LEVEL, min_size=1, max_size=4).map("/".join)
FILTER = st.lists(st.sampled_from(["a", "b", "", "+"]), min_size=1, max_size=4).flatmap(
    lambda levels: st.sampled_from(["/".join(levels), "/".join([*levels, "#"])])
)


@settings(max_examples=150, deadline=None)
@given(FILTER, FILTER, TOPIC)
def test_covers_is_consistent_with_matching(outer: str, inner: str, topic: str) -> None:
    # If outer covers inner, nothing inner matches may escape outer.
    if filter_covers(outer, inner) and topic_matches(inner, topic):
        assert topic_matches(outer, topic)


def test_user_rules() -> None:
    a = access("c1", "alice")
    assert a.may_write("alice/x") and a.may_read("alice/x/y")
    assert not a.may_read("alice/secret") and not a.may_write("alice/secret")
    assert a.may_read("sensors/1/t") and a.may_write("sensors/1/t")  # no word = readwrite
    assert a.may_write("cmd/all") and not a.may_read("cmd/all")
    assert not a.may_read("public/news")  # anonymous rules are not alice's
    assert not a.may_write("bob/x")


def test_subscribe_needs_a_covering_read_grant() -> None:
    a = access("c1", "alice")
    assert a.may_subscribe("alice/#")  # covered; the deny is enforced per message
    assert a.may_subscribe("sensors/+/t")
    assert not a.may_subscribe("sensors/#")
    assert not a.may_subscribe("#")
    assert not a.may_subscribe("alice/secret")  # wholly inside a deny rule
    assert not a.may_subscribe("cmd/all")  # write-only


def test_anonymous_and_patterns() -> None:
    anon = access("dev7", None)
    assert anon.may_read("public/a") and anon.may_subscribe("public/#")
    assert not anon.may_write("public/a")
    assert anon.may_read("devices/dev7/cmd")  # %c pattern applies to anonymous too
    assert not anon.may_write("devices/dev7/state/x")  # %u pattern: no user name
    bob = access("dev8", "bob")
    assert bob.may_read("devices/dev8/cmd") and not bob.may_read("devices/dev7/cmd")
    assert bob.may_write("devices/bob/state/temp")
    assert not bob.may_write("devices/alice/state/temp")


@pytest.mark.parametrize("cid", ["+", "#", "a/b", ""])
def test_wildcard_identities_never_widen_patterns(cid: str) -> None:
    a = access(cid, "bob")
    assert not a.may_read("devices/x/cmd")
    assert not a.may_subscribe("devices/+/cmd")
    assert not access("c", "a/b").may_write("devices/a/b/state/x")


def test_parse_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(AclError, match="line 2"):
        AclRules.parse("topic a\nfrobnicate x\n")
    with pytest.raises(AclError, match=r"line 1.*'#'"):
        AclRules.parse("topic read a/#/b\n")
    with pytest.raises(AclError, match=r"'\+'"):
        AclRules.parse("topic read a+/b\n")
    with pytest.raises(AclError, match="user name"):
        AclRules.parse("user\n")
    with pytest.raises(AclError, match="missing topic"):
        AclRules.parse("topic\n")
    with pytest.raises(AclError, match="no such file"):
        AclRules.load(tmp_path / "missing")
    path = tmp_path / "acl"
    path.write_text(ACL)
    assert set(AclRules.load(path).users) == {"alice", "bob"}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_parser_only_raises_acl_error(text: str) -> None:
    try:
        rules = AclRules.parse(text)
    except AclError:
        return
    ClientAccess(rules, "c", "u").may_read("a/b")
