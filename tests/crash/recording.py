"""One recorded run of the real gateway under the shim, and the crash points chosen in it."""

from __future__ import annotations

import bisect
import itertools
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.crash import checker, oplog
from tests.crash.disk import DiskModel
from tests.crash.gateway_proc import GatewayProcess
from tests.crash.workload import Run, Sent, flood

#: Small segments: a run of a few hundred KB creates several, and images stay small.
SEGMENT = 64 * 1024


@dataclass
class Recording:
    ops: list[oplog.Op]
    run: Run
    place: checker.Placement
    parent_counts: dict[bytes, int]
    phys: dict[bytes, int]  # body -> CommitLog offset
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

    def synced_before_ack(self, k: int) -> list[Sent]:
        """The acknowledged messages that a cut after op ``k`` must keep in async mode: those
        for which every CommitLog byte written before their acknowledgement, in their segment
        and the ones before it, and every segment name created before it, had been fsynced
        (the CommitLog is recovered as a prefix: a hole before a message loses it too)."""
        writes: dict[str, list[tuple[int, int]]] = {}  # path -> [(t_ns, seq)], in order
        synced: dict[str, int] = {}  # path -> durable up to this seq
        for o in self.ops[: k + 1]:
            if o.path.startswith("commitlog/") and o.kind in (oplog.WRITE, oplog.TRUNC):
                writes.setdefault(o.path, []).append((o.t_ns, o.seq))
            elif o.path.startswith("commitlog/") and o.kind == oplog.CREATE:
                writes.setdefault("commitlog", []).append((o.t_ns, o.seq))
            elif o.kind == oplog.SYNC and (
                o.path == "commitlog" or o.path.startswith("commitlog/")
            ):
                synced[o.path] = max(synced.get(o.path, 0), o.a)
        out = []
        for s in self.run.acked_by(self.t_cut(k)):
            assert s.t_ack is not None
            seg = self.phys[s.payload] // SEGMENT * SEGMENT
            ok = True
            for path, ws in writes.items():
                if path != "commitlog" and int(path.rsplit("/", 1)[1]) > seg:
                    continue
                i = bisect.bisect_left(ws, (s.t_ack, 0)) - 1  # the last one before the ack
                if i >= 0 and synced.get(path, 0) < ws[i][1]:
                    ok = False
                    break
            if ok:
                out.append(s)
        return out

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
    tmp: Path,
    shim: Path,
    *,
    messages: int,
    flush: str = "sync",
    nosync: bool = False,
    pause_s: float = 0.0,
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
        run = flood(gw.port, messages=messages, pause_s=pause_s)
    except BaseException:
        gw.kill()
        raise
    gw.kill()
    ops = oplog.parse(log.read_bytes(), str(data))
    # The oracle: the complete run (the page cache kept everything a SIGKILL leaves).
    full = tmp / "complete"
    shutil.copytree(data, full)
    place, counts, phys = checker.placement(full, SEGMENT)
    shutil.rmtree(full)
    return Recording(ops, run, place, counts, phys, {s.payload for s in run.sent}, flush)
