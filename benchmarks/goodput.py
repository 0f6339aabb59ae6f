"""Does goodput predict the time to a good model, and does its recommendation get there sooner?

For each workload (the quickstart's `synthetic-images`, and `synthetic-text`) and a few batch
sizes, one loader setting throughout (1 worker, prefetch 2, persistent, 1 torch thread):

1. **The study's view.** Trials as a study runs them (`run_trial`, the quickstart's budget of
   8,192 samples, the learning rate scaled by the study's rule, several seeds): each batch
   size's throughput (median) and validation loss, and the gradient noise scale pooled over
   every trial as a study pools it (`loader_search.study.stats.pool_noise`), with its 95%
   interval. Goodput = throughput x (B_noise + B0) / (B_noise + B), B0 = 64, the baseline's.
2. **The truth.** A plain training loop (the workload's data, model, optimiser and learning
   rate; nothing from `loader_search.trial`) trains each batch size until its validation loss
   reaches the target, the baseline's (B0's trials' median) after the study's budget, checked
   every `CHECK` samples, for several seeds: the training time to the target (evaluation
   left out) and the samples it took.
3. **Prediction against measurement.** Per batch size, the predicted time relative to B0's,
   goodput(B0) / goodput(B), against the measured ratio of median times; and the samples
   ratio E(B)/E(B0) against the model's (1 + B/B_noise)/(1 + B0/B_noise).
4. **The two rules.** The throughput-first recommendation (the fastest batch size whose trial
   loss is within 5% of the baseline's) and the goodput one (the highest goodput), and each
   one's measured time to the target.

    python -m benchmarks goodput [--seeds 3] [--workloads synthetic-images,synthetic-text]
        [--batch-sizes 32,64,128,256] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from loader_search.params import LoaderParams, TrainingSettings, scaled_lr
from loader_search.study.stats import NoiseScale, pool_noise
from loader_search.trial import TrialResult, run_trial
from loader_search.workloads import Workload, load_workload

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {
    "synthetic-images": {"image_size": 32, "train_size": 4096, "val_size": 1024},
    "synthetic-text": {"train_size": 4096, "val_size": 512, "seq_len": 64},
}
BASE_BATCH = 64
BUDGET = 8192  # the quickstart's train_samples: the baseline's loss after it is the target
CHECK = 1024  # samples between two validation checks of the plain loop
CAP = 8 * BUDGET  # a run that has not reached the target by then is reported as not reaching it
TOLERANCE = 0.05  # the throughput rule's loss tolerance (the study's default)


def loader_params(batch_size: int) -> LoaderParams:
    return LoaderParams(
        batch_size=batch_size,
        num_workers=1,
        prefetch_factor=2,
        persistent_workers=True,
        torch_threads=1,
    )


def study_trials(
    workload: Workload, batch_sizes: list[int], seeds: int
) -> dict[int, list[TrialResult]]:
    """Step 1: trials as a study runs them, per batch size, seeds interleaved."""
    found: dict[int, list[TrialResult]] = {b: [] for b in batch_sizes}
    for seed in range(seeds):
        for batch in batch_sizes:
            settings = TrainingSettings(
                train_samples=BUDGET, batch_size=BASE_BATCH, lr=workload.base_lr, seed=seed
            )
            result = run_trial(workload, loader_params(batch), settings)
            found[batch].append(result)
            print(
                f"trial  {workload.name} batch {batch:4d} seed {seed}:"
                f" {result.throughput_samples_per_s:7,.0f} samples/s, val_loss"
                f" {result.val_loss:.4f}, B_simple {result.gradient_noise_scale}",
                flush=True,
            )
    return found


def noise_of(trials: dict[int, list[TrialResult]]) -> NoiseScale | None:
    rows = [
        (float(r.noise_steps), r.noise_grad_sq, r.noise_trace, r.gradient_noise_scale_se)
        for results in trials.values()
        for r in results
        if r.noise_steps and r.noise_grad_sq is not None and r.noise_trace is not None
    ]
    return pool_noise(rows)


def _loss(workload: Workload, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if workload.train_step is not None:
        return workload.train_step(model, batch)
    inputs, targets = batch
    return workload.loss_fn(model(inputs), targets)


def _validate(workload: Workload, model: torch.nn.Module, loader: DataLoader[Any]) -> float:
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for batch in loader:
            size = len(batch["input_ids"]) if isinstance(batch, dict) else len(batch[0])
            total += float(_loss(workload, model, batch)) * size
            count += size
    model.train()
    return total / count


def time_to_target(
    workload: Workload, batch: int, seed: int, target: float
) -> tuple[float | None, int | None]:
    """Step 2: the plain loop's training time (s) and samples until the validation loss is
    at or below ``target`` (None, None: not within `CAP` samples)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = workload.make_model()
    lr = scaled_lr(workload.base_lr, batch, BASE_BATCH, "sqrt")
    optimizer = workload.make_optimizer(model.parameters(), lr)
    params = loader_params(batch)
    train = DataLoader(
        workload.train_dataset,
        batch_size=batch,
        shuffle=True,
        num_workers=params.num_workers,
        prefetch_factor=params.prefetch_factor,
        persistent_workers=params.persistent_workers,
        collate_fn=workload.collate_fn,
        generator=torch.Generator().manual_seed(seed),
    )
    val = DataLoader(workload.val_dataset, batch_size=256, collate_fn=workload.collate_fn)
    model.train()
    trained, next_check, training_s = 0, CHECK, 0.0
    while trained < CAP:
        started = time.perf_counter()
        for batch_data in train:
            optimizer.zero_grad(set_to_none=True)
            loss = _loss(workload, model, batch_data)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            trained += batch
            if trained >= next_check:
                training_s += time.perf_counter() - started
                next_check += CHECK
                if _validate(workload, model, val) <= target:
                    return training_s, trained
                started = time.perf_counter()
            if trained >= CAP:
                break
        training_s += time.perf_counter() - started
    return None, None


