"""PublishProperties (gateway/messages/records.py): the cached block of a topic is the store's
encoding of message_properties() byte for byte (the packet id pair appended per message), and
a topic the store refuses is refused the same way."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.messages.records import PID_BLOCK, PublishProperties, message_properties
from gateway.protocol import Publish
from store import InvalidPropertyError
from store.append import Appender
from topicmap.record import PID

encode = Appender.encode_properties


@given(
    topics=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6),
    qos=st.sampled_from([0, 1, 2]),
    retain=st.booleans(),
    client=st.sampled_from(["dev-1", "ü/ß", "c\x02"]),
)
def test_a_new_topics_block_is_the_stores_encoding_of_its_properties(
    topics: list[str], qos: int, retain: bool, client: str
) -> None:
    blocks = PublishProperties(client, encode)
    for topic in topics:
        pub = Publish(topic, b"x", qos, retain=retain, packet_id=9 if qos else None)
        props = message_properties(pub, client)
        props.pop(PID, None)
        try:
            want = encode(props)
        except InvalidPropertyError:
            with pytest.raises(InvalidPropertyError):
                blocks.of(pub)
            continue
        block, got_props = blocks.of(pub)
        assert block == want + (PID_BLOCK % 9 if qos else b"")
        assert got_props == props


@pytest.mark.parametrize("client", ["dev-1", "dev-2", "ü/ß", "c\x01", "c\x02"])
def test_blocks_built_without_the_store_match_it_and_keep_its_refusals(client: str) -> None:
    # After the first block of a (QoS, retain) kind (any publisher's), a new topic's block is
    # built from cached pieces; it must equal the store's encoding, and a topic or client id
    # with a store separator must still be refused.
    for topic in ("site/1", "site/ü/€", "a\x01b", "a\x02", "site/2"):
        for qos, retain in ((1, False), (0, True), (1, False)):
            blocks = PublishProperties(client, encode)  # a fresh publisher: a fleet's devices
            pub = Publish(topic, b"x", qos, retain=retain, packet_id=3 if qos else None)
            props = message_properties(pub, client)
            props.pop(PID, None)
            if any(sep in topic + client for sep in "\x01\x02"):
                with pytest.raises(InvalidPropertyError):
                    blocks.of(pub)
                continue
            assert blocks.of(pub) == (encode(props) + (PID_BLOCK % 3 if qos else b""), props)
