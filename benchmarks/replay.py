"""Search quality: studies replayed against the ground-truth table.

Every trial of a replayed study goes through the service's own code: its sampler
(`loader_search.study._open.make_sampler`), its search space (`ResolvedSpace.suggest`), the
baseline first, its early stop (`loader_search.study.work._plan.plan_trial`), the worker's
budget decision (`loader_search.study.work._budget.decide`: the next trial, the baseline,
re-measurement of the candidates) and its queueing of what that decision asks for
(`_take.queue_decision`), and its recommendation rule (`summarize_trials`). Only the
training is replaced: a trial is answered with one of the table's real repeats of its
configuration, drawn at random, so the replay sees the measurement noise a study sees: its
throughput over the study's window (warm-up to the early-stop mark, as every trial is scored)
and its validation loss. A trial that stops early reports the study's known validation loss of
its batch size and costs what the shortened run cost. The first trial of each batch size and
thread count also measures the ceiling, as in the service, and pays what a ceiling reading
costs; later trials of that pair reuse it. Once the budget is used, the candidates are
confirmed against the baseline in paired rounds as the worker decides (`decide`, one trial at a
time: `loader_search.study.stats._confirm`). The study itself is a real Optuna study in memory.

Quality is judged against the table's medians (the truth):

* **Hypervolume gap**: 1 - HV(true values of the configurations the study evaluated) /
  HV(the table's true Pareto front); objectives normalised to [0, 1] over the table
  (throughput / the best; val_loss min-max), reference point (0 samples/s, val_loss 1.1).
* **Recommendation regret**: 1 - true throughput of the recommended configuration / the best
  true throughput among configurations whose true val_loss is equal (within
  ``EQUAL_LOSS``, which absorbs the thread count's rounding noise) or better.
* **Claim error**: how far the speedup over the baseline that the study reports is from the
  true speedup of its recommendation (what re-measurement is for).
"""

from __future__ import annotations

import math
import random
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial

from benchmarks.ground_truth import Entry, Space
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study import (
    BASELINE_ATTR,
    CEILING_ATTR,
    COLLATE_COST,
    DIRECTIONS,
    MAIN_COST,
    MODEL_ROUND_ATTR,
    PARAMS_ATTR,
    PREDICTED_ATTR,
    PRODUCER_COST,
    VAL_LOSS_ATTR,
    VAL_LOSS_FROM,
    IntRange,
    ResolvedSpace,
    SamplerConfig,
    StudyConfig,
    hypervolume_2d,
    make_sampler,
    stored_params,
    summarize_trials,
)
from loader_search.study.search import Guide, Proposal
from loader_search.study.stats import ConfirmSettings
from loader_search.study.work import (
    FINISHED_STATES,
    Done,
    Take,
    Wait,
    count_used,
    decide,
    plan_trial,
    queue_decision,
)

EQUAL_LOSS = 0.005  # relative: val_losses this close are "equal" for the regret
HV_REFERENCE = (0.0, 1.1)  # (normalised throughput, normalised val_loss)
LOSS_TOLERANCE = 0.05
# The service's defaults: the 3 fastest candidates confirmed against the baseline in paired
# rounds (see loader_search.study.stats._confirm).
DEFAULTS = StudyConfig()
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
BASE_VARIANT = "random"  # what the other variants are compared with, seed by seed


