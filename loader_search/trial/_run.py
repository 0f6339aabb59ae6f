"""One trial: a real training run with given DataLoader settings, measured. No Optuna here.

The run trains a fresh, identically initialised model for a fixed number of training samples,
the same for every batch size, so the validation loss at the end carries batch size's
convergence cost next to its speed. Throughput is measured over the steady state only (see
`loader_search.trial._measure`).

A `RunPlan` adds what the study asks of a trial. With ``short_samples`` the throughput window
ends there, part-way through training, for every trial of a study alike: a trial of a batch size
whose validation loss the study already knows stops at that mark without evaluating, and
measuring all trials over the same window keeps them comparable (the whole run's reading is
kept as ``full_window_throughput_samples_per_s``). It can also ask for the ceiling: the same
model fed pre-decoded batches already on the device.

This module sets a run up and reports it; the training loop is `loader_search.trial._train`,
the validation pass `loader_search.trial._evaluate`, the ceiling `loader_search.trial._ceiling`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from loader_search._system import OtherLoad, usable_cpus
from loader_search.errors import TrainingDiverged
from loader_search.params import (
    FULL_RUN,
    LoaderParams,
    RunPlan,
    TrainingSettings,
    scaled_lr,
)
from loader_search.trial._ceiling import measure_ceiling, no_progress, sync_for
from loader_search.trial._evaluate import evaluate
from loader_search.trial._loader import ThreadLoader, build_loader
from loader_search.trial._measure import PeakRSS, StepMeter
from loader_search.trial._noise import (
    RANKS_EVERY,
    SIDE_EVERY,
    SPLIT_EVERY,
    NoiseEstimate,
    NoiseProbe,
    batch_norms,
    noise_fields,
)
from loader_search.trial._pages import own_pages
from loader_search.trial._ranks import (
    RankContext,
    distributed_sampler,
    per_rank_plan,
    rank_budget,
    rank_device,
    rank_sync,
    resolve_ranks,
    run_ranks,
    wrap_model,
)
from loader_search.trial._result import TrialResult
from loader_search.trial._stages import StageMeter, TimedCollate, timed_dataset
from loader_search.trial._step import Step
from loader_search.trial._train import LoopResult, Mark, train
from loader_search.workloads import Workload

# Batches measured after the warm-up, at the least: fewer make throughput a coin toss.
MIN_MEASURED_BATCHES = 8
# Batches a shortened run trains past the first epoch boundary (see `short_run_samples`).
BATCHES_PAST_EPOCH = 4


def warmup_batches(params: LoaderParams, extra: int) -> int:
    """Batches excluded from the measurement: the ones the loader prefetched during start-up
    (`LoaderParams.batches_in_flight`, delivered in a burst) plus ``extra`` more."""
    return params.batches_in_flight + extra


def batches_needed(params: LoaderParams, extra_warmup: int) -> int:
    """Training batches a trial needs to measure a steady state at all."""
    return warmup_batches(params, extra_warmup) + MIN_MEASURED_BATCHES


def short_run_samples(
    params: LoaderParams, settings: TrainingSettings, train_size: int | None
) -> int:
    """Training samples of a shortened trial (one that reuses a known validation loss).

    Half the budget, and when the full run crosses an epoch boundary, at least up to it and
    ``BATCHES_PAST_EPOCH`` batches beyond: non-persistent workers restart there, a cost the
    full run pays and the reading must include. Never fewer than a measurable window.
    """
    target = math.ceil(settings.train_samples / 2)
    if train_size is not None and settings.train_samples > train_size:
        target = max(target, train_size + BATCHES_PAST_EPOCH * params.batch_size)
    minimum = batches_needed(params, settings.warmup_batches) * params.micro_batch_size
    return min(settings.train_samples, max(target, minimum))


def run_trial(
    workload: Workload,
    params: LoaderParams,
    settings: TrainingSettings,
    device: torch.device | str = "cpu",
    *,
    progress: Callable[[], None] | None = None,
    plan: RunPlan = FULL_RUN,
    rank: RankContext | None = None,
    measure_noise: bool = True,
) -> TrialResult:
    """Train ``workload`` with ``params`` for ``settings.train_samples`` samples and measure
    (and what ``plan`` asks, see `RunPlan`).

    ``progress`` is called after every training step that trained samples and every
    evaluation batch: it is the progress ping `loader_search.trial._supervisor` watches to
    tell a slow trial from a hung one. It must be cheap (it runs inside the timed window).

    Raises `TrainingDiverged` when the loss becomes non-finite, and ``ValueError`` when the
    budget is too small to measure anything after the warm-up.

    With ``[training] ranks`` above 1 the trial runs on that many ranks
    (`loader_search.trial._ranks`): ``rank`` is this process's, and the budget, the early-stop
    mark and the window are per rank.

    ``measure_noise``: read the gradient noise scale on the way (`_Run.noise_probe`).
    """
    device = torch.device(device)
    tick = progress if progress is not None else no_progress
    world = resolve_ranks(settings.ranks, device)
    if world > 1 and rank is None:

        def one_rank(me: RankContext) -> TrialResult:
            ping = progress if me.is_main else None
            return run_trial(
                workload,
                params,
                settings,
                device,
                progress=ping,
                plan=plan,
                rank=me,
                measure_noise=measure_noise,
            )

        return run_ranks(one_rank, world, device, tick)
    if rank is not None:
        device = rank_device(device, rank)
        plan = per_rank_plan(plan, rank.world)
    run = _Run(workload, params, settings, device, plan, rank, tick, measure_noise)
    budget_samples = rank_budget(settings.train_samples, rank)
    steps = math.ceil(budget_samples / params.micro_batch_size)
    if steps < batches_needed(params, settings.warmup_batches):
        raise ValueError(
            f"train_samples = {budget_samples} gives {steps} batches of"
            f" {params.micro_batch_size}, but {run.warmup} warm-up + {MIN_MEASURED_BATCHES}"
            " measured batches are needed; raise train_samples"
        )
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(params.torch_threads)
    try:
        measured = _train_and_measure(run, budget_samples, steps)
    finally:
        torch.set_num_threads(previous_threads)
    return measured.result(run)


@dataclass(frozen=True)
class _Run:
    """What one rank of one trial runs: the trial's inputs as `run_trial` resolved them (the
    rank's device and plan), with the learning rate scaled to the batch size."""

    workload: Workload
    params: LoaderParams
    settings: TrainingSettings
    device: torch.device
    plan: RunPlan
    rank: RankContext | None
    tick: Callable[[], None]
    measure_noise: bool = True

    @property
    def warmup(self) -> int:
        return warmup_batches(self.params, self.settings.warmup_batches)

    @property
    def lr(self) -> float:
        settings = self.settings
        return scaled_lr(
            settings.lr if settings.lr is not None else self.workload.base_lr,
            self.params.batch_size,
            settings.batch_size,
            settings.lr_scaling,
        )

    def step(self, model: torch.nn.Module) -> Step:
        return Step(
            self.workload, self.settings, model, self.device, pin_memory=self.params.pin_memory
        )

    def noise_probe(self, step: Step) -> NoiseProbe | None:
        """What reads the gradient noise scale in this run's loop, or None where it is not
        read: when not asked; and, without gradient accumulation or ranks, a batch of one
        sample and a compiled model (a half batch is a new input shape, a second compilation
        the trial would pay and report). A model with BatchNorm, whose halves would each be
        normalised by their own statistics, is measured by a side pass
        (`NoiseProbe.side_pass`) rather than by splitting its batch. With ranks, a rank's
        batch is the small one and the node's the big one (`NoiseProbe.across`).
        """
        params = self.params
        if not self.measure_noise:
            return None
        parameters = list(step.module.parameters())
        world = self.rank.world if self.rank is not None else 1
        if world > 1:
            return NoiseProbe(
                parameters,
                params.batch_size,
                params.micro_batch_size,
                every=RANKS_EVERY,  # what it costs
                scaler=step.scaler,
                ranks=world,
            )
        whole = params.accumulation_steps == 1
        if whole and (params.batch_size < 2 or step.compiled):
            return None
        norms = batch_norms(step.module) if whole else []
        return NoiseProbe(
            parameters,
            params.batch_size,
            params.micro_batch_size,
            # what it costs
            every=(SIDE_EVERY if norms else SPLIT_EVERY) if whole else 1,
            scaler=step.scaler,
            side=norms or None,
        )


