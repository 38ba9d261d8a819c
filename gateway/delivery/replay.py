"""A subscription's replayed history, sent before its light queue (the replay itself, what it
reads and in which order, is gateway/session/replay.py).

A replay pass looks at up to REPLAY_STEP records and stops after REPLAY_SLICE_S of wall-clock
time, and runs only within the replays' share of the loop (ReplayPacer), so live traffic runs
in between: a live message waits at most about one slice behind it. Sent QoS 1/2 messages are
in flight as copies: their parent-queue position is not one the session reads. When the
replay is done the light queue takes over, passing over what the replay handed out.
"""

from __future__ import annotations

import logging
import time

from gateway.delivery.acks import Acknowledgements
from gateway.delivery.rules import decide
from gateway.delivery.state import UNKNOWN_END
from gateway.session.model import Inflight, SubscriptionState
from gateway.session.replay import Replay
from gateway.storage.port import StoredMessage

log = logging.getLogger("lmqtt.gateway")

# A replay waiting for the backend to read its history (RocketMQ: a pull) asks again after this.
REPLAY_WAIT_S = 0.005
REPLAY_STEP = 256
REPLAY_SLICE_S = 0.0005


class Replaying(Acknowledgements):
    """Sends the replays of a DeliveryLoop's subscriptions."""

    __slots__ = ()

    def _replay(self, sub: SubscriptionState) -> bool:
        """Hand `sub`'s replayed messages over within the window, a slice per pass."""
        replay = sub.replay
        assert replay is not None
        pacer = self.ctx.replay_pacer
        wait = pacer.wait()
        if wait > 0:  # live traffic first: come back when the replays' share allows
            if self._replay_timer is None:
                self._replay_timer = self._loop.call_later(wait, self._replay_due)
            return False
        started = time.monotonic()
        try:
            return self._replay_some(sub, replay, started + REPLAY_SLICE_S)
        finally:
            pacer.spent(started)

    def _replay_due(self) -> None:
        self._replay_timer = None
        self.wake()

    def _replay_some(self, sub: SubscriptionState, replay: Replay, until: float) -> bool:
        store = self.ctx.store
        session = self.session
        moved = False
        for i in range(REPLAY_STEP):
            if i & 7 == 7 and time.monotonic() > until:
                break
            msg = replay.peek(self.ctx.cursor)
            if msg is None:
                if replay.waiting:  # the backend's read is on its way (RocketMQ: a pull)
                    if self._replay_timer is None:
                        self._replay_timer = self._loop.call_later(REPLAY_WAIT_S, self._replay_due)
                    break
                sub.replay = None
                sub.start_phys = store.log_max_offset  # covers from here (see overlap.py)
                # Passed over as the light queue is read (_pass_replayed), whenever its
                # messages reach the store's reads: on RocketMQ they may not be there yet.
                sub.replayed_phys = replay.last_phys
                log.info("%r: replay of %r done, live now", session.client_id, sub.topic_filter)
                self.ctx.sessions.touch(session)
                return True
            rec = replay.record(msg)
            out = decide(rec, sub, session.client_id, self.level) if rec is not None else None
            if rec is not None and out is not None:
                qos = out.qos
                if (qos > 0 and self.capacity() <= 0) or not self.can_send():
                    break
                # History is not a retained message: RETAIN 0 whatever the subscription says.
                pid = self.send(rec, qos, False, out.sub_ids, out.expiry_left, None)
                if pid:
                    session.inflight[pid] = Inflight(
                        pid, None, 0, qos, message=rec, retain=False, sub_ids=out.sub_ids
                    )
            replay.advance()
            moved = True
        if moved:
            self.ctx.sessions.mark_progress(session)
            self._mark_ready(sub.queue, UNKNOWN_END)  # more to replay (paced: see _replay)
        return moved

    def _pass_replayed(
        self, sub: SubscriptionState, messages: list[StoredMessage]
    ) -> list[StoredMessage]:
        """Pass over the leading `messages` the replay of `sub` handed over (stored at or
        before `sub.replayed_phys`, see gateway/session/replay.py; the queue is in store order,
        so they come first) and return the rest. The first message past it ends the check."""
        last = sub.replayed_phys
        skip = 0
        for msg in messages:
            if msg.physical_offset > last:
                sub.replayed_phys = -1
                break
            if msg.queue_offset >= sub.next_offset:
                sub.next_offset = msg.queue_offset + 1
                sub.read_phys = msg.physical_offset + 1
            skip += 1
        return messages[skip:] if skip else messages
