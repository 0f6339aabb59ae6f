"""Ground truth: every configuration of a small real space, measured several times.

Each measurement is one real trial exactly as a study runs it (`run_isolated`: a forked child
trains the regime's workload for its whole budget and evaluates), under the host lock, so
nothing else of loader-search trains beside it. The configurations run in a shuffled order, one
pass per repeat, so a transient disturbance of the machine hits one repeat of a few
configurations rather than every repeat of one.

Every measurement is appended to a JSON-lines file as it finishes (a stopped run resumes where
it stopped); `aggregate` turns them into the table: median and spread per configuration.

Two regimes (`REGIMES`): the quickstart, CPU-bound on both sides, and the GPU stand-in
(``studies/standin.toml``), whose training step waits on a "device" with the GIL released so
the loader workers are the bottleneck, as on a GPU server.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from loader_search.params import LoaderParams, RunPlan
from loader_search.study import IntRange, StudyConfig, default_torch_threads, load_config
from loader_search.team import host_lock
from loader_search.trial import (
    FreshHost,
    TrialJob,
    WorkloadRecipe,
    run_isolated,
    short_run_samples,
)
from loader_search.workloads import Workload, load_workload

T = TypeVar("T")

STUDIES = Path(__file__).resolve().parent.parent / "studies"
QUICKSTART = STUDIES / "quickstart.toml"
STANDIN = STUDIES / "standin.toml"


@dataclass(frozen=True)
class Space:
    """A grid of loader settings (``prefetch`` and ``persistent`` only with workers)."""

    batch_sizes: tuple[int, ...]
    workers: tuple[int, ...]
    prefetch: tuple[int, ...]
    persistent: tuple[bool, ...]
    threads: tuple[int, ...]
    # Only the thread count the service's default rule gives each worker count (the table of
    # a search that does not search threads; half the size).
    rule_threads: bool = False

    def configs(self) -> list[LoaderParams]:
        out = []
        for batch, workers, threads in itertools.product(
            self.batch_sizes, self.workers, self.threads
        ):
            if self.rule_threads and threads != default_torch_threads(workers, max(self.threads)):
                continue
            if workers == 0:
                out.append(LoaderParams(batch, 0, torch_threads=threads))
                continue
            for prefetch, persistent in itertools.product(self.prefetch, self.persistent):
                out.append(LoaderParams(batch, workers, prefetch, False, persistent, threads))
        return out


# 4 x (1 + 3 x 3 x 2) x 2 = 152 configurations of the quickstart workload on a CPU.
FULL_SPACE = Space((32, 64, 128, 256), (0, 1, 2, 3), (1, 2, 4), (False, True), (1, 2))
QUICK_SPACE = Space((32, 64), (0, 1), (2,), (True,), (1,))
# 4 x (1 + 3 x 3 x 2) = 76: the stand-in's table, threads by the default rule.
STANDIN_SPACE = replace(FULL_SPACE, rule_threads=True)


@dataclass(frozen=True)
class Regime:
    """What a ground truth measures: a study config, its grid, and where its files go."""

    name: str
    config: Path
    space: Space
    suffix: str  # of the data files: ground_truth{suffix}.jsonl, replay{suffix}.json, ...
    resolvable: bool  # whether `benchmarks.resolve` re-measures its contenders


REGIMES = {
    "quickstart": Regime("quickstart", QUICKSTART, FULL_SPACE, "", resolvable=True),
    "standin": Regime("standin", STANDIN, STANDIN_SPACE, "_standin", resolvable=False),
}


def key(params: LoaderParams) -> str:
    """A configuration's stable name in the table."""
    return params.describe()


def quick_config(config: StudyConfig) -> StudyConfig:
    """The quickstart shrunk to seconds (for --quick: checks the code path, not timings)."""
    return replace(
        config,
        workload_options={**config.workload_options, "train_size": 512, "val_size": 128},
        training=replace(config.training, train_samples=1024, batch_size=32),
        space=replace(config.space, batch_sizes=(32, 64), prefetch_factor=IntRange(1, 2)),
    )


def trial_plan(
    workload: Workload,
    config: StudyConfig,
    params: LoaderParams,
    *,
    ceiling: bool,
    stop_early: bool = False,
) -> RunPlan:
    """A study's plan for a trial of ``params``: its shortened run's samples (the early-stop
    mark), stopping there with ``stop_early``, reading the ceiling with ``ceiling``."""
    train_size = len(workload.train_dataset)  # type: ignore[arg-type]
    return RunPlan(
        short_samples=short_run_samples(params, config.training, train_size),
        stop_early=stop_early,
        measure_ceiling=ceiling,
    )


def measure_in_process(config_path: Path, params: LoaderParams, *, quick: bool = False) -> float:
    """The throughput of ``params`` as `measure` reads it with ``stop_early`` and no ceiling
    (a confirmation trial), but run by this process itself, not forked: in a fresh process,
    the trial as a user's script trains (``quick``: the config shrunk by `quick_config`)."""
    from loader_search.trial import run_trial

    config = load_config(config_path)
    if quick:
        config = quick_config(config)
    workload = load_workload(config.workload, config.workload_options)
    plan = trial_plan(workload, config, params, ceiling=False, stop_early=True)
    result = run_trial(workload, params, config.training, "cpu", plan=plan)
    return result.throughput_samples_per_s


