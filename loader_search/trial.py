"""One trial: a real training run with given DataLoader settings, measured. No Optuna here.

The run trains a fresh, identically initialised model for a fixed number of training samples,
the same for every batch size, so the validation loss at the end carries batch size's
convergence cost next to its speed. Throughput is measured over the steady state only (see
`loader_search.measure`).
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
from loader_search.loader import build_loader
from loader_search.measure import PeakRSS, StepMeter, WindowStats
from loader_search.params import LoaderParams, TrainingSettings, scaled_lr
from loader_search.workloads import Workload

# Batches measured after the warm-up, at the least: fewer make throughput a coin toss.
MIN_MEASURED_BATCHES = 8


def warmup_batches(params: LoaderParams, extra: int) -> int:
    """Batches excluded from the measurement: the ones workers prefetched during start-up
    (``num_workers * prefetch_factor``, delivered in a burst) plus ``extra`` more."""
    prefetched = params.num_workers * (params.prefetch_factor or 0)
    return prefetched + extra


def batches_needed(params: LoaderParams, extra_warmup: int) -> int:
    """Training batches a trial needs to measure a steady state at all."""
    return warmup_batches(params, extra_warmup) + MIN_MEASURED_BATCHES


@dataclass(frozen=True)
class TrialResult:
    """Everything one training run measured. Keys of `user_attrs` carry their unit."""

    throughput_samples_per_s: float
    val_loss: float
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
) -> TrialResult:
    """Train ``workload`` with ``params`` for ``settings.train_samples`` samples and measure.

    ``progress`` is called after every training step and every evaluation batch: it is the
    heartbeat `loader_search.isolation` watches to tell a slow trial from a hung one. It must
    be cheap (it runs inside the timed window).

    Raises `TrainingDiverged` when the loss becomes non-finite, and ``ValueError`` when the
    budget is too small to measure anything after the warm-up.
    """
    device = torch.device(device)
    tick = progress if progress is not None else _no_progress
    warmup = warmup_batches(params, settings.warmup_batches)
    steps = math.ceil(settings.train_samples / params.batch_size)
    if steps < batches_needed(params, settings.warmup_batches):
        raise ValueError(
            f"train_samples = {settings.train_samples} gives {steps} batches of"
            f" {params.batch_size}, but {warmup} warm-up + {MIN_MEASURED_BATCHES} measured"
            " batches are needed; raise train_samples"
        )
    lr = scaled_lr(
        settings.lr if settings.lr is not None else workload.base_lr,
        params.batch_size,
        settings.base_batch_size,
        settings.lr_scaling,
    )
    sync = _sync_for(device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(params.torch_threads)
    try:
        torch.manual_seed(settings.seed)  # every trial starts from the same weights
        model = workload.make_model().to(device)
        optimizer = workload.make_optimizer(model.parameters(), lr)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with PeakRSS() as rss:
            train_start = time.perf_counter()
            loader = build_loader(
                workload.train_dataset,
                params,
                shuffle=True,
                seed=settings.seed,
                collate_fn=workload.collate_fn,
            )
            meter = StepMeter(warmup, sync)
            last_loss, epochs, stats = _train(
                model,
                optimizer,
                workload,
                loader,
                meter,
                settings.train_samples,
                device,
                params,
                tick,
            )
            del loader  # shuts down persistent workers before evaluation
            train_time = time.perf_counter() - train_start
            final_loss = float(last_loss)
            if not math.isfinite(final_loss):
                raise TrainingDiverged(
                    f"training loss became {final_loss} at lr={lr:.4g}; lower the learning rate"
                    " or use lr_scaling = 'sqrt'"
                )
            eval_start = time.perf_counter()
            val_loss, val_accuracy = _evaluate(model, workload, params, settings, device, tick)
            eval_time = time.perf_counter() - eval_start
        if not math.isfinite(val_loss):
            raise TrainingDiverged(f"validation loss is {val_loss} at lr={lr:.4g}")
        peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        torch.set_num_threads(previous_threads)
    return TrialResult(
        throughput_samples_per_s=stats.throughput,
        val_loss=val_loss,
        val_accuracy=val_accuracy,
        data_wait_fraction=stats.data_wait_fraction,
        time_to_first_batch_s=stats.time_to_first_batch_s,
        peak_host_rss_bytes=rss.peak_bytes,
        peak_gpu_bytes=peak_gpu,
        train_samples=settings.train_samples,
        measured_samples=stats.measured_samples,
        measured_time_s=stats.measured_time_s,
        warmup_batches=stats.warmup_batches,
        epochs=epochs,
        lr=lr,
        final_train_loss=final_loss,
        train_time_s=train_time,
        eval_time_s=eval_time,
        device=str(device),
    )


def _train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    workload: Workload,
    loader: DataLoader[Any],
    meter: StepMeter,
    budget: int,
    device: torch.device,
    params: LoaderParams,
    progress: Callable[[], None],
) -> tuple[torch.Tensor, int, WindowStats]:
    """The training loop; returns the last batch's loss (a tensor: no per-step device sync),
    the epochs begun and the measured window."""
    model.train()
    meter.start()
    iterator = iter(loader)
    epochs = 1
    seen = 0
    loss = torch.zeros(())
    while seen < budget:
        meter.wait_begin()
        try:
            inputs, targets = next(iterator)
        except StopIteration:  # next epoch: the restart's wait is real loading time
            epochs += 1
            iterator = iter(loader)
            inputs, targets = next(iterator)
        meter.wait_end()
        n = min(len(targets), budget - seen)
        if n < len(targets):  # the budget is exact, whatever the batch size
            inputs, targets = inputs[:n], targets[:n]
        inputs = inputs.to(device, non_blocking=params.pin_memory)
        targets = targets.to(device, non_blocking=params.pin_memory)
        loss = workload.loss_fn(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        seen += n
        meter.step(n)
        progress()
    # The window closes before the iterator is dropped: shutting workers down is not training,
    # and persistent and non-persistent loaders must be timed alike.
    stats = meter.finish()
    del iterator
    return loss.detach(), epochs, stats


def _evaluate(
    model: torch.nn.Module,
    workload: Workload,
    params: LoaderParams,
    settings: TrainingSettings,
    device: torch.device,
    progress: Callable[[], None],
) -> tuple[float, float | None]:
    """Mean validation loss over all samples (and accuracy for class-index targets)."""
    eval_params = LoaderParams(
        batch_size=settings.eval_batch_size,
        num_workers=params.num_workers,
        prefetch_factor=params.prefetch_factor,
        pin_memory=params.pin_memory,
        torch_threads=params.torch_threads,
    )
    loader = build_loader(
        workload.val_dataset, eval_params, shuffle=False, collate_fn=workload.collate_fn
    )
    model.eval()
    total_loss = 0.0
    correct = 0
    count = 0
    classification = True
    with torch.no_grad():
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=params.pin_memory)
            targets = targets.to(device, non_blocking=params.pin_memory)
            outputs = model(inputs)
            total_loss += float(workload.loss_fn(outputs, targets)) * len(targets)
            count += len(targets)
            is_class_index = targets.dim() == 1 and not targets.is_floating_point()
            if classification and outputs.dim() == 2 and is_class_index:
                correct += int((outputs.argmax(1) == targets).sum())
            else:
                classification = False
            progress()
    return total_loss / count, (correct / count if classification else None)
