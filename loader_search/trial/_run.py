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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from loader_search.errors import TrainingDiverged
from loader_search.params import (
    FULL_RUN,
    LoaderParams,
    RunPlan,
    TrainingSettings,
    scaled_lr,
)
from loader_search.trial._loader import ThreadLoader, build_loader
from loader_search.trial._measure import PeakRSS, StepMeter, WindowStats
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
from loader_search.trial._stages import StageCosts, StageMeter, TimedCollate, timed_dataset
from loader_search.trial._step import FirstStepClock, Step, compiled_graphs
from loader_search.trial._system import OtherLoad, usable_cpus
from loader_search.workloads import Workload

# Batches measured after the warm-up, at the least: fewer make throughput a coin toss.
MIN_MEASURED_BATCHES = 8
# Batches a shortened run trains past the first epoch boundary (see `short_run_samples`).
BATCHES_PAST_EPOCH = 4
# The ceiling: steps timed on pre-decoded batches, at the least, and for at least this long.
CEILING_WARMUP_STEPS = 2
CEILING_MIN_STEPS = 5
CEILING_MIN_S = 0.5
CEILING_DISTINCT_BATCHES = 2  # cycled: their content does not change the compute


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


@dataclass(frozen=True)
class TrialResult:
    """Everything one training run measured. Keys of `user_attrs` carry their unit."""

    throughput_samples_per_s: float
    val_loss: float | None  # None: stopped early, not evaluated (see `RunPlan`)
    val_accuracy: float | None
    data_wait_fraction: float
    time_to_first_batch_s: float
    peak_host_rss_bytes: int
    peak_gpu_bytes: int | None
    train_samples: int
    measured_samples: int
    measured_time_s: float
    warmup_batches: int
    epochs: int
    lr: float
    final_train_loss: float
    train_time_s: float
    eval_time_s: float
    device: str
    stopped_early: bool = False
    # With `RunPlan.short_samples`: where the throughput window ended, the training time until
    # then (what a shortened trial costs), and the reading over the whole run (None when the
    # trial stopped there).
    short_samples: int | None = None
    short_train_time_s: float | None = None
    full_window_throughput_samples_per_s: float | None = None
    ceiling_samples_per_s: float | None = None
    # The loss of the first training batch, before any step: what the untrained model scores
    # (a validation loss above it is not credible; see loader_search.study._points).
    untrained_loss: float | None = None
    # The share of the machine's CPUs other processes used while the ceiling was read: a
    # reading taken while the machine was busy is not reused (see loader_search.study._plan).
    ceiling_other_load: float | None = None
    # Stage costs over the same window (see `loader_search.trial._stages`).
    producer_cpu_s_per_sample: float | None = None
    collate_cpu_s_per_batch: float | None = None
    main_cpu_s_per_batch: float | None = None
    cpu_used_cores: float | None = None
    cpus_available: int | None = None
    # The share of its CPUs other processes kept busy over the same window: a confirmation
    # reading taken beside a busy neighbour is measured again (see loader_search.study._confirm).
    other_load: float | None = None
    # The user's step (loader_search.trial._step): with torch.compile, the first training
    # step's time (compilation included) and the recompilations during the window, left out
    # of it; with fp16, the optimizer steps the gradient scaler skipped.
    compile_time_s: float | None = None
    window_recompiles: int | None = None
    window_recompile_s: float | None = None
    skipped_steps: int | None = None
    # The window's slowest step over its median step: a spike left in it shows here.
    slowest_step_over_median: float | None = None
    # A multi-rank trial (loader_search.trial._ranks): its ranks, and each rank's figures
    # (lists, rank 0 first); the fields above are the node's.
    ranks: int | None = None
    per_rank: dict[str, list[Any]] | None = None

    def user_attrs(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _no_progress() -> None:
    pass


def _sync_for(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA runs asynchronously); a no-op on CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def run_trial(
    workload: Workload,
    params: LoaderParams,
    settings: TrainingSettings,
    device: torch.device | str = "cpu",
    *,
    progress: Callable[[], None] | None = None,
    plan: RunPlan = FULL_RUN,
    rank: RankContext | None = None,
) -> TrialResult:
    """Train ``workload`` with ``params`` for ``settings.train_samples`` samples and measure
    (and what ``plan`` asks, see `RunPlan`).

    ``progress`` is called after every training step and every evaluation batch: it is the
    progress ping `loader_search.trial._supervisor` watches to tell a slow trial from a hung one.
    It must be cheap (it runs inside the timed window).

    Raises `TrainingDiverged` when the loss becomes non-finite, and ``ValueError`` when the
    budget is too small to measure anything after the warm-up.

    With ``[training] ranks`` above 1 the trial runs on that many ranks
    (`loader_search.trial._ranks`): ``rank`` is this process's, and the budget, the early-stop
    mark and the window are per rank.
    """
    device = torch.device(device)
    tick = progress if progress is not None else _no_progress
    world = resolve_ranks(settings.ranks, device)
    if world > 1 and rank is None:

        def one_rank(me: RankContext) -> TrialResult:
            ping = progress if me.is_main else None
            return run_trial(workload, params, settings, device, progress=ping, plan=plan, rank=me)

        return run_ranks(one_rank, world, device, tick)
    if rank is not None:
        device = rank_device(device, rank)
        plan = per_rank_plan(plan, rank.world)
    budget_samples = rank_budget(settings.train_samples, rank)
    warmup = warmup_batches(params, settings.warmup_batches)
    steps = math.ceil(budget_samples / params.micro_batch_size)
    if steps < batches_needed(params, settings.warmup_batches):
        raise ValueError(
            f"train_samples = {budget_samples} gives {steps} batches of"
            f" {params.micro_batch_size}, but {warmup} warm-up + {MIN_MEASURED_BATCHES}"
            " measured batches are needed; raise train_samples"
        )
    lr = scaled_lr(
        settings.lr if settings.lr is not None else workload.base_lr,
        params.batch_size,
        settings.batch_size,
        settings.lr_scaling,
    )
    sync = _sync_for(device) if rank is None else rank_sync(_sync_for(device))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(params.torch_threads)
    try:
        torch.manual_seed(settings.seed)  # every trial starts from the same weights
        model = workload.make_model().to(device)
        plain = model  # without DDP: what rank 0 evaluates and reads the ceiling of
        if rank is not None:
            if settings.channels_last:  # before DDP lays out its gradient buckets
                plain = model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
            model = wrap_model(model, device)
        step = Step(workload, settings, model, device, pin_memory=params.pin_memory)
        optimizer = workload.make_optimizer(step.module.parameters(), lr)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if params.num_workers == 0 or params.backend == "thread":
            # This process loads its own samples: their pages are made its own first, as a
            # fresh training script's are (the trial is forked; see trial._pages).
            own_pages(workload.train_dataset)
        with PeakRSS() as rss:
            train_start = time.perf_counter()
            train_dataset = timed_dataset(workload.train_dataset)
            loader = build_loader(
                train_dataset,
                params,
                shuffle=True,
                seed=settings.seed,
                collate_fn=TimedCollate(workload.collate_fn),
                sampler=(
                    distributed_sampler(train_dataset, rank, settings.seed)
                    if rank is not None
                    else None
                ),
            )
            meter = StepMeter(
                warmup,
                sync,
                # Every rank must open its window at the same step (a barrier): fixed.
                until_stable=step.compiled and rank is None,
                max_warmup=steps - MIN_MEASURED_BATCHES,
            )
            stages = StageMeter(usable_cpus())
            mark = _Mark(plan.short_samples, train_start)
            budget = budget_samples
            if plan.stop_early and plan.short_samples is not None:
                budget = min(budget, plan.short_samples)
            trained = _train(step, optimizer, loader, (meter, stages), budget, params, tick, mark)
            stats, costs = trained.stats, trained.costs
            del loader  # shuts down persistent workers before evaluation
            train_time = time.perf_counter() - train_start
            final_loss = float(trained.last_loss)
            untrained_loss = float(trained.first_loss)
            if not math.isfinite(final_loss):
                raise TrainingDiverged(
                    f"training loss became {final_loss} at lr={lr:.4g}; lower the learning rate"
                    " or use lr_scaling = 'sqrt'"
                )
            val_loss: float | None = None
            val_accuracy: float | None = None
            eval_start = time.perf_counter()
            # With ranks, rank 0 alone evaluates (and reads the ceiling), on the model
            # without DDP: no collectives; the other ranks have trained their share.
            judge: Step | None = step
            if rank is not None:
                judge = Step(workload, settings, plain, device, pin_memory=params.pin_memory)
            if rank is not None and not rank.is_main:
                judge = None
            if judge is not None and plan.stop_early:
                # One evaluation batch, unscored: a setting whose evaluation runs out of
                # memory must not pass as feasible because it stopped early.
                _evaluate(judge, params, settings, tick, max_batches=1)
            elif judge is not None:
                val_loss, val_accuracy = _evaluate(judge, params, settings, tick)
                if not math.isfinite(val_loss):
                    raise TrainingDiverged(f"validation loss is {val_loss} at lr={lr:.4g}")
            eval_time = time.perf_counter() - eval_start
        # The trial's own peak: the ceiling's extra batches on the device are not the loader's.
        peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ceiling = other_load = None
        if plan.measure_ceiling and judge is not None:
            load = OtherLoad()
            ceiling = measure_ceiling(judge, optimizer, params, tick)
            other_load = load.share()
    finally:
        torch.set_num_threads(previous_threads)
    window = mark.stats or stats
    window_costs = mark.costs or costs
    return TrialResult(
        throughput_samples_per_s=window.throughput,
        val_loss=val_loss,
        val_accuracy=val_accuracy,
        data_wait_fraction=window.data_wait_fraction,
        time_to_first_batch_s=stats.time_to_first_batch_s,
        peak_host_rss_bytes=rss.peak_bytes,
        peak_gpu_bytes=peak_gpu,
        train_samples=budget,
        measured_samples=window.measured_samples,
        measured_time_s=window.measured_time_s,
        warmup_batches=stats.warmup_batches,
        epochs=trained.epochs,
        lr=lr,
        final_train_loss=final_loss,
        train_time_s=train_time,
        eval_time_s=eval_time,
        device=str(device),
        stopped_early=plan.stop_early,
        short_samples=mark.samples if mark.stats else None,
        short_train_time_s=mark.elapsed_s,
        full_window_throughput_samples_per_s=(
            stats.throughput if mark.stats and not plan.stop_early else None
        ),
        ceiling_samples_per_s=ceiling,
        ceiling_other_load=other_load,
        untrained_loss=untrained_loss if math.isfinite(untrained_loss) else None,
        producer_cpu_s_per_sample=window_costs.producer_cpu_s_per_sample,
        collate_cpu_s_per_batch=window_costs.collate_cpu_s_per_batch,
        main_cpu_s_per_batch=window_costs.main_cpu_s_per_batch,
        cpu_used_cores=window_costs.cpu_used,
        other_load=window_costs.other_load,
        cpus_available=window_costs.cpus_available,
        compile_time_s=trained.compile_time_s,
        window_recompiles=window.excluded_steps if step.compiled else None,
        window_recompile_s=window.excluded_s if step.compiled else None,
        skipped_steps=step.skipped_steps if step.scaler is not None else None,
        slowest_step_over_median=window.slowest_step_over_median,
    )


class _Mark:
    """The reading at ``samples`` trained: the window's stats and the training time so far."""

    def __init__(self, samples: int | None, started: float) -> None:
        self.samples = samples
        self._started = started
        self.stats: WindowStats | None = None
        self.costs: StageCosts | None = None
        self.elapsed_s: float | None = None

    def reached(self, seen: int, meter: StepMeter, stages: StageMeter) -> None:
        if self.samples is None or self.stats is not None or seen < self.samples:
            return
        if meter.measured_samples > 0:  # too early a mark has no window: no reading
            self.stats = meter.snapshot()
            self.costs = stages.snapshot()
            self.elapsed_s = time.perf_counter() - self._started


def measure_ceiling(
    step: Step,
    optimizer: torch.optim.Optimizer,
    params: LoaderParams,
    progress: Callable[[], None] = _no_progress,
) -> float:
    """Samples/s of the same step and batch size fed from batches already decoded and on
    the device: the throughput no loader setting can beat (loader efficiency divides by it).

    A few batches are decoded once, moved to the device, and cycled: their content does not
    change the compute. Timed after ``CEILING_WARMUP_STEPS``, device-synchronised, for at
    least ``CEILING_MIN_STEPS`` steps and ``CEILING_MIN_S`` seconds. It trains the model on
    (so it runs after the evaluation).
    """
    micro = params.micro_batch_size
    plain = LoaderParams(batch_size=micro, torch_threads=params.torch_threads)
    workload = step.workload
    loader = build_loader(
        workload.train_dataset, plain, shuffle=True, collate_fn=workload.collate_fn
    )
    batches = []
    for batch in loader:
        if step.size(batch) < micro:
            break  # a short last batch would compile a new shape and time another step
        batches.append(step.prepare(batch))
        if len(batches) == CEILING_DISTINCT_BATCHES:
            break
    if not batches:
        raise ValueError(f"the training set has fewer than {micro} samples")
    sync = _sync_for(step.device)
    step.module.train()
    accumulate = params.accumulation_steps

    def one(i: int) -> int:  # one micro-batch; the optimizer steps after each full batch
        batch = batches[i % len(batches)]
        loss = step.loss(batch)
        if i % accumulate == 0:
            optimizer.zero_grad(set_to_none=True)
        step.backward(loss / accumulate if accumulate > 1 else loss)
        if i % accumulate == accumulate - 1:
            step.optimizer_step(optimizer)
        progress()
        return micro

    warmup = CEILING_WARMUP_STEPS * accumulate
    for i in range(warmup):
        one(i)
    sync()
    start = time.perf_counter()
    samples = steps = 0
    while (
        steps < CEILING_MIN_STEPS * accumulate
        or steps % accumulate
        or time.perf_counter() - start < CEILING_MIN_S
    ):
        samples += one(warmup + steps)
        steps += 1
        if steps % CEILING_MIN_STEPS == 0:
            sync()  # the clock must see finished work, not queued work
    sync()
    return samples / (time.perf_counter() - start)


@dataclass(frozen=True)
class _Trained:
    """What `_train` returns: the last batch's loss and the first's (tensors: no per-step
    device sync), the epochs begun, the measured window, its stage costs, and with compile
    the first step's time."""

    last_loss: torch.Tensor
    first_loss: torch.Tensor
    epochs: int
    stats: WindowStats
    costs: StageCosts
    compile_time_s: float | None


def _train(
    step: Step,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any] | ThreadLoader,
    meters: tuple[StepMeter, StageMeter],
    budget: int,
    params: LoaderParams,
    progress: Callable[[], None],
    mark: _Mark,
) -> _Trained:
    """The training loop. The loader yields `TimedBatch`es (see
    `loader_search.trial._stages`); every batch goes through ``step``. With torch.compile, a
    step that compiled a new graph inside the window (a short last batch, a new shape) is
    left out of the window and counted (`StepMeter.step`'s ``exclude``)."""
    meter, stages = meters
    step.module.train()
    meter.start()
    iterator = iter(loader)
    epochs = 1
    seen = 0
    sampler = getattr(loader, "sampler", None)  # a rank's share, or the whole data set
    epoch_size = len(sampler if sampler is not None else loader.dataset)  # type: ignore[arg-type]
    in_epoch = 0  # samples of this epoch so far
    batch_left = 0  # samples of the effective batch still to come as micro-batches
    batch_samples = 0  # what the effective batch averages over
    loss = torch.zeros(())
    first: torch.Tensor | None = None
    in_process = params.num_workers == 0  # threads, like worker processes, produce aside
    clock = FirstStepClock(step)
    graphs = compiled_graphs() if step.compiled else None
    while seen < budget:
        meter.wait_begin()
        cpu_before = time.thread_time()
        try:
            timed = next(iterator)
        except StopIteration:  # next epoch: the restart's wait is real loading time
            epochs += 1
            in_epoch = 0
            set_epoch = getattr(sampler, "set_epoch", None)
            if set_epoch is not None:  # a rank's DistributedSampler: a new order
                set_epoch(epochs - 1)
            iterator = iter(loader)
            timed = next(iterator)
        meter.wait_end()
        stages.received(timed, time.thread_time() - cpu_before, in_process)
        batch = timed.batch
        size = step.size(batch)
        n = min(size, budget - seen)
        if n < size:  # the budget is exact, whatever the batch size
            batch = step.take(batch, n)
        cpu_before = time.thread_time()
        batch = step.prepare(batch)
        stages.copied(time.thread_time() - cpu_before)
        began = time.perf_counter()
        clock.begin()
        if batch_left == 0:  # an effective batch begins: as the whole batch's loader cuts it
            batch_samples = min(params.batch_size, budget - seen, epoch_size - in_epoch)
            batch_left = batch_samples
            optimizer.zero_grad(set_to_none=True)
        with step.no_sync(batch_left - n > 0):  # DDP: all-reduce on the stepping one only
            loss = step.loss(batch)
            if first is None:
                first = loss.detach()  # the untrained model's loss: before its first step
            if params.accumulation_steps > 1:  # weighted so that the sum is the batch's mean
                step.backward(loss * (n / batch_samples))
            else:
                step.backward(loss)
        batch_left -= n
        if batch_left <= 0:
            step.optimizer_step(optimizer)
            batch_left = 0
        clock.end()
        seen += n
        in_epoch += n
        exclude = None
        if graphs is not None:
            now = compiled_graphs()
            if now != graphs and meter.in_window:
                exclude = time.perf_counter() - began  # a recompilation: not the loader's
            graphs = now
        meter.step(n, exclude)
        if meter.in_window and not stages.is_open:
            stages.open()  # the same batches as the throughput window
        mark.reached(seen, meter, stages)
        progress()
    # The window closes before the iterator is dropped: shutting workers down is not training,
    # and persistent and non-persistent loaders must be timed alike.
    stats = meter.finish()
    costs = stages.snapshot()
    del iterator
    return _Trained(
        loss.detach(),
        loss.detach() if first is None else first,
        epochs,
        stats,
        costs,
        clock.seconds,
    )


