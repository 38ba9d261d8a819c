"""Hypothesis strategies for topics and filters, shared by the topicmap tests."""

from __future__ import annotations

from hypothesis import strategies as st

# Small alphabets make random filters and topics actually collide and match.
LEVELS = st.sampled_from(["", "a", "b", "ab", "$", "$SYS", "$x", "A", "é", "x y", "%", "_"])
WILD = st.sampled_from(["+", "#"])


@st.composite
def topics(draw: st.DrawFn) -> str:
    return "/".join(draw(st.lists(LEVELS, min_size=1, max_size=5))) or "/"


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.one_of(LEVELS, st.just("+")), min_size=1, max_size=5))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"


# Characters that stress the naming: escapes, separators and look-alikes, case, non-ASCII.
TRICKY = st.sampled_from(
    [
        *"aAzZ09-_.%/+#$ ,~",
        *["\u2215", "\uff0f", "\u2044"],  # division slash, fullwidth solidus, fraction slash
        *["\u00e9", "E\u0301", "\u00c9", "\u6e29", "\U0001f321", "\x01"],
    ]
)


@st.composite
def tricky_texts(draw: st.DrawFn) -> str:
    return "".join(draw(st.lists(TRICKY, min_size=1, max_size=30)))


@st.composite
def tricky_filters(draw: st.DrawFn) -> str:
    """Valid filters whose levels contain escapes, look-alike slashes and Unicode."""
    level = st.one_of(
        st.lists(TRICKY.filter(lambda c: c not in "/+#"), max_size=8).map("".join),
        st.just("+"),
    )
    levels = draw(st.lists(level, min_size=1, max_size=6))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"
