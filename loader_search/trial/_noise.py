"""The gradient noise scale of a trial's training, measured in its own loop.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training", appendix A.1, the
"simple" estimator. The squared norm of a mean gradient over ``B`` samples has expectation
``|G|^2 + tr(Sigma)/B`` (``G`` the true gradient, ``Sigma`` the per-sample gradients'
covariance), so squared norms at two batch sizes ``b < B`` give unbiased estimates of both
parts, step by step::

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

Each is averaged over the measured steps on its own (plain means: a trial is short, and one
figure for its run is what it reports), and ``B_simple = tr(Sigma) / |G|^2`` is their ratio.

Where the two sizes come from (`NoiseProbe`): a trial with gradient accumulation already has
them, its first micro-batch's gradient (``b``, the micro-batch) and the accumulated one
(``B``, the batch), read from the gradients the step computes anyway. Without accumulation a
measured batch is trained as two halves with the gradients accumulated: the same samples and
the same update, up to floating point, for a model that treats its samples independently.
A model with BatchNorm normalises each half by that half's statistics instead (a "ghost
batch" of ``B/2``) and updates its running statistics twice: a change to training. Such a
model is measured by a **side pass** instead: its measured batch is trained whole, and after
its backward pass one more forward and backward pass over its first quarter gives the small
gradient, the batch's gradient, the BatchNorm running statistics and the random state (a
dropout's) restored before the optimizer steps, so the run is the one it would have been. The
quarter batch is normalised by its own statistics, as a batch of that size is.

A multi-rank trial has the two sizes in its all-reduce: each rank's gradient is its own batch's
(``b``, the per-rank batch), the all-reduced one the node's (``B = N b``). DDP averages them
inside the backward pass, where no norm can be read between the two, so on a measured step the
stepping backward runs under ``no_sync()`` and the probe averages the gradients itself
(`average_over_ranks`: the mean DDP would have made, and the mean of the ranks' squared
norms). Every rank's update is the one DDP would have made, up to floating point; the cost is
the all-reduce a measured step does not overlap with its backward pass. The small squared
norm is the ranks' mean, an average of ``N`` estimates of the same expectation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# A batch the probe splits is measured every SPLIT_EVERY full batches, for what the split
# costs inside the throughput window. Quickstart trials (synthetic-images, batch 64, a 2-core
# CPU; 6 back-to-back pairs each, order alternated), median throughput on/off: split on every
# batch 0.95 (0.88-1.01) with 0 workers and 0.94 (0.91-0.99) with 1; every 4th 0.96 and
# 0.97; every 8th 0.98 (0.96-1.35) and 1.01 (0.94-1.10), against 1.01 and 1.00 for two
# identical trials. The norms alone, on micro-batches accumulation trains anyway, cost 0.98
# (0.93-1.00): every batch. A 128-batch trial then measures 16 split batches: a rough figure
# on its own (about 30-60% standard error), one a study pools over its trials.
SPLIT_EVERY = 8
# A side pass (BatchNorm) costs a quarter batch's forward and backward, and copies of the
# gradients and the running statistics: a quickstart step (batch 64, one thread) with one took
# 1.34-1.42x a plain step, so every 16th full batch costs the steps 2.1-2.6% of their time;
# over half the batch, as it was, 1.56-1.60x and 3.5-3.8%, above the 3% aimed at (5 repeats
# of 100 steps each way, interleaved in one process; `python -m tests.test_noise side`). The
# wider gap between the two sizes also suits the estimator: the two squared norms differ by
# 3 tr(S)/B instead of tr(S)/B. Rarer passes, or passes only outside the throughput reading
# (the warm-up and after the study's mark: late in training, where |G|^2 is small), left too
# few usable steps: the quickstart's pooled |G|^2 came out below zero, no figure at all.
SIDE_EVERY = 16
SIDE_SHARE = 4  # a side pass trains a quarter of the batch (`side_batch`)
# A multi-rank step measured every RANKS_EVERY full batches: its all-reduce runs after the
# backward pass instead of overlapping it (see the module docstring). 2-rank quickstart trials
# (gloo, a 2-core CPU; 8 pairs on and off, order alternated) read a paired on/off median of
# 1.016 (0.981-1.117): no cost the trials' spread can show (`python -m tests.test_noise ranks`).
RANKS_EVERY = 8
BUCKET_BYTES = 25 * 2**20  # what the probe all-reduces at once: DDP's default bucket
# Contiguous blocks of steps the standard error is computed from (batch means): the steps of
# one trial are correlated (the parameters drift), blocks of many steps much less so.
MAX_BLOCKS = 10


@dataclass(frozen=True)
class NoiseEstimate:
    """One trial's noise scale and its parts (see the module docstring).

    ``grad_sq`` and ``trace`` are the means over ``steps`` steps of the per-step estimates of
    ``|G|^2`` and ``tr(Sigma)``; a study that pools trials should pool these, not the
    ratios. ``scale`` is None where ``grad_sq`` is not positive: the noise swamped the signal
    and the ratio means nothing; it is below zero where ``trace`` is (hardly any noise: the
    trace's estimate is then within its error of zero), kept as it is, not clipped.
    ``standard_error`` is the delta-method standard error of the ratio from batch means
    (`GradientNoiseScale.standard_error`), None with fewer than two blocks.
    """

    scale: float | None
    standard_error: float | None
    small_batch: int
    big_batch: int
    steps: int
    grad_sq: float
    trace: float


class GradientNoiseScale:
    """The simple estimator's state: the per-step estimates of ``|G|^2`` and ``tr(Sigma)``
    from squared gradient norms at ``small_batch`` and ``big_batch`` samples."""

    def __init__(self, small_batch: int, big_batch: int) -> None:
        if not 0 < small_batch < big_batch:
            raise ValueError(
                f"the two batch sizes must satisfy 0 < small < big, got {small_batch}, {big_batch}"
            )
        self.small_batch = small_batch
        self.big_batch = big_batch
        self._grad_sq: list[float] = []
        self._trace: list[float] = []

    @property
    def steps(self) -> int:
        return len(self._grad_sq)

    def update(self, small_sq: float, big_sq: float) -> None:
        """One step's squared norms: of a mean gradient over ``small_batch`` samples and of
        one over ``big_batch`` samples that include them (or not: independence is not
        needed, only the two expectations). A non-finite pair (an fp16 overflow) is
        skipped."""
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return
        b, big = self.small_batch, self.big_batch
        self._grad_sq.append((big * big_sq - b * small_sq) / (big - b))
        self._trace.append((small_sq - big_sq) / (1 / b - 1 / big))

    def estimate(self) -> NoiseEstimate | None:
        """The estimate over the steps so far, None before the first."""
        if not self._grad_sq:
            return None
        grad_sq = math.fsum(self._grad_sq) / self.steps
        trace = math.fsum(self._trace) / self.steps
        return NoiseEstimate(
            scale=trace / grad_sq if grad_sq > 0 else None,
            standard_error=self.standard_error(),
            small_batch=self.small_batch,
            big_batch=self.big_batch,
            steps=self.steps,
            grad_sq=grad_sq,
            trace=trace,
        )

    def standard_error(self) -> float | None:
        """The standard error of ``B_simple = mean(trace) / mean(grad_sq)``, by the delta
        method over batch means: the steps are cut into at most `MAX_BLOCKS` contiguous
        blocks, and the spread of ``trace_j - B_simple * grad_sq_j`` over the blocks (block
        means ``_j``, weighted by their steps) is the ratio's.

        What it covers: the sampling noise of the trial's batches, and the drift of the
        parameters over the run (a block late in training differs from an early one), so it
        is the uncertainty of this run's average, not of the noise scale at one point of
        training. With few blocks (a short trial) it is itself rough: about ``1/sqrt(2(K-1))``
        relative error for ``K`` blocks. None with fewer than two blocks or no positive
        ``|G|^2``.
        """
        steps = self.steps
        blocks = min(MAX_BLOCKS, steps)
        grad_sq = math.fsum(self._grad_sq) / steps if steps else 0.0
        if blocks < 2 or grad_sq <= 0:
            return None
        ratio = math.fsum(self._trace) / steps / grad_sq
        bounds = [round(i * steps / blocks) for i in range(blocks + 1)]
        total = 0.0
        for start, end in itertools.pairwise(bounds):
            residual = math.fsum(
                t - ratio * g
                for t, g in zip(self._trace[start:end], self._grad_sq[start:end], strict=True)
            )
            total += residual**2  # (n_j * mean residual_j)^2
        variance = total / steps**2 * blocks / (blocks - 1)
        return math.sqrt(variance) / grad_sq


def squared_grad_norm(parameters: Sequence[nn.Parameter]) -> torch.Tensor:
    """The squared L2 norm of all the parameters' gradients together, as a tensor on their
    device (reading it would synchronise a GPU every step: the values are read once, at the
    end of the run)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), device=parameters[0].device if parameters else None)
    norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
    return norm.detach().float() ** 2