def _evaluate(
    step: Step,
    params: LoaderParams,
    settings: TrainingSettings,
    progress: Callable[[], None],
    max_batches: int | None = None,
) -> tuple[float, float | None]:
    """Mean validation loss over all samples (and accuracy for class-index targets, with the
    default step); over the first ``max_batches`` only when given."""
    workers = params.num_workers if max_batches is None else 0  # one batch: no start-up
    eval_params = LoaderParams(
        batch_size=settings.eval_batch_size,
        num_workers=workers,
        prefetch_factor=params.prefetch_factor if workers else None,
        pin_memory=params.pin_memory,
        torch_threads=params.torch_threads,
        start_method=params.start_method if workers else None,
        backend=params.backend if workers else "process",
    )
    workload = step.workload
    loader = build_loader(
        workload.val_dataset, eval_params, shuffle=False, collate_fn=workload.collate_fn
    )
    step.module.eval()
    total_loss = 0.0
    correct = 0
    count = 0
    classification = True
    for batches, batch in enumerate(loader, start=1):
        n = step.size(batch)
        batch = step.prepare(batch)
        loss, outputs = step.eval_loss(batch)
        total_loss += float(loss) * n
        count += n
        targets = batch[1] if outputs is not None else None
        if (
            classification
            and outputs is not None
            and isinstance(targets, torch.Tensor)
            and outputs.dim() == 2
            and targets.dim() == 1
            and not targets.is_floating_point()
        ):
            correct += int((outputs.argmax(1) == targets).sum())
        else:
            classification = False
        progress()
        if max_batches is not None and batches >= max_batches:
            break
    return total_loss / count, (correct / count if classification else None)
