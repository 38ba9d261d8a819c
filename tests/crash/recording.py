"""One recorded run of the real gateway under the shim, and the crash points chosen in it."""

from __future__ import annotations

import bisect
import itertools
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.crash import checker, oplog
from tests.crash.disk import DiskModel
from tests.crash.gateway_proc import ROOT, GatewayProcess
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

    def crash_points(self, n: int, seed: int, *, state_steps: bool = True) -> list[int]:
        """``n`` op indexes: every step of a CommitLog segment's creation (create, size, the
        directory's fsync: a cut there once left a 0-byte segment no restart could open), with
        ``state_steps`` every op of the first start and every name change of the state logs,
        two thirds of the rest just after an fsync, a create, a rename or a directory change
        (where the on-disk state changes shape), the others anywhere."""
        rnd = random.Random(seed)
        pts = {
            i
            for i, o in enumerate(self.ops)
            if o.path == "commitlog"
            or (o.path.startswith("commitlog/") and o.kind in (oplog.CREATE, oplog.TRUNC))
        }
        if state_steps:
            # The first start (before the first client connected), and every step of a state
            # or offsets log's generation start (a cut there once left a log no start could
            # read). The promises about messages alone leave them out: nothing is
            # acknowledged at the first.
            pts |= {i for i, o in enumerate(self.ops) if o.t_ns < self.run.t_start}
            pts |= set(name_changes(self.ops, ("state", "offsets")))
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


def name_changes(ops: list[oplog.Op], dirs: tuple[str, ...]) -> list[int]:
    """Op indexes where the files of ``dirs`` change shape: every create, rename, unlink,
    truncation and directory fsync there, and each file's first write and first fsync (a
    new file's header)."""
    out: list[int] = []
    seen_write: set[str] = set()
    seen_sync: set[str] = set()
    shape = (oplog.CREATE, oplog.RENAME, oplog.UNLINK, oplog.TRUNC, oplog.MKDIR, oplog.RMDIR)
    for i, o in enumerate(ops):
        top = o.path.split("/", 1)[0]
        if top not in dirs:
            continue
        if o.kind in shape or (o.kind == oplog.SYNC and o.path in dirs):
            out.append(i)
        elif o.kind == oplog.WRITE and o.path not in seen_write:
            seen_write.add(o.path)
            out.append(i)
        elif o.kind == oplog.SYNC and o.path not in seen_sync:
            seen_sync.add(o.path)
            out.append(i)
    return out


class DiskModelWalk:
    """Replays the recording once, stopping at each crash point in turn."""

    def __init__(self, rec: Recording | StateRecording, points: list[int]) -> None:
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


@dataclass
class StateRecording:
    """A recorded run of tests/crash/statework.py: its operations and acknowledged rounds."""

    ops: list[oplog.Op]
    acks: list[tuple[int, int]]  # (round, CLOCK_MONOTONIC ns when acknowledged)
    rounds: int

    def acked_by(self, k: int) -> int:
        """The last round acknowledged before a cut just after op ``k`` (0: none)."""
        t = self.ops[k + 1].t_ns if k + 1 < len(self.ops) else None
        done = [i for i, t_ack in self.acks if t is None or t_ack < t]
        return max(done, default=0)

    def crash_points(self, extra: int, seed: int) -> list[int]:
        """Every op where the state files change shape (see name_changes), and ``extra`` more
        anywhere."""
        pts = set(name_changes(self.ops, ("state", "offsets")))
        pts |= {i for i, o in enumerate(self.ops) if o.path in ("", "commitlog", "consumequeue")}
        rnd = random.Random(seed)
        want = min(len(self.ops), len(pts) + extra)
        while len(pts) < want:
            pts.add(rnd.randrange(len(self.ops)))
        return sorted(pts)

    def model_at(self, points: list[int]) -> DiskModelWalk:
        return DiskModelWalk(self, points)


def record_state(tmp: Path, shim: Path, *, rounds: int) -> StateRecording:
    """Run tests/crash/statework.py under the shim on an empty data dir."""
    data = (tmp / "data").resolve()
    data.mkdir(parents=True)
    log = tmp / "ops.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LD_PRELOAD": str(shim),
        "CRASHSIM_ROOT": str(data),
        "CRASHSIM_LOG": str(log),
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.crash.statework", str(data), str(rounds)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    acks = [(int(a), int(b)) for a, b in (line.split() for line in out.stdout.splitlines())]
    return StateRecording(oplog.parse(log.read_bytes(), str(data)), acks, rounds)
