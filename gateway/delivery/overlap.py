"""Overlapping subscriptions of one session: which of its queues delivers a message.

A message matching several filters of one session sits in several of its queues. It is
delivered once, at the highest QoS of the matching subscriptions and with all their
subscription identifiers (gateway/delivery/rules.py `decide`), from its "owner" queue: the
first (by name) of the session's queues that contains it at or after that subscription's
start. The record's dispatch properties tell every queue and offset it sits at
(StoredMessage.queues), so the answer needs no memory and is the same after a restart; the
other queues skip it, but not before the owner has read it (they wait for it like for a full
window): were the owner unsubscribed first, nothing would deliver it any more.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.session.model import SubscriptionState
from gateway.storage.cursor import QueueCursor
from gateway.storage.port import Storage, StoredMessage

__all__ = ["covering", "owner_has_read"]


def covering(
    by_queue: Mapping[str, SubscriptionState], sub: SubscriptionState, msg: StoredMessage
) -> list[SubscriptionState] | None:
    """The session's other subscriptions (of `by_queue`) this message is delivered for through
    `sub` (`decide`'s `also`; empty: `sub` alone), or None if another of the session's queues
    owns the delivery: the lowest queue name among those covering it, so overlapping
    subscriptions deliver a message once."""
    if len(by_queue) == 1 or len(msg.queues) <= 1:
        return []
    # A plain loop: this runs per delivery for every session with several subscriptions,
    # and most messages are covered by just one of them.
    phys = msg.physical_offset
    mine = sub.queue
    # Stored while `sub` was replaying (see gateway/session/replay.py): the others delivered it.
    late = phys < sub.start_phys
    found: list[SubscriptionState] = []
    for q in msg.queues:
        s = by_queue.get(q)
        if s is None or s is sub or phys < s.start_phys:
            continue
        if q < mine or late:
            return None
        found.append(s)
    return found


def owner_has_read(
    by_queue: Mapping[str, SubscriptionState],
    sub: SubscriptionState,
    msg: StoredMessage,
    store: Storage,
    cursor: QueueCursor,
) -> bool:
    """`msg` is delivered for another of the session's subscriptions (the owner, see
    covering). `sub` may pass it by only once the owner has read it: were the owner
    unsubscribed first, nothing would deliver it any more. False: `sub` waits (as for a full
    window) and is looked at again in the next pass."""
    phys = msg.physical_offset
    owner: SubscriptionState | None = None
    for q in msg.queues:
        s = by_queue.get(q)
        if s is not None and phys >= s.start_phys and (owner is None or q < owner.queue):
            owner = s
    if owner is None or owner is sub:
        return True
    read = owner.read_phys
    if read is None:
        read = owner.read_phys = _read_position(owner, cursor)
    return read > phys or owner.next_offset >= store.max_offset(owner.queue)


def _read_position(sub: SubscriptionState, cursor: QueueCursor) -> int:
    """`read_phys` of `sub` from the store: just past the message before `next_offset`."""
    if sub.next_offset <= sub.start_offset:
        return sub.start_phys  # nothing read since subscribing
    msg = cursor.one(sub.queue, sub.next_offset - 1)
    if msg is not None:
        return msg.physical_offset + 1
    return 1 << 62  # gone (retention): everything before it was read
