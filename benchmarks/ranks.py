"""Multi-rank trials against a plain DDP loop, and three ways to set a 2-rank node's loaders.

``python -m benchmarks ranks [--rounds 6] [--trials 12] [--out DIR]``, in the GPU stand-in
regime (``studies/standin.toml``: the training step waits on a "device" with the GIL
released, so the node is loader-bound), with 2 ranks on the CPU (gloo):

1. **Agreement**: the service's 2-rank trial (`run_isolated`, ``[training] ranks = 2``) and a
   plain two-process DDP loop written here (in a fresh process, `benchmarks._fresh`: two
   forked processes, gloo over a FileStore, `DistributedSampler`, DDP, a barrier at each
   window edge, all ranks' samples over the window; it shares no code with
   `loader_search.trial`), on the same settings, in alternating order. Target: the medians
   within 10%.
2. **Three recommendations, side by side** (2-rank trials, shuffled rounds): a one-rank
   study's recommendation copied to 2 ranks (what a user does today), Lightning's rule
   (``num_workers = cpus // ranks - 1``), and a 2-rank study's own recommendation.

Figures land in ``ranks.json`` / ``ranks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks._fresh import in_fresh_process

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "studies" / "standin.toml"
RANKS = 2
WARMUP, WINDOWS, WINDOW_BATCHES = 6, 3, 12
TIMEOUT_S = 600


# --- the plain loop -----------------------------------------------------------------------


def _plain_rank(rank: int, store: str, params: dict[str, Any], out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from loader_search.study import load_config
    from loader_search.workloads import load_workload

    config = load_config(CONFIG)
    workload = load_workload(config.workload, config.workload_options)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, RANKS),  # type: ignore[attr-defined]
        rank=rank,
        world_size=RANKS,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(int(params["torch_threads"]))
    torch.manual_seed(0)
    model = DistributedDataParallel(workload.make_model())
    optimizer = workload.make_optimizer(model.parameters(), workload.base_lr)
    sampler: DistributedSampler[Any] = DistributedSampler(
        workload.train_dataset, RANKS, rank, shuffle=True, seed=0
    )
    kwargs: dict[str, Any] = {"batch_size": params["batch_size"], "sampler": sampler}
    if params["num_workers"]:
        kwargs.update(
            num_workers=params["num_workers"],
            prefetch_factor=params["prefetch_factor"],
            persistent_workers=params["persistent_workers"],
        )
    loader = DataLoader(workload.train_dataset, collate_fn=workload.collate_fn, **kwargs)
    needed = WARMUP + WINDOWS * WINDOW_BATCHES
    marks: list[tuple[float, int]] = []
    done = samples = 0
    epoch = 0
    while done < needed:
        sampler.set_epoch(epoch)
        epoch += 1
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            workload.loss_fn(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            done += 1
            samples += len(targets)
            if done >= WARMUP and (done - WARMUP) % WINDOW_BATCHES == 0:
                dist.barrier()
                marks.append((time.perf_counter(), samples))
            if done >= needed:
                break
    rates = [(s1 - s0) / (t1 - t0) for (t0, s0), (t1, s1) in itertools.pairwise(marks)]
    out.send(rates)
    dist.destroy_process_group()


def plain_reading(params: dict[str, Any]) -> float:
    """One reading of the plain loop in this process (two forked ranks): the median window's
    samples/s of all ranks together."""
    import multiprocessing

    folder = tempfile.mkdtemp(prefix="plain-ddp-")
    context = multiprocessing.get_context("fork")
    pipes, ranks = [], []
    for rank in range(RANKS):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_plain_rank, args=(rank, os.path.join(folder, "store"), params, writer)
        )
        process.start()
        pipes.append(reader)
        ranks.append(process)
    per_rank = [reader.recv() for reader in pipes]
    for process in ranks:
        process.join(timeout=60)
    windows = [sum(rates) for rates in zip(*per_rank, strict=True)]  # each rank's samples/s
    return float(statistics.median(windows))


def _plain(params: dict[str, Any]) -> float:
    return float(
        in_fresh_process(plain_reading, params, timeout_s=TIMEOUT_S, what="the plain DDP loop")
    )


# --- the runner ---------------------------------------------------------------------------


def _samples(params: dict[str, Any]) -> int:
    """The node's training samples for a reading of ``params``: the plain loop's batches (its
    warm-up and windows) on every rank, at the setting's batch size."""
    return RANKS * (WARMUP + WINDOWS * WINDOW_BATCHES) * int(params["batch_size"])


