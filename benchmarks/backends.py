"""Worker processes against a thread pool, each in and out of order, side by side.

For the quickstart's workload and a variable-cost variant of it (a tenth of the training
images stored 4x larger each way, so decoding one costs about 16 times as much: the stall
``in_order=False`` exists for), every contender trains full trials in shuffled rounds on the
same machine; the table gives the median throughput, the CPU time per sample (the trial
process tree's), the peak memory (the tree's RSS) and the validation loss.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from benchmarks.ground_truth import QUICKSTART, shuffled_rounds
from loader_search._system import usable_cpus
from loader_search.params import LoaderParams, RunPlan
from loader_search.study import StudyConfig, load_config
from loader_search.team import host_lock
from loader_search.trial import TrialJob, run_isolated
from loader_search.workloads import load_workload

SLOW = {"slow_fraction": 0.1, "slow_scale": 4}


def configs(quick: bool) -> dict[str, StudyConfig]:
    """The quickstart's study config, and the same with the variable-cost images."""
    base = load_config(QUICKSTART)
    if quick:
        options = {**base.workload_options, "train_size": 512, "val_size": 128}
        base = replace(
            base,
            workload_options=options,
            training=replace(base.training, train_samples=1024),
        )
    variable = replace(base, workload_options={**base.workload_options, **SLOW})
    return {"quickstart": base, "variable cost": variable}


def contenders(batch_size: int, cpus: int) -> dict[str, LoaderParams]:
    """The baseline, worker processes and thread pools of a few sizes, each in and out of
    order. One training thread beside workers (the default rule on 2 CPUs)."""
    found = {"no workers": LoaderParams(batch_size, torch_threads=cpus)}
    for workers in (1, 2):
        found[f"process x{workers}"] = LoaderParams(
            batch_size, workers, 2, persistent_workers=True, torch_threads=1
        )
    for workers in (2, 4):
        found[f"thread x{workers}"] = LoaderParams(
            batch_size, workers, 2, backend="thread", torch_threads=1
        )
    for name, params in list(found.items()):
        if params.num_workers:
            found[f"{name} out of order"] = replace(params, in_order=False)
    return found


def measure(
    config: StudyConfig, contenders: dict[str, LoaderParams], rounds: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Full trials of each contender, ``rounds`` times in shuffled order; medians."""
    workload = load_workload(config.workload, config.workload_options)
    readings: dict[str, list[Any]] = {name: [] for name in contenders}
    for _, name in shuffled_rounds(list(contenders), rounds, seed):
        with host_lock():
            outcome = run_isolated(
                TrialJob(workload, contenders[name], config.training, "cpu", plan=RunPlan()),
                limits=config.limits,
            )
        if outcome.result is None:
            raise RuntimeError(f"{name} failed: {outcome.failure}")
        readings[name].append(outcome.result)
    out = {}
    for name, results in readings.items():
        throughput = statistics.median(r.throughput_samples_per_s for r in results)
        out[name] = {
            "params": contenders[name].describe(),
            "throughput": throughput,
            "throughputs": [r.throughput_samples_per_s for r in results],
            "cpu_ms_per_sample": statistics.median(
                1e3 * (r.cpu_used_cores or 0.0) / r.throughput_samples_per_s for r in results
            ),
            "peak_rss_mb": statistics.median(r.peak_host_rss_bytes / 2**20 for r in results),
            "val_loss": statistics.median(r.val_loss for r in results if r.val_loss is not None),
            "data_wait": statistics.median(r.data_wait_fraction for r in results),
        }
    return out


def run(quick: bool = False, rounds: int = 3, seed: int = 0) -> dict[str, Any]:
    cpus = usable_cpus()
    result: dict[str, Any] = {"cpus": cpus, "rounds": rounds, "workloads": {}}
    for name, config in configs(quick).items():
        table = measure(config, contenders(config.training.batch_size, cpus), rounds, seed)
        best = {
            backend: max(
                (n for n in table if n.startswith(backend) and "out of order" not in n),
                key=lambda n: table[n]["throughput"],
            )
            for backend in ("process", "thread")
        }
        result["workloads"][name] = {
            "description": load_workload(config.workload, config.workload_options).description,
            "table": table,
            "best": best,
        }
    return result


def section(result: dict[str, Any]) -> str:
    lines = [
        f"{result['cpus']} usable CPUs, {result['rounds']} shuffled rounds of full trials,"
        " medians; CPU per sample is the trial process tree's CPU time over the measured"
        " window.",
    ]
    for name, data in result["workloads"].items():
        table = data["table"]
        base = table["no workers"]["throughput"]
        lines += [
            "",
            f"**{name}** ({data['description']}); best process setting: {data['best']['process']},"
            f" best thread setting: {data['best']['thread']}",
            "",
            "| loader | samples/s | vs no workers | CPU ms/sample | peak RSS MB | data wait |"
            " val_loss |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for contender, row in table.items():
            lines.append(
                f"| {contender} | {row['throughput']:,.0f} | {row['throughput'] / base:.2f}x"
                f" | {row['cpu_ms_per_sample']:.2f} | {row['peak_rss_mb']:,.0f}"
                f" | {row['data_wait']:.2f} | {row['val_loss']:.4f} |"
            )
    return "\n".join(lines)
