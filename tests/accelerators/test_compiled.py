"""The mypyc group (accelerators/compiled.py): built, it runs compiled as a whole; switched
off, stale or not built, it runs from its source as a whole; and its source stays the
reference: the modules' own tests pass both ways."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from accelerators import compiled

ROOT = Path(compiled.__file__).resolve().parents[1]

# Where each of the group's modules came from, and why, in a fresh interpreter.
PROBE = """
import importlib, json, sys
import accelerators, accelerators.compiled as c
files = {m: importlib.import_module(m).__file__ for m in c.MODULES}
kernels = not accelerators.pure_python()
print(json.dumps({"why": c.why_source(), "files": files, "kernels": kernels}))
"""


def _probe(env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _built() -> None:
    """Skip where the group was not built; fail there when CI requires it."""
    if not compiled.built_digests():
        if os.environ.get("LMQTT_REQUIRE_COMPILED"):
            pytest.fail("the mypyc group was not built (LMQTT_REQUIRE_COMPILED is set)")
        pytest.skip("the mypyc group was not built (no mypyc, or it failed: see setup.py)")


def test_a_current_build_runs_every_module_of_the_group_compiled() -> None:
    _built()
    assert compiled.why_source() is None, compiled.why_source()
    probe = _probe({"LMQTT_PURE_PYTHON": ""})
    assert probe["why"] is None
    files = probe["files"]
    assert isinstance(files, dict) and set(files) == set(compiled.MODULES)
    assert all(f.endswith(".so") for f in files.values()), files


def test_the_pure_python_switch_runs_every_module_from_its_source() -> None:
    probe = _probe({"LMQTT_PURE_PYTHON": "1"})
    assert probe["why"] == "LMQTT_PURE_PYTHON is set"
    files = probe["files"]
    assert isinstance(files, dict)
    assert all(f.endswith(".py") for f in files.values()), files


def test_the_groups_own_switch_runs_it_from_source_and_keeps_the_kernels() -> None:
    probe = _probe({"LMQTT_PURE_PYTHON": "", compiled.SWITCH: "1"})
    assert probe["why"] == f"{compiled.SWITCH} is set"
    files = probe["files"]
    assert isinstance(files, dict)
    assert all(f.endswith(".py") for f in files.values()), files
    assert probe["kernels"] is True  # the C kernels are not switched off by it


def test_a_source_changed_after_the_build_runs_the_whole_group_from_source(
    tmp_path: Path,
) -> None:
    _built()
    # A copy of the tree with its build, in which one module of the group is edited afterwards.
    tree = tmp_path / "tree"
    for package in {"accelerators", *(m.split(".")[0] for m in compiled.MODULES)}:
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__py*"))
    for lib in ROOT.glob(f"{compiled.GROUP}__mypyc*.so"):
        shutil.copy2(lib, tree)
    edited = tree / "topicmap" / "topic.py"
    edited.write_text(edited.read_text() + "\n# edited after the build\n")
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tree)!r})\n" + PROBE],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    probe = json.loads(done.stdout)
    assert probe["why"].startswith("changed since the build: topicmap.topic"), probe["why"]
    assert all(f.endswith(".py") for f in probe["files"].values()), probe["files"]
    assert all(f.startswith(str(tree)) for f in probe["files"].values())
    # Said once, where an operator sees it.
    assert done.stderr.count("compiled modules not used: changed since the build") == 1


def test_every_module_of_the_group_has_its_source_and_no_other_module_has_a_build() -> None:
    for module in compiled.MODULES:
        assert compiled.source_of(module).exists(), module
    assert compiled.stale_builds() == []


@pytest.mark.slow
def test_the_groups_own_tests_pass_from_source_too() -> None:
    """The source is the reference: the tests of the group's modules, run again with the
    group from its source (the suite itself runs it compiled, when built)."""
    # The unit-level ones, the connection's inline paths and the delivery loop's (~30 s): the
    # end-to-end suites run the group compiled.
    tests = [
        "tests/topicmap",
        "tests/store/test_statelog.py",
        "tests/store/test_offsets.py",
        "tests/gateway/session/test_expiry_ticks.py",
        "tests/gateway/session/test_sessions.py",
        "tests/gateway/session/test_state_records.py",
        "tests/gateway/connection/test_basic.py",
        "tests/gateway/connection/test_batch_ingest.py",
        "tests/gateway/connection/test_bad_input.py",
        "tests/gateway/delivery/test_delivery_pacing.py",
        "tests/gateway/delivery/test_delivery_plain.py",
        "tests/gateway/delivery/test_delivery_drain.py",
        "tests/gateway/delivery/test_outbound.py",
        "tests/gateway/delivery/test_standby.py",
        "tests/gateway/messages/test_publishing.py",
        "tests/gateway/messages/test_recent_messages.py",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests],
        cwd=ROOT,
        env={**os.environ, "LMQTT_PURE_PYTHON": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
