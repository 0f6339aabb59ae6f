"""Can a user bet on the speedup a study prints? Its claim against a side-by-side measurement
taken afterwards, over several independent studies.

For each seed: a real study with the service's defaults (the quickstart config, a fresh SQLite
file, that seed), which ends with its paired confirmation rounds and states the recommendation's
speedup over the baseline with a 95% interval (`loader_search.study.stats._confirm`). Then, once
the study is done, the baseline and the recommendation side by side: ``rounds`` paired rounds of
the reference loop (`benchmarks.reference`: a plain training loop, a fresh process per
reading, sharing no code with the service's trial runner, so a bias of the runner cannot hide
in both sides), each round both settings in alternating order. The side-by-side speedup is
the geometric mean of the per-round ratios, with its own 95% interval. Interleaved into the
same rounds, each setting is also read by the service's own runner as the study's worker ran
its confirmation trials (`confirming`: forked from a fresh process kept for the rounds, by
default; until 2026-12-06, forked from this process, the study's worker), so a
claim's error splits into what the runner reads differently from the plain loop at the same
time and what changed between the study's rounds and the check. The study's own rounds are
also continued to ten after it stops (`more_rounds`), for `benchmarks.stopping`. Also per
study: the confirmation rounds' share of the time its trials took.

Figures: per study, the claim, its interval, the side-by-side speedup, the claim error
(claim / side-by-side - 1) and whether the claimed interval covers the side-by-side estimate;
over the studies, the median absolute claim error and the coverage.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from benchmarks import reference
from benchmarks.ground_truth import QUICKSTART, measure, quick_config
from loader_search.params import LoaderParams
from loader_search.study import (
    MEASURED_SAMPLES,
    WINDOW_FAULTS,
    NullReporter,
    StudyConfig,
    TrialEvent,
    is_confirmation,
    load_config,
    run_study,
    stored_params,
)
from loader_search.study.stats import paired_speedup
from loader_search.trial import FreshHost, WorkloadRecipe
from loader_search.workloads import Workload, load_workload

# Each study's confirmation rounds are continued to this many (`more_rounds`): what a stop
# rule that ran on would have read, for `benchmarks.stopping` (about 4 s a round here).
EXTEND_TO = 10


@contextlib.contextmanager
def confirming(
    config: StudyConfig, workload: Workload
) -> Iterator[Callable[[LoaderParams], float]]:
    """A reader of one setting's throughput as the study's worker ran its confirmation
    trials (`benchmarks.ground_truth.measure`, shortened at the early-stop mark): each trial
    forked from a fresh process kept for the readings, built before the first
    (``confirm_process = "fresh"``, the default), or forked from this process ("fork")."""
    fresh = config.confirm_process == "fresh"
    with FreshHost() as host:
        if fresh:
            host.prepare(WorkloadRecipe(config.workload, dict(config.workload_options)), "cpu")
            if (failed := host.settle()) is not None:
                raise RuntimeError(f"the fresh process for confirmation trials failed: {failed}")

        def read(params: LoaderParams) -> float:
            kept = host if fresh else None
            row = measure(workload, config, params, ceiling=False, stop_early=True, host=kept)
            if "throughput" not in row:
                raise RuntimeError(f"{params.describe()} failed: {row.get('failure')}")
            return float(row["throughput"])

        yield read


def side_by_side(
    config_path: Path,
    config: StudyConfig,
    baseline: LoaderParams,
    candidate: LoaderParams,
    rounds: int,
    window: dict[str, int] | None = None,
    *,
    workload: Workload | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """``rounds`` paired rounds of the two settings through the reference loop
    (`benchmarks.reference`: a plain training loop in a fresh process, no code of the trial
    runner), alternating which goes first. With ``workload``, each round also reads both
    settings with the service's runner as the study ran its confirmation trials
    (`confirming`), the round's four readings in a shuffled order."""
    settings = {"baseline": baseline, "recommended": candidate}
    methods = ("reference", "runner") if workload is not None else ("reference",)
    rng = random.Random(seed)
    readings: dict[str, dict[str, list[float]]] = {m: {n: [] for n in settings} for m in methods}
    faults: dict[str, list[float]] = {"baseline": [], "recommended": []}
    with contextlib.ExitStack() as stack:
        read = stack.enter_context(confirming(config, workload)) if workload else None
        for round_ in range(rounds):
            if read is None:
                jobs = [("reference", "baseline"), ("reference", "recommended")]
                if round_ % 2:
                    jobs.reverse()
            else:
                jobs = [(method, name) for method in methods for name in settings]
                rng.shuffle(jobs)
            for method, name in jobs:
                params = settings[name]
                if method == "runner":
                    assert read is not None
                    readings[method][name].append(read(params))
                    continue
                value = reference.reading(
                    config_path, params.as_dict(), config.workload_options, **(window or {})
                )
                readings[method][name].append(value["throughput"])
                faults[name].append(value["faults_per_batch"])
    speedups = {}
    for method in methods:
        ratios = [
            r / b
            for r, b in zip(
                readings[method]["recommended"], readings[method]["baseline"], strict=True
            )
        ]
        speedup = paired_speedup(ratios)
        assert speedup is not None, "at least 2 rounds"
        speedups[method] = (speedup, ratios)
    speedup, ratios = speedups["reference"]
    result: dict[str, Any] = {
        "speedup": speedup.estimate,
        "ci95": [speedup.low, speedup.high],
        "ratios": ratios,
        "readings": readings["reference"],
        "faults_per_batch": faults,
    }
    if "runner" in speedups:
        runner, runner_ratios = speedups["runner"]
        result["runner"] = {
            "speedup": runner.estimate,
            "ci95": [runner.low, runner.high],
            "ratios": runner_ratios,
            "readings": readings["runner"],
            # Each setting: the runner's reading over the reference's in the same round.
            "over_reference": {
                name: statistics.median(
                    a / b
                    for a, b in zip(
                        readings["runner"][name], readings["reference"][name], strict=True
                    )
                )
                for name in settings
            },
        }
    return result