def _runner(params: dict[str, Any], samples: int) -> float:
    from loader_search.params import LoaderParams
    from loader_search.study import load_config
    from loader_search.trial import TrialJob, run_isolated
    from loader_search.workloads import load_workload

    config = load_config(CONFIG)
    workload = load_workload(config.workload, config.workload_options)
    settings = replace(config.training, ranks=RANKS, train_samples=samples, warmup_batches=2)
    outcome = run_isolated(TrialJob(workload, LoaderParams.from_dict(params), settings))
    if outcome.result is None:
        raise RuntimeError(f"the 2-rank trial failed: {outcome.failure}")
    return outcome.result.throughput_samples_per_s


# --- the studies --------------------------------------------------------------------------


def _study(ranks: int, trials: int, folder: Path) -> dict[str, Any]:
    """The recommendation (its loader settings) of a study of the stand-in with ``ranks``."""
    import optuna

    from loader_search import run_study
    from loader_search.study import load_config, summarize

    config = load_config(CONFIG)
    config = replace(
        config,
        name=f"ranks-{ranks}",
        trials=trials,
        # The budget is shared by the ranks: each rank trains as much as one rank alone.
        training=replace(
            config.training, ranks=ranks, train_samples=config.training.train_samples * ranks
        ),
    )
    storage = f"sqlite:///{folder / f'ranks-{ranks}.db'}"
    run_study(config, storage=storage, quiet=True)
    study = optuna.load_study(study_name=config.name, storage=storage)
    rec = summarize(study, config.loss_tolerance).recommended
    assert rec is not None
    return rec.point.params.as_dict()


def run(rounds: int, trials: int, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    cpus = len(os.sched_getaffinity(0))
    settings = {
        "no workers": {"batch_size": 64, "num_workers": 0, "torch_threads": 1},
        "1 worker per rank": {
            "batch_size": 64,
            "num_workers": 1,
            "prefetch_factor": 2,
            "persistent_workers": True,
            "torch_threads": 1,
        },
    }
    agreement: dict[str, dict[str, list[float]]] = {
        name: {"runner": [], "plain": []} for name in settings
    }
    rng = random.Random(0)
    for _ in range(rounds):
        order = [(name, way) for name in settings for way in ("runner", "plain")]
        rng.shuffle(order)
        for name, way in order:
            params = {"prefetch_factor": None, "persistent_workers": False, **settings[name]}
            value = _runner(params, _samples(params)) if way == "runner" else _plain(params)
            agreement[name][way].append(value)
            print(f"agreement {name:18} {way:7} {value:8.0f}/s", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        one = _study(1, trials, Path(folder))
        two = _study(RANKS, trials, Path(folder))
    rule = max(0, cpus // RANKS - 1)
    lightning = {**one, "num_workers": rule}
    if rule == 0:
        lightning.update(prefetch_factor=None, persistent_workers=False)
    candidates = {
        "one-rank study, copied": one,
        "cpus // ranks - 1": lightning,
        "2-rank study": two,
    }
    side: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        names = list(candidates)
        rng.shuffle(names)
        for name in names:
            side[name].append(_runner(candidates[name], _samples(candidates[name])))
    document = {
        "cpus": cpus,
        "ranks": RANKS,
        "rounds": rounds,
        "agreement": agreement,
        "candidates": candidates,
        "side_by_side": side,
        "elapsed_s": time.perf_counter() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks.json").write_text(json.dumps(document, indent=1))
    (out / "ranks.md").write_text(table(document))
    print(table(document))
    return document


def table(document: dict[str, Any]) -> str:
    lines = [
        f"GPU stand-in, {document['ranks']} ranks (gloo) on {document['cpus']} CPUs,"
        f" {document['rounds']} rounds in shuffled order; samples/s of the node (medians).",
        "",
        "| setting | service's 2-rank trial | plain DDP loop | trial / plain"
        " | spread (trial, plain) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, ways in document["agreement"].items():
        runner, plain = statistics.median(ways["runner"]), statistics.median(ways["plain"])
        spread = [f"{(max(v) - min(v)) / statistics.median(v):.0%}" for v in ways.values()]
        lines.append(
            f"| {name} | {runner:,.0f} | {plain:,.0f} | {runner / plain:.3f}"
            f" | {', '.join(spread)} |"
        )
    lines += [
        "",
        "| recommendation | its settings | node samples/s (median) | vs copied |",
        "|---|---|---:|---:|",
    ]
    side = document["side_by_side"]
    copied = statistics.median(side["one-rank study, copied"])
    for name, values in side.items():
        params = document["candidates"][name]
        described = (
            f"batch {params['batch_size']}, {params['num_workers']} workers,"
            f" prefetch {params.get('prefetch_factor')}, {params['torch_threads']} threads"
        )
        lines.append(
            f"| {name} | {described} | {statistics.median(values):,.0f} |"
            f" {statistics.median(values) / copied:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks ranks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--trials", type=int, default=12, help="trials of each study")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data")
    args = parser.parse_args(argv)
    run(args.rounds, args.trials, args.out)
