"""Model-guided search: the pipeline model (`loader_search.study.search._pipeline`) read from a
study's trials, the settings it asks to measure, and what it says about the answer.

Optuna stays the engine. After the baseline, the model's predicted optimum of each batch size
is queued as ordinary trials (``enqueue_trial``), fastest predicted first (round 1). Once they
have run, the model is fitted again on what they measured, and each batch size whose optimum
moved, or whose prediction missed by more than `UNSURE_ERROR`, gets that setting too (round 2),
unless its validation loss already rules it out of the recommendation (above the loss
tolerance). The model tells settings apart by workers and threads; the prefetch depth only
smooths bursts in it, yet moved throughput by 5% on the measured table (benchmarks/RESULTS.md).
So round 3 measures the prefetch neighbours of the leader (the fastest setting measured within
the loss tolerance): the next depths below and above its own on a doubling ladder, half and
twice its depth where the range allows. Then the configured sampler goes on, with
every model trial in its history.

Once a trial has measured the gradient noise scale (`loader_search.study.stats._goodput`), a
round's proposals are queued by their predicted goodput, not their throughput: a batch size far
above the noise scale, whose speed would be spent on convergence, is tried last. A goodput study
(``[study] objective = "goodput"``) goes further: its rounds 2 and 3 leave out a batch size
whose best predicted goodput cannot reach the leader's (the setting of the highest goodput
measured), and the loss tolerance does not rule batch sizes out (the efficiency prices a
larger batch's loss). The
recommendation always rests on real measurements; the model only chooses what to measure and
explains the result (the pipeline limit of a batch size, what bounds it, what would lift it).

Pure: everything here is computed from the trials given (the worker reads them under the study
lock, the benchmarks' replay from its own study), so every worker of a team agrees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import Literal

from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams, Objective
from loader_search.study._keys import (
    CEILING_ATTR,
    COLLATE_COST,
    MAIN_COST,
    MODEL_ROUND_ATTR,
    PREDICTED_ATTR,
    PRODUCER_COST,
    stored_params,
    trial_hardware_class,
)
from loader_search.study._points import TrialPoint, is_feasible, points_of, tolerance_limit
from loader_search.study.search._pipeline import (
    BatchLimit,
    Lift,
    LimitSource,
    Observation,
    PipelineModel,
    PipelineSnapshot,
    Prediction,
    fit,
)
from loader_search.study.search._space import IntRange, ResolvedSpace
from loader_search.study.stats import pooled_noise_scale

ROUNDS = 3  # the model's optima, the unsure batch sizes again, the leader's prefetch neighbours
UNSURE_ERROR = 0.10  # a round-1 trial this far off its prediction: its batch size is unsure
# What-ifs the answer offers, as factors on the model's demands (see `lifts`).
CACHED_FETCH = 0.05  # indexing a pre-decoded tensor: ~20x cheaper than decoding (measured here)
CHEAPER_TRANSFORMS = 0.5
GPU_DECODE = 0.2  # what stays on the CPU when decoding moves to the GPU: reading the bytes


@dataclass(frozen=True)
class Proposal:
    """A setting the model asks to measure, with what it predicts."""

    params: LoaderParams
    predicted: float
    round: int


@dataclass(frozen=True)
class Guide:
    """The model for one study on one class of machine."""

    space: ResolvedSpace
    device: Literal["cpu", "cuda"]
    cpus: int
    hardware_class: str | None = None
    # The study's loss tolerance (see `tolerance_limit`): rounds 2 and 3 spend trials only
    # where the recommendation may land. None: every batch size is a candidate.
    loss_tolerance: float | None = None
    # Ranks per trial: ``cpus`` is then one rank's share of the node's (see `PipelineModel`).
    ranks: int = 1
    objective: Objective = "throughput"  # [study] objective (see the module docstring)

    def observations(self, trials: Sequence[FrozenTrial]) -> list[Observation]:
        """Completed, feasible trials of this machine class trained whole, as the model reads
        them."""
        found = []
        for trial in trials:
            if trial.state != TrialState.COMPLETE or not is_feasible(trial) or not trial.values:
                continue
            if self.hardware_class is not None and (
                trial_hardware_class(trial) != self.hardware_class
            ):
                continue
            params = stored_params(trial)
            # The model's stages are per batch of the DataLoader: a trial that accumulated
            # micro-batches is measured and recommended, but not modelled.
            if params is None or params.accumulation_steps > 1:
                continue
            attrs = trial.user_attrs
            found.append(
                Observation(
                    params,
                    float(trial.values[0]),
                    attrs.get(CEILING_ATTR),
                    attrs.get(PRODUCER_COST),
                    attrs.get(COLLATE_COST),
                    attrs.get(MAIN_COST),
                )
            )
        return found

    def model(self, trials: Sequence[FrozenTrial]) -> PipelineModel | None:
        return fit(self.observations(trials), self.device, self.cpus, self.ranks)

    def may_propose(self, trials: Sequence[FrozenTrial]) -> bool:
        """Whether `proposals` may ask for anything: a round is left, and none is queued or
        running (without fitting the model: the cheap half of the question)."""
        if _rounds_done(trials) >= ROUNDS:
            return False
        pending = (TrialState.WAITING, TrialState.RUNNING)
        return not any(t.state in pending and t.user_attrs.get(MODEL_ROUND_ATTR) for t in trials)

    def proposals(
        self, trials: Sequence[FrozenTrial], model: PipelineModel | None
    ) -> list[Proposal]:
        """What ``model`` (`model` of these ``trials``) asks to measure next: nothing while a
        round is queued or running, or before it could be fitted (the baseline, with its
        stage costs and ceiling, has not completed)."""
        if model is None or not self.may_propose(trials):
            return []
        done = _rounds_done(trials)
        pending = (TrialState.WAITING, TrialState.RUNNING)
        tried = {o.params for o in self.observations(trials)} | {
            p for p in (stored_params(t) for t in trials if t.state in pending) if p is not None
        }
        efficiency = self._efficiency(trials)
        for round_ in range(done + 1, ROUNDS + 1):  # a round with nothing to ask is skipped
            wanted = self._round(round_, trials, model, tried)
            if wanted:
                return sorted(wanted, key=lambda p: -p.predicted * efficiency(p.params))
        return []

    def _efficiency(self, trials: Sequence[FrozenTrial]) -> Callable[[LoaderParams], float]:
        """The statistical efficiency of a setting's batch size against the baseline's at
        the study's noise scale (1 before a trial measured it)."""
        noise = pooled_noise_scale(trials, interval=False)  # the estimate orders, alone
        baseline = points_of(trials, self.hardware_class).baseline
        if noise is None or baseline is None:
            return lambda params: 1.0
        reference = baseline.params.batch_size
        return lambda params: noise.efficiency(params.batch_size, reference)

    def _round(
        self,
        round_: int,
        trials: Sequence[FrozenTrial],
        model: PipelineModel,
        tried: set[LoaderParams],
    ) -> list[Proposal]:
        if round_ == 1:
            optima = (model.best(batch, self.space) for batch in self.space.batch_sizes)
            return [
                Proposal(b.params, b.throughput, round_) for b in optima if b.params not in tried
            ]
        allowed, leader = self._within_tolerance(trials)
        if round_ == 3:
            return [
                Proposal(params, model.predict(params).throughput, round_)
                for params in self._neighbours(leader)
                if params not in tried
            ]
        wanted = []
        efficiency = self._efficiency(trials)
        for batch in self.space.batch_sizes:
            if batch not in allowed:
                continue
            best = model.best(batch, self.space)
            if (
                self.objective == "goodput"
                and leader is not None
                and best.throughput * efficiency(best.params)
                < leader.throughput * efficiency(leader.params)
            ):
                continue  # its speed cannot pay for the samples it would cost
            if not self._unsure(trials, batch, model.best(batch, self.space)):
                continue
            # The refitted optimum, or when it was measured already, its runner-up.
            ranked = sorted(
                (model.predict(p) for p in model.candidates(batch, self.space)),
                key=lambda p: -p.throughput,
            )
            untried = [p for p in ranked if p.params not in tried]
            if untried:
                wanted.append(Proposal(untried[0].params, untried[0].throughput, round_))
        return wanted

    def _within_tolerance(
        self, trials: Sequence[FrozenTrial]
    ) -> tuple[set[int], TrialPoint | None]:
        """The batch sizes the recommendation may still land on (none of their measurements
        within the loss tolerance is known to be above it), and the fastest setting measured
        within it (medians of repeats, as the recommendation reads them)."""
        found = points_of(trials, self.hardware_class)
        if self.objective == "goodput":
            efficiency = self._efficiency(trials)
            return set(self.space.batch_sizes), max(
                found.points, key=lambda p: p.throughput * efficiency(p.params), default=None
            )
        if self.loss_tolerance is None or not found.pareto:
            return set(self.space.batch_sizes), max(
                found.points, key=lambda p: p.throughput, default=None
            )
        limit, _, _ = tolerance_limit(
            found.pareto, found.baseline, self.loss_tolerance, found.baseline_doubt
        )
        within = [p for p in found.points if p.val_loss <= limit]
        ruled_out = {p.params.batch_size for p in found.points} - {
            p.params.batch_size for p in within
        }
        leader = max(within, key=lambda p: p.throughput, default=None)
        return set(self.space.batch_sizes) - ruled_out, leader

    def _neighbours(self, leader: TrialPoint | None) -> list[LoaderParams]:
        """The leader with the next prefetch depths below and above its own on a doubling
        ladder within the space (1, 2, 4, 8 for 1..8: half and twice its depth)."""
        if leader is None or leader.params.prefetch_factor is None:
            return []
        depth, span = leader.params.prefetch_factor, self.space.prefetch_factor
        doublings = (2**k for k in range(span.high.bit_length()))
        ladder = sorted({span.low, span.high, depth} | {d for d in doublings if d >= span.low})
        at = ladder.index(depth)
        depths = ladder[max(0, at - 1) : at] + ladder[at + 1 : at + 2]
        return [replace(leader.params, prefetch_factor=d) for d in depths]

    def _unsure(self, trials: Sequence[FrozenTrial], batch: int, best: Prediction) -> bool:
        """After round 1: a batch size is worth a second model trial when its round-1 trial
        missed its prediction, or its refitted optimum is another setting."""
        for trial in trials:
            params = stored_params(trial)
            if params is None or params.batch_size != batch or trial.values is None:
                continue
            predicted = trial.user_attrs.get(PREDICTED_ATTR)
            if trial.user_attrs.get(MODEL_ROUND_ATTR) == 1 and isinstance(predicted, float):
                if abs(trial.values[0] / predicted - 1) > UNSURE_ERROR:
                    return True
                return params != best.params
        return True  # its round-1 trial did not complete: measure the refitted optimum

    def predict(self, trials: Sequence[FrozenTrial], params: LoaderParams) -> Prediction | None:
        model = self.model(trials)
        return model.predict(params) if model is not None else None

    def snapshot(self, trials: Sequence[FrozenTrial], model: PipelineModel) -> PipelineSnapshot:
        """``model`` (`model` of these ``trials``), the limit of each batch size and what would
        lift it: stored with the study (`PIPELINE_ATTR`) for `best`, the report and people."""
        measured = _measured_best(self.observations(trials))
        batches: dict[int, BatchLimit] = {}
        for batch in self.space.batch_sizes:
            best = model.best(batch, self.space)
            limit, params = best.throughput, best.params
            source: LimitSource = "model"
            if batch in measured and measured[batch][0] > limit:
                # A limit below what was measured is the model's error: the measurement stands.
                (limit, params), source = measured[batch], "measurement"
            batches[batch] = BatchLimit(
                limit_samples_per_s=limit,
                limit_from=source,
                bottleneck=best.bottleneck,
                extrapolated=best.extrapolated,
                limit_params=params,
                lifts=tuple(lifts(model, self.space, batch, limit)),
            )
        return PipelineSnapshot(model, batches)