def measure(
    workload: Workload,
    config: StudyConfig,
    params: LoaderParams,
    *,
    ceiling: bool,
    stop_early: bool = False,
    lock: bool = True,
    host: FreshHost | None = None,
) -> dict[str, Any]:
    """One real trial with the study's own code path; its numbers as a flat dict. With
    ``stop_early`` it stops at the early-stop mark, as a study's shortened trial does: the
    throughput is the same window's, and there is no validation loss. It holds this machine's
    host lock unless ``lock`` is False (the caller holds it: a study's reporter). With a
    ``host``, the trial is forked from its fresh process (which built ``config``'s workload,
    kept for the next), as a study's confirmation trial is with ``confirm_process = "fresh"``;
    else it forks from this process."""
    plan = trial_plan(workload, config, params, ceiling=ceiling, stop_early=stop_early)
    fresh = WorkloadRecipe(config.workload, dict(config.workload_options)) if host else None
    job = TrialJob(workload, params, config.training, "cpu", plan=plan, fresh=fresh)
    with host_lock() if lock else contextlib.nullcontext():
        outcome = run_isolated(job, limits=config.limits, host=host)
    row: dict[str, Any] = {
        "config": key(params),
        "params": params.as_dict(),
        "wall_s": outcome.wall_s,
        "overhead_s": outcome.overhead_s,
    }
    if outcome.failure is not None:
        row["failure"] = f"{outcome.failure.reason}: {outcome.failure.message}"
        return row
    result = outcome.result
    assert result is not None
    row.update(
        throughput=result.throughput_samples_per_s,  # the study's window: until the mark
        full_window_throughput=result.full_window_throughput_samples_per_s,
        val_loss=result.val_loss,
        short_samples=result.short_samples,
        short_train_time_s=result.short_train_time_s,
        train_time_s=result.train_time_s,
        eval_time_s=result.eval_time_s,
        data_wait_fraction=result.data_wait_fraction,
        ceiling=result.ceiling_samples_per_s,
        # Stage costs over the same window (loader_search.trial._stages), for the model.
        producer_cpu_s_per_sample=result.producer_cpu_s_per_sample,
        collate_cpu_s_per_batch=result.collate_cpu_s_per_batch,
        main_cpu_s_per_batch=result.main_cpu_s_per_batch,
        cpu_used_cores=result.cpu_used_cores,
    )
    return row


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(
    path: Path,
    *,
    repeats: int,
    quick: bool,
    seed: int = 0,
    log: Any = print,
    regime: Regime = REGIMES["quickstart"],
) -> list[dict[str, Any]]:
    """Measure every configuration ``repeats`` times, appending to ``path`` (resumable)."""
    config = load_config(regime.config)
    if quick:
        config = quick_config(config)
    workload = load_workload(config.workload, config.workload_options)
    space = QUICK_SPACE if quick else regime.space
    configs = space.configs()
    done = {(r["config"], r["repeat"]) for r in read_rows(path)}
    path.parent.mkdir(parents=True, exist_ok=True)
    total = len(configs) * repeats
    started = time.perf_counter()
    count = len(done)
    for repeat, params in shuffled_rounds(configs, repeats, seed):
        if (key(params), repeat) in done:
            continue
        # The ceiling depends on batch size and threads only: measured once per config (first
        # pass), it gives many readings per (batch size, threads) pair.
        row = measure(workload, config, params, ceiling=repeat == 0)
        row["repeat"] = repeat
        with path.open("a") as out:
            out.write(json.dumps(row) + "\n")
        count += 1
        elapsed = time.perf_counter() - started
        log(
            f"[{count}/{total}] {key(params):<50} "
            + (
                f"{row['throughput']:>7,.0f} samples/s val_loss {row['val_loss']:.4f}"
                if "throughput" in row
                else row["failure"]
            )
            + f"  ({elapsed:.0f} s)"
        )
    return read_rows(path)


def shuffled_rounds(items: Sequence[T], rounds: int, seed: int) -> Iterator[tuple[int, T]]:
    """(round, item): every one of ``items`` once a round, for ``rounds`` rounds, each round
    in a fresh order drawn from ``seed``, so that a slow spell of the machine falls on one
    reading of several items rather than on every reading of one."""
    rng = random.Random(seed)
    for round_ in range(rounds):
        order = list(items)
        rng.shuffle(order)
        for item in order:
            yield round_, item


