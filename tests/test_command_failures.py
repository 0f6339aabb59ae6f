"""How a training command's trials fail, and what the user is told: a non-finite validation
loss, an interpreter flag that keeps the start-up hook out, a loader context torch refuses
without workers, a torchrun rank's own error under the launcher's banner, and a Ctrl-C before
any trial. Real scripts in real processes: whole CLI studies or real command trials."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest

from loader_search.params import LoaderParams, TrainingSettings, TrialLimits
from loader_search.trial import CommandSpec, TrialJob, run_isolated
from loader_search.trial._command_text import interpreter_flag, last_error
from tests.conftest import ROOT, run_cli
from tests.test_command_study import _config

# A small script the hook tunes without flags: a TensorDataset, a linear model, an epoch loop
# that ends by itself after ``{epochs}`` epochs, ``{report}`` after each. ``{head}`` runs
# first, ``{loader}`` holds the training loader's extra arguments.
SCRIPT = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import loader_search

def main():
    {head}
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x.sum(1) > 0).long()
    train_loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True{loader})
    val_loader = DataLoader(TensorDataset(x[:128], y[:128]), batch_size=64)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range({epochs}):
        for xb, yb in train_loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            time.sleep(0.002)
        with torch.no_grad():
            loss = sum(torch.nn.functional.cross_entropy(model(a), b).item()
                       for a, b in val_loader)
        {report}

if __name__ == "__main__":  # a spawned loader worker imports this file again
    main()
"""
REPORT = "loader_search.report(val_loss=loss)"


def _script(
    folder: Path,
    *,
    head: str = "pass",
    loader: str = "",
    epochs: int = 1000,
    report: str = REPORT,
    name: str = "train.py",
) -> Path:
    path = folder / name
    path.write_text(SCRIPT.format(head=head, loader=loader, epochs=epochs, report=report))
    return path


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _left(before: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def _study_trials(url: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="study", storage=url).get_trials()


# --- a validation loss that is not finite ----------------------------------------------


@pytest.mark.slow  # a whole study of command trials
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("value", "report", "extra"),
    [
        ("nan", "loader_search.report(val_loss=float('nan'))", ""),
        ("inf", "print('val_loss=inf', flush=True)", "val_loss_pattern = 'val_loss=(\\S+)'"),
    ],
    ids=["nan reported", "inf printed"],
)
def test_a_non_finite_validation_loss_is_a_diverged_trial_never_recommended(
    tmp_path: Path, sqlite_url: str, value: str, report: str, extra: str
) -> None:
    before = _children()
    script = _script(tmp_path, report=report)
    config = _config(
        tmp_path, [sys.executable, str(script)], trials=2, extra=extra, training="",
        workdir=tmp_path,
    )  # fmt: skip
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    said = ran.stdout + ran.stderr
    # The baseline itself diverged: the workload is broken, the study stops with one line.
    assert ran.returncode == 1, said
    assert f"the baseline trial (#0) failed: the validation loss reported is {value}" in said
    assert "is not acceptable" not in said and "Traceback" not in said
    assert "# run:" not in said and "Recommended" not in said
    (trial,) = _study_trials(sqlite_url)
    assert trial.state == optuna.trial.TrialState.FAIL  # stored, not left RUNNING
    assert trial.user_attrs["failure_reason"] == "diverged"
    assert "lower training.lr" in trial.user_attrs["failure_hint"]
    assert _left(before) == []


@pytest.mark.slow  # a whole study of command trials
@pytest.mark.timeout(240)
def test_a_setting_whose_loss_is_not_finite_is_infeasible_and_the_study_goes_on(
    tmp_path: Path, sqlite_url: str
) -> None:
    before = _children()
    # Batches of 32 blow up, printed as inf; the baseline's 64 train.
    report = "print(f'val_loss={float(\"inf\") if train_loader.batch_size == 32 else loss}')"
    script = _script(tmp_path, report=report)
    extra = "val_loss_pattern = 'val_loss=(\\S+)'"
    config = _config(
        tmp_path, [sys.executable, str(script)], trials=3, extra=extra, training="",
        workdir=tmp_path,
    )  # fmt: skip
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "(2 complete, 0 failed, 1 infeasible)" in ran.stdout, ran.stdout
    trials = _study_trials(sqlite_url)
    assert optuna.trial.TrialState.RUNNING not in {t.state for t in trials}
    (blown,) = [t for t in trials if t.params["batch_size"] == 32]
    # Infeasible: stored complete with the placeholder values, so the sampler avoids it.
    assert blown.state == optuna.trial.TrialState.COMPLETE
    assert blown.user_attrs["failure_reason"] == "diverged"
    assert blown.values == [0.0, float("inf")]
    recommended = next(line for line in ran.stdout.splitlines() if "Recommended" in line)
    assert f"#{blown.number}" not in recommended and "batch=32" not in recommended
    assert _left(before) == []


