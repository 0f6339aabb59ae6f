"""The loader settings under each training step: fp32 eager, bf16, compile, bf16 + compile.

``python -m benchmarks.steps [--quick] [--out DIR]`` trains, for the quickstart
(``studies/quickstart.toml``) and the text workload (``studies/text.toml``), each step
variant with a small grid of loader settings (no workers and 2 torch threads; 1 or 2
persistent workers, prefetch 2, 1 torch thread), one trial per setting, each in a fresh
process (``python -m benchmarks.steps --one ...``: every trial compiles, as a study's do),
the variants and settings interleaved in one run. Per workload and variant it prints the
ceiling (the same step fed pre-decoded batches), each setting's throughput, the best setting,
its share of the ceiling, and the compile time. The figures land in ``steps.json`` and
``steps.md``.

What it shows: whether a faster step asks more of the loader (the best setting's share of the
ceiling falls, more workers win) or, on a CPU, a slower one (bf16 autocast without AMX) asks
less.
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

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"quickstart": "studies/quickstart.toml", "text": "studies/text.toml"}
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32 eager": {},
    "bf16": {"precision": "bf16"},
    "compile": {"compile": True},
    "bf16 + compile": {"precision": "bf16", "compile": True},
}
SETTINGS: dict[str, dict[str, Any]] = {
    "0 workers, 2 threads": {"batch_size": 64, "num_workers": 0, "torch_threads": 2},
    "1 worker, 1 thread": {
        "batch_size": 64,
        "num_workers": 1,
        "prefetch_factor": 2,
        "persistent_workers": True,
        "torch_threads": 1,
    },
    "2 workers, 1 thread": {
        "batch_size": 64,
        "num_workers": 2,
        "prefetch_factor": 2,
        "persistent_workers": True,
        "torch_threads": 1,
    },
}
TIMEOUT_S = 600


def one(
    config: str, variant: dict[str, Any], params: dict[str, Any], samples: int
) -> dict[str, Any]:
    """One trial in this process: the config's workload and training settings, the variant's
    step, ``params``; with the ceiling."""
    import dataclasses

    from loader_search.params import LoaderParams, RunPlan
    from loader_search.study._config import load_config
    from loader_search.trial._run import run_trial
    from loader_search.workloads import load_workload

    study = load_config(ROOT / config)
    settings = dataclasses.replace(
        study.training, train_samples=samples, warmup_batches=2, **variant
    )
    workload = load_workload(study.workload, study.workload_options)
    result = run_trial(
        workload, LoaderParams.from_dict(params), settings, plan=RunPlan(measure_ceiling=True)
    )
    return result.user_attrs()


def _reading(config: str, variant: str, setting: str, samples: int) -> dict[str, Any]:
    args = json.dumps([config, VARIANTS[variant], SETTINGS[setting], samples])
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.steps", "--one", args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{variant} / {setting} failed:\n{done.stderr[-2000:]}")
    attrs: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return attrs


def run(out: Path, quick: bool) -> dict[str, Any]:
    samples = 1280 if quick else 4096
    variants = ["fp32 eager", "compile"] if quick else list(VARIANTS)
    found: dict[str, Any] = {}
    started = time.perf_counter()
    for name, config in WORKLOADS.items():
        rows = found.setdefault(name, {})
        for setting in SETTINGS:  # every variant of one setting, then the next setting
            for variant in variants:
                attrs = _reading(config, variant, setting, samples)
                rows.setdefault(variant, {})[setting] = {
                    "throughput": attrs["throughput_samples_per_s"],
                    "ceiling": attrs.get("ceiling_samples_per_s"),
                    "val_loss": attrs.get("val_loss"),
                    "compile_time_s": attrs.get("compile_time_s"),
                    "window_recompiles": attrs.get("window_recompiles"),
                }
                print(
                    f"{name:10} {variant:15} {setting:22}"
                    f" {attrs['throughput_samples_per_s']:8.0f}/s"
                    f" ceiling {attrs.get('ceiling_samples_per_s') or 0:8.0f}/s",
                    flush=True,
                )
    document = {"samples": samples, "results": found, "elapsed_s": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(document, indent=1))
    (out / "steps.md").write_text(table(document))
    print(table(document))
    return document


def table(document: dict[str, Any]) -> str:
    lines = [
        f"One trial per cell ({document['samples']} samples, batch 64), each in a fresh"
        " process; samples/s. Ceiling: the median over the row's trials of the same step fed"
        " pre-decoded batches.",
        "",
        "| workload | step | ceiling | "
        + " | ".join(SETTINGS)
        + " | best | best / ceiling | compile s | val_loss |",
        "|---|---|---:|" + "---:|" * len(SETTINGS) + "---|---:|---:|---:|",
    ]
    for name, rows in document["results"].items():
        for variant, cells in rows.items():
            ceiling = statistics.median(c["ceiling"] for c in cells.values() if c["ceiling"])
            best = max(cells, key=lambda s: cells[s]["throughput"])
            compiles = [c["compile_time_s"] for c in cells.values() if c["compile_time_s"]]
            losses = [c["val_loss"] for c in cells.values() if c["val_loss"] is not None]
            lines.append(
                f"| {name} | {variant} | {ceiling:,.0f} | "
                + " | ".join(f"{cells[s]['throughput']:,.0f}" for s in SETTINGS)
                + f" | {best} | {cells[best]['throughput'] / ceiling:.2f}"
                + f" | {statistics.median(compiles):.1f}" * bool(compiles)
                + " | -" * (not compiles)
                + f" | {statistics.median(losses):.4f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 variants, short trials")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        config, variant, params, samples = json.loads(args.one)
        print(json.dumps(one(config, variant, params, samples)))
        return
    run(args.out, args.quick)


if __name__ == "__main__":
    main()
