"""Session's QoS 2 ids: shared empty until the first one (memory per device), set semantics."""

from __future__ import annotations

from gateway.session.model import NO_IDS, Session


def test_qos2_ids_are_shared_until_the_first_and_round_trip() -> None:
    a, b = Session("a", 5, 0), Session("b", 5, 0)
    assert a.qos2_inbound is NO_IDS and b.qos2_inbound is NO_IDS  # no set per session
    assert a.add_qos2(7) and not a.add_qos2(7)  # a duplicate is known
    assert a.add_qos2(9) and a.qos2_inbound == {7, 9}
    assert b.qos2_inbound is NO_IDS  # the shared empty one was not changed
    assert a.release_qos2(7) and not a.release_qos2(7) and a.qos2_inbound == {9}
    assert a.release_qos2(9) and a.qos2_inbound is NO_IDS
    assert not b.release_qos2(1)
    a.add_qos2(3)
    restored = Session.from_json("a", a.to_json())
    assert restored.qos2_inbound == {3}
    assert Session.from_json("b", b.to_json()).qos2_inbound is NO_IDS
