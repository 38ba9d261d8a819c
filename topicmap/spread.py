"""The merged offsets of a deployment spread over several RocketMQ brokers.

One home for the format, because two sides that must not import each other read it: the
gateway writes it (gateway/storage/rocketmq/spread.py: its session records, in-flight entries and
shared groups' positions of a merged queue) and the fan-out report reads it back from the
%STATE% queue (analytics/rocketmq.py). Standard library only, like the rest of topicmap.

Slots. The brokers of a deployment are numbered once, in the `meta/brokers` state record
(SLOTS_KEY, a JSON list of names): slot 0 is the home broker, a broker seen later takes the
next slot. The numbering never changes, so positions saved with it stay valid when brokers join.

Offsets of a merged queue (a gateway queue named `%LMQ%...`: spread_queue; the core keeps them
as ints). A position is the vector of the per-broker offsets (one per slot, the copy's next
offset there), packed:

       v = BASE + (pack(vec) << IDX_BITS | idx)        pack(vec) = sum(vec[k] << (W * k))

    idx 0        the position vec
    idx 2k+1     the message at vec[k] of slot k (a message's offset: what `get` hands out)
    idx 2k+2     the position after that message: vec + e_k (= the message's offset + 1,
                 which is how the delivery loop moves on)

A message read from position vec on slot k gets offset enc(vec, 2k+1); the next one
enc(vec + e_k, ...) is larger, so offsets rise along a read as the core expects, `off + 1`
is the position after `off`, and any offset names its broker and that broker's offset (an
in-flight entry is re-read after a restart, on any node). A value below BASE is an offset of
the home broker's copy saved before spread was turned on. Two representations of one position
(enc(vec, 2k+2) = enc(vec + e_k, 0)) compare differently: a caught-up reader at the first
looks "behind" the queue's end (`max_offset` is enc(maxes, 0)) until it reads again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

log = logging.getLogger("lmqtt.rocketmq")

W = 48  # bits per broker's offset
MASK = (1 << W) - 1
IDX_BITS = 6
MAX_SLOTS = 31  # idx 2k+2 < 2**IDX_BITS
BASE = 1 << 62  # every merged offset is at or above it; a plain home offset below it
#: The state record numbering the brokers (slot 0: the home broker).
SLOTS_KEY = "meta/brokers"


def spread_queue(queue: str) -> bool:
    """Whether gateway queue `queue` is merged over the brokers (a filter's light queue), or
    lives on the home broker only (%STATE%, %RETAIN%, %CLUSTER%: one total order each)."""
    return queue.startswith("%LMQ%")


def encode(vec: Sequence[int], idx: int = 0) -> int:
    packed = 0
    for k, off in enumerate(vec):
        packed |= off << (W * k)
    return BASE + (packed << IDX_BITS | idx)


def decode(value: int, slots: int) -> tuple[list[int], int]:
    """(position vector, slot whose message is asked first or -1) of an offset."""
    if value < BASE:  # a home-broker offset from before spread
        return [value] + [0] * (slots - 1), -1
    x = value - BASE
    idx = x & ((1 << IDX_BITS) - 1)
    packed = x >> IDX_BITS
    vec = [(packed >> (W * k)) & MASK for k in range(slots)]
    if idx:
        k = (idx - 1) >> 1
        if k >= slots:  # defensive: a slot this process does not know
            return vec, -1
        if idx & 1:
            return vec, k
        vec[k] += 1
    return vec, -1


def position(value: int, slots: int) -> list[int]:
    """The per-broker offsets (by slot) a merged offset stands for as a read position: each
    copy's next offset (a message's own offset is the position holding it next)."""
    return decode(value, slots)[0]


def message_at(value: int, slots: int) -> tuple[int, int] | None:
    """(slot, offset in that broker's copy) of a message's merged offset, or None if `value`
    is a position rather than a message's offset."""
    if value < BASE:
        return 0, value
    vec, pref = decode(value, slots)
    return (pref, vec[pref]) if pref >= 0 else None


def slots_from_state(raw: bytes | None, home: str, brokers: Sequence[str]) -> list[str]:
    """The slot list: the recorded one (its home first), then `brokers` not in it, by name."""
    known: list[str] = []
    if raw:
        try:
            known = [str(b) for b in json.loads(raw)]
        except (ValueError, TypeError):
            log.warning("state record %s unreadable: brokers renumbered", SLOTS_KEY)
    if not known:
        known = [home]
    for b in sorted(brokers):
        if b not in known:
            known.append(b)
    if len(known) > MAX_SLOTS:
        raise ValueError(f"more than {MAX_SLOTS} brokers in one deployment")
    return known
