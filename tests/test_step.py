"""The user's real step (`loader_search.trial._step`, issue 25): precision, torch.compile,
channels_last, a step of the workload's own for batches of any structure. Real training runs
on this CPU (it has avx512_bf16; gcc is installed, so inductor compiles here)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from loader_search._snippets import dataloader_snippet
from loader_search.errors import ConfigError
from loader_search.params import LoaderParams, RunPlan, TrainingSettings, TrialLimits
from loader_search.trial import TrialJob, run_isolated, run_trial
from loader_search.trial._step import (
    Step,
    check_step_settings,
    default_batch_size,
    first_tensor,
    move,
    tree_map,
)
from loader_search.workloads import Workload, load_workload
from tests._datasets import TimedDataset, activation_hungry, linear_model

# --- batches of any structure -------------------------------------------------------------


class Pair(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor


@dataclasses.dataclass
class Features:
    pixels: torch.Tensor
    label: torch.Tensor
    name: str = "kept"


class HasTo:
    """An object with its own ``.to()`` (a Hugging Face BatchEncoding does this)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.moved_to: Any = None

    def to(self, device: Any) -> HasTo:
        self.moved_to = device
        return self


def test_one_tree_map_keeps_every_structure_and_reaches_every_tensor() -> None:
    batch = {
        "ids": torch.zeros(4, 3, dtype=torch.long),
        "pair": Pair(torch.ones(4, 2), torch.zeros(4)),
        "features": Features(torch.ones(4, 1, 2, 2), torch.zeros(4)),
        "list": [torch.ones(4), (torch.ones(4, 5), 7)],
        "other": HasTo(torch.ones(4)),
        "text": "not a tensor",
    }
    doubled = tree_map(batch, lambda t: t.double())
    assert isinstance(doubled, dict) and doubled["text"] == "not a tensor"
    assert isinstance(doubled["pair"], Pair) and doubled["pair"].inputs.dtype == torch.float64
    assert isinstance(doubled["features"], Features)
    assert doubled["features"].pixels.dtype == torch.float64
    assert doubled["features"].name == "kept"
    assert isinstance(doubled["list"][1], tuple) and doubled["list"][1][1] == 7
    assert doubled["list"][1][0].dtype == torch.float64
    moved = move(batch, torch.device("cpu"))
    assert moved["other"].moved_to == torch.device("cpu")
    assert first_tensor(batch) is batch["ids"]
    assert default_batch_size(batch) == 4
    with pytest.raises(TypeError, match="batch_size_of"):
        default_batch_size({"text": "no tensor"})


def test_a_batch_is_cut_to_the_budget_in_every_tensor_of_its_size() -> None:
    workload = Workload("w", TimedDataset(8), TimedDataset(8), linear_model)
    step = Step(workload, TrainingSettings(), linear_model(), torch.device("cpu"))
    batch = {"x": torch.ones(8, 3), "y": torch.zeros(8), "table": torch.ones(5, 2)}
    cut = step.take(batch, 3)
    assert cut["x"].shape == (3, 3) and cut["y"].shape == (3,)
    assert cut["table"].shape == (5, 2)  # not of the batch's size: kept whole
    assert step.take(batch, 8) is batch


@pytest.mark.timeout(60)  # a count of 0 used to train for ever
@pytest.mark.parametrize("returned", [0, -3, 2.5, 10**12])
def test_a_batch_size_of_that_is_not_a_count_of_the_batch_fails_the_trial_at_once(
    returned: float,
) -> None:
    # 0 or less never advanced the budget: the trial trained for ever, its every step a
    # progress ping; 2.5 and 10**12 failed with messages about something else.
    def size_of(batch: Any) -> int:
        return returned  # type: ignore[return-value]  # a plug-in's wrong answer, on purpose

    workload = Workload(
        "w", TimedDataset(512), TimedDataset(64), linear_model, batch_size_of=size_of
    )
    job = TrialJob(
        workload, LoaderParams(32, 0, torch_threads=1), TrainingSettings(train_samples=1024)
    )
    started = time.perf_counter()
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=10))
    failure = outcome.failure
    assert failure is not None and failure.reason == "exception", failure
    assert "batch_size_of" in failure.message and f"returned {returned}:" in failure.message
    assert time.perf_counter() - started < 8


@pytest.mark.timeout(60)  # steps used to count as progress, samples or none
def test_steps_that_train_no_samples_are_no_progress_and_time_out() -> None:
    def empty(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(0, 16), torch.empty(0, dtype=torch.long)  # batches of no sample

    workload = Workload("w", TimedDataset(512), TimedDataset(64), linear_model, collate_fn=empty)
    job = TrialJob(
        workload, LoaderParams(32, 0, torch_threads=1), TrainingSettings(train_samples=1024)
    )
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=3))
    assert outcome.failure is not None and outcome.failure.reason == "timeout", outcome.failure


# --- settings and their errors ------------------------------------------------------------


