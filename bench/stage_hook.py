"""The gateway side of bench/stages.py: timers around named functions of a running gateway.

Loaded at interpreter start by the sitecustomize module bench/stages.py writes (only into the
gateway's process, through its PYTHONPATH). `install()` wraps every stage named in
LMQTT_STAGES (comma-separated `module:Qualified.name`) with a timer that counts calls, wall
and thread CPU time while a window is open, and remembers the event loop that
uvloop.new_event_loop makes. LMQTT_STAGES_AFTER seconds after start the window opens on the
loop's thread, LMQTT_STAGES_WINDOW seconds later it closes and the figures go to
LMQTT_STAGES_OUT as JSON, with the loop thread's CPU over the window.

Standard library only (the gateway imports nothing of the bench but this module). A wrapper
reads two clocks per call (thread CPU time is a system call): about 1 us a call on the
measuring host, which a stage's figure includes, and so does the figure of a stage that calls
it.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["install"]

# name -> [calls, wall seconds, thread CPU seconds]
_totals: dict[str, list[float]] = {}
_open = False
_loops: list[Any] = []


def _resolve(spec: str) -> tuple[Any, str, Callable[..., Any]]:
    """`module:Class.method` or `module:function` -> (owner, attribute name, function)."""
    module_name, _, qualified = spec.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualified.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    totals = _totals.setdefault(name, [0, 0.0, 0.0])
    wall = time.perf_counter
    cpu = time.thread_time

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _open:
            return fn(*args, **kwargs)
        w, c = wall(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[0] += 1
            totals[1] += wall() - w
            totals[2] += cpu() - c

    return timed


def _capture_loop() -> None:
    import uvloop

    make = uvloop.new_event_loop

    def new_event_loop() -> Any:
        loop = make()
        _loops.append(loop)
        return loop

    uvloop.new_event_loop = new_event_loop


def _window(after: float, window: float, out: str) -> None:
    time.sleep(after)
    if not _loops:
        with open(out, "w") as f:
            json.dump({"error": "no uvloop event loop was made"}, f)
        return
    loop = _loops[-1]
    start: list[float] = []

    def open_window() -> None:
        global _open
        for totals in _totals.values():
            totals[:] = [0, 0.0, 0.0]
        start[:] = [time.monotonic(), time.thread_time()]
        _open = True

    def close_window() -> None:
        global _open
        _open = False
        wall = time.monotonic() - start[0]
        figures = {
            "window_s": wall,
            "loop_cpu_s": time.thread_time() - start[1],
            "stages": {
                name: {"calls": int(n), "wall_s": w, "cpu_s": c}
                for name, (n, w, c) in _totals.items()
            },
        }
        with open(out, "w") as f:
            json.dump(figures, f)

    loop.call_soon_threadsafe(open_window)
    time.sleep(window)
    loop.call_soon_threadsafe(close_window)


def install() -> None:
    """Wrap the stages of LMQTT_STAGES and start the window's thread (see the docstring)."""
    env = os.environ
    for spec in filter(None, env.get("LMQTT_STAGES", "").split(",")):
        owner, name, fn = _resolve(spec)
        setattr(owner, name, _timed(spec, fn))
    _capture_loop()
    after = float(env.get("LMQTT_STAGES_AFTER", "10"))
    window = float(env.get("LMQTT_STAGES_WINDOW", "4"))
    out = env["LMQTT_STAGES_OUT"]
    threading.Thread(target=_window, args=(after, window, out), daemon=True).start()