def average_over_ranks(grads: Sequence[torch.Tensor], local_sq: torch.Tensor) -> torch.Tensor:
    """Average ``grads`` in place over the ranks of the default process group, as DDP's
    all-reduce would, and return the mean over the ranks of ``local_sq`` (each rank's squared
    norm of its own gradient, read before). The gradients go in buckets of at most
    `BUCKET_BYTES` (DDP's default size), so a large model needs no second copy of its whole
    gradient; a gradient larger than a bucket is reduced where it is."""
    import torch.distributed as dist

    world = dist.get_world_size()
    mean_sq = local_sq.detach().float().reshape(1).clone()
    dist.all_reduce(mean_sq)
    for bucket in _buckets(grads):
        if len(bucket) == 1:
            dist.all_reduce(bucket[0])
            bucket[0].div_(world)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return mean_sq[0] / world


def _buckets(grads: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` in order, cut into runs of one dtype and device of at most `BUCKET_BYTES`."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        last = buckets[-1][-1] if buckets else None
        if (
            last is None
            or size + nbytes > BUCKET_BYTES
            or (last.dtype, last.device) != (grad.dtype, grad.device)
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """``model``'s layers that normalise by batch statistics in training (BatchNorm and its
    kinds): splitting a batch changes their forward pass."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def has_batch_statistics(model: nn.Module) -> bool:
    return bool(batch_norms(model))


def side_batch(big_batch: int) -> int:
    """The samples of a side pass over a batch of ``big_batch``: a quarter of it (`SIDE_SHARE`),
    at least 2 (a BatchNorm layer needs two samples to normalise); half of a batch of under 8."""
    return big_batch // SIDE_SHARE if big_batch >= 2 * SIDE_SHARE else big_batch // 2


class NoiseProbe:
    """Collects squared gradient norms in the training loop, for `GradientNoiseScale`.

    ``big_batch`` is the trial's effective batch (a rank's, with ranks); only full batches are
    measured (an epoch's or the budget's last, shorter one is not), so both sizes are the same
    on every measured step. ``ranks`` above 1: the rank's batch is the small one and the
    node's the big one (`across`, see the module). Else ``micro_batch`` below ``big_batch``
    (accumulation): the first micro-batch's gradient is the small one. Equal to it: a measured
    batch is split in two halves (``split``), the first half the small one. ``every``: measure
    every that many full batches (1: all).

    The norms stay tensors on the device until `estimate`, so measuring adds no device
    synchronisation to a step; with fp16 gradient scaling the scale is read (a sync the
    scaler's step makes anyway) to unscale them.
    """

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        big_batch: int,
        micro_batch: int,
        *,
        every: int = 1,
        scaler: torch.amp.GradScaler | None = None,
        side: Sequence[nn.Module] | None = None,
        ranks: int = 1,
    ) -> None:
        self.across = ranks > 1
        # ``side``: the model's BatchNorm layers, measured by a side pass (see the module).
        self.side = side is not None and micro_batch == big_batch and not self.across
        self._batch_norms = list(side or ()) if self.side else []
        self.split = micro_batch == big_batch and not self.side and not self.across
        self._full = big_batch
        if self.across:
            small, big = big_batch, big_batch * ranks
        elif self.side:
            small, big = side_batch(big_batch), big_batch
        else:
            small = big_batch // 2 if micro_batch == big_batch else micro_batch
            big = big_batch
        if small < 1:
            raise ValueError(f"a batch of {big_batch} cannot be split for the noise scale")
        self._parameters = list(parameters)
        self._estimator = GradientNoiseScale(small, big)
        self._every = every
        self._scaler = scaler
        self._full_batches = 0
        self._measuring = False
        self._small: list[torch.Tensor] = []
        self._big: list[torch.Tensor] = []

    @property
    def small_batch(self) -> int:
        return self._estimator.small_batch

    def begin(self, batch_samples: int) -> None:
        """An effective batch of ``batch_samples`` begins: measured when it is full and its
        turn has come."""
        self._measuring = False
        if batch_samples == self._full:
            self._full_batches += 1
            # The last of every ``every`` full batches: never the trial's first one, whose
            # loss is the untrained model's and whose forward a model may remember.
            self._measuring = self._full_batches % self._every == 0

    @property
    def reduces(self) -> bool:
        """Whether this batch's gradients are the probe's to all-reduce (`across`): DDP must
        not, so its stepping backward runs under ``no_sync()``."""
        return self.across and self._measuring

    def split_at(self, n: int) -> int | None:
        """Where to cut a loader batch of ``n`` samples for the measurement (None: train it
        whole)."""
        if self.split and self._measuring and n == self._estimator.big_batch:
            return self.small_batch
        return None

    def small(self, samples: int, weight: float) -> None:
        """After the backward pass of the effective batch's first piece, of ``samples``
        samples, whose mean loss was scaled by ``weight`` (its share of the batch)."""
        if self.side or self.across:
            return  # the small gradient comes from the side pass, or from the rank's batch
        if not self._measuring or samples != self.small_batch:
            self._measuring = False  # a piece of another size: not this step
            return
        self._small.append(self._unscaled(squared_grad_norm(self._parameters)) / weight**2)

    def big(self) -> None:
        """After the last backward pass of the effective batch, before the optimizer step
        (with ranks, on every rank: the probe's all-reduce is a collective)."""
        if self.reduces:
            self._measuring = False
            grads = [p.grad for p in self._parameters if p.grad is not None]
            local = squared_grad_norm(self._parameters)
            self._small.append(self._unscaled(average_over_ranks(grads, local)))
            self._big.append(self._unscaled(squared_grad_norm(self._parameters)))
            return
        if self._measuring and (self.side or len(self._big) < len(self._small)):
            self._big.append(self._unscaled(squared_grad_norm(self._parameters)))
            if self.side:
                return  # measuring until the side pass
        self._measuring = False

    @property
    def side_due(self) -> bool:
        """Whether the batch just trained wants its side pass (`side_pass`)."""
        return self.side and self._measuring and len(self._small) < len(self._big)

    def side_pass(self, loss_of_head: Any, backward: Any) -> None:
        """The small gradient of a side pass: ``backward(loss_of_head())`` over the batch's
        first `side_batch` samples, everything it changed put back (see the module docstring)."""
        self._measuring = False
        grads = [p.grad for p in self._parameters]
        buffers = [
            {name: b.clone() for name, b in m.named_buffers(recurse=False)}
            for m in self._batch_norms
        ]
        cpu_rng = torch.random.get_rng_state()
        cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        cuda_rng = torch.cuda.get_rng_state_all() if cuda else None
        try:
            for parameter in self._parameters:
                parameter.grad = None
            backward(loss_of_head())
            self._small.append(self._unscaled(squared_grad_norm(self._parameters)))
        finally:
            for parameter, grad in zip(self._parameters, grads, strict=True):
                parameter.grad = grad
            with torch.no_grad():
                for module, saved in zip(self._batch_norms, buffers, strict=True):
                    for name, value in saved.items():
                        getattr(module, name).copy_(value)
            torch.random.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            if len(self._big) > len(self._small):
                self._big.pop()  # the side pass failed: the pair is dropped

    def _unscaled(self, squared: torch.Tensor) -> torch.Tensor:
        if self._scaler is None:
            return squared
        return squared / self._scaler.get_scale() ** 2

    def estimate(self) -> NoiseEstimate | None:
        """The trial's estimate from what was collected (one device read), None when no
        step was measured."""
        pairs = min(len(self._small), len(self._big))
        if pairs == 0:
            return None
        values: list[Any] = torch.stack(
            [torch.stack(self._small[:pairs]), torch.stack(self._big[:pairs])]
        ).tolist()
        for small_sq, big_sq in zip(values[0], values[1], strict=True):
            self._estimator.update(float(small_sq), float(big_sq))
        del self._small[:pairs], self._big[:pairs]  # fed once: a second call adds nothing
        return self._estimator.estimate()


def noise_fields(estimate: NoiseEstimate | None) -> dict[str, Any]:
    """`TrialResult`'s noise-scale fields for ``estimate`` (all None when not measured)."""
    if estimate is None:
        return {}
    return {
        "gradient_noise_scale": estimate.scale,
        "gradient_noise_scale_se": estimate.standard_error,
        "noise_small_batch": estimate.small_batch,
        "noise_big_batch": estimate.big_batch,
        "noise_steps": estimate.steps,
        "noise_grad_sq": estimate.grad_sq,
        "noise_trace": estimate.trace,
    }
