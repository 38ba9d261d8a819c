"""A rich progress display for a Spark job: one line per phase, a bar of Spark tasks done.

Spark's own console progress bar is turned off (it would interleave with ours); instead a daemon
thread polls the status tracker a few times a second and moves the current phase's bar.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

if TYPE_CHECKING:
    from pyspark import SparkContext


class SparkProgress:
    """`with SparkProgress(sc, console) as p: with p.phase("scan"): ...`"""

    def __init__(self, sc: SparkContext | None, console: Console, enabled: bool = True) -> None:
        self.sc = sc
        self.console = console
        self.enabled = enabled
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tasks"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not enabled,
        )
        self._current: TaskID | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_stages: set[int] = set()
        self._done_in_finished = 0
        self._total_in_finished = 0

    def __enter__(self) -> SparkProgress:
        self.progress.__enter__()
        if self.enabled and self.sc is not None:
            self._thread = threading.Thread(target=self._poll, name="spark-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.progress.__exit__(exc_type, exc, tb)

    @contextmanager
    def phase(self, description: str) -> Iterator[None]:
        task = self.progress.add_task(description, total=None)
        self._current = task
        started = time.monotonic()
        self._seen_stages.clear()
        try:
            yield
        finally:
            self._current = None
            done = max(1, int(self.progress.tasks[task].completed))
            self.progress.update(task, total=done, completed=done)
            self.progress.update(
                task, description=f"{description} ({time.monotonic() - started:.1f}s)"
            )

    def _poll(self) -> None:
        assert self.sc is not None
        tracker = self.sc.statusTracker()
        stage_totals: dict[int, tuple[int, int]] = {}
        while not self._stop.wait(0.25):
            task = self._current
            if task is None:
                stage_totals.clear()
                continue
            try:
                for stage_id in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(stage_id)
                    if info is not None:
                        stage_totals[stage_id] = (info.numCompletedTasks, info.numTasks)
            except Exception:  # the context is stopping: nothing more to show
                return
            done = sum(d for d, _ in stage_totals.values())
            total = sum(t for _, t in stage_totals.values())
            if self._current == task and total:
                self.progress.update(task, completed=done, total=total)
