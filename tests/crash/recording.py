"""One recorded run of the real gateway under the shim, and the crash points chosen in it."""

from __future__ import annotations

import itertools
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.crash import checker, oplog
from tests.crash.disk import DiskModel
from tests.crash.gateway_proc import GatewayProcess
from tests.crash.workload import Run, flood

#: Small segments: a run of a few hundred KB creates several, and images stay small.
SEGMENT = 64 * 1024


@dataclass
class Recording:
    ops: list[oplog.Op]
    run: Run
    place: checker.Placement
    parent_counts: dict[bytes, int]
    sent_bodies: set[bytes]
    flush: str

    def t_cut(self, k: int) -> int:
        """The instant of a cut just after op ``k``: before op k+1 was issued."""
        return self.ops[k + 1].t_ns if k + 1 < len(self.ops) else self.run.t_end

    def crash_points(self, n: int, seed: int) -> list[int]:
        """``n`` op indexes: every step of a CommitLog segment's creation (create, size, the
        directory's fsync: a cut there once left a 0-byte segment no restart could open), two
        thirds of the rest just after an fsync, a create, a rename or a directory change
        (where the on-disk state changes shape), the others anywhere."""
        rnd = random.Random(seed)
        pts = {
            i
            for i, o in enumerate(self.ops)
            if o.path == "commitlog"
            or (o.path.startswith("commitlog/") and o.kind in (oplog.CREATE, oplog.TRUNC))
        }
        kinds = (oplog.SYNC, oplog.CREATE, oplog.RENAME, oplog.MKDIR, oplog.TRUNC)
        marked = [i for i, o in enumerate(self.ops) if o.kind in kinds and i not in pts]
        pts |= set(rnd.sample(marked, max(0, min(len(marked), n * 2 // 3 - len(pts)))))
        while len(pts) < min(n, len(self.ops)):
            pts.add(rnd.randrange(len(self.ops)))
        return sorted(pts)

    def model_at(self, points: list[int]) -> DiskModelWalk:
        return DiskModelWalk(self, points)

    def log_synced_before(self, k: int) -> int:
        """When the newest CommitLog fsync completed by op ``k`` began (CLOCK_MONOTONIC ns;
        0 if none): every byte written before then was durable at a cut after op k."""
        by_seq = {o.seq: o for o in self.ops}
        for o in reversed(self.ops[: k + 1]):
            if o.kind == oplog.SYNC and o.path.startswith("commitlog/"):
                return by_seq[o.a].t_ns if o.a in by_seq else 0
        return 0

    def log_sync_gaps_ns(self) -> list[int]:
        """Time between the starts of successive CommitLog fsyncs."""
        by_seq = {o.seq: o for o in self.ops}
        starts = [
            by_seq[o.a].t_ns
            for o in self.ops
            if o.kind == oplog.SYNC and o.path.startswith("commitlog/") and o.a in by_seq
        ]
        return [b - a for a, b in itertools.pairwise(starts)]


class DiskModelWalk:
    """Replays the recording once, stopping at each crash point in turn."""

    def __init__(self, rec: Recording, points: list[int]) -> None:
        self.rec = rec
        self.points = points
        self.model = DiskModel()

    def __iter__(self) -> Iterator[tuple[int, DiskModel]]:
        for k in self.points:
            while self.model.applied <= k:
                self.model.replay(self.rec.ops[self.model.applied])
            yield k, self.model


def record(
    tmp: Path, shim: Path, *, messages: int, flush: str = "sync", nosync: bool = False
) -> Recording:
    """Run the gateway under the shim on an empty data dir, flood it, SIGKILL it."""
    data = (tmp / "data").resolve()
    data.mkdir(parents=True)
    log = tmp / "ops.log"
    env = {"LD_PRELOAD": str(shim), "CRASHSIM_ROOT": str(data), "CRASHSIM_LOG": str(log)}
    if nosync:
        env["CRASHSIM_NOSYNC"] = "1"
    gw = GatewayProcess(data, flush=flush, segment_size=SEGMENT, env=env)
    try:
        run = flood(gw.port, messages=messages)
    except BaseException:
        gw.kill()
        raise
    gw.kill()
    ops = oplog.parse(log.read_bytes(), str(data))
    # The oracle: the complete run (the page cache kept everything a SIGKILL leaves).
    full = tmp / "complete"
    shutil.copytree(data, full)
    place, counts = checker.placement(full, SEGMENT)
    shutil.rmtree(full)
    return Recording(ops, run, place, counts, {s.payload for s in run.sent}, flush)
