"""LoopLoad (gateway/delivery/load.py): the thread's CPU share over the last window, measured
when asked once the window is over; a quiet spell reads as not loaded."""

from __future__ import annotations

import time

from gateway.delivery.load import WINDOW_S, LoopLoad


def _burn_window() -> None:
    """Keep this thread busy for a little more than one window of the wall clock."""
    end = time.monotonic() + WINDOW_S * 1.2
    n = 0
    while time.monotonic() < end:
        n += 1


def test_a_thread_that_computes_reads_as_loaded_and_a_quiet_one_does_not() -> None:
    # A share no scheduler on a shared host takes from a thread that computes all along.
    load = LoopLoad(share=0.05)
    _burn_window()
    assert load.busy(), "a window of computing did not read as load"
    time.sleep(WINDOW_S * 1.2)
    assert not load.busy(), "a window of sleeping read as load"


def test_the_measure_holds_for_a_window() -> None:
    load = LoopLoad(share=0.05)
    _burn_window()
    assert load.busy()
    # Asked again within the window: the last measure, not a new one over a few microseconds.
    assert load.busy()
    assert load.loaded


def test_the_first_question_after_a_quiet_spell_is_not_load() -> None:
    load = LoopLoad()
    time.sleep(WINDOW_S * 1.2)
    assert not load.busy()
