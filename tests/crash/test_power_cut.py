"""Power cuts against the real gateway: record its file-system calls, then check recovery on
the disk states a cut could leave (see docs/durability.md and tests/crash/disk.py).

One recorded run per flush mode is shared by the tests of this module: a QoS 1 + QoS 2 flood
with persistent sessions (some subscribing during the flood) and retained messages.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.crash import checker, oplog
from tests.crash.recording import SEGMENT, Recording, record, record_state

pytestmark = [
    pytest.mark.slow,
    # A recovery that hangs fails the test here (each image is also flagged past 10 s); the
    # bound is generous for the recorded runs and ~1,000 images on a slow 2-core runner.
    pytest.mark.timeout(300),
    pytest.mark.skipif(oplog.compiler() is None, reason="needs a C compiler for the shim"),
    pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="the shim needs /proc"),
]

MESSAGES = 500  # of each QoS: ~1,000 acknowledged publishes, ~4,000 recorded operations
CRASH_POINTS = 160  # of which ~40 are fixed: the first start, the state logs' name changes
SUBSETS = 3  # random choices of unsynced writes per point, besides the synced-only state
GATEWAY_SAMPLE = 4  # crash points where the real gateway is started on the image


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return oplog.build_shim(tmp_path_factory.mktemp("shim"))


@pytest.fixture
def images_dir(tmp_path: Path) -> Iterator[Path]:
    """Where crash images are written and recovered: RAM (/dev/shm) when there is one, as
    each image is fsynced by its recovery and deleted at once; else the test's tmp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="lmqtt-crash-", dir=shm))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory, shim: Path) -> Iterator[Recording]:
    yield record(tmp_path_factory.mktemp("sync"), shim, messages=MESSAGES)


def _images(
    rec: Recording,
    tmp: Path,
    points: list[int],
    subsets: int,
    seed: int,
    pending: list[int] | None = None,
) -> Iterator[tuple[int, int, Path]]:
    """(crash point, subset number, image dir) for every image; 0 is the synced-only state.
    ``pending`` collects how many unsynced operations each crash point had to choose from."""
    rnd = random.Random(seed)
    for k, model in rec.model_at(points):
        if pending is not None:
            pending.append(model.pending_count())
        for sub in range(subsets + 1):
            img = tmp / f"img-{k}-{sub}"
            model.image(img, None if sub == 0 else rnd)
            yield k, sub, img


def _check_all(
    rec: Recording, tmp: Path, points: list[int], subsets: int, pending: list[int] | None = None
) -> list[str]:
    findings: list[str] = []
    for k, sub, img in _images(rec, tmp, points, subsets, seed=len(points), pending=pending):
        t_cut = rec.t_cut(k)
        subscribed = [s for s in rec.run.subscribed if s.t_ack < t_cut]
        r = checker.check_store(
            img, SEGMENT, rec.run.acked_by(t_cut), rec.place, rec.sent_bodies, True, subscribed
        )
        where = f"cut after op {k} ({rec.ops[k].path}), subset {sub}"
        if r.error:
            findings.append(f"{where}: recovery failed: {r.error}")
        if r.lost:
            findings.append(f"{where}: {len(r.lost)} acknowledged lost, e.g. {r.lost[:3]}")
        if r.foreign:
            findings.append(f"{where}: served {len(r.foreign)} bodies nobody sent")
        if r.open_s > 10:
            findings.append(f"{where}: recovery took {r.open_s:.1f} s")
        _rmtree(img)
    return findings


def _rmtree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


def test_the_recording_sees_the_store_work(sync_run: Recording) -> None:
    """The run the images come from: every publish answered was stored once, the recorder saw
    segments created, fsynced and renamed files (else the images would prove nothing)."""
    rec = sync_run
    acked = rec.run.acked_by(rec.run.t_end)
    assert len(acked) >= 2 * MESSAGES
    assert all(rec.parent_counts.get(s.payload) == 1 for s in acked), "stored twice or lost"
    kinds = {o.kind for o in rec.ops}
    assert {oplog.CREATE, oplog.WRITE, oplog.SYNC, oplog.RENAME, oplog.MKDIR} <= kinds
    segments = {
        o.path for o in rec.ops if o.kind == oplog.CREATE and o.path.startswith("commitlog/")
    }
    assert len(segments) >= 3
    assert len(rec.ops) > CRASH_POINTS * 4