@dataclass(frozen=True)
class _Measured:
    """What one rank's run measured, before it becomes a `TrialResult`: the training (its
    loop's `LoopResult`, the early-stop `Mark`, the samples it trained and its time), the
    evaluation, the peaks, and the ceiling."""

    trained: LoopResult
    mark: Mark
    step: Step
    budget: int
    train_time_s: float
    val_loss: float | None
    val_accuracy: float | None
    eval_time_s: float
    peak_host_rss_bytes: int
    peak_gpu_bytes: int | None
    ceiling: float | None
    ceiling_other_load: float | None
    noise: NoiseEstimate | None

    def result(self, run: _Run) -> TrialResult:
        """The measurements as a trial reports them: the window at the early-stop mark when
        there is one, else the whole run's."""
        trained, mark, plan = self.trained, self.mark, run.plan
        stats = trained.stats
        window = mark.stats or stats
        window_costs = mark.costs or trained.costs
        untrained_loss = float(trained.first_loss)
        compiled = self.step.compiled
        return TrialResult(
            throughput_samples_per_s=window.throughput,
            val_loss=self.val_loss,
            val_accuracy=self.val_accuracy,
            data_wait_fraction=window.data_wait_fraction,
            time_to_first_batch_s=stats.time_to_first_batch_s,
            peak_host_rss_bytes=self.peak_host_rss_bytes,
            peak_gpu_bytes=self.peak_gpu_bytes,
            train_samples=self.budget,
            measured_samples=window.measured_samples,
            measured_time_s=window.measured_time_s,
            warmup_batches=stats.warmup_batches,
            epochs=trained.epochs,
            lr=run.lr,
            final_train_loss=float(trained.last_loss),
            train_time_s=self.train_time_s,
            eval_time_s=self.eval_time_s,
            device=str(run.device),
            stopped_early=plan.stop_early,
            short_samples=mark.samples if mark.stats else None,
            short_train_time_s=mark.elapsed_s,
            full_window_throughput_samples_per_s=(
                stats.throughput if mark.stats and not plan.stop_early else None
            ),
            ceiling_samples_per_s=self.ceiling,
            ceiling_other_load=self.ceiling_other_load,
            untrained_loss=untrained_loss if math.isfinite(untrained_loss) else None,
            producer_cpu_s_per_sample=window_costs.producer_cpu_s_per_sample,
            collate_cpu_s_per_batch=window_costs.collate_cpu_s_per_batch,
            main_cpu_s_per_batch=window_costs.main_cpu_s_per_batch,
            cpu_used_cores=window_costs.cpu_used,
            other_load=window_costs.other_load,
            cpus_available=window_costs.cpus_available,
            compile_time_s=trained.compile_time_s,
            window_recompiles=window.excluded_steps if compiled else None,
            window_recompile_s=window.excluded_s if compiled else None,
            skipped_steps=self.step.skipped_steps if self.step.scaler is not None else None,
            slowest_step_over_median=window.slowest_step_over_median,
            window_minor_faults=window.minor_faults,
            **noise_fields(self.noise),
        )


