"""The training loop of one trial: every batch through the user's step, timed by the step
meter (throughput window) and the stage meter (where the CPU time goes), with the reading
at the early-stop mark kept aside (`Mark`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from loader_search.params import LoaderParams
from loader_search.trial._loader import ThreadLoader
from loader_search.trial._measure import StepMeter, WindowStats
from loader_search.trial._noise import NoiseProbe
from loader_search.trial._stages import StageCosts, StageMeter
from loader_search.trial._step import FirstStepClock, Step, compiled_graphs


class Mark:
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


@dataclass(frozen=True)
class LoopResult:
    """What `train` returns: the last batch's loss and the first's (tensors: no per-step
    device sync), the epochs begun, the measured window, its stage costs, and with compile
    the first step's time."""

    last_loss: torch.Tensor
    first_loss: torch.Tensor
    epochs: int
    stats: WindowStats
    costs: StageCosts
    compile_time_s: float | None


def train(
    step: Step,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any] | ThreadLoader,
    meters: tuple[StepMeter, StageMeter],
    budget: int,
    params: LoaderParams,
    progress: Callable[[], None],
    mark: Mark,
    probe: NoiseProbe | None = None,
) -> LoopResult:
    """The training loop. The loader yields `TimedBatch`es (see
    `loader_search.trial._stages`); every batch goes through ``step``. With torch.compile, a
    step that compiled a new graph inside the window (a short last batch, a new shape) is
    left out of the window and counted (`StepMeter.step`'s ``exclude``). ``probe`` reads the
    gradient noise scale's norms (`loader_search.trial._noise`)."""
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
    loss = torch.zeros(())  # the last micro-batch's mean loss, detached
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
        size = step.size(batch, params.micro_batch_size)
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
            if probe is not None:
                probe.begin(batch_samples)
        # DDP all-reduces on the stepping micro-batch only; never where the probe does (ranks)
        with step.no_sync(batch_left - n > 0 or (probe is not None and probe.reduces)):
            loss = _backward(step, batch, n, batch_samples, batch_left, params, probe)
            if first is None:
                first = loss  # the untrained model's loss: before its first step
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
        if n > 0:  # progress is samples trained: steps that train none must time out
            progress()
    # The window closes before the iterator is dropped: shutting workers down is not training,
    # and persistent and non-persistent loaders must be timed alike.
    stats = meter.finish()
    costs = stages.snapshot()
    del iterator
    return LoopResult(
        loss,
        loss if first is None else first,
        epochs,
        stats,
        costs,
        clock.seconds,
    )


def _backward(
    step: Step,
    batch: Any,
    n: int,
    batch_samples: int,
    batch_left: int,
    params: LoaderParams,
    probe: NoiseProbe | None,
) -> torch.Tensor:
    """The forward and backward passes of one loader batch of ``n`` samples, of an effective
    batch of ``batch_samples`` with ``batch_left`` still to train; its mean loss, detached.

    With accumulation, each micro-batch's loss is weighted by its share of the batch, so that
    the gradients sum to the batch's mean. A batch the noise probe measures by splitting it is
    trained as two such pieces (`NoiseProbe.split_at`); the probe reads the gradient after the
    effective batch's first piece (the small batch's gradient: nothing else is in it yet) and
    after its last (the whole batch's, before the optimizer steps on it).
    """
    cut = probe.split_at(n) if probe is not None else None
    pieces = [(batch, n)]
    if cut is not None:
        head, tail = step.split(batch, cut)
        pieces = [(head, cut), (tail, n - cut)]
    weighted = params.accumulation_steps > 1 or cut is not None
    total: torch.Tensor | None = None
    for index, (piece, size) in enumerate(pieces):
        loss = step.loss(piece)
        weight = size / batch_samples
        step.backward(loss * weight if weighted else loss)
        if probe is not None and index == 0 and batch_left == batch_samples:
            probe.small(size, weight)
        part = loss.detach() * (size / n) if cut is not None else loss.detach()
        total = part if total is None else total + part
    if probe is not None and batch_left <= n:
        probe.big()
        if probe.side_due:  # a BatchNorm model's small gradient (`NoiseProbe.side_pass`)
            head = step.split(batch, probe.small_batch)[0]
            probe.side_pass(lambda: step.loss(head), step.backward)
    assert total is not None
    return total
