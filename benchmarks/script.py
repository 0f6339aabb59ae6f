"""Does a study of your own script read what a study of the built-in workload reads?

The quickstart workload written as a standalone script (`examples/train.py`: the same data,
model, optimiser and learning rate, its own training loop, its settings as flags) against the
built-in workload, interleaved in one run:

1. **Per setting**, in shuffled rounds: one built-in trial (in a fresh Python process, as a
   study's confirmation trial runs) and one command trial of the script, each a full trial
   (the quickstart's budget, its validation). The throughput ratio script / built-in: its
   geometric mean with a 95% bootstrap interval, its median, and each kind's wall time.
2. **What a command costs a trial**: a new interpreter that imports torch and loader-search
   and builds the quickstart's data, timed alone (what a command trial pays before its first
   batch and a forked trial does not).
3. **Two studies side by side**: `studies/quickstart.toml` and the same study with the script
   as its workload: their wall times (ratio) and their recommendations.

Targets: the ratio within 5% or its interval covering 1; the command study's wall time at
most 1.5x the built-in one's.

    python -m benchmarks script [--rounds 8] [--no-studies] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.replay import bootstrap_mean_ci
from loader_search.params import LoaderParams, TrainingSettings, TrialLimits
from loader_search.study import load_config
from loader_search.trial import CommandSpec, TrialJob, WorkloadRecipe, run_isolated
from loader_search.workloads import Workload, load_workload

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
OPTIONS = {"image_size": 32, "train_size": 4096, "val_size": 1024}  # the quickstart's
# The script's learning rate at batch 64 is the workload's base_lr, scaled alike ({lr}).
SETTINGS = TrainingSettings(train_samples=8192, batch_size=64, lr=0.02, lr_scaling="sqrt")
POINTS = {
    "baseline": LoaderParams(64, 0, torch_threads=2),
    "1 worker": LoaderParams(64, 1, prefetch_factor=4, persistent_workers=True),
    "batch 128, 1 worker": LoaderParams(128, 1, prefetch_factor=2, persistent_workers=True),
}


def example_command() -> tuple[str, ...]:
    """`examples/flags.toml`'s command, run by this interpreter."""
    command = load_config(EXAMPLES / "flags.toml").command
    assert command is not None
    return tuple(sys.executable if word == "python" else word for word in command.argv)


FLAGS = example_command()
LIMITS = TrialLimits(trial_timeout_s=300)


_BUILT: list[Workload] = []  # the built-in workload, built once (its trials rebuild it)


def one_trial(kind: str, params: LoaderParams, settings: TrainingSettings) -> dict[str, Any]:
    """One full trial of ``kind`` ("built-in" or "script"): its throughput, loss and wall."""
    if kind == "script":
        job = TrialJob(None, params, settings, "cpu", command=CommandSpec(FLAGS, str(EXAMPLES)))
    else:
        if not _BUILT:
            _BUILT.append(load_workload("synthetic-images", OPTIONS))
        recipe = WorkloadRecipe("synthetic-images", OPTIONS)
        own = dataclasses.replace(settings, lr=None)  # the workload's base_lr
        job = TrialJob(_BUILT[0], params, own, "cpu", fresh=recipe)
    outcome = run_isolated(job, limits=LIMITS)
    if outcome.result is None:
        failure = outcome.failure
        raise RuntimeError(f"{kind} trial of {params.describe()} failed: {failure}")
    result = outcome.result
    return {
        "throughput": result.throughput_samples_per_s,
        "val_loss": result.val_loss,
        "wall_s": outcome.wall_s,
    }


def interleaved(rounds: int, settings: TrainingSettings, seed: int = 0) -> list[dict[str, Any]]:
    """``rounds`` shuffled rounds of every point, each a built-in and a script trial."""
    rng = random.Random(seed)
    readings = []
    for number in range(rounds):
        order = [(name, kind) for name in POINTS for kind in ("built-in", "script")]
        rng.shuffle(order)
        for name, kind in order:
            reading = one_trial(kind, POINTS[name], settings)
            readings.append({"round": number, "point": name, "kind": kind, **reading})
            print(
                f"round {number} {name:<20} {kind:<8} {reading['throughput']:9,.0f} samples/s"
                f"  val_loss {reading['val_loss']:.4f}  {reading['wall_s']:5.1f} s",
                flush=True,
            )
    return readings


