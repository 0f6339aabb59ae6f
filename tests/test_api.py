"""The Python API: a notebook user tunes a loader for their own datasets, without the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search import CpuRange, SearchSpace, StudyConfig, TrainingSettings, Workload, run_study
from loader_search.errors import UserError
from tests.conftest import ROOT


def _my_workload() -> Workload:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, 12, generator=generator)
    y = (x[:, :3].sum(1) > 0).long()
    return Workload(
        name="notebook",
        train_dataset=TensorDataset(x[:240], y[:240]),
        val_dataset=TensorDataset(x[240:], y[240:]),
        make_model=lambda: nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 2)),
        base_lr=0.1,
    )


CONFIG = StudyConfig(
    confirm_top=0,  # tests count trials; tests/test_reuse.py covers re-measurement
    name="notebook",
    trials=3,
    device="cpu",
    training=TrainingSettings(train_samples=640, batch_size=16),
    space=SearchSpace(batch_sizes=(16, 32), num_workers=CpuRange(0, 1), torch_threads=1),
)


def test_run_study_with_an_in_memory_workload(sqlite_url: str) -> None:
    summary = run_study(CONFIG, workload=_my_workload(), storage=sqlite_url)
    assert summary.n_complete == 3
    assert summary.baseline is not None and summary.baseline.params.num_workers == 0
    assert summary.recommended is not None
    assert "DataLoader(" in summary.recommended.snippet
    study = optuna.load_study(study_name="notebook", storage=sqlite_url)
    assert study.user_attrs["fingerprint"]["workload"] == "python:notebook"


def test_continuing_with_other_settings_is_refused(sqlite_url: str) -> None:
    run_study(CONFIG, workload=_my_workload(), storage=sqlite_url)
    changed = StudyConfig(
        name="notebook",
        trials=4,
        device="cpu",
        training=TrainingSettings(train_samples=1280, batch_size=16),
        space=CONFIG.space,
    )
    with pytest.raises(UserError, match="different settings \\(training\\)"):
        run_study(changed, workload=_my_workload(), storage=sqlite_url)
    assert len(optuna.load_study(study_name="notebook", storage=sqlite_url).trials) == 3


def test_inconsistent_config_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="baseline batch size 48"):
        StudyConfig(training=TrainingSettings(batch_size=48))


# A notebook's or a script's run: the module's workload, two trials, then the same quietly.
_SCRIPT = """
import sys
from loader_search import StudyConfig, run_study
from tests.test_api import CONFIG, _my_workload

config = StudyConfig(**{**CONFIG.__dict__, "trials": 2})
run_study(config, workload=_my_workload(), storage=sys.argv[1])
sys.stderr.write("QUIET FROM HERE\\n")
run_study(config, workload=_my_workload(), storage=sys.argv[1], n_trials=3, quiet=True)
"""


def test_run_study_prints_progress_unless_quiet(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, storage],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loud, _, quiet = done.stderr.partition("QUIET FROM HERE\n")
    lines = [line for line in loud.splitlines() if line.startswith("[loader-search] ")]
    assert any("created study 'notebook'" in line and "0/2 trials done" in line for line in lines)
    assert any(line.startswith("[loader-search] trial #0 started: ") for line in lines)
    for number, progress in ((0, "[1/2]"), (1, "[2/2]")):
        finished = [line for line in lines if f"trial #{number} {progress} " in line]
        assert len(finished) == 1 and "samples/s, val_loss" in finished[0], loud
    assert "[loader-search]" not in quiet + done.stdout
    study = optuna.load_study(study_name="notebook", storage=storage)
    assert len(study.trials) == 3  # the quiet run ran its trial
