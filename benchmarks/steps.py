"""The loader settings under each training step: fp32 eager, bf16, compile, bf16 + compile.

``python -m benchmarks steps [--quick] [--out DIR]`` trains, for the quickstart
(``studies/quickstart.toml``) and the text workload (``studies/text.toml``), each step
variant with a small grid of loader settings (no workers and 2 torch threads; 1 or 2
persistent workers, prefetch 2, 1 torch thread), one trial per setting, each in a fresh
process (`benchmarks._fresh`: every trial compiles, as a study's do),
the variants and settings interleaved in one run. Per workload and variant it prints the
ceiling (the same step fed pre-decoded batches), each setting's throughput, the best setting,
its share of the ceiling, and the compile time. The figures land in ``steps.json`` and
``steps.md``.

What it shows: whether a faster step asks more of the loader (the best setting's share of the
ceiling falls, more workers win) or, on a CPU, a slower one (bf16 autocast without AMX) asks
less.

``python -m benchmarks steps --standin``: the same question where the step's speed is set,
not found: in the GPU stand-in regime (``studies/standin.toml``: the "device" waits a fixed
time per sample with the GIL released) a study for each of three device speeds, each twice
as fast as the one before (300, 150, 75 us per sample). Per speed: the ceiling, the workers
a consumer that fast needs by the pipeline model's own arithmetic (ceiling x the producer's
measured CPU seconds per sample), the workers the model's limit setting and the
recommendation use, their throughput and the bottleneck. A consumer twice as fast should
ask for about twice the producer capacity, until the machine's CPUs run out. Figures land
in ``steps_standin.json`` / ``steps_standin.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._fresh import in_fresh_process
from loader_search.study import CEILING_ATTR, PRODUCER_COST

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
    from loader_search.study import load_config
    from loader_search.trial import run_trial
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
    attrs: dict[str, Any] = in_fresh_process(
        one,
        config,
        VARIANTS[variant],
        SETTINGS[setting],
        samples,
        timeout_s=TIMEOUT_S,
        what=f"{variant} / {setting}",
    )
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
                    "ceiling": attrs.get(CEILING_ATTR),
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
        " pre-decoded batches (their thread counts differ); best / ceiling: the best"
        " setting's throughput over its own trial's ceiling.",
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
            compile_s = f"{statistics.median(compiles):.1f}" if compiles else "-"
            lines.append(
                f"| {name} | {variant} | {ceiling:,.0f} | "
                + " | ".join(f"{cells[s]['throughput']:,.0f}" for s in SETTINGS)
                + f" | {best} | {cells[best]['throughput'] / cells[best]['ceiling']:.2f}"
                + f" | {compile_s} | {statistics.median(losses):.4f} |"
            )
    return "\n".join(lines) + "\n"


STANDIN = "studies/standin.toml"
DEVICE_US = (300, 150, 75)  # each consumer twice as fast as the one before


def standin(out: Path, quick: bool) -> dict[str, Any]:
    """One study per device speed in the stand-in regime (see the module docstring)."""
    import tempfile
    from dataclasses import replace

    import optuna
    from optuna.trial import TrialState

    from benchmarks.ground_truth import quick_config
    from loader_search.study import load_config, run_study

    base = load_config(ROOT / STANDIN)
    if quick:
        base = replace(quick_config(base), trials=6, confirm_min_rounds=3, confirm_max_rounds=3)
    rows = []
    started = time.perf_counter()
    for device_us in DEVICE_US:
        config = replace(
            base,
            name=f"standin-{device_us}us",
            workload_options={**base.workload_options, "device_us_per_sample": device_us},
        )
        with tempfile.TemporaryDirectory(prefix="steps-standin-") as folder:
            storage = f"sqlite:///{Path(folder) / f'{device_us}.db'}"
            summary = run_study(config, storage=storage, quiet=True)
            study = optuna.load_study(study_name=config.name, storage=storage)
            done = [t for t in study.trials if t.state == TrialState.COMPLETE]

        def median_attr(key: str, trials: list[Any] = done) -> float | None:
            values = [t.user_attrs[key] for t in trials if t.user_attrs.get(key)]
            return statistics.median(values) if values else None

        ceiling = median_attr(CEILING_ATTR)
        producer = median_attr(PRODUCER_COST)
        rec = summary.recommended
        pipeline = rec.pipeline if rec is not None else None
        rows.append(
            {
                "device_us_per_sample": device_us,
                "ceiling": ceiling,
                "producer_cpu_s_per_sample": producer,
                # The producer capacity a consumer this fast needs, in worker processes.
                "workers_needed": ceiling * producer if ceiling and producer else None,
                "cpus": median_attr("cpus_available"),
                "limit_workers": pipeline.limit_params.num_workers if pipeline else None,
                "limit": pipeline.limit_samples_per_s if pipeline else None,
                "bottleneck": pipeline.bottleneck if pipeline else None,
                "recommended": rec.point.params.describe() if rec else None,
                "recommended_workers": rec.point.params.num_workers if rec else None,
                "throughput": rec.point.throughput if rec else None,
                "speedup": rec.speedup_vs_baseline if rec else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    document = {"rows": rows, "quick": quick, "elapsed_s": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps_standin.json").write_text(json.dumps(document, indent=1))
    text = standin_table(document)
    (out / "steps_standin.md").write_text(text)
    print(text)
    return document


def standin_table(document: dict[str, Any]) -> str:
    def number(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = [
        "One study per device speed (GPU stand-in, each twice as fast as the one before)."
        " Workers needed: the ceiling times the producer's measured CPU seconds per sample,"
        " the pipeline model's arithmetic; limit setting: the workers of the setting the"
        " model predicts reaches its limit.",
        "",
        "| device us/sample | ceiling | producer ms/sample | workers needed | CPUs"
        " | limit setting's workers | limit | bottleneck | recommended | its samples/s"
        " | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for row in document["rows"]:
        producer = row["producer_cpu_s_per_sample"]
        lines.append(
            f"| {row['device_us_per_sample']} | {number(row['ceiling'])}"
            f" | {number(producer and producer * 1000, 3)} | {number(row['workers_needed'], 2)}"
            f" | {number(row['cpus'])} | {number(row['limit_workers'])}"
            f" | {number(row['limit'])} | {row['bottleneck'] or '-'}"
            f" | {row['recommended'] or '-'} | {number(row['throughput'])}"
            f" | {number(row['speedup'], 2)}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks steps", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="2 variants, short trials")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument(
        "--standin", action="store_true", help="the stand-in regime at three device speeds"
    )
    args = parser.parse_args(argv)
    if args.standin:
        standin(args.out, args.quick)
        return
    run(args.out, args.quick)


if __name__ == "__main__":  # scripts/gpu_check.sh runs it by its module name
    main()