@dataclass(frozen=True)
class Truth:
    """The table as the judge sees it."""

    entries: dict[LoaderParams, Entry]
    best_throughput: float
    min_loss: float
    max_loss: float
    true_hv: float
    # What a ceiling reading adds to a trial, per (batch size, threads): the median over the
    # configurations of the pair (one configuration's difference is noisy).
    ceiling_wall_s: dict[tuple[int, int], float] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: Sequence[Entry]) -> Truth:
        table = {e.params: e for e in entries}
        best = max(e.throughput for e in entries)
        low = min(e.val_loss for e in entries)
        high = max(e.val_loss for e in entries)
        by_pair: dict[tuple[int, int], list[float]] = {}
        for e in entries:
            by_pair.setdefault(_pair(e.params), []).append(e.ceiling_wall_s)
        ceiling = {pair: statistics.median(values) for pair, values in by_pair.items()}
        truth = cls(table, best, low, high, 0.0, ceiling)
        return replace(truth, true_hv=truth.hypervolume(list(table)))

    def normalised(self, params: LoaderParams) -> tuple[float, float]:
        entry = self.entries[params]
        span = (self.max_loss - self.min_loss) or 1.0
        return entry.throughput / self.best_throughput, (entry.val_loss - self.min_loss) / span

    def hypervolume(self, configs: Sequence[LoaderParams]) -> float:
        if not configs:
            return 0.0
        points = [(-t, v) for t, v in map(self.normalised, set(configs))]
        return hypervolume_2d(points, (-HV_REFERENCE[0], HV_REFERENCE[1]))

    def hv_gap(self, configs: Sequence[LoaderParams]) -> float:
        return 1.0 - self.hypervolume(configs) / self.true_hv

    def regret(self, params: LoaderParams) -> float:
        chosen = self.entries[params]
        limit = chosen.val_loss * (1 + EQUAL_LOSS)
        best = max(e.throughput for e in self.entries.values() if e.val_loss <= limit)
        return 1.0 - chosen.throughput / best


@dataclass(frozen=True)
class Variant:
    """One way to run the study: a sampler and the service's options."""

    name: str
    sampler: SamplerConfig | Callable[[int], optuna.samplers.BaseSampler]
    trials_factor: int = 1  # "random with twice the trials"
    reuse_val_loss: bool = True
    confirm: bool = True
    threads_searched: bool = False

    @property
    def model(self) -> bool:
        """Whether the pipeline model picks the first trials
        (`loader_search.study.search._guide`)."""
        return isinstance(self.sampler, SamplerConfig) and self.sampler.model


@dataclass(frozen=True)
class Run:
    """One replayed study: what it recommends, what its set is worth, what it cost."""

    variant: str
    seed: int
    budget: int
    regret: float
    hv_gap: float
    cost_s: float  # the sum of its trials' measured wall times
    trials: int  # confirmations included
    stopped_early: int
    first_within_5pct: int | None  # trials after which the recommendation first had regret <= 5%
    # The speedup the study reported over its baseline / the true one (table medians) - 1.
    claim_error: float


def resolved(table: Space, threads_searched: bool) -> ResolvedSpace:
    """The table's space as the service searches it on the table's machine: prefetch is
    suggested as steps 1..n that map to the table's values (an order-preserving relabelling),
    and without ``threads_searched`` the thread count follows the service's default rule."""
    persistent = None if len(set(table.persistent)) == 2 else table.persistent[0]
    return ResolvedSpace(
        batch_sizes=table.batch_sizes,
        num_workers=IntRange(min(table.workers), max(table.workers)),
        prefetch_factor=IntRange(1, len(table.prefetch)),
        persistent_workers=persistent,
        pin_memory=False,
        torch_threads=IntRange(min(table.threads), max(table.threads))
        if threads_searched
        else None,
        usable_cpus=max(table.threads),
    )


def _pair(params: LoaderParams) -> tuple[int, int]:
    """What the ceiling depends on: batch size and thread count."""
    return params.batch_size, params.torch_threads


def _to_table(params: LoaderParams, table: Space) -> LoaderParams:
    if params.prefetch_factor is None:
        return params
    return replace(params, prefetch_factor=table.prefetch[params.prefetch_factor - 1])


def _gp(seed: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False)


