"""Same-run A/B of two lmqtt trees on one `python -m bench` row, taking turns.

``python -m bench.ab TREE --base BASE [--rounds N] [--broker ROW] [-- BENCH ARGS]``

TREE and BASE are two checkouts of lmqtt, each with its own ``.venv`` (``make
.venv/.installed-dev`` in each): a change and what it is measured against. Each round runs the
bench once in each tree, the order alternating between rounds, so a host whose load drifts
weighs on both alike. BENCH ARGS default to the fleet at 2,000 devices @10k msg/s; ROW picks
the row to compare (``lmqtt``, ``lmqtt-rocketmq``, ``lmqtt-rocketmq-3n``). It prints each run's
figures, the medians of both trees and the tree/base ratio of CPU per delivery and per publish.
A run the bench flagged (the generator out of headroom, the host loaded) counts like the
others: read its flags before the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Run", "main", "medians", "ratio", "read_row"]

KEYS = (
    "us_cpu_per_delivery",
    "us_cpu_per_publish",
    "p50_ms",
    "p99_ms",
    "p999_ms",
    "broker_cpu",
    "gen_cpu_max_process",
    "loss_pct",
)
DEFAULT_BENCH = [
    "fleet",
    "--devices",
    "2000",
    "--rate",
    "10000",
    "--no-capacity",
    "--repeat",
    "1",
    "--duration",
    "10",
    "--quiet-wait",
    "5",
]

Run = dict[str, Any]


def read_row(latest: Path, broker: str) -> Run:
    """The figures of ROW's first run in a bench result file (``latest.json``)."""
    data = json.loads(latest.read_text())
    scenario = next(iter(data["results"].values()))
    row = scenario[broker]["runs"][0]
    return {key: row.get(key) for key in KEYS} | {"flags": row.get("flags")}


def medians(runs: list[Run]) -> dict[str, float]:
    """Each figure's median over the runs that have it."""
    out: dict[str, float] = {}
    for key in KEYS:
        values = [float(run[key]) for run in runs if run.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def ratio(tree: list[Run], base: list[Run], key: str) -> float | None:
    """The tree's median of `key` over the base's, or None when either has no figure."""
    a, b = medians(tree).get(key), medians(base).get(key)
    return a / b if a is not None and b else None


def _run(tree: Path, out: Path, broker: str, bench: list[str]) -> Run:
    command = [str(tree / ".venv/bin/python"), "-m", "bench", *bench, "--brokers", broker]
    subprocess.run(
        [*command, "--out", str(out)],
        cwd=tree,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return read_row(out / "latest.json", broker)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    bench = args[args.index("--") + 1 :] if "--" in args else []
    own = args[: args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    parser.add_argument("tree", type=Path)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default="lmqtt", help="the row compared")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    options = parser.parse_args(own)
    bench = bench or DEFAULT_BENCH
    out = options.out / f"ab-{time.strftime('%Y%m%d-%H%M%S')}"
    runs: dict[str, list[Run]] = {"tree": [], "base": []}
    trees = {"tree": options.tree.resolve(), "base": options.base.resolve()}
    for i in range(options.rounds):
        order = ("tree", "base") if i % 2 == 0 else ("base", "tree")
        for name in order:
            run = _run(trees[name], out.resolve() / f"{name}{i}", options.broker, bench)
            runs[name].append(run)
            print(name, i, run, flush=True)
    for name in ("tree", "base"):
        figures = " ".join(f"{k}={v:.3f}" for k, v in medians(runs[name]).items())
        print(f"MEDIAN {name:5s} {figures}")
    for key in ("us_cpu_per_delivery", "us_cpu_per_publish"):
        r = ratio(runs["tree"], runs["base"], key)
        if r is not None:
            print(f"{key} tree/base = {r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