def test_bad_step_settings_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"training\.precision.*fp32, bf16, fp16"):
        TrainingSettings(precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"training\.compile.*max-autotune"):
        TrainingSettings(compile="fastest")
    with pytest.raises(ConfigError, match=r"training\.matmul_precision"):
        TrainingSettings(matmul_precision="low")  # type: ignore[arg-type]
    assert TrainingSettings(compile=True).compile_mode == "default"
    assert TrainingSettings(compile="max-autotune").compile_mode == "max-autotune"
    assert TrainingSettings().compile_mode is None
    from loader_search.errors import UserError

    with pytest.raises(UserError, match=r'"fp16".*CUDA.*"bf16"'):
        check_step_settings(TrainingSettings(precision="fp16"), torch.device("cpu"))
    check_step_settings(TrainingSettings(precision="bf16"), torch.device("cpu"))


def _config(tmp_path: Path, training: str, workload: str = '"synthetic-text"') -> Path:
    path = tmp_path / "study.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [study]
            name = "step"
            trials = 2
            confirm_top = 0
            [workload]
            name = {workload}
            [workload.options]
            train_size = 512
            val_size = 128
            [training]
            train_samples = 768
            warmup_batches = 1
            device = "cpu"
            {training}
            [space]
            batch_size = [32, 64]
            num_workers = {{ min = 0, max = 1 }}
            prefetch_factor = 2
            """
        )
    )
    return path


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loader_search", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def test_fp16_on_a_cpu_and_an_unknown_precision_exit_2_with_nothing_stored(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.db"
    for training, message in (
        ('precision = "fp16"', 'training.precision = "fp16": fp16 autocast'),
        ('precision = "fp8"', "training.precision"),
        ('compile = "fastest"', "training.compile"),
    ):
        config = _config(tmp_path, training)
        done = _cli("run", str(config), "--storage", f"sqlite:///{db}", cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert not db.exists()


# --- real training runs -------------------------------------------------------------------


def _text() -> Workload:
    return load_workload("synthetic-text", {"train_size": 1024, "val_size": 256})


def test_bf16_trains_to_the_validation_loss_of_fp32_and_the_same_step_reads_the_ceiling() -> None:
    params = LoaderParams(64, 0, torch_threads=1)
    runs = {}
    for precision in ("fp32", "bf16"):
        settings = TrainingSettings(train_samples=1024, precision=precision)  # type: ignore[arg-type]
        runs[precision] = run_trial(_text(), params, settings, plan=RunPlan(measure_ceiling=True))
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert fp32.val_loss is not None and bf16.val_loss is not None
    # Trained: below the untrained model's loss; bf16 within 2% of fp32 (measured: 0.01%).
    assert fp32.untrained_loss is not None and fp32.val_loss < fp32.untrained_loss - 0.1
    assert bf16.val_loss == pytest.approx(fp32.val_loss, rel=0.02)
    assert bf16.val_loss != fp32.val_loss  # autocast really ran
    assert fp32.ceiling_samples_per_s and bf16.ceiling_samples_per_s
    assert fp32.compile_time_s is None and bf16.skipped_steps is None


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="fp16 autocast with GradScaler needs CUDA (gpu_check.sh)"
)
def test_fp16_with_its_gradient_scaler_trains_on_cuda_and_counts_skipped_steps() -> None:
    params = LoaderParams(64, 0, torch_threads=1)
    runs = {}
    for precision in ("fp32", "fp16"):
        settings = TrainingSettings(train_samples=1024, precision=precision)  # type: ignore[arg-type]
        runs[precision] = run_trial(_text(), params, settings, device="cuda")
    fp16 = runs["fp16"]
    assert fp16.skipped_steps is not None and 0 <= fp16.skipped_steps < 8
    assert fp16.val_loss == pytest.approx(runs["fp32"].val_loss, rel=0.03)


@pytest.mark.slow  # 7 s once inductor's cache holds its kernels, 88 s on a machine without
def test_a_compiled_trial_stores_its_compile_time_and_leaves_a_recompilation_out() -> None:
    # 1,056 samples in batches of 64: a last batch of 32, a new shape, compiled again inside
    # the window. That step is left out of the reading, and counted.
    params = LoaderParams(64, 0, torch_threads=2)
    settings = TrainingSettings(train_samples=1056, compile=True, warmup_batches=2)
    result = run_trial(_text(), params, settings)
    assert result.compile_time_s is not None and result.compile_time_s > 1.0
    assert result.window_recompiles == 1 and result.window_recompile_s
    assert result.window_recompile_s > 0.1  # a compilation, not a step
    # What is left of the window has no spike: its slowest step is near its median.
    assert result.slowest_step_over_median is not None
    assert result.slowest_step_over_median < 5
    assert result.warmup_batches >= 2
    assert result.measured_samples == 1056 - 32 - 64 * result.warmup_batches


def test_accumulated_micro_batches_of_a_custom_step_make_the_whole_batchs_update() -> None:
    settings = TrainingSettings(train_samples=1024, batch_size=64)
    whole = run_trial(_text(), LoaderParams(64, 0, torch_threads=1), settings)
    micro = run_trial(
        _text(), LoaderParams(64, 0, torch_threads=1, accumulation_steps=2), settings
    )
    assert whole.val_loss is not None and micro.val_loss is not None
    # No BatchNorm, losses averaged over equal halves: only the order of sums differs.
    assert micro.val_loss == pytest.approx(whole.val_loss, rel=1e-3)


def test_channels_last_trains_a_cnn_on_4d_inputs_to_the_same_loss() -> None:
    workload = load_workload("synthetic-images", {"train_size": 256, "val_size": 64})
    params = LoaderParams(64, 0, torch_threads=1)
    losses = []
    for channels_last in (False, True):
        settings = TrainingSettings(train_samples=768, channels_last=channels_last)
        losses.append(run_trial(workload, params, settings).val_loss)
    plain, last = losses
    assert plain is not None and last is not None
    assert last == pytest.approx(plain, rel=1e-3)  # the memory layout, not the math


def test_the_snippet_shows_the_step_the_measurement_used() -> None:
    step = {"precision": "bf16", "compile": "max-autotune", "channels_last": True}
    text = dataloader_snippet(LoaderParams(64, 2, 2), step=step)
    assert 'torch.compile(model, mode="max-autotune")' in text
    assert "dtype=torch.bfloat16" in text and "channels_last" in text
    assert text.index("torch.compile") < text.index("DataLoader(")
    assert "autocast" not in dataloader_snippet(LoaderParams(64, 2, 2))


# --- a dict-batch plug-in through the CLI -------------------------------------------------

PLUGIN = '''
"""A Hugging Face-style plug-in: dict batches, a model that returns an object with .loss."""
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from loader_search.workloads import Workload


class Tokens(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 50, (n, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids % 2}


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.EmbeddingBag(50, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.head(self.embed(input_ids))
        return Output(nn.functional.cross_entropy(logits, labels[:, 0]), logits)


def workload():
    return Workload(
        name="hf-style",
        train_dataset=Tokens(512, 0),
        val_dataset=Tokens(128, 1),
        make_model=Classifier,
        train_step=lambda model, batch: model(**batch).loss,
    )
'''


def test_a_dict_batch_plugin_runs_a_whole_study_through_the_cli(tmp_path: Path) -> None:
    (tmp_path / "hf_plugin.py").write_text(PLUGIN)
    config = _config(tmp_path, 'precision = "bf16"', workload='"hf_plugin.py:workload"')
    text = config.read_text().replace("train_size = 512\nval_size = 128\n", "")
    config.write_text(text)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    done = _cli("run", str(config), "--storage", storage, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    best = _cli("best", "step", "--storage", storage, "--json", cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    document = json.loads(best.stdout)
    assert document["trials"]["complete"] == 2 and document["trials"]["failed"] == 0
    rec = document["recommended"]
    # confirm_top = 0: no paired rounds, so no interval (not confirmed, or the baseline kept)
    assert rec["verdict"] in ("not_confirmed", "no_reliable_gain")
    assert rec["speedup_ci95"] is None
    assert "dtype=torch.bfloat16" in rec["snippet"]


@pytest.mark.slow
def test_a_custom_step_that_does_not_fit_is_retried_as_micro_batches(tmp_path: Path) -> None:
    import optuna

    from loader_search import SearchSpace, StudyConfig, run_study
    from loader_search.study._keys import stored_params
    from loader_search.study.config._config import SamplerConfig
    from loader_search.study.search._space import CpuRange

    # Batch 256 holds about 384 MiB of activations, 128 about 192: 300 MiB of headroom fits
    # 128 with room to spare and not 256 (400 was too close to 256 to fail every time).
    base = activation_hungry(width=2**17, headroom_mb=300)

    class AsDicts(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self, pairs: Any) -> None:
            self.pairs = pairs

        def __len__(self) -> int:
            return len(self.pairs)

        def __getitem__(self, i: int) -> dict[str, Any]:
            x, y = self.pairs[i]
            return {"x": x, "y": y}

    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    workload = dataclasses.replace(
        base,
        train_dataset=AsDicts(base.train_dataset),
        val_dataset=AsDicts(base.val_dataset),
        train_step=step,
    )
    config = StudyConfig(
        name="dict-oom",
        trials=2,
        confirm_top=0,
        sampler=SamplerConfig(name="grid"),
        training=TrainingSettings(
            train_samples=4096,
            batch_size=128,
            lr=0.005,
            lr_scaling="none",
            warmup_batches=1,
            eval_batch_size=64,
        ),
        space=SearchSpace(batch_sizes=(128, 256), num_workers=CpuRange(0, 0), torch_threads=1),
    )
    storage = f"sqlite:///{tmp_path / 'oom.db'}"
    run_study(config, workload=workload, storage=storage, quiet=True)
    study = optuna.load_study(study_name="dict-oom", storage=storage)
    by_batch = {stored_params(t).batch_size: t for t in study.trials}  # type: ignore[union-attr]
    big = by_batch[256]
    assert big.state == optuna.trial.TrialState.COMPLETE
    assert big.user_attrs["accumulation_steps"] == 2
    assert big.user_attrs["oom_attempts"][0]["reason"] == "host_oom"