class ReferenceBesideRounds(NullReporter):
    """A study's reporter that, after each of its confirmation trials, reads the same setting
    at once with the reference loop and with the service's runner outside the study's worker
    (`benchmarks.ground_truth.measure` forked from the same process, the two in a shuffled
    order; ``--beside-rounds``). The same moment seen three ways: a claim's error splits into
    the study's moment, the runner, and the worker's path around its trials."""

    def __init__(
        self,
        config_path: Path,
        config: StudyConfig,
        window: dict[str, int] | None,
        workload: Workload | None = None,
        seed: int = 0,
    ) -> None:
        self.config_path, self.config, self.window = config_path, config, window
        self.workload = workload
        self.rng = random.Random(seed)
        # round -> setting -> method -> reading ("trial": the study's own)
        self.rounds: dict[int, dict[LoaderParams, dict[str, float]]] = {}

    def trial_finished(self, event: TrialEvent) -> None:
        if not (event.confirmation and event.complete and event.params and event.throughput):
            return
        assert event.confirm_round is not None
        found = {"trial": event.throughput}
        methods = ["reference", "runner"] if self.workload is not None else ["reference"]
        self.rng.shuffle(methods)
        for method in methods:
            if method == "runner":
                assert self.workload is not None
                row = measure(
                    self.workload,
                    self.config,
                    event.params,
                    ceiling=False,
                    stop_early=True,
                    lock=False,  # the study's worker holds it while it reports a trial
                )
                if "throughput" in row:
                    found[method] = float(row["throughput"])
                continue
            value = reference.reading(
                self.config_path,
                event.params.as_dict(),
                self.config.workload_options,
                **(self.window or {}),
            )
            found[method] = value["throughput"]
        self.rounds.setdefault(event.confirm_round, {})[event.params] = found

    def speedups(self, baseline: LoaderParams, candidate: LoaderParams) -> dict[str, Any]:
        """The candidate's speedup over the baseline in the rounds that read both, by the
        trials and by each reading beside them; with each setting's trial reading over the
        others' (medians)."""
        both = [r for r in self.rounds.values() if baseline in r and candidate in r]
        found: dict[str, Any] = {"rounds": len(both)}
        for method in ("trial", "runner", "reference"):
            pairs = [r for r in both if method in r[candidate] and method in r[baseline]]
            paired = paired_speedup([r[candidate][method] / r[baseline][method] for r in pairs])
            found[method] = None if paired is None else paired.estimate
        found["trial_over"] = {
            name: {
                method: statistics.median(
                    r[params]["trial"] / r[params][method] for r in both if method in r[params]
                )
                for method in ("runner", "reference")
                if any(method in r[params] for r in both)
            }
            for name, params in (("baseline", baseline), ("recommended", candidate))
        }
        found["readings"] = {
            name: [r[params] for r in both]
            for name, params in (("baseline", baseline), ("recommended", candidate))
        }
        return found