def test_sync_flush_loses_nothing_acknowledged_at_any_crash_point(
    sync_run: Recording, images_dir: Path
) -> None:
    points = sync_run.crash_points(CRASH_POINTS, seed=1)
    assert len(points) >= 150
    pending: list[int] = []
    findings = _check_all(sync_run, images_dir, points, SUBSETS, pending)
    # The random subsets had something to choose from at most points (else they would only
    # repeat the synced-only state).
    assert sum(1 for n in pending if n > 0) >= len(points) * 3 // 4, pending
    assert not findings, f"{len(findings)} bad images:\n" + "\n".join(findings[:20])


@pytest.fixture(scope="module")
def gateway_checks(sync_run: Recording) -> Iterator[list[tuple[int, checker.GatewayResult]]]:
    """The real gateway started on a sample of images (one random subset each)."""
    rec = sync_run
    # Spread over the run, alternately just after an fsync (most just made durable) and just
    # before one (the most pending).
    syncs = [i for i, o in enumerate(rec.ops) if o.kind == oplog.SYNC]
    chosen = sorted(
        syncs[len(syncs) * (j + 1) // (GATEWAY_SAMPLE + 1)] - (j % 2) for j in range(GATEWAY_SAMPLE)
    )
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="lmqtt-crash-gw-", dir=shm if shm.is_dir() else None))
    out = []
    try:
        for k, sub, img in _images(rec, root, chosen, 1, seed=5):
            if sub:
                out.append((k, checker.check_gateway(img, rec.run, rec.t_cut(k), SEGMENT, "sync")))
            _rmtree(img)
        yield out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_gateway_restarts_on_crash_images_with_sessions_and_qos2_state(
    gateway_checks: list[tuple[int, checker.GatewayResult]],
) -> None:
    """Sessions SUBACKed before the cut are there and subscribed; PUBREC'd QoS 2 messages are
    completed by PUBREL and delivered exactly once; every acknowledged message is delivered."""
    assert len(gateway_checks) == GATEWAY_SAMPLE
    problems = [f"cut after op {k}: {p}" for k, r in gateway_checks for p in r.problems]
    assert not problems, "\n".join(problems[:20])


def test_an_unanswered_qos2_publish_resent_after_the_cut_is_stored_once(
    gateway_checks: list[tuple[int, checker.GatewayResult]],
) -> None:
    assert sum(r.resent for _k, r in gateway_checks) > 0
    twice = [f"cut after op {k}: {m}" for k, r in gateway_checks for m in r.resent_twice]
    assert not twice, f"{len(twice)} stored twice: {twice[:10]}"


STATE_ROUNDS = 22  # of tests/crash/statework.py: 3 compactions, 2 opens (~100 fixed points)
STATE_EXTRA_POINTS = 12
STATE_SUBSETS = 2


def test_state_log_generations_and_compactions_survive_a_cut_at_every_step(
    tmp_path: Path, images_dir: Path, shim: Path
) -> None:
    """A store's first start, every new state-log generation (at each open and compaction)
    and every compaction, cut at each step that changes a file's shape: the store opens (and
    opens again), its state is that of a whole round at or after the last one acknowledged."""
    rec = record_state(tmp_path / "rec", shim, rounds=STATE_ROUNDS)
    assert len(rec.acks) == STATE_ROUNDS
    names = {o.path for o in rec.ops}
    assert any(p.startswith("state/") and p.endswith(".snapshot") for p in names)
    assert sum(1 for p in names if p.startswith("state/") and p.endswith(".log")) >= 5
    points = rec.crash_points(STATE_EXTRA_POINTS, seed=6)
    findings: list[str] = []
    rnd = random.Random(6)
    for k, model in rec.model_at(points):
        for sub in range(STATE_SUBSETS + 1):
            img = images_dir / f"state-{k}-{sub}"
            model.image(img, None if sub == 0 else rnd)
            found = checker.check_state(img, rec.acked_by(k), rec.rounds)
            if found:
                findings.append(f"cut after op {k} ({rec.ops[k].path}), subset {sub}: {found}")
            _rmtree(img)
    assert not findings, f"{len(findings)} bad images:\n" + "\n".join(findings[:20])