def _train_and_measure(run: _Run, budget_samples: int, steps: int) -> _Measured:
    """The run itself, with this process's torch threads already set: build the model, train,
    evaluate, and read the ceiling when the plan asks."""
    workload, params, device, plan = run.workload, run.params, run.device, run.plan
    torch.manual_seed(run.settings.seed)  # every trial starts from the same weights
    step, plain = _model(run)
    optimizer = workload.make_optimizer(step.module.parameters(), run.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if params.num_workers == 0 or params.backend == "thread":
        # This process loads its own samples: their pages are made its own first, as a
        # fresh training script's are (the trial is forked; see trial._pages).
        own_pages(workload.train_dataset)
    # Child processes (loader workers; rank 0's sibling ranks, which its tree holds) are
    # sampled by a thread; without them, none runs beside the step.
    workers = params.num_workers > 0 and params.backend == "process"
    siblings = run.rank is not None and run.rank.is_main and run.rank.world > 1
    with PeakRSS(children=workers or siblings) as rss:
        train_start = time.perf_counter()
        loader = _train_loader(run)
        meter = StepMeter(
            run.warmup,
            sync_for(device) if run.rank is None else rank_sync(sync_for(device)),
            # Every rank must open its window at the same step (a barrier): fixed.
            until_stable=step.compiled and run.rank is None,
            max_warmup=steps - MIN_MEASURED_BATCHES,
        )
        stages = StageMeter(usable_cpus())
        mark = Mark(plan.short_samples, train_start)
        budget = budget_samples
        if plan.stop_early and plan.short_samples is not None:
            budget = min(budget, plan.short_samples)
        probe = run.noise_probe(step)
        trained = train(
            step, optimizer, loader, (meter, stages), budget, params, run.tick, mark, probe
        )
        del loader  # shuts down persistent workers before evaluation
        train_time = time.perf_counter() - train_start
        final_loss = float(trained.last_loss)
        if not math.isfinite(final_loss):
            raise TrainingDiverged(
                f"training loss became {final_loss} at lr={run.lr:.4g}; lower the learning rate"
                " or use lr_scaling = 'sqrt'"
            )
        eval_start = time.perf_counter()
        # With ranks, rank 0 alone evaluates (and reads the ceiling), on the model
        # without DDP: no collectives; the other ranks have trained their share.
        judge: Step | None = step
        if run.rank is not None:
            judge = run.step(plain)
        if run.rank is not None and not run.rank.is_main:
            judge = None
        val_loss, val_accuracy = _judge(run, judge)
        eval_time = time.perf_counter() - eval_start
    # The trial's own peak: the ceiling's extra batches on the device are not the loader's.
    peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    ceiling = other_load = None
    if plan.measure_ceiling and judge is not None:
        load = OtherLoad()
        ceiling = measure_ceiling(judge, optimizer, params, run.tick)
        other_load = load.share()
    return _Measured(
        trained=trained,
        mark=mark,
        step=step,
        budget=budget,
        train_time_s=train_time,
        val_loss=val_loss,
        val_accuracy=val_accuracy,
        eval_time_s=eval_time,
        peak_host_rss_bytes=rss.peak_bytes,
        peak_gpu_bytes=peak_gpu,
        ceiling=ceiling,
        ceiling_other_load=other_load,
        noise=probe.estimate() if probe is not None else None,
    )


def _model(run: _Run) -> tuple[Step, torch.nn.Module]:
    """The freshly initialised model in its step (in DDP with ranks), and the model without
    DDP: what rank 0 evaluates and reads the ceiling of."""
    model = run.workload.make_model().to(run.device)
    plain = model
    if run.rank is not None:
        if run.settings.channels_last:  # before DDP lays out its gradient buckets
            plain = model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        model = wrap_model(model, run.device)
    return run.step(model), plain


def _train_loader(run: _Run) -> DataLoader[Any] | ThreadLoader:
    """The trial's training loader, its samples and batches timed (`loader_search.trial._stages`);
    with ranks, over this rank's share of the data."""
    workload, seed = run.workload, run.settings.seed
    train_dataset = timed_dataset(workload.train_dataset)
    return build_loader(
        train_dataset,
        run.params,
        shuffle=True,
        seed=seed,
        collate_fn=TimedCollate(workload.collate_fn),
        sampler=(
            distributed_sampler(train_dataset, run.rank, seed) if run.rank is not None else None
        ),
    )


def _judge(run: _Run, judge: Step | None) -> tuple[float | None, float | None]:
    """The evaluation this rank owes (none on a rank other than 0): the validation loss and
    accuracy, or with ``stop_early`` one unscored batch (None, None)."""
    if judge is None:
        return None, None
    if run.plan.stop_early:
        # One evaluation batch, unscored: a setting whose evaluation runs out of
        # memory must not pass as feasible because it stopped early.
        evaluate(judge, run.params, run.settings, run.tick, max_batches=1)
        return None, None
    val_loss, val_accuracy = evaluate(judge, run.params, run.settings, run.tick)
    if not math.isfinite(val_loss):
        raise TrainingDiverged(f"validation loss is {val_loss} at lr={run.lr:.4g}")
    return val_loss, val_accuracy
