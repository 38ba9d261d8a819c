"""Real-time scheduling of the processes a latency run measures (broker and load generator).

Why: on a shared host the tail of a 1,000 msg/s latency run is the scheduler's, not the
broker's. Each message wakes three sleeping processes (publisher, broker, subscriber); when
other work keeps both cores busy, the fair scheduler lets a woken process wait for the running
one's slice, a few ms, at every hop. Measured here with two cores saturated by other jobs: the
publisher, a process doing nothing but sleep until its next slot, left p99 3-6 ms late, and
Mosquitto's end-to-end p99 was 3-4 ms. With broker and generator under SCHED_FIFO (lowest
real-time priority) both fell below 1 ms on the same busy host (Mosquitto 0.2-0.3 ms).

SCHED_FIFO only changes who runs first when a process wakes; it gives no broker more CPU than
another, and every broker gets the same. Only the paced latency scenarios use it: a flooding
broker at real-time priority would starve the rest of the host (the kernel's RT throttling
still leaves 5 % of each period to normal tasks). Setting it needs root or CAP_SYS_NICE; without
it the run stays at normal priority and says so.
"""

from __future__ import annotations

import contextlib
import os

#: The lowest SCHED_FIFO priority: above every normal task, below kernel threads that use RT.
PRIORITY = 1


def make_realtime(pid: int) -> bool:
    """Put every thread of ``pid`` under SCHED_FIFO; False if not permitted or not Linux.

    Threads started later inherit the policy of the thread that creates them, so applying this
    right after the process starts covers its future threads; applying it again later catches
    threads started in between.
    """
    if not hasattr(os, "sched_setscheduler"):
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    param = os.sched_param(PRIORITY)
    done = False
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            try:
                os.sched_setscheduler(tid, os.SCHED_FIFO, param)
            except PermissionError:
                return False
            done = True
    return done


def make_normal(pid: int) -> None:
    """Back to the default policy (SCHED_OTHER) for every thread of ``pid``."""
    if not hasattr(os, "sched_setscheduler"):
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def is_realtime(pid: int) -> bool:
    try:
        return os.sched_getscheduler(pid) == os.SCHED_FIFO
    except (OSError, AttributeError):
        return False
