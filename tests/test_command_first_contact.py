"""A user's first study of their own command, where it cannot be tuned: a Python without torch
(the system's, the user's environment not active), and a script that batches by hand with no
DataLoader. Whole CLI studies of real scripts in real processes, each with its own SQLite file:
the study stops at the first look, in one line that says what to do; a later look, the command
fixed, replaces what an earlier one noted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import optuna
import psutil
import pytest

from tests.conftest import run_cli
from tests.test_command_study import _config

# A zero-code script that trains on a DataLoader and reports a loss after each epoch.
TRAINS = """
import torch
from torch.utils.data import DataLoader, TensorDataset
import loader_search

torch.manual_seed(0)
x = torch.randn(512, 8)
y = (x.sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(1000):
    for xb, yb in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    loader_search.report(val_loss=1.0)
"""
# Batches by hand from tensors, for a minute: no DataLoader for the hook to find.
BY_HAND = """
import time
import torch

x = torch.randn(4096, 8)
y = torch.randn(4096, 1)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
end = time.monotonic() + 60
while time.monotonic() < end:
    for at in range(0, len(x), 64):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[at:at + 64]), y[at:at + 64]).backward()
        opt.step()
    time.sleep(0.01)
"""


def _python_without_torch(folder: Path) -> Path:
    """The system's Python where it has no torch (as a user's shell finds it, their
    environment not active), else a bare virtual environment's."""
    system = Path("/usr/bin/python3")
    if system.exists():
        found = subprocess.run([system, "-c", "import torch"], capture_output=True, check=False)
        if found.returncode != 0:
            return system
    venv.EnvBuilder(with_pip=False).create(folder / "bare")
    return folder / "bare" / "bin" / "python"


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _error(said: str) -> str:
    lines = [line for line in said.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, said
    return lines[0]


def _facts(url: str, name: str) -> object:
    return optuna.load_study(study_name=name, storage=url).user_attrs.get("script_facts")


@pytest.mark.slow  # two whole studies, one of them with a trial
@pytest.mark.timeout(240)
def test_a_python_without_torch_is_named_and_its_look_leaves_no_note(tmp_path: Path) -> None:
    before = _children()
    python = _python_without_torch(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TRAINS)
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    started = time.monotonic()
    ran = run_cli("run", "--storage", url, "--n-trials", "1", "--", str(python), "train.py",
                  cwd=tmp_path)  # fmt: skip
    said = ran.stdout + ran.stderr
    # A study that cannot start: exit 1 and one line naming the interpreter, what it lacks,
    # and the fix; not the workload's own error, and no trial ran.
    assert ran.returncode == 1, said
    error = _error(said)
    assert f"the command's Python {python} cannot import torch" in error, error
    assert "activate the environment that has torch and loader-search" in error
    assert "workload's code raised" not in said and "Traceback" not in said
    assert time.monotonic() - started < 60
    assert _facts(url, "train") is None
    assert optuna.load_study(study_name="train", storage=url).get_trials() == []
    # The same study with the environment's own Python: it trains, and nothing of the first
    # look is said again.
    ran = run_cli("run", "--storage", url, "--n-trials", "1", "--", sys.executable, "train.py",
                  cwd=tmp_path)  # fmt: skip
    said = ran.stdout + ran.stderr
    assert ran.returncode == 0, said
    assert "cannot import torch" not in said and "found no training loader" not in said
    facts = _facts(url, "train")
    assert isinstance(facts, dict) and facts["failure"] is None, facts
    assert str(facts["site"]).startswith(f"{script}:")
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


@pytest.mark.slow  # two whole studies, a failed baseline and a trial
@pytest.mark.timeout(240)
def test_a_later_first_look_replaces_the_note_of_an_earlier_one(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text('raise SystemExit("no data folder: give --data")\n')
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    argv = ("run", "--storage", url, "--n-trials", "1", "--", sys.executable, "train.py")
    ran = run_cli(*argv, cwd=tmp_path)
    said = " ".join((ran.stdout + ran.stderr).split())
    # The script's own error: its look notes it, its baseline stops the study.
    assert ran.returncode == 1, said
    assert "a first look at the command found no training loader" in said
    assert "the baseline trial (#0) failed" in said and "no data folder" in said
    assert "no data folder" in str(_facts(url, "train"))
    script.write_text(TRAINS)  # fixed
    ran = run_cli(*argv, cwd=tmp_path)
    said = ran.stdout + ran.stderr
    assert ran.returncode == 0, said
    assert "found no training loader" not in said and "no data folder" not in said
    facts = _facts(url, "train")
    assert isinstance(facts, dict) and facts["failure"] is None, facts
    assert str(facts["site"]).startswith(f"{script}:")


@pytest.mark.slow  # a whole study, stopped at its first look
@pytest.mark.timeout(120)
def test_a_script_without_a_dataloader_stops_at_the_first_look(
    tmp_path: Path, sqlite_url: str
) -> None:
    before = _children()
    script = tmp_path / "by_hand.py"
    script.write_text(BY_HAND)
    config = _config(
        tmp_path, [sys.executable, str(script)], training="", workdir=tmp_path,
        extra="[limits]\ntrial_timeout_s = 5",
    )  # fmt: skip
    started = time.monotonic()
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    took = time.monotonic() - started
    said = ran.stdout + ran.stderr
    # Stopped within the first look (its 5 s limit, and start-up), long before the script's
    # minute: one line, no trial, never a timeout.
    assert ran.returncode == 1, said
    assert took < 40, took
    error = _error(said)
    assert "the command built no torch.utils.data.DataLoader in 5 s" in error, error
    assert "nothing to tune" in error and "feed its training loop from a DataLoader" in error
    assert "timeout:" not in said and "no training progress" not in said
    assert "deadlock" not in said
    assert optuna.load_study(study_name="study", storage=sqlite_url).get_trials() == []
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


def test_the_interpreter_is_found_as_the_command_finds_it(tmp_path: Path) -> None:
    from loader_search.trial._command_text import command_python

    assert command_python(["python3"], str(tmp_path)) == shutil.which("python3")
    assert command_python([".venv/bin/python"], str(tmp_path)) == str(
        tmp_path / ".venv" / "bin" / "python"
    )
    assert command_python(["no-such-program-here"], str(tmp_path)) == "no-such-program-here"
    assert os.path.isabs(command_python([sys.executable], "/"))