def confirmation_share(storage: str, name: str) -> dict[str, float]:
    """The confirmation rounds' share of the time the study's trials took."""
    study = optuna.load_study(study_name=name, storage=storage)
    total = confirming = 0.0
    for trial in study.get_trials(deepcopy=False):
        if trial.datetime_start is None or trial.datetime_complete is None:
            continue
        took = (trial.datetime_complete - trial.datetime_start).total_seconds()
        total += took
        if is_confirmation(trial):
            confirming += took
    return {"trials_s": total, "confirmation_s": confirming, "share": confirming / total}


def confirmation_trials(
    storage: str, name: str, settings: dict[str, LoaderParams]
) -> dict[str, list[FrozenTrial]]:
    """The study's finished confirmation trials of each of ``settings``, by its key."""
    study = optuna.load_study(study_name=name, storage=storage)
    wanted = {params: key for key, params in settings.items()}
    found: dict[str, list[FrozenTrial]] = {key: [] for key in settings}
    for trial in study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.COMPLETE]):
        params = stored_params(trial)
        if is_confirmation(trial) and params in wanted and trial.values:
            found[wanted[params]].append(trial)
    return found


def faults_per_batch(trial: FrozenTrial, params: LoaderParams) -> float | None:
    """The trial's minor page faults in its window, per batch (None: not stored)."""
    faults = trial.user_attrs.get(WINDOW_FAULTS)
    samples = trial.user_attrs.get(MEASURED_SAMPLES)
    if isinstance(faults, int) and isinstance(samples, int) and samples > 0:
        return faults / (samples / params.micro_batch_size)
    return None


def one_study(
    config_path: Path,
    config: StudyConfig,
    seed: int,
    rounds: int,
    folder: Path,
    window: dict[str, int] | None = None,
    beside_rounds: bool = False,
    extend_to: int = 0,
) -> dict[str, Any]:
    config = replace(config, seed=seed, name=f"claims-{seed}")
    db = folder / f"claims-{seed}.db"
    db.unlink(missing_ok=True)
    started = time.perf_counter()
    storage = f"sqlite:///{db}"
    # With `study.confirm_process = "fork"`, the runner's readings (`confirming`) are forked
    # from this process, the study's worker, as its confirmation trials were.
    workload = load_workload(config.workload, config.workload_options)
    beside = None
    if beside_rounds:
        beside = ReferenceBesideRounds(config_path, config, window, workload, seed)
    summary = run_study(config, storage=storage, quiet=True, reporter=beside)
    study_s = time.perf_counter() - started
    rec, base = summary.recommended, summary.baseline
    if rec is None or base is None:
        raise RuntimeError(f"study {config.name} has no baseline or no recommendation")
    result: dict[str, Any] = {
        "seed": seed,
        "study_s": study_s,
        "recommended": rec.point.params.describe(),
        "claim": rec.speedup_vs_baseline,
        "claim_ci95": [rec.paired.low, rec.paired.high] if rec.paired else None,
        "verdict": rec.verdict,
        "confirmation_rounds": rec.paired.rounds if rec.paired else 0,
        "trials": summary.n_complete,
        "confirmation": confirmation_share(storage, str(config.name)),
        "blocks_disagree": rec.paired.blocks_disagree if rec.paired else None,
        # The baseline's first reading (the study's first trial, in a fresh worker) against
        # the median of its later readings: how far off a first reading is.
        "baseline_first_vs_later": _first_vs_later(base.measurements),
    }
    if rec.point.params == base.params:  # nothing beat the baseline: no speedup to check
        return {**result, "side_by_side": None, "claim_error": None, "covered": None}
    if beside is not None:
        result["beside_rounds"] = beside.speedups(base.params, rec.point.params)
    both = {"baseline": base.params, "recommended": rec.point.params}
    if extend_to > result["confirmation_rounds"] > 0:
        result["more_rounds"] = more_rounds(
            config, workload, both, result["confirmation_rounds"], extend_to
        )
    started = time.perf_counter()
    measured = side_by_side(
        config_path,
        config,
        base.params,
        rec.point.params,
        rounds,
        window,
        workload=workload,
        seed=seed,
    )
    truth = measured["speedup"]
    low, high = result["claim_ci95"] or (None, None)
    # Each setting as the study read it against the reference loop afterwards: a runner that
    # reads one setting low shows here (the medians; machine state moves both alike).
    trials = confirmation_trials(storage, str(config.name), both)
    study_read = {key: [t.values[0] for t in found] for key, found in trials.items()}
    # The window's minor page faults per batch, medians: the study's trials beside the
    # reference loop's.
    study_faults = {
        key: [f for t in found if (f := faults_per_batch(t, both[key])) is not None]
        for key, found in trials.items()
    }
    return {
        **result,
        "study_readings": study_read,
        "faults_per_batch": {
            key: {
                "study": statistics.median(study_faults[key]) if study_faults[key] else None,
                "reference": statistics.median(measured["faults_per_batch"][key]),
            }
            for key in both
        },
        "study_over_reference": {
            key: statistics.median(values) / statistics.median(measured["readings"][key])
            for key, values in study_read.items()
            if values
        },
        "side_by_side": measured,
        "side_by_side_s": time.perf_counter() - started,
        "claim_error": rec.speedup_vs_baseline / truth - 1,  # type: ignore[operator]
        "covered": low <= truth <= high if low is not None else None,
    }


