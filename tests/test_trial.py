from __future__ import annotations

import math

import pytest

from loader_search.errors import TrainingDiverged
from loader_search.params import LoaderParams, RunPlan, TrainingSettings, scaled_lr
from loader_search.trial._run import (
    BATCHES_PAST_EPOCH,
    run_trial,
    short_run_samples,
    warmup_batches,
)
from loader_search.workloads import Workload
from tests._datasets import timed_workload

SETTINGS = TrainingSettings(train_samples=512, batch_size=16, eval_batch_size=64)


def test_real_training_run_is_measured(tiny_workload: Workload) -> None:
    params = LoaderParams(16, num_workers=1, prefetch_factor=2, torch_threads=1)
    result = run_trial(tiny_workload, params, SETTINGS)
    assert math.isfinite(result.throughput_samples_per_s) and result.throughput_samples_per_s > 0
    assert math.isfinite(result.val_loss) and result.val_loss > 0
    assert 0.0 <= result.data_wait_fraction <= 1.0
    assert result.time_to_first_batch_s > 0
    assert result.peak_host_rss_bytes > 50 * 2**20
    assert result.peak_gpu_bytes is None
    assert result.warmup_batches == 1 * 2 + SETTINGS.warmup_batches
    assert result.epochs == 2  # 512 samples of a 256-sample set
    assert result.val_accuracy is not None and 0 <= result.val_accuracy <= 1
    attrs = result.user_attrs()
    assert attrs["throughput_samples_per_s"] == result.throughput_samples_per_s
    assert {"val_loss", "data_wait_fraction", "peak_host_rss_bytes"} <= attrs.keys()
    # Training allocates every batch: its process faults some pages in the window.
    assert isinstance(attrs["window_minor_faults"], int) and attrs["window_minor_faults"] >= 0


@pytest.mark.parametrize("batch_size", [16, 24, 32])
def test_budget_is_the_same_for_every_batch_size(tiny_workload: Workload, batch_size: int) -> None:
    params = LoaderParams(batch_size, torch_threads=1)
    result = run_trial(tiny_workload, params, SETTINGS)
    warmup_samples = result.warmup_batches * batch_size
    assert result.measured_samples + warmup_samples == SETTINGS.train_samples
    assert result.lr == pytest.approx(scaled_lr(0.02, batch_size, 16, "sqrt"))


def test_measurement_excludes_slow_start() -> None:
    workload = timed_workload(n=512, first_delay_s=0.5)
    result = run_trial(workload, LoaderParams(16, torch_threads=1), SETTINGS)
    assert result.time_to_first_batch_s >= 0.5
    # Had the window included the start, it would be at least 0.5 s long.
    assert result.measured_time_s < result.train_time_s - 0.45


def test_data_wait_fraction_sees_a_slow_loader() -> None:
    workload = timed_workload(n=512, delay_s=0.002)
    result = run_trial(workload, LoaderParams(16, torch_threads=1), SETTINGS)
    assert result.data_wait_fraction > 0.7


def test_loader_settings_do_not_change_what_the_model_learns(tiny_workload: Workload) -> None:
    plain = run_trial(tiny_workload, LoaderParams(16, torch_threads=1), SETTINGS)
    tuned = LoaderParams(16, 2, 3, persistent_workers=True, torch_threads=1)
    assert run_trial(tiny_workload, tuned, SETTINGS).val_loss == pytest.approx(
        plain.val_loss, rel=1e-6
    )


def test_prefetched_burst_is_warmup() -> None:
    assert warmup_batches(LoaderParams(8), 2) == 2
    assert warmup_batches(LoaderParams(8, 2, 3), 2) == 8


def test_lr_scaling() -> None:
    assert scaled_lr(0.1, 256, 64, "linear") == pytest.approx(0.4)
    assert scaled_lr(0.1, 256, 64, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 256, 64, "none") == pytest.approx(0.1)


def test_divergence_is_reported() -> None:
    settings = TrainingSettings(train_samples=512, batch_size=16, lr=1e30)
    with pytest.raises(TrainingDiverged, match="lower the learning rate"):
        run_trial(timed_workload(), LoaderParams(16, torch_threads=1), settings)


def test_budget_too_small_to_measure(tiny_workload: Workload) -> None:
    settings = TrainingSettings(train_samples=64, batch_size=16)
    with pytest.raises(ValueError, match="raise train_samples"):
        run_trial(tiny_workload, LoaderParams(16, 2, 4, torch_threads=1), settings)


def test_throughput_is_read_at_the_mark_past_the_first_epoch(tiny_workload: Workload) -> None:
    params = LoaderParams(16, num_workers=1, prefetch_factor=2, torch_threads=1)
    # 512 samples of a 256-sample set: the mark is 4 batches into the second epoch, where
    # non-persistent workers restart (half the budget would stop right before it).
    short = short_run_samples(params, SETTINGS, 256)
    assert short == 256 + BATCHES_PAST_EPOCH * 16
    result = run_trial(tiny_workload, params, SETTINGS, plan=RunPlan(short_samples=short))
    assert result.short_samples == short and not result.stopped_early
    # The objective's window ends at the mark, as a shortened trial's does ...
    assert result.measured_samples + result.warmup_batches * 16 == short
    assert result.throughput_samples_per_s > 0
    # ... while training goes on to the whole budget, read over its whole window too.
    assert result.train_samples == SETTINGS.train_samples
    assert result.full_window_throughput_samples_per_s is not None
    assert result.full_window_throughput_samples_per_s > 0
    assert result.short_train_time_s is not None
    assert 0 < result.short_train_time_s < result.train_time_s
    assert result.val_loss is not None  # the full run still evaluates
    assert result.ceiling_samples_per_s is None  # not asked for


def test_stopping_early_skips_the_rest_and_scores_no_evaluation(tiny_workload: Workload) -> None:
    params = LoaderParams(16, torch_threads=1)
    short = short_run_samples(params, SETTINGS, 256)
    plan = RunPlan(short_samples=short, stop_early=True, measure_ceiling=True)
    result = run_trial(tiny_workload, params, SETTINGS, plan=plan)
    assert result.stopped_early
    assert result.train_samples == short < SETTINGS.train_samples
    assert result.val_loss is None and result.val_accuracy is None
    # One evaluation batch ran, unscored, so that its memory is known (issue 17).
    assert result.eval_time_s > 0.0
    assert "val_loss" not in result.user_attrs()  # never stored as if measured
    # The window ends at the stop: the same window as a full trial's.
    assert result.measured_samples + result.warmup_batches * 16 == short
    assert result.full_window_throughput_samples_per_s is None
    # The ceiling: the same model on pre-decoded batches, faster than decoding PNGs per sample.
    assert result.ceiling_samples_per_s is not None
    assert result.ceiling_samples_per_s > result.throughput_samples_per_s


def test_a_short_run_is_never_too_short_to_measure() -> None:
    params = LoaderParams(32, num_workers=2, prefetch_factor=4, torch_threads=1)
    settings = TrainingSettings(train_samples=8192, batch_size=32)
    # No epoch boundary (a huge data set): half the budget...
    assert short_run_samples(params, settings, None) == 4096
    # ... but never fewer than the warm-up (2 x 4 + 2) plus 8 measured batches.
    tiny_budget = TrainingSettings(train_samples=18 * 32, batch_size=32)
    assert short_run_samples(params, tiny_budget, None) == 18 * 32
    with pytest.raises(ValueError, match="stop_early needs short_samples"):
        RunPlan(stop_early=True)
