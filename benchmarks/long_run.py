"""The plain loop's short reading against a long run of the same loop (issue 27).

`benchmarks.reference` reads a setting over the first batches of a fresh process: 10 warm-up
batches, then the median of three 40-batch windows. A user's training runs for hours. This
reads the quickstart's baseline and its usual recommendation through the same loop two ways
per round, in a shuffled order:

- ``short``: the reference's window, as `claims` and `agreement` read it;
- ``long``: 400 warm-up batches (about six epochs of the quickstart's data), then the median
  of three 200-batch windows: the loop's steady state.

It prints each way's medians, its paired speedup (the per-round ratios' geometric mean with
its 95% interval, as the study's confirmation computes it) and the windows' minor page faults
per batch. Run: ``python -m benchmarks.long_run [--rounds 6] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks import reference
from benchmarks.agreement import QUICKSTART_SETTINGS
from benchmarks.ground_truth import QUICKSTART
from loader_search.study._config import load_config
from loader_search.study._paired import paired_speedup

WINDOWS = {
    "short": {
        "warmup": reference.WARMUP_BATCHES,
        "windows": reference.WINDOWS,
        "window_batches": reference.WINDOW_BATCHES,
    },
    "long": {"warmup": 400, "windows": 3, "window_batches": 200},
}


def run(rounds: int, seed: int = 0) -> dict[str, Any]:
    """``rounds`` shuffled rounds of both settings read both ways; their figures."""
    options = load_config(QUICKSTART).workload_options
    rng = random.Random(seed)
    readings: dict[str, dict[str, list[dict[str, Any]]]] = {
        way: {name: [] for name in QUICKSTART_SETTINGS} for way in WINDOWS
    }
    for round_ in range(rounds):
        jobs = [(way, name) for way in WINDOWS for name in QUICKSTART_SETTINGS]
        rng.shuffle(jobs)
        for way, name in jobs:
            params = QUICKSTART_SETTINGS[name].as_dict()
            reading = reference.reading(QUICKSTART, params, options, **WINDOWS[way])
            readings[way][name].append(reading)
            print(
                f"round {round_ + 1}/{rounds}: {way:<5} {name:<12}"
                f" {reading['throughput']:8.0f} samples/s,"
                f" {reading['faults_per_batch']:7.0f} faults per batch",
                flush=True,
            )
    return {"rounds": rounds, "windows": WINDOWS, "ways": _figures(readings)}


def _figures(readings: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for way, by_name in readings.items():
        baseline, recommended = by_name["baseline"], by_name["recommended"]
        ratios = [
            c["throughput"] / b["throughput"] for b, c in zip(baseline, recommended, strict=True)
        ]
        paired = paired_speedup(ratios)
        figures[way] = {
            "medians": {
                name: statistics.median(r["throughput"] for r in found)
                for name, found in by_name.items()
            },
            "faults_per_batch": {
                name: statistics.median(r["faults_per_batch"] for r in found)
                for name, found in by_name.items()
            },
            "speedup": paired.estimate if paired else ratios[0],
            "speedup_ci95": [paired.low, paired.high] if paired else None,
            "ratios": ratios,
            "readings": by_name,
        }
    return figures


def section(result: dict[str, Any]) -> str:
    """The Markdown report."""
    lines = [
        f"{result['rounds']} rounds, both settings both ways in a shuffled order, each reading a"
        " fresh process of `benchmarks/reference.py`.",
        "",
        "| way | window | baseline | recommended | speedup | its 95% CI"
        " | faults per batch (baseline / recommended) |",
        "|---|---|---|---|---|---|---|",
    ]
    for way, figures in result["ways"].items():
        window = result["windows"][way]
        ci = figures["speedup_ci95"]
        lines.append(
            f"| {way} | {window['warmup']} warm-up, {window['windows']} x"
            f" {window['window_batches']} batches"
            f" | {figures['medians']['baseline']:,.0f} | {figures['medians']['recommended']:,.0f}"
            f" | {figures['speedup']:.3f}x | "
            + ("-" if ci is None else f"{ci[0]:.3f}-{ci[1]:.3f}")
            + f" | {figures['faults_per_batch']['baseline']:,.0f}"
            f" / {figures['faults_per_batch']['recommended']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_run", description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    result = run(args.rounds)
    print(section(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