def _measured_best(observations: Sequence[Observation]) -> dict[int, tuple[float, LoaderParams]]:
    """Per batch size, the setting with the highest median throughput (repeats are one)."""
    readings: dict[LoaderParams, list[float]] = {}
    for o in observations:
        readings.setdefault(o.params, []).append(o.throughput)
    best: dict[int, tuple[float, LoaderParams]] = {}
    for params, values in readings.items():
        value = median(values)
        if value > best.get(params.batch_size, (0.0, params))[0]:
            best[params.batch_size] = (value, params)
    return best


def lifts(
    model: PipelineModel, space: ResolvedSpace, batch: int, limit: float | None = None
) -> list[Lift]:
    """What would lift the limit of ``batch`` (the model's, or ``limit`` where a measurement
    beat it), with the model's predicted limit after each and its gain over ``limit``, largest
    first: twice the CPUs, samples cached decoded, transforms half as costly, decoding on the
    GPU (CUDA only), and the best other batch size (whose validation loss differs: see the
    Pareto front)."""
    if limit is None:
        limit = model.best(batch, space).throughput
    options: list[tuple[str, str, float]] = []  # (lever, what, predicted limit)
    more = replace(space, usable_cpus=space.usable_cpus * 2, num_workers=_doubled(space))
    options.append(
        (
            "more_cpus",
            f"twice the CPUs ({model.cpus * 2})",
            replace(model, cpus=model.cpus * 2).best(batch, more).throughput,
        )
    )
    for lever, text, factor in (
        ("cache_decoded", "caching decoded samples (in memory or on disk)", CACHED_FETCH),
        ("cheaper_transforms", "transforms half as costly", CHEAPER_TRANSFORMS),
        ("gpu_decode", "decoding and augmenting on the GPU", GPU_DECODE),
    ):
        if lever == "gpu_decode" and model.device != "cuda":
            continue
        cheaper = replace(model, fetch_s=model.fetch_s * factor)
        options.append((lever, text, cheaper.best(batch, space).throughput))
    others = {b: model.best(b, space).throughput for b in space.batch_sizes if b != batch}
    if others:
        other = max(others, key=lambda b: others[b])
        options.append(
            ("batch_size", f"batch size {other} (its validation loss differs)", others[other])
        )
    return [
        Lift(lever, text, predicted, predicted / limit)
        for lever, text, predicted in sorted(options, key=lambda o: -o[2])
        if predicted > limit * 1.02
    ]


def _doubled(space: ResolvedSpace) -> IntRange:
    """The worker range on a machine with twice the CPUs (its top end doubled)."""
    return replace(space.num_workers, high=space.num_workers.high * 2)


def _rounds_done(trials: Sequence[FrozenTrial]) -> int:
    rounds = [t.user_attrs.get(MODEL_ROUND_ATTR) for t in trials]
    return max((r for r in rounds if isinstance(r, int)), default=0)
