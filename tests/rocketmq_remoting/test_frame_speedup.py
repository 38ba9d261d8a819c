"""rocketmq_remoting/_speedups.c `frame`: exactly what its reference command.decode_frame_at_py
returns (every field of the command) or raises, for the JSON headers a broker writes and any
other frame (escapes, whitespace, non-ASCII text, numbers that are not plain integers, values
the reference converts, binary headers, truncated or malformed frames); the broker's answers
take the C path (frame_fast), the others the reference; and the switch that keeps it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketmq_remoting import command
from rocketmq_remoting.codes import FLAG_RESPONSE, SerializeType
from rocketmq_remoting.command import RemotingCommand, decode_frame_at_py
from rocketmq_remoting.errors import ProtocolError

kernel = pytest.importorskip("rocketmq_remoting._speedups")

#: A SEND_MESSAGE_V2 answer of RocketMQ 5.3.3, byte for byte as the broker wrote it (captured
#: from the test cluster: fastjson's compact header, extFields in HashMap order, no body).
SEND_ANSWER = (
    b'{"code":0,"extFields":{"queueId":"0","transactionId":"C00002024C3B4E0E2F2A1E13EA404F5C",'
    b'"msgId":"7F000001000052B30000000000A74486","TRACE_ON":"true","MSG_REGION":"DefaultRegion",'
    b'"queueOffset":"3"},"flag":1,"language":"JAVA","opaque":1,'
    b'"serializeTypeCurrentRPC":"JSON","version":479}'
)


def frame(header: bytes, body: bytes = b"", kind: int = 0) -> bytes:
    """A frame without its length prefix: mark (serialize type, header length), header, body."""
    return struct.pack(">i", (kind << 24) | len(header)) + header + body


def outcome(fn: object, buf: bytes | bytearray, start: int, end: int) -> object:
    try:
        return fn(buf, start, end)  # type: ignore[operator]
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))


def agree(buf: bytes | bytearray, start: int = 0, end: int | None = None) -> object:
    end = len(buf) if end is None else end
    ours = outcome(kernel.frame, buf, start, end)
    ref = outcome(decode_frame_at_py, buf, start, end)
    assert ours == ref
    if isinstance(ours, RemotingCommand):
        assert type(ours) is RemotingCommand and isinstance(ref, RemotingCommand)
        assert [type(getattr(ours, f)) for f in ours.__slots__] == [
            type(getattr(ref, f)) for f in ref.__slots__
        ]
    return ours


def test_a_send_answer_takes_the_c_path_and_matches() -> None:
    buf = b"xx" + frame(SEND_ANSWER) + b"yy"
    fast = kernel.frame_fast(buf, 2, len(buf) - 2)
    assert fast is not None
    assert fast == decode_frame_at_py(buf, 2, len(buf) - 2)
    assert fast.ext_fields["queueOffset"] == "3" and fast.flag == FLAG_RESPONSE
    assert agree(buf, 2, len(buf) - 2) == fast
    assert agree(bytearray(buf), 2, len(buf) - 2) == fast  # the connection's buffer


def test_a_pull_answer_with_a_body_and_a_remark_takes_the_c_path() -> None:
    header = (
        b'{"code":1,"extFields":{"nextBeginOffset":"12","minOffset":"0","maxOffset":"12"},'
        b'"flag":1,"language":"JAVA","opaque":77,"remark":"FOUND",'
        b'"serializeTypeCurrentRPC":"JSON","version":479}'
    )
    buf = frame(header, b"\x00\x01records")
    assert kernel.frame_fast(buf, 0, len(buf)) is not None
    cmd = agree(buf)
    assert isinstance(cmd, RemotingCommand) and cmd.body == b"\x00\x01records"


@pytest.mark.parametrize(
    "header",
    [
        b'{"code":0, "flag":1}',  # whitespace
        b' {"code":0}',
        b'{"code":0} ',
        b'{"code":0,"remark":"a \\"quoted\\" word"}',  # escapes
        b'{"code":0,"extFields":{"k":"\\u00e9"}}',
        b'{"code":0,"extFields":{"k":1}}',  # a value the reference converts to str
        b'{"code":"7"}',
        b'{"code":1.0}',
        b'{"code":1e3}',
        b'{"code":007}',
        b'{"code":-}',
        b'{"code":12345678901234567890}',
        b'{"code":true}',
        b'{"code":Infinity}',  # the reference raised OverflowError here, not ProtocolError
        b'{"code":0,"opaque":1e999}',
        b'{"code":0,"language":null}',
        b'{"code":0,"extFields":""}',
        b'{"code":0,"extFields":[]}',
        b'{"code":0,"other":{"a":1}}',
        b'{"code":0,"other":[1]}',
        b'{"code":0,"k\xc3\xa9y":"v"}',  # a non-ASCII key
        b'{"code":0,"other":"\xff"}',  # not UTF-8 in a skipped value
        b'{"code":0,"remark":"\xff"}',
        b'{"flag":1}',  # no code
        b"{}",
        b"",
        b"[1]",
        b'{"code":0',
        b'{"code":0,}',
        b'{"code":0}}',
        b'{"code":0,"code":1}',
        b'{"code":0,"remark":null}',
        b'{"code":0,"extFields":null}',
        b'{"code":0,"extFields":{}}',
        b'{"code":-0,"opaque":-5,"version":0}',
        b'{"code":0,"remark":"caf\xc3\xa9","extFields":{"k":"\xe2\x82\xac"}}',
        b'{"code":0,"extFields":{"a":"1"},"extFields":{"b":"2"}}',
        b'{"code":0,"x":null,"y":true,"z":false,"w":-3,"v":"s"}',
        b'{"code":0,"extFields":{"a":"\x01"}}',  # a control character
    ],
)
def test_other_json_headers_decode_or_raise_as_the_reference(header: bytes) -> None:
    agree(frame(header, b"body"))


def test_binary_headers_and_malformed_frames_go_to_the_reference() -> None:
    binary = RemotingCommand(
        code=11, opaque=3, remark="r", ext_fields={"a": "b"}, serialize_type=SerializeType.ROCKETMQ
    ).encode()[4:]
    assert kernel.frame_fast(binary, 0, len(binary)) is None
    agree(binary)
    agree(b"\x00\x00")  # shorter than the mark
    agree(b"\x00\x00\x00\x09{}")  # header longer than the frame
    agree(frame(b'{"code":0}', kind=7))  # unknown serialize type
    for cut in range(len(SEND_ANSWER) + 4):
        agree(frame(SEND_ANSWER)[:cut])


def test_bounds_are_checked() -> None:
    buf = frame(SEND_ANSWER)
    for start, end in ((-1, 4), (5, 4), (0, len(buf) + 1)):
        with pytest.raises(ValueError):
            kernel.frame(buf, start, end)


values = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
ints = st.integers(-(2**70), 2**70)
scalars = st.one_of(values, ints, st.none(), st.booleans(), st.floats())


@st.composite
def json_header(draw: st.DrawFn) -> bytes:
    """A JSON header object: the broker's keys (sometimes missing, of other types, repeated)
    and others, written compact or not, escaped or not."""
    keys = st.sampled_from(
        ["code", "opaque", "flag", "version", "language", "remark", "extFields", "other"]
    )
    items: list[tuple[str, object]] = []
    for key in draw(st.lists(keys, max_size=9)):
        if key == "extFields":
            value: object = draw(
                st.one_of(
                    st.dictionaries(values, values, max_size=4),
                    st.dictionaries(values, scalars, max_size=2),
                    st.none(),
                    scalars,
                )
            )
        elif key in ("language", "remark", "other"):
            value = draw(st.one_of(values, scalars))
        else:
            value = draw(st.one_of(ints, ints, scalars))
        items.append((key, value))
    text = (
        "{"
        + ",".join(
            f"{json.dumps(k)}:{json.dumps(v, ensure_ascii=draw(st.booleans()))}" for k, v in items
        )
        + "}"
    )
    if draw(st.booleans()):
        text = text.replace(",", ", ")
    return text.encode()


plain_text = st.text(
    st.characters(blacklist_categories=["Cs", "Cc"], blacklist_characters='"\\'), max_size=12
)
plain_ints = st.integers(-(10**18) + 1, 10**18 - 1)


@st.composite
def plain_header(draw: st.DrawFn) -> bytes:
    """A header as a broker writes it: compact, the code and other numbers plain integers,
    text without escapes (non-ASCII kept as UTF-8), extFields of strings; keys in any order,
    some left out, some the reference does not read."""
    items: list[tuple[str, object]] = [("code", draw(plain_ints))]
    for key in draw(st.lists(st.sampled_from(["opaque", "flag", "version"]), max_size=3)):
        items.append((key, draw(plain_ints)))
    if draw(st.booleans()):
        items.append(("language", draw(plain_text)))
    if draw(st.booleans()):
        items.append(("remark", draw(st.one_of(st.none(), plain_text))))
    if draw(st.booleans()):
        ext = draw(st.one_of(st.none(), st.dictionaries(plain_text, plain_text, max_size=6)))
        items.append(("extFields", ext))
    if draw(st.booleans()):
        other = st.one_of(st.from_regex(r"[a-zA-Z0-9 ]{0,8}", fullmatch=True), plain_ints)
        items.append(("serializeTypeCurrentRPC", draw(other)))
    items = draw(st.permutations(items))
    text = (
        "{"
        + ",".join(
            f"{json.dumps(k)}:{json.dumps(v, ensure_ascii=False, separators=(',', ':'))}"
            for k, v in items
        )
        + "}"
    )
    return text.encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=plain_header(), body=st.binary(max_size=8))
def test_broker_shaped_headers_take_the_c_path_and_agree(header: bytes, body: bytes) -> None:
    buf = b"pre" + frame(header, body) + b"post"
    assert kernel.frame_fast(buf, 3, len(buf) - 4) is not None, header
    agree(buf, 3, len(buf) - 4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=json_header(), body=st.binary(max_size=8), cut=st.integers(0, 3))
def test_generated_headers_agree_with_the_reference(header: bytes, body: bytes, cut: int) -> None:
    buf = b"pre" + frame(header, body) + b"post"
    agree(buf, 3, len(buf) - 4)
    if cut:
        agree(buf, 3, len(buf) - 4 - cut)  # a frame cut short


def test_the_read_switch_keeps_the_reference() -> None:
    code = (
        "from rocketmq_remoting import command as c; "
        "print(c.decode_frame_at is c.decode_frame_at_py)"
    )
    seen = {}
    for value in ("0", "1"):
        env = {**os.environ, "LMQTT_PURE_PYTHON_READ": value, "LMQTT_PURE_PYTHON": "0"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        seen[value] = out.stdout.strip()
    assert seen == {"0": "False", "1": "True"}
    assert command.decode_frame_at is kernel.frame