# --- a start-up hook that cannot load -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["python", "-I", "train.py"], "-I"),
        (["/usr/bin/python3.11", "-uE", "-m", "pkg.train"], "-E"),
        (["python3", "-W", "ignore", "-S", "-c", "code"], "-S"),
        (["python", "-X", "dev", "train.py", "-I"], None),  # the script's own flag
        (["python", "-I", "-m", "torch.distributed.run", "train.py"], None),  # ranks start anew
        (["torchrun", "-I", "train.py"], None),
        (["python", "train.py"], None),
    ],
)
def test_the_interpreter_flag_that_keeps_the_hook_out_is_read_from_the_words(
    argv: list[str], flag: str | None
) -> None:
    assert interpreter_flag(argv) == flag


@pytest.mark.timeout(120)
def test_a_python_run_with_dash_i_says_the_hook_did_not_load_and_why(tmp_path: Path) -> None:
    script = _script(tmp_path, epochs=2)
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    started = time.monotonic()
    ran = run_cli(
        "run", "--storage", url, "--n-trials", "1", "--", sys.executable, "-I", str(script),
        cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 1, ran.stdout + ran.stderr
    error = next(line for line in ran.stderr.splitlines() if line.startswith("error:"))
    # One line: what happened, the flag seen, and the fix; not "loaders seen: none".
    assert "the loader-search hook did not load in the command" in error, ran.stderr
    assert "runs with -I" in error and "drop -I" in error
    assert "loaders seen" not in ran.stdout + ran.stderr
    assert time.monotonic() - started < 60  # refused at once, not after the script's run


@pytest.mark.timeout(120)
def test_a_command_without_the_hook_that_reports_a_loss_says_so(tmp_path: Path) -> None:
    # No flag in the words: a launcher that drops PYTHONPATH. The script still reports a
    # loss (loader_search is installed), so its process writes, without the hook.
    script = _script(tmp_path, epochs=2)
    argv = ("env", "-u", "PYTHONPATH", sys.executable, str(script))
    job = TrialJob(
        None,
        LoaderParams(batch_size=32),
        TrainingSettings(train_samples=1024, batch_size=64, warmup_batches=2),
        "cpu",
        command=CommandSpec(argv, str(tmp_path)),
    )
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=60))
    failure = outcome.failure
    assert failure is not None and failure.reason == "not_applied", failure
    assert failure.message.startswith("the loader-search hook did not load in the command")
    assert "ignores PYTHONPATH" in failure.message and "loaders seen" not in failure.message


# --- a multiprocessing_context of the script's own --------------------------------------


@pytest.mark.slow  # a whole study of command trials, loader workers spawned
@pytest.mark.timeout(300)
def test_a_spawn_context_in_the_script_does_not_break_the_trials_without_workers(
    tmp_path: Path, sqlite_url: str
) -> None:
    before = _children()
    script = _script(tmp_path, loader=', multiprocessing_context="spawn"')
    config = _config(
        tmp_path, [sys.executable, str(script)], trials=2, training="", workdir=tmp_path
    )
    config.write_text(config.read_text().replace("train_samples = 1024", "train_samples = 768"))
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    said = ran.stdout + ran.stderr
    assert ran.returncode == 0, said
    # Said once (the console wraps it), naming the context, the loader and why.
    flat = " ".join(said.split())
    assert flat.count("the script's multiprocessing_context='spawn'") == 1, said
    site = f"(the training DataLoader at {script}:"
    assert f"multiprocessing_context='spawn' {site}" in flat, said
    assert "left out of trials with num_workers = 0: torch takes it only with" in flat
    trials = _study_trials(sqlite_url)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    baseline = trials[0]
    assert baseline.user_attrs["baseline"] and baseline.params["num_workers"] == 0
    assert "failure_reason" not in baseline.user_attrs
    assert _left(before) == []