class _Replay:
    """A study whose trials are answered from the table."""

    def __init__(
        self,
        truth: Truth,
        table: Space,
        variant: Variant,
        seed: int,
        training: TrainingSettings,
    ) -> None:
        self.truth = truth
        self.table = table
        self.variant = variant
        self.rng = random.Random(seed)
        self.space = resolved(table, variant.threads_searched)
        self.training = replace(training, reuse_val_loss=variant.reuse_val_loss)
        if isinstance(variant.sampler, SamplerConfig):
            sampler = make_sampler(StudyConfig(sampler=variant.sampler, seed=seed))
        else:
            sampler = variant.sampler(seed)
        self.study = optuna.create_study(directions=list(DIRECTIONS), sampler=sampler)
        # The worker's budget decision takes these (see `run`).
        self.confirm = ConfirmSettings(
            top=DEFAULTS.confirm_top if variant.confirm else 0,
            min_rounds=DEFAULTS.confirm_min_rounds,
            max_rounds=DEFAULTS.confirm_max_rounds,
            half_width=DEFAULTS.confirm_half_width,
            loss_tolerance=LOSS_TOLERANCE,
        )
        grid = isinstance(variant.sampler, SamplerConfig) and variant.sampler.name == "grid"
        self.grid_size = self.space.size() if grid else None
        self.cost = 0.0
        self.train_size: int | None = None
        # As the worker does (`loader_search.study.work._take._guide`), on the table's machine.
        self.guide = (
            Guide(self.space, "cpu", self.space.usable_cpus, loss_tolerance=LOSS_TOLERANCE)
            if variant.model
            else None
        )

    def trial(self, *, baseline: bool = False) -> None:
        trial = self.study.ask()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Fixed parameter", UserWarning)
            params = self.space.suggest(trial)
        # Stored as the service stores it, in the space's terms; the table's is looked up.
        trial.set_user_attr(PARAMS_ATTR, params.as_dict())
        if baseline:
            trial.set_user_attr(BASELINE_ATTR, True)
        if self.guide is not None:
            prediction = self.guide.predict(self.study.get_trials(deepcopy=False), params)
            if prediction is not None:
                trial.set_user_attr(PREDICTED_ATTR, prediction.throughput)
        entry = self.truth.entries[_to_table(params, self.table)]
        reuse = plan_trial(
            self.study.get_trials(deepcopy=False),
            params,
            self.training,
            None,
            self.train_size,
            reuse_val_loss=self.training.reuse_val_loss,
        )
        repeat = self.rng.randrange(len(entry.throughputs))
        # A re-measured setting (`benchmarks.resolve`) has more throughput repeats than
        # validation losses: the loss is drawn on its own.
        loss_repeat = self.rng.randrange(len(entry.val_losses))
        if entry.costs:  # what this repeat measured of its stages, as a trial stores it
            producer, collate, main = entry.costs[repeat]
            trial.set_user_attr(PRODUCER_COST, producer)
            trial.set_user_attr(COLLATE_COST, collate)
            trial.set_user_attr(MAIN_COST, main)
        if reuse.plan.stop_early:
            assert reuse.val_loss is not None
            throughput, val_loss = entry.throughputs[repeat], reuse.val_loss
            self.cost += entry.short_wall_s
            trial.set_user_attr(VAL_LOSS_FROM, list(reuse.val_loss_from))
        else:
            throughput, val_loss = entry.throughputs[repeat], entry.val_losses[loss_repeat]
            self.cost += entry.wall_s
            trial.set_user_attr(VAL_LOSS_ATTR, val_loss)
        if reuse.plan.measure_ceiling:
            # The first trial of its batch size and thread count: it reads the ceiling (its
            # value is not judged here) and pays for it; later trials of the pair reuse it.
            self.cost += self.truth.ceiling_wall_s.get(_pair(entry.params), 0.0)
            trial.set_user_attr(CEILING_ATTR, entry.ceiling or 1.0)
        self.study.tell(trial, [throughput, val_loss])

    def run(self, budget: int) -> list[FrozenTrial]:
        """Run ``budget`` more trials (the baseline first, unless the study has one), then
        the re-measurements: each step as the worker takes it
        (`loader_search.study.work._budget.decide`, one trial at a time)."""
        total = budget + count_used(self._trials(), FINISHED_STATES)
        while True:
            trials = self._trials()
            proposals: list[Proposal] = []
            if self.guide is not None and not self.grid_size:
                proposals = self.guide.proposals(trials, self.guide.model(trials))
            decision = decide(
                trials, total, self.confirm, grid_size=self.grid_size, proposals=proposals
            )
            if isinstance(decision, Done):
                return self._trials()
            if isinstance(decision, Wait):
                raise AssertionError(f"{decision.running} replayed trial(s) left running")
            # Queued by the worker's own code, as a worker queues under the study lock.
            queue_decision(self.study, self.space, self.training.batch_size, decision)
            self.trial(baseline=isinstance(decision, Take) and decision.baseline)

    def _trials(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False)


