"""Gradient accumulation: a batch that does not fit is trained as micro-batches that do, with
the whole batch's update. Real training runs, a real memory limit (``RLIMIT_AS`` in the trial
process, so torch's CPU allocator really fails), real studies on SQLite."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optuna
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search import SearchSpace, StudyConfig, TrainingSettings, run_study
from loader_search._snippets import dataloader_snippet
from loader_search.params import LoaderParams, RunPlan
from loader_search.study import CpuRange, SamplerConfig, stored_params
from loader_search.study.config import parse_config
from loader_search.study.work._plan import fit_in_memory
from loader_search.trial import TrialJob, run_isolated, run_trial
from loader_search.workloads import Workload
from tests._datasets import activation_hungry

# ActivationHungry with width 2**17 holds about 1.5 MB per sample: under 400 MB of headroom a
# batch of 128 fits and one of 256 fails in the allocator (measured: peak RSS 659 MB at 256
# without the limit, 481 MB as 2 x 128, 402 MB as 4 x 64).
WIDTH = 2**17
HEADROOM_MB = 400


def test_params_separate_the_batch_from_the_micro_batch() -> None:
    params = LoaderParams(batch_size=256, num_workers=2, prefetch_factor=2, accumulation_steps=4)
    assert params.micro_batch_size == 64
    assert params.loader_kwargs()["batch_size"] == 64  # what the DataLoader gets
    assert params.describe().startswith("batch=256 (4x64) workers=2")
    assert LoaderParams.from_dict(params.as_dict()) == params
    plain = LoaderParams(batch_size=256)
    assert "accumulation_steps" not in plain.as_dict()  # stored as before accumulation existed
    assert LoaderParams.from_dict({"batch_size": 256}).accumulation_steps == 1
    with pytest.raises(ValueError, match="accumulation_steps must divide batch_size 96"):
        LoaderParams(batch_size=96, accumulation_steps=5)


def test_the_snippet_gives_the_micro_batch_loader_and_the_loop() -> None:
    snippet = dataloader_snippet(LoaderParams(batch_size=256, accumulation_steps=4))
    assert "batch_size=64," in snippet and "batch_size=256" not in snippet.split("# batch")[0]
    assert "accumulation_steps = 4" in snippet and "BatchNorm" in snippet
    loop = snippet[snippet.index("for i, (inputs, targets)") :]
    assert loop.index("loss.backward()") < loop.index("optimizer.step()")
    assert "if (i + 1) % accumulation_steps == 0:" in loop
    assert "accumulation" not in dataloader_snippet(LoaderParams(batch_size=256))


def _linear_workload() -> Workload:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=generator)
    y = (x.sum(1) > 0).long()
    return Workload(
        name="linear",
        train_dataset=TensorDataset(x, y),
        val_dataset=TensorDataset(x[:64], y[:64]),
        make_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
    )


def test_accumulated_micro_batches_make_the_whole_batchs_update() -> None:
    # 200 samples, batch 32: every epoch ends with a batch of 8, which the micro-batches must
    # cut the same way; 500 samples end mid-epoch with a partial batch too.
    workload = _linear_workload()
    settings = TrainingSettings(train_samples=500, batch_size=32, warmup_batches=1)
    whole = run_trial(workload, LoaderParams(batch_size=32), settings)
    assert whole.val_loss is not None
    for steps in (2, 4, 8):
        params = LoaderParams(
            batch_size=32, num_workers=1, prefetch_factor=2, accumulation_steps=steps
        )
        accumulated = run_trial(workload, params, settings)
        assert accumulated.val_loss == pytest.approx(whole.val_loss, rel=1e-5), steps
        assert accumulated.lr == whole.lr  # scaled for the batch, not the micro-batch


def test_a_stopped_early_trial_evaluates_one_batch_so_its_memory_is_known() -> None:
    # Training at 64 fits; the evaluation batch of 1024 does not. A trial that stops early
    # skipped evaluation and passed as feasible; now it runs one evaluation batch.
    workload = activation_hungry(width=WIDTH, headroom_mb=HEADROOM_MB, val_n=1024)
    settings = TrainingSettings(
        train_samples=2048, batch_size=64, warmup_batches=1, eval_batch_size=1024
    )
    plan = RunPlan(short_samples=1024, stop_early=True)
    outcome = run_isolated(TrialJob(workload, LoaderParams(batch_size=64), settings, plan=plan))
    assert outcome.failure is not None and outcome.failure.reason == "host_oom"
    settings = dataclasses.replace(settings, eval_batch_size=64)
    fits = run_isolated(TrialJob(workload, LoaderParams(batch_size=64), settings, plan=plan))
    assert fits.failure is None and fits.result is not None and fits.result.stopped_early


def _study(
    tmp_path: Path, name: str, headroom_mb: int, accumulation: str = "auto"
) -> optuna.Study:
    config = StudyConfig(
        name=name,
        trials=3,
        confirm_top=0,
        sampler=SamplerConfig(name="grid"),
        training=TrainingSettings(
            train_samples=4096,
            batch_size=64,
            lr=0.005,
            lr_scaling="none",
            warmup_batches=1,
            eval_batch_size=64,
            gradient_accumulation=accumulation,  # type: ignore[arg-type]
        ),
        space=SearchSpace(batch_sizes=(64, 128, 256), num_workers=CpuRange(0, 0), torch_threads=1),
    )
    storage = f"sqlite:///{tmp_path / f'{name}.db'}"
    workload = activation_hungry(width=WIDTH, headroom_mb=headroom_mb)
    run_study(config, workload=workload, storage=storage, quiet=True)
    return optuna.load_study(study_name=name, storage=storage)


def _by_batch(study: optuna.Study) -> dict[int, optuna.trial.FrozenTrial]:
    trials = {}
    for trial in study.trials:
        params = stored_params(trial)
        assert params is not None
        trials[params.batch_size] = trial
    return trials


@pytest.mark.slow
def test_a_batch_that_does_not_fit_is_measured_as_micro_batches(tmp_path: Path) -> None:
    limited = _by_batch(_study(tmp_path, "limited", HEADROOM_MB))
    free = _by_batch(_study(tmp_path, "free", 0))
    big = limited[256]
    assert big.state == optuna.trial.TrialState.COMPLETE and big.values[0] > 0
    attrs = big.user_attrs
    assert attrs["accumulation_steps"] == 2 and attrs["micro_batch_size"] == 128
    assert attrs["oom_attempts"] == [
        {"micro_batch_size": 256, "in_flight": 0, "reason": "host_oom"}
    ]
    assert attrs["loader_params"]["accumulation_steps"] == 2
    assert attrs["peak_host_rss_bytes"] > 0
    # Without the limit, batch 256 trains whole: the same validation loss (a linear model, no
    # BatchNorm: only the order of floating-point sums differs).
    whole = free[256]
    assert whole.user_attrs["accumulation_steps"] == 1 and "oom_attempts" not in whole.user_attrs
    assert big.values[1] == pytest.approx(whole.values[1], rel=1e-4)
    for batch in (64, 128):  # these fit: trained whole in both studies, the same loss
        assert limited[batch].user_attrs["accumulation_steps"] == 1
        assert limited[batch].values[1] == pytest.approx(free[batch].values[1], rel=1e-6)
    # What the study now knows: a later trial of batch 256 goes straight to 2 x 128.
    hardware = attrs["hardware_class"]
    trials = list(limited.values())
    fitted, source = fit_in_memory(trials, LoaderParams(batch_size=256), hardware)
    assert (fitted.accumulation_steps, source) == (2, big.number)
    assert fit_in_memory(trials, LoaderParams(batch_size=128), hardware) == (
        LoaderParams(batch_size=128),
        None,
    )


@pytest.mark.slow
def test_with_accumulation_off_a_batch_that_does_not_fit_is_infeasible(tmp_path: Path) -> None:
    big = _by_batch(_study(tmp_path, "off", HEADROOM_MB, accumulation="off"))[256]
    assert big.user_attrs["failure_reason"] == "host_oom"
    assert big.values == [0.0, float("inf")]  # infeasible: recorded, never recommended


def test_the_config_option_and_its_bad_values() -> None:
    assert parse_config({}).training.gradient_accumulation == "auto"
    config = parse_config({"training": {"gradient_accumulation": "off"}})
    assert config.training.gradient_accumulation == "off"
    with pytest.raises(Exception, match=r'training\.gradient_accumulation = "always": use one of'):
        parse_config({"training": {"gradient_accumulation": "always"}})


def test_the_stand_in_device_memory_refuses_training_batches_that_do_not_fit() -> None:
    from loader_search.workloads.synthetic_images import synthetic_images

    workload = synthetic_images(image_size=32, train_size=64, val_size=64, device_memory_mb=4)
    assert workload.options["device_memory_mb"] == 4
    model = workload.make_model()
    model.train()
    assert model(torch.randn(32, 3, 32, 32)).shape == (32, 10)  # 3.3 MB of activations
    with pytest.raises(torch.OutOfMemoryError, match=r"a batch of 64 keeps 6\.5 MiB"):
        model(torch.randn(64, 3, 32, 32))
    model.eval()  # evaluation keeps no activations for backward
    assert model(torch.randn(64, 3, 32, 32)).shape == (64, 10)
    assert "device_memory_mb" not in synthetic_images(train_size=64, val_size=64).options
