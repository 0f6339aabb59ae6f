"""What a thread beside a ``num_workers=0`` training step costs its reading (issue 27).

A trial samples its memory with a thread only when it has loader worker processes
(`loader_search.trial._measure.PeakRSS`); before, one woke every 50 ms in every trial. This
runs the quickstart's baseline (batch 64, no workers, 2 torch threads: every core of a 2-core
CPU) through the trial runner, shortened at the early-stop mark as a confirmation trial is,
in a fresh process per reading, two ways per round in a shuffled order:

- ``default``: as a trial runs now, no thread beside the step;
- ``thread``: the memory-sampling thread forced on, as every trial ran before.

It prints each way's median and the paired speedup of ``default`` over ``thread`` (the
per-round ratios' geometric mean with its 95% interval, as the study's confirmation computes
it). Run: ``python -m benchmarks.sampling_thread [--rounds 14]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from loader_search.study._paired import paired_speedup

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("default", "thread")
TIMEOUT_S = 300


def one_reading(way: str) -> float:
    """One trial of the quickstart's baseline in this process (see the module docstring)."""
    from benchmarks.ground_truth import QUICKSTART, measure_in_process
    from loader_search.params import LoaderParams
    from loader_search.trial import _run

    if way == "thread":
        _run.PeakRSS = functools.partial(_run.PeakRSS, children=True)  # type: ignore[attr-defined,misc,assignment]
    return measure_in_process(QUICKSTART, LoaderParams(64, 0, torch_threads=2))


def run(rounds: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    readings: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(rounds):
        ways = list(WAYS)
        rng.shuffle(ways)
        for way in ways:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.sampling_thread", "--one", way],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                check=True,
            )
            readings[way].append(float(done.stdout.strip().splitlines()[-1]))
        print(f"round {round_}: " + ", ".join(f"{w} {readings[w][-1]:,.0f}" for w in WAYS))
    speedup = paired_speedup(
        [d / t for d, t in zip(readings["default"], readings["thread"], strict=True)]
    )
    assert speedup is not None, "at least 2 rounds"
    return {
        "rounds": rounds,
        "readings": readings,
        "default_over_thread": {
            "estimate": speedup.estimate,
            "ci95": [speedup.low, speedup.high],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # one reading, here
    parser.add_argument("--out", type=Path, help="write the readings here as JSON")
    args = parser.parse_args()
    if args.one:
        print(one_reading(args.one))
        return
    result = run(args.rounds)
    for way in WAYS:
        values = result["readings"][way]
        print(f"{way}: median {statistics.median(values):,.0f} samples/s")
    found = result["default_over_thread"]
    low, high = found["ci95"]
    print(f"default / thread: {found['estimate']:.3f}x (95% CI {low:.3f}-{high:.3f})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