def replay_one(
    truth: Truth,
    table: Space,
    variant: Variant,
    seed: int,
    budget: int,
    training: TrainingSettings,
) -> Run:
    replay = _Replay(truth, table, variant, seed, training)
    trials = replay.run(budget * variant.trials_factor)
    summary = summarize_trials("replay", trials, LOSS_TOLERANCE)
    assert summary.recommended is not None
    first = None
    for n in range(1, len(trials) + 1):
        prefix = summarize_trials("replay", trials[:n], LOSS_TOLERANCE).recommended
        if prefix is not None and truth.regret(_to_table(prefix.point.params, table)) <= 0.05:
            first = n
            break
    assert summary.baseline is not None and summary.recommended.speedup_vs_baseline is not None
    recommended = _to_table(summary.recommended.point.params, table)
    true_speedup = (
        truth.entries[recommended].throughput
        / truth.entries[_to_table(summary.baseline.params, table)].throughput
    )
    measured = [_to_table(p, table) for p in map(stored_params, trials) if p is not None]
    return Run(
        claim_error=summary.recommended.speedup_vs_baseline / true_speedup - 1,
        variant=variant.name,
        seed=seed,
        budget=budget,
        regret=truth.regret(recommended),
        hv_gap=truth.hv_gap(measured),
        cost_s=replay.cost,
        trials=len(trials),
        stopped_early=sum(VAL_LOSS_FROM in t.user_attrs for t in trials),
        first_within_5pct=first,
    )


def measured_by_default(
    entries: Sequence[Entry],
    table: Space,
    training: TrainingSettings,
    *,
    seeds: int,
    budget: int,
) -> list[LoaderParams]:
    """The settings the default (model-guided) study measures before its sampler takes over,
    over ``seeds`` replays: the baseline and every model proposal, most frequent first."""
    truth = Truth.of(entries)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    counts: dict[LoaderParams, int] = {}
    for seed in range(seeds):
        replay = _Replay(truth, table, variants()[0], seed, training)
        for trial in replay.run(budget):
            attrs = trial.user_attrs
            params = stored_params(trial)
            if params is not None and (BASELINE_ATTR in attrs or MODEL_ROUND_ATTR in attrs):
                params = _to_table(params, table)
                counts[params] = counts.get(params, 0) + 1
    return sorted(counts, key=lambda p: -counts[p])


def variants() -> list[Variant]:
    """What the replay compares (see benchmarks/README.md)."""
    return [
        # The default: the pipeline model picks the first trials, then TPE.
        Variant("model + tpe (default)", SamplerConfig()),
        Variant("model + random", SamplerConfig(name="random")),
        # Without the model: the samplers alone, as the service searched before.
        Variant("tpe", SamplerConfig(model=False)),
        Variant("tpe multivariate", SamplerConfig(multivariate=True, model=False)),
        Variant("tpe, 5 startup", SamplerConfig(n_startup_trials=5, model=False)),
        Variant("nsga2 (pop 10)", SamplerConfig(name="nsga2", population_size=10, model=False)),
        Variant("gp", _gp),
        Variant("random", SamplerConfig(name="random", model=False)),
        Variant("random, 2x trials", SamplerConfig(name="random", model=False), trials_factor=2),
        Variant("tpe, no early stop", SamplerConfig(model=False), reuse_val_loss=False),
        Variant("tpe, no confirmation", SamplerConfig(model=False), confirm=False),
        Variant("tpe, threads searched", SamplerConfig(model=False), threads_searched=True),
    ]