def measure(workload_name: str, batch_sizes: list[int], seeds: int) -> dict[str, Any]:
    workload = load_workload(workload_name, OPTIONS[workload_name])
    trials = study_trials(workload, batch_sizes, max(2, seeds - 1))
    noise = noise_of(trials)
    base_losses = [r.val_loss for r in trials[BASE_BATCH] if r.val_loss is not None]
    target = statistics.median(base_losses)
    rows: dict[int, dict[str, Any]] = {}
    for batch in batch_sizes:
        throughput = statistics.median(r.throughput_samples_per_s for r in trials[batch])
        loss = statistics.median(r.val_loss for r in trials[batch] if r.val_loss is not None)
        efficiency = noise.efficiency(batch, BASE_BATCH) if noise is not None else None
        rows[batch] = {
            "throughput": throughput,
            "val_loss": loss,
            "efficiency": efficiency,
            "goodput": throughput * efficiency if efficiency is not None else None,
            "times_s": [],
            "samples": [],
        }
    for seed in range(seeds):
        for batch in batch_sizes:
            seconds, samples = time_to_target(workload, batch, seed, target)
            rows[batch]["times_s"].append(seconds)
            rows[batch]["samples"].append(samples)
            shown = f"{seconds:.1f} s, {samples:,} samples" if seconds else "not reached"
            print(f"target {workload_name} batch {batch:4d} seed {seed}: {shown}", flush=True)
    for row in rows.values():
        reached = [t for t in row["times_s"] if t is not None]
        row["median_time_s"] = statistics.median(reached) if len(reached) * 2 > seeds else None
        got = [s for s in row["samples"] if s is not None]
        row["median_samples"] = statistics.median(got) if len(got) * 2 > seeds else None
    base = rows[BASE_BATCH]
    for batch, row in rows.items():
        row["predicted_time_ratio"] = (
            base["goodput"] / row["goodput"] if row["goodput"] and base["goodput"] else None
        )
        row["measured_time_ratio"] = (
            row["median_time_s"] / base["median_time_s"]
            if row["median_time_s"] and base["median_time_s"]
            else None
        )
        row["predicted_samples_ratio"] = (
            (1 + batch / noise.value) / (1 + BASE_BATCH / noise.value)
            if noise is not None and noise.value > 0
            else None
        )
        row["measured_samples_ratio"] = (
            row["median_samples"] / base["median_samples"]
            if row["median_samples"] and base["median_samples"]
            else None
        )
    within = [b for b in batch_sizes if rows[b]["val_loss"] <= target * (1 + TOLERANCE)]
    throughput_pick = max(within, key=lambda b: rows[b]["throughput"])
    goodput_pick = (
        max(batch_sizes, key=lambda b: rows[b]["goodput"]) if noise is not None else None
    )
    return {
        "workload": workload_name,
        "target_val_loss": target,
        "noise_scale": noise.as_dict() if noise is not None else None,
        "rows": {str(b): r for b, r in rows.items()},
        "throughput_pick": throughput_pick,
        "goodput_pick": goodput_pick,
    }


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Goodput against the measured time to a loss",
        "",
        f"{results['machine']}, {results['date']}; `{results['command']}`",
    ]
    for w in results["workloads"]:
        noise = w["noise_scale"]
        lines += [
            "",
            f"## {w['workload']}",
            "",
            f"Target: val_loss {w['target_val_loss']:.4f} (batch {BASE_BATCH} after"
            f" {BUDGET:,} samples). B_noise "
            + (
                f"{noise['value']:.0f} (95% CI {noise['ci95'][0]:.0f}-"
                f"{_f(noise['ci95'][1], '.0f')}, {noise['trials']} trials,"
                f" {noise['steps']} steps)"
                if noise
                else "not measured"
            )
            + ".",
            "",
            "| batch | samples/s | val_loss | efficiency | goodput | time to target (median,"
            " s) | time vs 64: measured / predicted | samples vs 64: measured / predicted |",
            "|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for batch, r in w["rows"].items():
            lines.append(
                f"| {batch} | {r['throughput']:,.0f} | {r['val_loss']:.4f} |"
                f" {_f(r['efficiency'], '.3f')} | {_f(r['goodput'], ',.0f')} |"
                f" {_f(r['median_time_s'], '.1f')} |"
                f" {_f(r['measured_time_ratio'], '.2f')} /"
                f" {_f(r['predicted_time_ratio'], '.2f')} |"
                f" {_f(r['measured_samples_ratio'], '.2f')} /"
                f" {_f(r['predicted_samples_ratio'], '.2f')} |"
            )
        t_pick, g_pick = w["throughput_pick"], w["goodput_pick"]
        t_time = w["rows"][str(t_pick)]["median_time_s"]
        g_time = w["rows"][str(g_pick)]["median_time_s"] if g_pick is not None else None
        lines += [
            "",
            f"Throughput-first pick: batch {t_pick} ({_f(t_time, '.1f')} s to the target);"
            f" goodput pick: batch {g_pick} ({_f(g_time, '.1f')} s).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks goodput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workloads", default="synthetic-images,synthetic-text")
    parser.add_argument("--batch-sizes", default="32,64,128,256")
    parser.add_argument("--quick", action="store_true", help="2 seeds, 2 batch sizes, images")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data")
    args = parser.parse_args(argv)
    from benchmarks.cli import machine

    seeds = args.seeds
    workloads = args.workloads.split(",")
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")} | {BASE_BATCH})
    if args.quick:
        seeds, workloads, batch_sizes = 2, ["synthetic-images"], [BASE_BATCH, 128]
    results: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m benchmarks goodput "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "workloads": [measure(name, batch_sizes, seeds) for name in workloads],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    (args.out / "goodput.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