def more_rounds(
    config: StudyConfig,
    workload: Workload,
    settings: dict[str, LoaderParams],
    done: int,
    until: int,
) -> dict[str, Any]:
    """The study's confirmation rounds continued past its stop: rounds ``done`` to ``until``
    - 1 of ``settings`` (baseline first), each trial run as the study's worker ran its
    confirmation trials (`confirming`), the two in the order the rounds rotate. What a stop
    rule that ran on would have read: `benchmarks.stopping` replays any rule on the rounds
    with these after them. Taken right after the study, before the reference loop."""
    readings: dict[str, list[float]] = {name: [] for name in settings}
    started = time.perf_counter()
    with confirming(config, workload) as read:
        for round_ in range(done, until):
            names = list(settings)
            shift = round_ % len(names)  # `Rounds.order`'s rotation
            for name in names[shift:] + names[:shift]:
                readings[name].append(read(settings[name]))
    return {**readings, "s": time.perf_counter() - started}


def _first_vs_later(measurements: Sequence[float]) -> float | None:
    if len(measurements) < 2:
        return None
    return measurements[0] / statistics.median(measurements[1:])


def run(
    *,
    config_path: Path = QUICKSTART,
    quick: bool = False,
    studies: int = 5,
    rounds: int = 12,
    workdir: Path | None = None,
    beside_rounds: bool = False,
    extend_to: int = EXTEND_TO,
    log: Any = print,
) -> dict[str, Any]:
    config = load_config(config_path)
    window = None
    if quick:
        config = replace(
            quick_config(config), trials=6, confirm_min_rounds=3, confirm_max_rounds=3
        )
        window = dict(reference.QUICK_WINDOW)
        studies, rounds, extend_to = 2, 2, min(extend_to, 4)
    folder = Path(workdir or tempfile.mkdtemp(prefix="loader-search-claims-"))
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in range(studies):
        results.append(
            one_study(config_path, config, seed, rounds, folder, window, beside_rounds, extend_to)
        )
        r = results[-1]
        truth = r["side_by_side"]["speedup"] if r["side_by_side"] else None
        log(
            f"study {seed}: claimed {r['claim']:.3f}x {r['claim_ci95']} ({r['verdict']}),"
            f" side by side {truth if truth is None else f'{truth:.3f}x'}"
        )
    checked = [r for r in results if r["claim_error"] is not None]
    with_interval = [r for r in checked if r["covered"] is not None]
    return {
        "studies": results,
        "rounds": rounds,
        "extend_to": extend_to,
        "checked": len(checked),
        "median_abs_claim_error": statistics.median(abs(r["claim_error"]) for r in checked)
        if checked
        else None,
        "max_abs_claim_error": max((abs(r["claim_error"]) for r in checked), default=None),
        "covered": sum(bool(r["covered"]) for r in with_interval),
        "with_interval": len(with_interval),
        "baseline_first_vs_later": [r["baseline_first_vs_later"] for r in results],
        "median_confirmation_share": statistics.median(
            r["confirmation"]["share"] for r in results
        ),
    }