def test_fsync_switched_off_is_caught(tmp_path: Path, images_dir: Path, shim: Path) -> None:
    """The same check on a run whose fsyncs the shim turns into no-ops (reporting success):
    the acknowledged messages are not on the simulated disk, and the checker must say so."""
    rec = record(tmp_path / "rec", shim, messages=150, nosync=True)
    assert not any(o.kind == oplog.SYNC for o in rec.ops)
    # Cuts before the first client connected have nothing acknowledged to lose: only the
    # later ones count (the start's own steps grew with its directory fsyncs, and with the
    # state and offsets logs' preallocations).
    points = [
        k
        for k in rec.crash_points(44, seed=2, state_steps=False)
        if rec.ops[k].t_ns >= rec.run.t_start
    ]
    assert len(points) >= 20, points
    findings = _check_all(rec, images_dir, points, 1)
    lost = [f for f in findings if "acknowledged lost" in f or "recovery failed" in f]
    assert len(lost) >= len(points), f"only {len(lost)} of {2 * len(points)} images flagged"
    # The gateway-level check sees it too: at the end of the run nothing was ever synced.
    k = len(rec.ops) - 1
    for _k, sub, img in _images(rec, images_dir, [k], 0, seed=3):
        assert sub == 0
        r = checker.check_gateway(img, rec.run, rec.t_cut(k), SEGMENT, "sync")
        assert any("not delivered" in p or "session" in p for p in r.problems), r.problems


def test_async_flush_loses_at_most_the_last_interval_and_serves_nothing_corrupt(
    tmp_path: Path, images_dir: Path, shim: Path
) -> None:
    """flush=async promises less: a message is durable once the periodic CommitLog fsync
    that began after its acknowledgement has completed (every flush interval, 200 ms by
    default). At every cut, messages whose log bytes (and the ones before them) were fsynced
    are there; recovery never fails; nothing served is corrupt. Some acknowledged messages
    are lost at some cuts (the promise is weaker, and the check must see the difference)."""
    # Paced over about a second: an unpaced flood of batched appends ends within one 200 ms
    # flush interval, before any periodic fsync.
    rec = record(tmp_path / "rec", shim, messages=200, flush="async", pause_s=0.08)
    gaps = rec.log_sync_gaps_ns()
    assert gaps, "no periodic CommitLog fsync recorded"
    # The interval is 200 ms; the bound is generous for a loaded host.
    assert max(gaps) < 3_000_000_000, f"CommitLog fsyncs {max(gaps) / 1e9:.2f} s apart"
    points = rec.crash_points(60, seed=4, state_steps=False)
    findings: list[str] = []
    unsynced_lost = 0
    for k, sub, img in _images(rec, images_dir, points, 2, seed=4):
        durable = rec.synced_before_ack(k)
        r = checker.check_store(
            img, SEGMENT, durable, rec.place, rec.sent_bodies, scan_parents=True
        )
        if r.error or r.lost or r.foreign:
            findings.append(
                f"op {k} subset {sub}: {r.error} lost={r.lost[:3]} foreign={len(r.foreign)}"
            )
        if sub == 0:  # synced-only state: what an ack did not wait for is gone
            acked = rec.run.acked_by(rec.t_cut(k))
            unsynced_lost += bool(
                checker.check_store(
                    img, SEGMENT, acked, rec.place, rec.sent_bodies, scan_parents=False
                ).lost
            )
        _rmtree(img)
    assert unsynced_lost > 0, "async mode never lost an acknowledged message: check the check"
    assert not findings, "\n".join(findings[:20])
