from __future__ import annotations

import math

import pytest

from loader_search.errors import TrainingDiverged
from loader_search.params import LoaderParams, TrainingSettings, scaled_lr
from loader_search.trial import run_trial, warmup_batches
from loader_search.workloads import Workload
from tests._datasets import timed_workload

SETTINGS = TrainingSettings(train_samples=512, base_batch_size=16, eval_batch_size=64)


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
    settings = TrainingSettings(train_samples=512, base_batch_size=16, lr=1e30)
    with pytest.raises(TrainingDiverged, match="lower the learning rate"):
        run_trial(timed_workload(), LoaderParams(16, torch_threads=1), settings)


def test_budget_too_small_to_measure(tiny_workload: Workload) -> None:
    settings = TrainingSettings(train_samples=64, base_batch_size=16)
    with pytest.raises(ValueError, match="raise train_samples"):
        run_trial(tiny_workload, LoaderParams(16, 2, 4, torch_threads=1), settings)