# --- a torchrun rank's own error ----------------------------------------------------------

TORCHRUN = Path(sys.executable).parent / "torchrun"
LAUNCH = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
# Rank 1 raises after a few steps; rank 0 then fails in its next collective, with an error
# of its own that is not the cause.
RANK_BREAKS = """
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
data = TensorDataset(torch.randn(2048, 8), torch.randn(2048, 1))
loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, shuffle=True))
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
for step, (xb, yb) in enumerate(loader):
    if dist.get_rank() == 1 and step == 3:
        raise RuntimeError("rank one broke")
    torch.nn.functional.mse_loss(model(xb), yb).backward()
"""


@pytest.mark.slow  # torchrun's own start-up, seconds
@pytest.mark.timeout(180)
def test_a_failing_torchrun_rank_is_told_by_its_own_error(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_BREAKS)
    before = _children()
    job = TrialJob(
        None,
        LoaderParams(batch_size=32),
        TrainingSettings(train_samples=1024, batch_size=32, warmup_batches=2, ranks=2),
        "cpu",
        command=CommandSpec((*LAUNCH, "--nproc-per-node", "2", str(script)), str(tmp_path)),
    )
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=90))
    assert _left(before) == []
    failure = outcome.failure
    assert failure is not None and failure.reason == "exception", failure
    # The rank's own error, not torchrun's banner nor rank 0's consequence of it.
    assert failure.message == (
        "the command exited with status 1: rank 1: RuntimeError: rank one broke"
    ), failure.message
    # The stored traceback leads with the rank's own lines; torchrun's banner follows.
    first = failure.traceback.splitlines()[0]
    assert first.startswith("Traceback (most recent call last)"), failure.traceback
    assert failure.traceback.index("rank one broke") < failure.traceback.index("ChildFailed")


# torchrun's output for the same failure, as printed (shortened): without the hook's record,
# the error is read from it.
TORCHRUN_OUTPUT = """
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/r.py", line 4, in <module>
[rank1]:     raise RuntimeError("rank one broke")
[rank1]: RuntimeError: rank one broke
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/r.py", line 5, in <module>
[rank0]:     dist.barrier()
[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:10121
W1208 00:37:26.719000 8351 torch/distributed/elastic/multiprocessing/api.py:1028] Sending...
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
r.py FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8356)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 8357)
============================================================
"""


def test_the_failing_ranks_error_is_read_from_torchruns_output() -> None:
    assert last_error(TORCHRUN_OUTPUT) == "rank 1: RuntimeError: rank one broke"
    # Without rank prefixes, the last traceback that is not torchrun's own.
    plain = "\n".join(line.split("]: ", 1)[-1] for line in TORCHRUN_OUTPUT.splitlines())
    plain = plain.replace("Root Cause", "Cause")
    assert last_error(plain) == "RuntimeError: Connection closed by peer [127.0.0.1]:10121"
    assert last_error("starting\nValueError: bad\n") == "ValueError: bad"
    assert last_error("") == "(no output)"


# --- Ctrl-C before any trial --------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_ctrl_c_during_the_first_look_claims_no_trial(tmp_path: Path) -> None:
    # The script says it started, then sleeps before it builds a loader: the look still runs.
    marker = tmp_path / "started.txt"
    head = f"open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    script = _script(tmp_path, head=head)
    database = tmp_path / "studies.db"
    env = {k: v for k, v in os.environ.items() if k != "LOADER_SEARCH_STORAGE"}
    process = subprocess.Popen(
        [sys.executable, "-m", "loader_search", "run", "--storage", f"sqlite:///{database}",
         "--", sys.executable, str(script)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() or not marker.read_text():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the first look did not start the script"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last == "Interrupted; run the same command again to continue the study.", stderr
    assert "recorded" not in stdout + stderr and "Traceback" not in stderr
    # No trial existed, none does now; the script the look started is gone.
    with sqlite3.connect(database) as connection:
        assert connection.execute("SELECT COUNT(*) FROM trials").fetchone() == (0,)
    script_pid = int(marker.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(script_pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # reaped by whoever inherited it
    assert not psutil.pid_exists(script_pid)