def ratios(readings: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per point: the script / built-in throughput ratios of the rounds, summarised."""
    summary = {}
    for name in POINTS:
        by_round: dict[int, dict[str, float]] = {}
        walls: dict[str, list[float]] = {"built-in": [], "script": []}
        for r in readings:
            if r["point"] == name:
                by_round.setdefault(r["round"], {})[r["kind"]] = r["throughput"]
                walls[r["kind"]].append(r["wall_s"])
        logs = [math.log(v["script"] / v["built-in"]) for v in by_round.values() if len(v) == 2]
        low, high = bootstrap_mean_ci(logs)
        summary[name] = {
            "rounds": len(logs),
            "ratio": math.exp(statistics.fmean(logs)),
            "ci": [math.exp(low), math.exp(high)],
            "median": math.exp(statistics.median(logs)),
            "wall_built_in_s": statistics.median(walls["built-in"]),
            "wall_script_s": statistics.median(walls["script"]),
        }
    return summary


def startup_cost(repeats: int) -> list[float]:
    """Seconds a new interpreter takes to import torch and loader-search and build the
    quickstart's data: what a command trial pays before its first batch."""
    code = (
        "from loader_search.workloads import load_workload;"
        f" load_workload('synthetic-images', {OPTIONS!r})"
    )
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
        times.append(time.perf_counter() - started)
    return times


def study(config: Path, folder: Path) -> dict[str, Any]:
    """One study through the CLI: its wall time and its recommendation line."""
    storage = f"sqlite:///{folder / (config.stem + '.db')}"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "loader_search", "run", str(config), "--storage", storage],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
        cwd=ROOT,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"study {config} failed: {done.stderr[-2000:]}")
    found = re.search(r"^Recommended: .*$", done.stdout, re.M)
    setting = re.search(r"^Recommended: trial #\d+, .*$", done.stdout, re.M)
    return {
        "wall_s": wall,
        "recommended": found.group(0) if found else None,
        "setting": setting.group(0) if setting else None,
    }


def command_study_config(folder: Path, quick: bool) -> Path:
    """The quickstart study with the script as its workload (everything else the same)."""
    text = (ROOT / "studies" / "quickstart.toml").read_text()
    command = json.dumps(list(FLAGS))
    text = re.sub(
        r"\[workload\].*?(?=\n\[training\])",
        f'[workload]\ncommand = {command}\nworkdir = "{EXAMPLES}"\n',
        text,
        flags=re.S,
    )
    text = text.replace('name = "quickstart"', 'name = "quickstart-script"')
    text = text.replace("[training]\n", "[training]\nlr = 0.02\n", 1)
    if quick:
        text = text.replace("trials = 16", "trials = 3")
    path = folder / "quickstart-script.toml"
    path.write_text(text)
    return path


def quick_builtin_config(folder: Path) -> Path:
    text = (ROOT / "studies" / "quickstart.toml").read_text().replace("trials = 16", "trials = 3")
    path = folder / "quickstart.toml"
    path.write_text(text)
    return path


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Your script against the built-in workload",
        "",
        f"{results['machine']}, {results['date']}; `{results['command']}`",
        "",
        "| setting | rounds | script / built-in (95% CI) | median | wall built-in | wall script |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, s in results["ratios"].items():
        lines.append(
            f"| {name} | {s['rounds']} | {s['ratio']:.3f} ({s['ci'][0]:.3f}-{s['ci'][1]:.3f})"
            f" | {s['median']:.3f} | {s['wall_built_in_s']:.1f} s | {s['wall_script_s']:.1f} s |"
        )
    startup = results["startup_s"]
    lines += [
        "",
        f"A new interpreter importing torch and loader-search and building the data:"
        f" median {statistics.median(startup):.2f} s ({len(startup)} runs,"
        f" {min(startup):.2f}-{max(startup):.2f}).",
    ]
    studies = results.get("studies")
    if studies:
        built, script = studies["built-in"], studies["script"]
        lines += [
            "",
            f"Studies: built-in {built['wall_s']:.0f} s, script {script['wall_s']:.0f} s"
            f" ({script['wall_s'] / built['wall_s']:.2f}x).",
            f"- built-in: {built['recommended']}",
            f"- script: {script['recommended']}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks script", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="1 round, 2,048-sample trials")
    parser.add_argument("--no-studies", action="store_true", help="the trials only")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data")
    args = parser.parse_args(argv)
    from benchmarks.cli import machine

    settings = SETTINGS
    rounds = args.rounds
    if args.quick:
        settings = TrainingSettings(train_samples=2048, batch_size=64, lr=0.02)
        rounds = 1
    results: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m benchmarks script "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    readings = interleaved(rounds, settings)
    results["readings"] = readings
    results["ratios"] = ratios(readings)
    results["startup_s"] = startup_cost(1 if args.quick else 5)
    if not args.no_studies:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            built_config = (
                quick_builtin_config(folder) if args.quick else ROOT / "studies/quickstart.toml"
            )
            results["studies"] = {
                "built-in": study(built_config, folder),
                "script": study(command_study_config(folder, args.quick), folder),
            }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "script.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    (args.out / "script.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
