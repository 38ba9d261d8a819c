"""bench.ab: the same-run A/B of two trees, on a real (tiny) fleet run of this checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ab import Run, main, medians, ratio

ROOT = Path(__file__).resolve().parents[2]


def test_medians_skip_missing_figures_and_ratio_is_tree_over_base() -> None:
    tree: list[Run] = [{"us_cpu_per_delivery": 10.0}, {"us_cpu_per_delivery": 30.0}, {}]
    base: list[Run] = [{"us_cpu_per_delivery": 40.0, "p50_ms": None}]
    assert medians(tree) == {"us_cpu_per_delivery": 20.0}
    assert medians(base) == {"us_cpu_per_delivery": 40.0}
    assert ratio(tree, base, "us_cpu_per_delivery") == 0.5
    assert ratio(tree, base, "p50_ms") is None


@pytest.mark.slow
def test_both_trees_run_in_turn_and_the_ratio_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = ["fleet", "--devices", "20", "--rate", "200", "--duration", "1", "--quiet-wait", "0"]
    bench += ["--no-capacity", "--repeat", "1"]
    argv = [str(ROOT), "--base", str(ROOT), "--rounds", "2", "--out", str(tmp_path), "--", *bench]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [line.split(" ", 2)[:2] for line in lines if line.startswith(("tree ", "base "))]
    # Round 0 runs the tree first, round 1 the base first.
    assert runs == [["tree", "0"], ["base", "0"], ["base", "1"], ["tree", "1"]]
    assert any(line.startswith("us_cpu_per_delivery tree/base = ") for line in lines)
    (result_dir,) = tmp_path.iterdir()
    assert sorted(p.name for p in result_dir.iterdir()) == ["base0", "base1", "tree0", "tree1"]
