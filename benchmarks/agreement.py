"""The service's trial runner against a plain training loop, on the same settings, in one run.

A study's figures are readings of its own trial runner (`loader_search.trial`: a forked
child or a kept fresh process, meters, the early-stop window). `benchmarks.reference` is a
textbook loop in a fresh process that shares no code with it. Each round measures every
setting four ways, in a shuffled order of its own (so a slow spell of the machine hits one
reading of a round, not one method):

- ``runner``: a confirmation trial (shortened at the early-stop mark, no ceiling) forked from
  this process, as a study's worker forks its search trials (and, with ``confirm_process =
  "fork"``, its confirmation trials); with ``after_study`` this process first runs a study of
  the config, so that the trial forks from a worker's state;
- ``host``: the same trial forked from a fresh process kept across the rounds
  (`loader_search.trial.FreshHost`), as a study's confirmation trial runs with
  ``confirm_process = "fresh"``;
- ``fresh``: the same trial, the same code and plan, run by a fresh Python process itself
  (`benchmarks._fresh`: imports, the workload built, no fork), as a
  user's script runs its training;
- ``reference``: the plain loop, over its median window.

Figures: per setting and method, the median and spread of the readings; per setting, the
runner's and the fresh process's readings over the reference's (the medians of the
per-round ratios); per method, each setting's speedup over the first (the baseline), from the
per-round ratios as the study's confirmation computes it. A runner that reads one setting low
and another right shows here as a speedup the reference does not see; a runner that differs
from the fresh process shows what forking from the worker does to a reading (the claims
of 2026-12-04 read a mean 7% high against the loop), and the host whether a trial forked from a
kept fresh process reads as a new process does.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import reference
from benchmarks._fresh import in_fresh_process
from benchmarks.ground_truth import QUICKSTART, measure, measure_in_process, quick_config
from loader_search.params import LoaderParams
from loader_search.study import StudyConfig, load_config
from loader_search.study.stats import paired_speedup
from loader_search.trial import FreshHost
from loader_search.workloads import load_workload

METHODS = ("runner", "host", "fresh", "reference")
OTHERS = METHODS[:-1]  # read against the reference
TIMEOUT_S = 300  # one fresh reading
# The quickstart's baseline and what its studies recommend on a 2-core CPU (one persistent
# worker, prefetch 6, one torch thread: what the claims studies recommended).
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
    after_study: bool = False,
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
    if after_study:
        _become_a_worker(config, seed, log)
    workload = load_workload(config.workload, config.workload_options)
    rng = random.Random(seed)
    readings: dict[str, dict[str, list[float]]] = {m: {n: [] for n in settings} for m in METHODS}
    with FreshHost() as host:

        def reading(method: str, params: LoaderParams) -> float:
            if method in ("runner", "host"):
                kept = host if method == "host" else None
                row = measure(workload, config, params, ceiling=False, stop_early=True, host=kept)
                if "throughput" not in row:
                    raise RuntimeError(f"{params.describe()} failed: {row.get('failure')}")
                return float(row["throughput"])
            if method == "fresh":
                return fresh_reading(config_path, params, quick=quick)
            return float(
                reference.reading(
                    config_path, params.as_dict(), config.workload_options, **window
                )["throughput"]
            )

        for round_ in range(rounds):
            jobs = [(method, name) for method in METHODS for name in settings]
            rng.shuffle(jobs)
            for method, name in jobs:
                value = reading(method, settings[name])
                readings[method][name].append(value)
                log(f"round {round_ + 1}/{rounds}: {method:<9} {name:<12} {value:8.0f} samples/s")
    return {
        **summarise(readings, {n: p.describe() for n, p in settings.items()}),
        "reference_window": window,
        "after_study": after_study,
    }


def _become_a_worker(config: StudyConfig, seed: int, log: Any) -> None:
    """Run a study of ``config`` in this process (a temporary SQLite file), as a worker does
    before its confirmation trials: the runner's trials then fork from that state."""
    from loader_search.study import run_study

    with tempfile.TemporaryDirectory(prefix="agreement-") as folder:
        storage = f"sqlite:///{Path(folder) / 'agreement.db'}"
        summary = run_study(
            replace(config, seed=seed, name="agreement"), storage=storage, quiet=True
        )
    log(f"ran a study of {summary.n_complete} trials in this process first")


def fresh_reading(config_path: Path, params: LoaderParams, *, quick: bool) -> float:
    """One reading of ``params`` as the runner's trial, run by a fresh Python process itself
    (see the module docstring); raises on its failure."""
    return float(
        in_fresh_process(
            reading_in_this_process,
            str(config_path),
            params.as_dict(),
            quick=quick,
            timeout_s=TIMEOUT_S,
            what=f"a fresh reading of {params.describe()}",
        )
    )


def reading_in_this_process(config_path: str, params: dict[str, Any], *, quick: bool) -> float:
    """What `fresh_reading` runs in its fresh process (plain data in and out)."""
    return measure_in_process(Path(config_path), LoaderParams.from_dict(params), quick=quick)


def summarise(
    readings: dict[str, dict[str, list[float]]], described: dict[str, str]
) -> dict[str, Any]:
    """The figures of the module docstring from each method's per-round readings."""
    names = list(described)
    baseline = names[0]
    per_setting = []
    for name in names:
        ref = readings["reference"][name]
        per_setting.append(
            {
                "setting": name,
                "params": described[name],
                **{f"{m}_median": statistics.median(readings[m][name]) for m in METHODS},
                **{f"{m}_spread": _spread(readings[m][name]) for m in METHODS},
                **{
                    f"{m}_over_reference": statistics.median(
                        a / b for a, b in zip(readings[m][name], ref, strict=True)
                    )
                    for m in OTHERS
                },
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
    parent = "a process that ran a study first" if result.get("after_study") else "this process"
    lines = [
        f"{result['rounds']} rounds; each round every setting once with each method, in a"
        " shuffled order. Runner: a study's confirmation trial (shortened at the early-stop"
        f" mark) forked from {parent}. Host: the same trial forked from a fresh process"
        ' kept across the rounds (`confirm_process = "fresh"`). Fresh: the same trial run'
        " by a new Python process itself (no fork). Reference: `benchmarks/reference.py`, a"
        " plain loop in a"
        f" fresh process ({window['warmup']} warm-up batches, median of {window['windows']}"
        f" {window['window_batches']}-batch windows).",
        "",
        "| setting | "
        + " | ".join(f"{m} median | spread" for m in METHODS)
        + " | "
        + " | ".join(f"{m} / reference" for m in OTHERS)
        + " |",
        "|---" * (1 + 2 * len(METHODS) + len(OTHERS)) + "|",
    ]
    for row in result["settings"]:
        lines.append(
            f"| {row['setting']} (`{row['params']}`)"
            + "".join(f" | {row[f'{m}_median']:,.0f} | {row[f'{m}_spread']:.0%}" for m in METHODS)
            + "".join(f" | {row[f'{m}_over_reference']:.3f}" for m in OTHERS)
            + " |"
        )
    lines += [
        "",
        "| setting | " + " | ".join(f"speedup, {m} | its 95% CI" for m in METHODS) + " |",
    ]
    lines.append("|---" * (1 + 2 * len(METHODS)) + "|")
    for row in result["speedups"]:
        cells = [
            f"{row[m]:.3f}x | "
            + ("-" if row[f"{m}_ci95"] is None else "{:.3f}-{:.3f}".format(*row[f"{m}_ci95"]))
            for m in METHODS
        ]
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