@dataclass(frozen=True)
class Entry:
    """One configuration of the table: medians over its repeats, and their spread."""

    params: LoaderParams
    throughput: float  # median samples/s over the study's window (warm-up to the mark)
    throughputs: tuple[float, ...]
    val_loss: float  # median
    val_losses: tuple[float, ...]
    full_window_throughputs: tuple[float, ...]  # over the whole run (warm-up to the end)
    wall_s: float  # median wall time of a full trial (fork to reaped)
    short_wall_s: float  # median wall time of the same trial stopped early
    train_time_s: float
    ceiling: float | None  # median samples/s on pre-decoded data (per batch size and threads)
    # What a ceiling reading adds to a trial: the median wall time of this configuration's
    # runs that measured the ceiling minus ``wall_s`` (the runs that did not), at least 0.
    ceiling_wall_s: float = 0.0
    # Per repeat (aligned with ``throughputs``): the stage costs it measured, (producer CPU s
    # per sample, collate CPU s per batch, main-process CPU s per batch); empty in old tables.
    costs: tuple[tuple[float, float, float], ...] = ()

    @property
    def spread(self) -> float:
        """(max - min) / median of the throughput repeats."""
        return (max(self.throughputs) - min(self.throughputs)) / self.throughput

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": key(self.params),
            "params": self.params.as_dict(),
            "throughput": self.throughput,
            "throughputs": list(self.throughputs),
            "val_loss": self.val_loss,
            "val_losses": list(self.val_losses),
            "full_window_throughputs": list(self.full_window_throughputs),
            "wall_s": self.wall_s,
            "short_wall_s": self.short_wall_s,
            "train_time_s": self.train_time_s,
            "ceiling": self.ceiling,
            "ceiling_wall_s": self.ceiling_wall_s,
            "costs": [list(c) for c in self.costs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Entry:
        return cls(
            params=LoaderParams.from_dict(data["params"]),
            throughput=data["throughput"],
            throughputs=tuple(data["throughputs"]),
            val_loss=data["val_loss"],
            val_losses=tuple(data["val_losses"]),
            full_window_throughputs=tuple(data["full_window_throughputs"]),
            wall_s=data["wall_s"],
            short_wall_s=data["short_wall_s"],
            train_time_s=data["train_time_s"],
            ceiling=data["ceiling"],
            ceiling_wall_s=data.get("ceiling_wall_s", 0.0),  # absent in older tables
            costs=tuple((c[0], c[1], c[2]) for c in data.get("costs", ())),
        )


def aggregate(rows: Sequence[dict[str, Any]]) -> list[Entry]:
    """The table: one `Entry` per configuration that never failed."""
    by_config: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_config.setdefault(row["config"], []).append(row)
    ceilings: dict[tuple[int, int], list[float]] = {}
    for row in rows:
        if row.get("ceiling"):
            p = row["params"]
            ceilings.setdefault((p["batch_size"], p["torch_threads"]), []).append(row["ceiling"])
    entries = []
    for group in by_config.values():
        if any("failure" in r for r in group):
            continue
        params = LoaderParams.from_dict(group[0]["params"])
        # A ceiling reading costs its trial extra time, which a study pays once per batch
        # size and thread count: a trial's cost comes from the other repeats (all of them if
        # there are none), the reading's from the difference.
        with_ceiling = [r for r in group if r.get("ceiling")]
        timed = [r for r in group if not r.get("ceiling")] or group
        wall_s = statistics.median(r["wall_s"] for r in timed)
        ceiling_wall_s = 0.0
        if with_ceiling:
            ceiling_wall_s = max(
                0.0, statistics.median(r["wall_s"] for r in with_ceiling) - wall_s
            )
        # What a shortened trial costs: its training until the reading, plus the full
        # trial's time outside training and evaluation (fork, start-up, teardown).
        short_walls = [
            r["short_train_time_s"] + r["wall_s"] - r["train_time_s"] - r["eval_time_s"]
            for r in timed
        ]
        ceiling = ceilings.get((params.batch_size, params.torch_threads))
        entries.append(
            Entry(
                params=params,
                throughput=statistics.median(r["throughput"] for r in group),
                throughputs=tuple(r["throughput"] for r in group),
                val_loss=statistics.median(r["val_loss"] for r in group),
                val_losses=tuple(r["val_loss"] for r in group),
                full_window_throughputs=tuple(r["full_window_throughput"] for r in group),
                wall_s=wall_s,
                short_wall_s=statistics.median(short_walls),
                train_time_s=statistics.median(r["train_time_s"] for r in group),
                ceiling=statistics.median(ceiling) if ceiling else None,
                ceiling_wall_s=ceiling_wall_s,
                costs=tuple(
                    (
                        r["producer_cpu_s_per_sample"],
                        r["collate_cpu_s_per_batch"],
                        r["main_cpu_s_per_batch"],
                    )
                    for r in group
                )
                if all(r.get("producer_cpu_s_per_sample") for r in group)
                else (),
            )
        )
    return sorted(entries, key=lambda e: key(e.params))


def save_table(entries: Sequence[Entry], path: Path, meta: dict[str, Any]) -> None:
    path.write_text(
        json.dumps({"meta": meta, "configs": [e.as_dict() for e in entries]}, indent=1) + "\n"
    )


def load_table(path: Path) -> tuple[dict[str, Any], list[Entry]]:
    data = json.loads(path.read_text())
    return data["meta"], [Entry.from_dict(d) for d in data["configs"]]