def replay_all(
    entries: Sequence[Entry],
    table: Space,
    training: TrainingSettings,
    *,
    seeds: int,
    budgets: Sequence[int],
    chosen: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> list[Run]:
    truth = Truth.of(entries)
    runs = []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for variant in variants():
            if chosen is not None and variant.name not in chosen:
                continue
            if variant.threads_searched and table.rule_threads:
                continue  # the table has only the default rule's thread counts
            for budget in budgets:
                for seed in range(seeds):
                    runs.append(replay_one(truth, table, variant, seed, budget, training))
            log(f"replayed {variant.name}")
    return runs


def table(runs: Sequence[Run], budgets: Sequence[int]) -> list[dict[str, Any]]:
    """Per variant and budget: medians over seeds, the mean regret with its 95% interval and,
    where the runs include `BASE_VARIANT`, the paired comparison with it (same seed, same
    budget). ``trials_to_5pct`` is at the largest budget (see `trials_to_5pct`)."""
    rows = []
    names = list(dict.fromkeys(r.variant for r in runs))
    base = {(r.seed, r.budget): r for r in runs if r.variant == BASE_VARIANT}
    for name in names:
        row: dict[str, Any] = {"variant": name}
        for budget in budgets:
            group = [r for r in runs if r.variant == name and r.budget == budget]
            if not group:
                continue
            regrets = [r.regret for r in group]
            row[f"hv_gap@{budget}"] = statistics.median(r.hv_gap for r in group)
            row[f"regret@{budget}"] = statistics.median(regrets)
            row[f"regret_mean@{budget}"] = statistics.fmean(regrets)
            row[f"regret_ci@{budget}"] = list(bootstrap_mean_ci(regrets))
            row[f"within5@{budget}"] = sum(r.regret <= 0.05 for r in group) / len(group)
            row[f"cost_s@{budget}"] = statistics.median(r.cost_s for r in group)
            row[f"claim_error@{budget}"] = statistics.median(abs(r.claim_error) for r in group)
            row[f"trials@{budget}"] = statistics.median(r.trials for r in group)
            if name != BASE_VARIANT:
                paired = [
                    r.regret - base[r.seed, budget].regret
                    for r in group
                    if (r.seed, budget) in base
                ]
                if paired:
                    row[f"vs_{BASE_VARIANT}@{budget}"] = paired_difference(paired)
        largest = [r for r in runs if r.variant == name and r.budget == max(budgets)]
        median, at_least = trials_to_5pct(largest)
        row["trials_to_5pct"] = median
        row["trials_to_5pct_above"] = at_least
        reached = sum(r.first_within_5pct is not None for r in largest)
        row["reached_5pct"] = f"{reached}/{len(largest)}"
        rows.append(row)
    return rows


def trials_to_5pct(runs: Sequence[Run]) -> tuple[float | None, float | None]:
    """The median over all ``runs`` of the trials run (search, re-measurements, and the extra
    trials of a longer run all count) until the recommendation first had regret <= 5%, a run
    that never got there counting as infinitely many: ``(median, None)``; or, when the median
    is not reached, ``(None, bound)``: it is more than ``bound``, the median with each run
    that never got there counted as the trials it had."""
    if not runs:
        return None, None
    median = statistics.median(
        math.inf if r.first_within_5pct is None else r.first_within_5pct for r in runs
    )
    if math.isfinite(median):
        return median, None
    bound = statistics.median(
        r.trials if r.first_within_5pct is None else r.first_within_5pct for r in runs
    )
    return None, bound


def bootstrap_mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean (fixed seed: the report reproduces)."""
    data = np.asarray(values, dtype=float)
    if len(data) < 2:
        return float(data.mean()), float(data.mean())
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    picks = rng.integers(0, len(data), size=(BOOTSTRAP_RESAMPLES, len(data)))
    low, high = np.percentile(data[picks].mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


def paired_difference(differences: Sequence[float]) -> dict[str, Any]:
    """Regret differences (variant - base, seed by seed): their mean, its 95% bootstrap
    interval, and in how many seeds the variant did better (wins: lower regret) or worse."""
    return {
        "mean": statistics.fmean(differences),
        "ci": list(bootstrap_mean_ci(differences)),
        "wins": sum(d < 0 for d in differences),
        "losses": sum(d > 0 for d in differences),
        "pairs": len(differences),
    }
