"""The gradient noise scale a trial measures in its own loop (loader_search.trial._noise):
real training runs, checked against a noise scale computed exactly.

Run as a module (``python -m tests.test_noise [rounds]``) it measures what the probe costs on
the quickstart workload instead (see `measure_cost`); ``python -m tests.test_noise ranks
[rounds]``, what it costs a 2-rank trial (`measure_ranks_cost`); ``python -m tests.test_noise
side``, what a side pass costs a step over a quarter and over half of the batch
(`measure_side_shares`)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import loader_search.trial._noise as noise_module
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.trial import TrialResult, run_trial
from loader_search.trial._noise import (
    BUCKET_BYTES,
    RANKS_EVERY,
    SIDE_EVERY,
    SIDE_SHARE,
    SPLIT_EVERY,
    GradientNoiseScale,
    side_batch,
)
from loader_search.workloads import Workload, load_workload
from tests.plugins.least_squares import least_squares

BATCH = 64


def test_the_estimators_formulas_give_back_a_known_split() -> None:
    # Squared norms at their expectations, |G|^2 + tr(Sigma)/B, give |G|^2 and tr(Sigma)
    # back exactly, whatever the two sizes.
    grad_sq, trace = 2.0, 300.0
    for small, big in ((16, 64), (32, 64), (1, 3)):
        estimator = GradientNoiseScale(small, big)
        for _ in range(3):
            estimator.update(grad_sq + trace / small, grad_sq + trace / big)
        estimate = estimator.estimate()
        assert estimate is not None and estimate.steps == 3
        assert estimate.grad_sq == pytest.approx(grad_sq)
        assert estimate.trace == pytest.approx(trace)
        assert estimate.scale == pytest.approx(trace / grad_sq)
        assert estimate.standard_error == pytest.approx(0.0, abs=1e-6)
    # Noise swamping the signal: a negative mean |G|^2 has no ratio.
    swamped = GradientNoiseScale(32, 64)
    swamped.update(1.0, 0.4)
    swamped.update(1.0, 0.4)
    estimate = swamped.estimate()
    assert estimate is not None and estimate.grad_sq == pytest.approx(-0.2)
    assert estimate.scale is None and estimate.standard_error is None
    # Hardly any noise: the trace's estimate may come out below zero, and so the ratio (kept:
    # it is within its error of zero, and a study pools the parts, not the ratios).
    quiet = GradientNoiseScale(32, 64)
    quiet.update(1.0, 1.2)
    estimate = quiet.estimate()
    assert estimate is not None and estimate.scale is not None and estimate.scale < 0
    # A pair with an fp16 overflow is left out.
    quiet.update(float("inf"), 1.0)
    assert quiet.steps == 1
    assert GradientNoiseScale(32, 64).estimate() is None  # no step, no estimate
    with pytest.raises(ValueError, match="0 < small < big"):
        GradientNoiseScale(64, 64)


@pytest.mark.parametrize(
    ("accumulation_steps", "small", "every"),
    [(1, BATCH // 2, SPLIT_EVERY), (4, BATCH // 4, 1)],
    ids=["split-in-two", "accumulated-micro-batches"],
)
def test_a_trial_recovers_the_exact_noise_scale_of_least_squares(
    accumulation_steps: int, small: int, every: int
) -> None:
    workload, target = least_squares()
    assert 50 < target < 200  # the regime it is for: B_noise of the order of the batch
    steps = 1000 * every  # a split batch is measured one in SPLIT_EVERY
    result = run_trial(
        workload,
        LoaderParams(batch_size=BATCH, accumulation_steps=accumulation_steps),
        TrainingSettings(train_samples=steps * BATCH, batch_size=BATCH, warmup_batches=1),
    )
    assert result.noise_small_batch == small and result.noise_big_batch == BATCH
    assert result.noise_steps == 1000  # N is a multiple of the batch: every batch is full
    scale, error = result.gradient_noise_scale, result.gradient_noise_scale_se
    assert scale is not None and error is not None
    # The standard error is tight enough to mean something (about 6% here), and it covers
    # the truth at 3 standard errors: a wrong weight, a swapped size or a missing unscaling
    # of the micro-batch's gradient moves the estimate by 25% or more.
    assert error < 0.1 * target
    assert abs(scale - target) < 3 * error
    assert result.noise_trace is not None and result.noise_grad_sq is not None
    assert result.noise_trace / result.noise_grad_sq == pytest.approx(scale)


def _two_ranks(workload: Workload, samples: int, *, measure: bool = True) -> TrialResult:
    """A 2-rank trial (gloo, this CPU) of ``workload``: batches of BATCH per rank, this
    process rank 0 (a trial's own process is, under the supervisor)."""
    settings = TrainingSettings(
        train_samples=samples, batch_size=BATCH, ranks=2, warmup_batches=1, lr_scaling="none"
    )
    params = LoaderParams(batch_size=BATCH, torch_threads=1)
    result = run_trial(workload, params, settings, measure_noise=measure)
    assert result.ranks == 2
    return result


def test_a_two_rank_trial_recovers_the_exact_noise_scale_from_its_ranks() -> None:
    # A rank's gradient is its own batch's (64), the all-reduced one the node's (128): each
    # rank's batch is a uniform draw without replacement (DistributedSampler's shuffled
    # share), the node's the union of two disjoint ones, so the least-squares target holds.
    workload, target = least_squares()
    measured = 150
    result = _two_ranks(workload, measured * RANKS_EVERY * 2 * BATCH)
    assert result.noise_small_batch == BATCH and result.noise_big_batch == 2 * BATCH
    assert result.noise_steps == measured
    scale, error = result.gradient_noise_scale, result.gradient_noise_scale_se
    assert scale is not None and error is not None
    # The small norm is the two ranks' mean: tighter than one process's over as many steps
    # (measured: 3.2% over 400 steps, against 6% over 1000 for one process).
    assert error < 0.1 * target
    assert abs(scale - target) < 3 * error


@pytest.mark.parametrize("bucket", [BUCKET_BYTES, 150], ids=["one-bucket", "three-buckets"])
def test_measuring_across_ranks_leaves_a_two_rank_run_unchanged(
    bucket: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a measured step the probe, not DDP, averages the gradients: the update is the same,
    # so the run is (momentum SGD over 12 epochs would let any difference grow). With buckets
    # of 150 bytes, the classifier's 512-, 64-, 128- and 8-byte gradients go as three: the
    # first two alone (reduced in place), the last two flattened together.
    monkeypatch.setattr(noise_module, "BUCKET_BYTES", bucket)  # rank 1 forks from here
    shapes = [[16, 8], [16], [2, 16], [2]]
    buckets = noise_module._buckets([torch.zeros(shape) for shape in shapes])
    assert [len(b) for b in buckets] == ([4] if bucket == BUCKET_BYTES else [1, 1, 2])
    workload = _linear_classifier()
    on = _two_ranks(workload, 6000)
    off = _two_ranks(workload, 6000, measure=False)
    assert on.val_loss is not None and off.val_loss is not None
    assert on.val_loss == pytest.approx(off.val_loss, rel=1e-5)
    assert on.final_train_loss == pytest.approx(off.final_train_loss, rel=1e-5)
    assert off.noise_steps is None
    # 3000 samples a rank: 46 full batches of 64 (the last, 56, is short); every 8th.
    assert on.noise_steps == 46 // RANKS_EVERY and on.noise_big_batch == 2 * BATCH


def _linear_classifier() -> Workload:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = (x[:, 0] + 0.5 * torch.randn(512, generator=generator) > 0).long()
    return Workload(
        name="linear",
        train_dataset=TensorDataset(x, y),
        val_dataset=TensorDataset(x[:128], y[:128]),
        make_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
    )


def _on_and_off(workload: Workload, samples: int) -> tuple[TrialResult, TrialResult]:
    """The same trial with the noise probe and without; their training must be the same."""
    settings = TrainingSettings(train_samples=samples, batch_size=BATCH, warmup_batches=1)
    params = LoaderParams(batch_size=BATCH)
    on = run_trial(workload, params, settings)
    off = run_trial(workload, params, settings, measure_noise=False)
    assert on.val_loss is not None and off.val_loss is not None
    assert on.val_loss == pytest.approx(off.val_loss, rel=1e-5)
    assert on.final_train_loss == pytest.approx(off.final_train_loss, rel=1e-5)
    return on, off


def test_splitting_batches_to_measure_leaves_training_unchanged() -> None:
    # A model that treats samples independently: the halves' weighted gradients sum to the
    # batch's, so the run is the same up to floating point (with momentum SGD and 12 epochs,
    # any difference in the update would grow).
    on, off = _on_and_off(_linear_classifier(), 6000)
    assert on.untrained_loss == pytest.approx(off.untrained_loss, rel=1e-6)
    assert off.gradient_noise_scale is None and off.noise_steps is None
    # 512 samples = 8 full batches an epoch; the run's last batch (6000 = 93 x 64 + 48) is
    # short and not measured; of the 93 full ones, the last of every SPLIT_EVERY (never the
    # first: the untrained model's loss is read from it whole).
    assert on.noise_steps == 93 // SPLIT_EVERY and on.noise_small_batch == BATCH // 2
    # Trained to convergence, the mean gradient is within its noise of zero (the mean |G|^2
    # came out negative here): the parts are stored, the ratio is not.
    assert "noise_trace" in on.user_attrs() and "noise_steps" not in off.user_attrs()


def _images_noise(seed: int, accumulation_steps: int) -> TrialResult:
    workload = load_workload("synthetic-images", {"train_size": 4096, "val_size": 1024})
    params = LoaderParams(batch_size=BATCH, accumulation_steps=accumulation_steps)
    return run_trial(workload, params, TrainingSettings(seed=seed))


def test_a_batchnorm_model_is_measured_by_a_side_pass_that_leaves_training_unchanged() -> None:
    # The quickstart's CNN has BatchNorm (and here dropout: the random state is restored
    # too). Split in two, each half would be normalised by its own statistics: a different
    # run. A side pass over a quarter of every SIDE_EVERY-th batch, with the batch's gradient,
    # the running statistics and the random state put back, leaves the run as it was.
    workload = load_workload("synthetic-images", {"train_size": 1024, "val_size": 256})
    make_model = workload.make_model

    def with_dropout() -> nn.Module:
        return nn.Sequential(nn.Dropout(0.1), make_model())

    on, off = _on_and_off(replace(workload, make_model=with_dropout), 2048)
    assert off.noise_steps is None
    # 2048 samples = 32 full batches of 64; the last of every SIDE_EVERY is measured.
    assert on.noise_steps == 32 // SIDE_EVERY and on.noise_small_batch == side_batch(BATCH)
    assert on.noise_trace is not None and on.noise_grad_sq is not None


def test_a_side_pass_trains_a_quarter_of_the_batch_and_half_of_one_under_8() -> None:
    # A quarter cost a step 1.34-1.42x where a half cost 1.56-1.60x (`python -m
    # tests.test_noise side`); below 8 samples a quarter would leave BatchNorm under two.
    assert [side_batch(b) for b in (256, 64, 8, 7, 4)] == [64, 16, 2, 3, 2]


def test_synthetic_images_noise_scale_is_stable_across_seeds() -> None:
    # Trained as 2 x 32 micro-batches the quickstart's CNN is measured on every batch, from
    # the micro-batches it trains anyway; whole, by a side pass on every SIDE_EVERY-th.
    whole = _images_noise(0, 1)
    assert whole.noise_steps == 128 // SIDE_EVERY and whole.noise_small_batch == side_batch(BATCH)
    scales = []
    for seed in (0, 1):
        result = _images_noise(seed, 2)
        scale, error = result.gradient_noise_scale, result.gradient_noise_scale_se
        assert scale is not None and error is not None and math.isfinite(scale)
        assert result.noise_steps == 128 and result.noise_small_batch == BATCH // 2
        # Positive, and of the order of the batch sizes a study tries (measured: 125 and 155).
        assert 10 < scale < 2000
        assert 0 < error < scale
        scales.append(scale)
    # "Stable" here: the two seeds' figures within a factor of 2 of each other (the standard
    # errors are about 20-25% each, the seeds differ in initial weights and order).
    assert max(scales) / min(scales) < 2


class _QuickstartSteps:
    """The quickstart's step on pre-decoded batches of 64 (one torch thread), for timing the
    probe's ways of measuring step by step, the loader left out."""

    def __init__(self) -> None:
        from torch.utils.data import DataLoader

        from loader_search.trial._step import Step

        torch.set_num_threads(1)
        workload = load_workload("synthetic-images", {"train_size": 4096, "val_size": 1024})
        loader = DataLoader(workload.train_dataset, batch_size=BATCH)
        self.batches = [batch for _, batch in zip(range(16), loader, strict=False)]
        torch.manual_seed(0)
        self.model = workload.make_model()
        self.step = Step(workload, TrainingSettings(), self.model, torch.device("cpu"))
        self.optimizer = workload.make_optimizer(self.model.parameters(), workload.base_lr)
        self.parameters = list(self.model.parameters())

    def medians(
        self, ways: list[str], one: Any, repeats: int, steps: int, warmup: int
    ) -> Iterator[dict[str, float]]:
        """Per repeat, each way's median step time: ``one(way, batch)`` run ``steps`` times a
        way, the ways in turn, each after each other (a busy machine slows them all alike)."""
        for index in range(warmup * len(ways)):
            one(ways[index % len(ways)], self.batches[index % len(self.batches)])
        for _ in range(repeats):
            times: dict[str, list[float]] = {way: [] for way in ways}
            for index in range(steps * len(ways)):
                way = ways[(index + index // len(ways)) % len(ways)]
                began = time.perf_counter()
                one(way, self.batches[index % len(self.batches)])
                times[way].append(time.perf_counter() - began)
            yield {way: statistics.median(values) for way, values in times.items()}


def _step_costs(repeats: int, steps: int) -> None:
    """The probe's cost per training step (`_QuickstartSteps`), five ways: off (the batch
    whole), split (two halves, norms read: what a measured step costs where the probe
    splits), side (this BatchNorm model's side pass), and as 2 x 32 micro-batches without
    and with the norms read (what it costs where it uses accumulation's micro-batches).
    Prints per repeat each way's median step time."""
    from loader_search.trial._noise import NoiseProbe, batch_norms
    from loader_search.trial._train import _backward

    bench = _QuickstartSteps()
    step, parameters, half = bench.step, bench.parameters, BATCH // 2
    whole, halves = LoaderParams(BATCH), LoaderParams(BATCH, accumulation_steps=2)

    def one(way: str, batch: object) -> None:
        bench.optimizer.zero_grad(set_to_none=True)
        probe = None
        if way in ("split", "2x32 on"):
            probe = NoiseProbe(parameters, BATCH, BATCH if way == "split" else half)
        if way == "side":  # this BatchNorm model's way: a side pass, here on every batch
            probe = NoiseProbe(parameters, BATCH, BATCH, side=batch_norms(bench.model))
        if probe is not None:
            probe.begin(BATCH)  # as `train` does where an effective batch begins
        if way in ("off", "split", "side"):
            _backward(step, batch, BATCH, BATCH, BATCH, whole, probe)
        else:
            head, tail = step.split(batch, half)
            _backward(step, head, half, BATCH, BATCH, halves, probe)
            _backward(step, tail, half, BATCH, half, halves, probe)
        bench.optimizer.step()
        if probe is not None:
            assert probe.estimate() is not None, way  # the step was measured

    ways = ["off", "split", "side", "2x32 off", "2x32 on"]
    for repeat, medians in enumerate(bench.medians(ways, one, repeats, steps, warmup=4)):
        print(
            f"repeat {repeat}: "
            + ", ".join(f"{way} {1000 * value:.2f} ms" for way, value in medians.items())
            + f"; split/off {medians['split'] / medians['off']:.3f},"
            f" side/off {medians['side'] / medians['off']:.3f} (every {SIDE_EVERY}th batch:"
            f" {1 + (medians['side'] / medians['off'] - 1) / SIDE_EVERY:.3f}),"
            f" 2x32 on/off {medians['2x32 on'] / medians['2x32 off']:.3f}",
            flush=True,
        )


def measure_side_shares(repeats: int, steps: int) -> None:
    """What a side pass costs a step (`_QuickstartSteps`) over a quarter of the batch
    (`SIDE_SHARE`) and over half of it: three ways (off, half, quarter). Prints per repeat
    each way's median step time and the two ratios to off."""
    from loader_search.trial._noise import NoiseProbe, batch_norms
    from loader_search.trial._train import _backward

    bench = _QuickstartSteps()
    whole, share = LoaderParams(BATCH), SIDE_SHARE
    shares = {"off": 0, "half": 2, "quarter": 4}

    def one(way: str, batch: object) -> None:
        bench.optimizer.zero_grad(set_to_none=True)
        probe = None
        if shares[way]:
            noise_module.SIDE_SHARE = shares[way]
            probe = NoiseProbe(bench.parameters, BATCH, BATCH, side=batch_norms(bench.model))
            noise_module.SIDE_SHARE = share
            probe.begin(BATCH)
        _backward(bench.step, batch, BATCH, BATCH, BATCH, whole, probe)
        bench.optimizer.step()
        if probe is not None:
            assert probe.estimate() is not None, way

    for repeat, medians in enumerate(bench.medians(list(shares), one, repeats, steps, 10)):
        print(
            f"repeat {repeat}: "
            + ", ".join(f"{way} {1000 * value:.2f} ms" for way, value in medians.items())
            + f"; half/off {medians['half'] / medians['off']:.3f}, quarter/off"
            f" {medians['quarter'] / medians['off']:.3f} (every {SIDE_EVERY}th batch:"
            f" {1 + (medians['quarter'] / medians['off'] - 1) / SIDE_EVERY:.3f})",
            flush=True,
        )


def measure_cost(rounds: int) -> None:
    """Throughput of quickstart trials (synthetic-images, 4096 training images, batch 64,
    default training settings) with the probe on and off, interleaved in one process, for
    num_workers 0 and 1: off (whole batches); "side", this BatchNorm model's way (a side pass
    over a quarter of every 16th batch); the batch split in two with the norms read (what the
    probe costs where it splits: forced here on this BatchNorm model, which the probe does
    not split); and 2 x 32 accumulation without and with the probe (the cost of the norms
    alone). Prints each reading, then per pair the medians, ranges and the median of the
    paired on/off ratios."""
    import loader_search.trial._run as run_module

    workload = load_workload("synthetic-images", {"train_size": 4096, "val_size": 1024})
    # The split of a BatchNorm model, forced by replacing the rule's test in the run module
    # for the "split" readings: what the split costs does not depend on the model's layers.
    rules = run_module.__dict__
    real = rules["batch_norms"]
    ways = ((1, "side"), (1, "split"), (2, "on"))
    pairs = [(workers, acc, on) for workers in (0, 1) for acc, on in ways]
    # (workers, accumulation, the way it is paired with, the way it ran): its readings.
    readings: dict[tuple[int, int, str, str], list[float]] = {}
    for index in range(rounds):
        for workers, acc, on_mode in pairs:
            # Each pair back to back, in turn off first and on first: what the trial before
            # leaves behind (its workers exiting, its memory) falls on both alike.
            modes = ("off", on_mode) if index % 2 == 0 else (on_mode, "off")
            for mode in modes:
                rules["batch_norms"] = (lambda _: []) if mode == "split" else real
                params = LoaderParams(
                    batch_size=BATCH,
                    num_workers=workers,
                    prefetch_factor=2 if workers else None,
                    accumulation_steps=acc,
                )
                result = run_trial(
                    workload, params, TrainingSettings(), measure_noise=mode != "off"
                )
                throughput = result.throughput_samples_per_s
                readings.setdefault((workers, acc, on_mode, mode), []).append(throughput)
                print(index, (workers, acc, mode), round(throughput), flush=True)
    rules["batch_norms"] = real
    for workers in (0, 1):
        for acc, on_mode in ways:
            off = readings[(workers, acc, on_mode, "off")]
            on = readings[(workers, acc, on_mode, on_mode)]
            ratios = [b / a for a, b in zip(off, on, strict=True)]
            print(
                f"workers={workers} accumulation={acc}: off {statistics.median(off):.0f}"
                f" [{min(off):.0f}-{max(off):.0f}], {on_mode} {statistics.median(on):.0f}"
                f" [{min(on):.0f}-{max(on):.0f}] samples/s; paired {on_mode}/off median"
                f" {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
            )


def measure_ranks_cost(rounds: int) -> None:
    """Throughput of 2-rank quickstart trials (gloo, one torch thread a rank, no loader
    workers) with the probe on (its own all-reduce every RANKS_EVERY-th batch) and off, each
    pair back to back, in turn off first and on first. Prints each reading, the medians and
    the median of the paired on/off ratios."""
    workload = load_workload("synthetic-images", {"train_size": 4096, "val_size": 1024})
    params = LoaderParams(batch_size=BATCH, torch_threads=1)
    settings = TrainingSettings(ranks=2)
    readings: dict[bool, list[float]] = {True: [], False: []}
    for index in range(rounds):
        for on in (False, True) if index % 2 == 0 else (True, False):
            result = run_trial(workload, params, settings, measure_noise=on)
            readings[on].append(result.throughput_samples_per_s)
            print(index, "on" if on else "off", round(readings[on][-1]), result.noise_steps)
    off, on = readings[False], readings[True]
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    print(
        f"2 ranks: off {statistics.median(off):.0f} [{min(off):.0f}-{max(off):.0f}], on"
        f" {statistics.median(on):.0f} [{min(on):.0f}-{max(on):.0f}] samples/s; paired on/off"
        f" median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["ranks"]:  # python -m tests.test_noise ranks [rounds]
        measure_ranks_cost(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    elif sys.argv[1:2] == ["side"]:  # python -m tests.test_noise side
        measure_side_shares(repeats=5, steps=100)
    else:
        _step_costs(repeats=5, steps=100)
        measure_cost(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
