"""The service's trial runner against a plain training loop, on the same settings, in one run.

A study's figures are readings of its own trial runner (`loader_search.trial`: a forked
child, meters, the early-stop window). `benchmarks.reference` is a textbook loop in a fresh
process that shares no code with it. Each round measures every setting with both, in a
shuffled order of its own (so a slow spell of the machine hits one reading of a round, not
one method), the runner as a study's confirmation trial runs (shortened at the early-stop
mark, no ceiling), the reference over its median window.

Figures: per setting and method, the median and spread of the readings; per setting, the
runner's reading over the reference's (the median of the per-round ratios); per method, each
setting's speedup over the first (the baseline), from the per-round ratios as the study's
confirmation computes it. A runner that reads one setting low and another right shows here
as a speedup the reference does not see.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import reference
from benchmarks.ground_truth import QUICKSTART, measure, quick_config
from loader_search.params import LoaderParams
from loader_search.study._config import load_config
from loader_search.study._paired import paired_speedup
from loader_search.workloads import load_workload

METHODS = ("runner", "reference")
# The quickstart's baseline and what its studies recommend on a 2-core CPU (one persistent
# worker, prefetch 6, one torch thread: the issue 27 studies' answer).
QUICKSTART_SETTINGS = {
    "baseline": LoaderParams(64, 0, torch_threads=2),
    "recommended": LoaderParams(64, 1, 6, False, True, 1),
}


def run(
    *,
    config_path: Path = QUICKSTART,
    settings: dict[str, LoaderParams] | None = None,
    rounds: int = 10,
    quick: bool = False,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """``rounds`` interleaved rounds (see the module docstring); the first setting is the
    baseline of the speedups."""
    settings = dict(settings or QUICKSTART_SETTINGS)
    config = load_config(config_path)
    window = {
        "warmup": reference.WARMUP_BATCHES,
        "windows": reference.WINDOWS,
        "window_batches": reference.WINDOW_BATCHES,
    }
    if quick:
        config = quick_config(config)
        rounds, window = 2, dict(reference.QUICK_WINDOW)
        settings = {name: replace(p, batch_size=32) for name, p in settings.items()}
    workload = load_workload(config.workload, config.workload_options)
    rng = random.Random(seed)
    readings: dict[str, dict[str, list[float]]] = {m: {n: [] for n in settings} for m in METHODS}
    for round_ in range(rounds):
        jobs = [(method, name) for method in METHODS for name in settings]
        rng.shuffle(jobs)
        for method, name in jobs:
            params = settings[name]
            if method == "runner":
                row = measure(workload, config, params, ceiling=False, stop_early=True)
                if "throughput" not in row:
                    raise RuntimeError(f"{params.describe()} failed: {row.get('failure')}")
                value = float(row["throughput"])
            else:
                value = float(
                    reference.reading(
                        config_path, params.as_dict(), config.workload_options, **window
                    )["throughput"]
                )
            readings[method][name].append(value)
            log(f"round {round_ + 1}/{rounds}: {method:<9} {name:<12} {value:8.0f} samples/s")
    return {
        **summarise(readings, {n: p.describe() for n, p in settings.items()}),
        "reference_window": window,
    }


def summarise(
    readings: dict[str, dict[str, list[float]]], described: dict[str, str]
) -> dict[str, Any]:
    """The figures of the module docstring from each method's per-round readings."""
    names = list(described)
    baseline = names[0]
    per_setting = []
    for name in names:
        runner, ref = readings["runner"][name], readings["reference"][name]
        per_setting.append(
            {
                "setting": name,
                "params": described[name],
                **{f"{m}_median": statistics.median(readings[m][name]) for m in METHODS},
                **{f"{m}_spread": _spread(readings[m][name]) for m in METHODS},
                "runner_over_reference": statistics.median(
                    a / b for a, b in zip(runner, ref, strict=True)
                ),
            }
        )
    speedups = []
    for name in names[1:]:
        row: dict[str, Any] = {"setting": name}
        for method in METHODS:
            ratios = [
                a / b
                for a, b in zip(readings[method][name], readings[method][baseline], strict=True)
            ]
            paired = paired_speedup(ratios)
            row[method] = paired.estimate if paired else ratios[0]
            row[f"{method}_ci95"] = [paired.low, paired.high] if paired else None
            row[f"{method}_ratios"] = ratios
        speedups.append(row)
    return {
        "rounds": len(readings["runner"][baseline]),
        "settings": per_setting,
        "speedups": speedups,
        "readings": readings,
    }


def _spread(values: Sequence[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def section(result: dict[str, Any]) -> str:
    """The Markdown report."""
    window = result["reference_window"]
    lines = [
        f"{result['rounds']} rounds; each round every setting once with each method, in a"
        " shuffled order. Runner: a study's confirmation trial (forked child, shortened at the"
        " early-stop mark). Reference: `benchmarks/reference.py`, a plain loop in a fresh"
        f" process ({window['warmup']} warm-up batches, median of {window['windows']}"
        f" {window['window_batches']}-batch windows).",
        "",
        "| setting | runner median | spread | reference median | spread | runner / reference |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["settings"]:
        lines.append(
            f"| {row['setting']} (`{row['params']}`) | {row['runner_median']:,.0f}"
            f" | {row['runner_spread']:.0%} | {row['reference_median']:,.0f}"
            f" | {row['reference_spread']:.0%} | {row['runner_over_reference']:.3f} |"
        )
    lines += ["", "| setting | speedup, runner | its 95% CI | speedup, reference | its 95% CI |"]
    lines.append("|---|---|---|---|---|")
    for row in result["speedups"]:
        cis = [
            "-" if row[f"{m}_ci95"] is None else "{:.3f}-{:.3f}".format(*row[f"{m}_ci95"])
            for m in METHODS
        ]
        lines.append(
            f"| {row['setting']} | {row['runner']:.3f}x | {cis[0]}"
            f" | {row['reference']:.3f}x | {cis[1]} |"
        )
    return "\n".join(lines)
