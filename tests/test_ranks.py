"""Multi-rank trials (`loader_search.trial._ranks`, issue 26): 2 ranks with gloo on this CPU,
real DDP training, real rank processes, real faults planted in one rank."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
import torch

from loader_search.errors import ConfigError
from loader_search.params import LoaderParams, RunPlan, TrainingSettings, TrialLimits
from loader_search.trial import FreshHost, TrialJob, WorkloadRecipe, run_isolated
from tests._datasets import rank_fault, timed_workload

TWO = TrainingSettings(train_samples=4096, ranks=2, warmup_batches=2)


def _leftovers() -> list[psutil.Process]:
    """Processes of a trial still alive under this one (none may be left)."""
    alive = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.parametrize("workers", [0, 1])
def test_a_two_rank_trial_measures_the_node_and_keeps_each_ranks_figures(workers: int) -> None:
    params = LoaderParams(64, workers, 2 if workers else None, torch_threads=1)
    single = TrainingSettings(train_samples=4096, warmup_batches=2, lr_scaling="none")
    job = TrialJob(timed_workload(n=2048), params, TWO, plan=RunPlan(measure_ceiling=True))
    outcome = run_isolated(job)
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None and result.ranks == 2 and result.per_rank is not None
    per_rank = result.per_rank
    assert len(per_rank["throughput_samples_per_s"]) == 2
    assert len(per_rank["peak_host_rss_bytes"]) == 2
    # The node's memory is rank 0's process tree, which holds rank 1 (its loader workers or
    # none): about twice rank 1's alone (measured: 529 and 1,027 MiB against 264 and 513),
    # where rank 0's own process would read about as much as rank 1's.
    assert result.peak_host_rss_bytes == per_rank["peak_host_rss_bytes"][0]
    assert result.peak_host_rss_bytes > 1.5 * per_rank["peak_host_rss_bytes"][1]
    # The node's throughput: every rank's samples over the slowest window.
    rates, times = per_rank["throughput_samples_per_s"], per_rank["measured_time_s"]
    counted = sum(r * t for r, t in zip(rates, times, strict=True))
    assert counted == pytest.approx(result.measured_samples)
    assert result.throughput_samples_per_s == pytest.approx(
        result.measured_samples / result.measured_time_s
    )
    assert result.measured_time_s == max(per_rank["measured_time_s"])
    # Half the budget each; rank 0 evaluated the whole validation set once.
    assert result.train_samples == 4096
    assert result.val_loss is not None and result.ceiling_samples_per_s
    assert result.untrained_loss is not None and result.val_loss < result.untrained_loss / 2
    # DDP averages the ranks' gradients: 2 ranks of 32 train as one process with batches of
    # 64 does, at one learning rate (the orders of the samples differ).
    halves = TrialJob(
        timed_workload(n=2048),
        LoaderParams(32, workers, 2 if workers else None, torch_threads=1),
        TrainingSettings(train_samples=4096, ranks=2, warmup_batches=2, lr_scaling="none"),
    )
    one = run_isolated(TrialJob(timed_workload(n=2048), params, single)).result
    two = run_isolated(halves).result
    assert one is not None and two is not None and one.val_loss and two.val_loss
    assert two.val_loss == pytest.approx(one.val_loss, rel=0.25)
    assert _leftovers() == []


@pytest.mark.parametrize(
    ("fault", "reason"), [("raise", "exception"), ("segfault", "crashed"), ("hang", "timeout")]
)
def test_a_rank_that_fails_fails_the_trial_with_its_class_and_leaves_nothing(
    fault: str, reason: str
) -> None:
    job = TrialJob(rank_fault(fault), LoaderParams(64, 0, torch_threads=1), TWO)
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=3))
    assert outcome.result is None and outcome.failure is not None
    assert outcome.failure.reason == reason, outcome.failure
    if fault != "hang":  # the rank's own failure, not rank 0's broken connection
        assert "rank 1" in outcome.failure.message
    if fault == "raise":
        assert "planted fault in rank 1" in outcome.failure.message
    assert outcome.wall_s < 60
    assert _leftovers() == []


_steps: list[int] = []  # the steps this rank's process took


def _kills_itself_on(rank: int) -> Any:
    """The default step, but ``rank`` SIGKILLs itself at its fifth step: no out-of-memory
    kill, nothing in memory, a signal someone else could have sent."""

    def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        _steps.append(1)
        if torch.distributed.get_rank() == rank and len(_steps) > 4:
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    return step


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_killed_by_sigkill_without_an_oom_record_crashed_naming_the_rank(
    rank: int,
) -> None:
    # It was host_oom, and the study then retrained the batch as micro-batches, and forced
    # every later trial of that batch size into accumulation. Rank 0 is the trial's own
    # process, seen by the supervisor; rank 1 a sibling, seen by rank 0.
    workload = dataclasses.replace(timed_workload(n=2048), train_step=_kills_itself_on(rank))
    job = TrialJob(workload, LoaderParams(64, 0, torch_threads=1), TWO)
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=20))
    failure = outcome.failure
    assert failure is not None and failure.reason == "crashed", failure
    assert f"rank {rank}" in failure.message and "SIGKILL" in failure.message
    assert not failure.infeasible
    assert _leftovers() == []


def test_a_killed_multi_rank_trial_leaves_no_store_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # read once, then cached
    job = TrialJob(rank_fault("hang"), LoaderParams(64, 0, torch_threads=1), TWO)
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=3))
    assert outcome.failure is not None and outcome.failure.reason == "timeout"
    assert list(private.iterdir()) == []
    assert _leftovers() == []


def test_a_two_rank_trial_in_a_fresh_process_trains_and_its_process_is_not_kept() -> None:
    params = LoaderParams(64, 0, torch_threads=1)
    recipe = WorkloadRecipe("tests._datasets:timed_workload", {"n": 2048})
    with FreshHost() as host:
        job = TrialJob(timed_workload(n=2048), params, TWO, fresh=recipe)
        outcome = run_isolated(job, host=host)
        assert outcome.failure is None, outcome.failure
        assert outcome.result is not None and outcome.result.ranks == 2
        assert outcome.exitcode == 0 and host.process is None  # it ended with its trial
    assert _leftovers() == []


def test_ranks_are_a_whole_number_or_auto() -> None:
    assert TrainingSettings(ranks="auto").ranks == "auto"
    for bad in (0, -1, 1.5, "two", True, 2000):
        with pytest.raises(ConfigError, match=r"training\.ranks"):
            TrainingSettings(ranks=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("pinned", [False, True], ids=["affinity", "cpus-option"])
def test_more_ranks_than_the_machines_cpus_are_refused_before_anything_is_stored(
    tmp_path: Path, pinned: bool
) -> None:
    # One rank a CPU at most: a stored or mistyped ranks = 1024 must not fork 1,024 ranks
    # nor reach a command's {ranks}. With --cpus the bound is the CPUs pinned to.
    usable = 1 if pinned else len(os.sched_getaffinity(0))
    ranks = usable + 1
    config = tmp_path / "ranks.toml"
    config.write_text(
        "[study]\nname = 'too-many'\ntrials = 1\n"
        "[workload]\ncommand = ['torchrun', '--nproc-per-node', '{ranks}', 'train.py']\n"
        # A budget large enough for the ranks: the machine's bound is all that is wrong.
        f"[training]\ndevice = 'cpu'\nranks = {ranks}\ntrain_samples = 65536\n"
    )
    storage = f"sqlite:///{tmp_path / 'ranks.db'}"
    optuna.storages.RDBStorage(storage)  # a fresh file with the schema, and no study
    pin = ["--cpus", str(min(os.sched_getaffinity(0)))] if pinned else []
    ran = _cli("run", str(config), "--storage", storage, *pin, cwd=tmp_path)
    message = ran.stderr.strip()
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "\n" not in message and "Traceback" not in message
    assert f"[training] ranks = {ranks}: this machine has {usable} usable CPU(s)" in message
    assert f"set ranks to at most {usable}" in message
    assert optuna.get_all_study_names(storage) == []


def test_a_two_rank_study_runs_through_the_cli_and_recommends_per_rank(tmp_path: Path) -> None:
    plugin = Path(__file__).with_name("_datasets.py")
    config = tmp_path / "ranks.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [study]
            name = "ranks"
            trials = 3
            confirm_top = 0
            [workload]
            name = "{plugin}:timed_workload"
            [workload.options]
            n = 2048
            [training]
            device = "cpu"
            ranks = 2
            train_samples = 4096
            warmup_batches = 1
            [space]
            batch_size = [64]
            num_workers = {{ min = 0, max = "auto" }}
            prefetch_factor = 2
            """
        )
    )
    storage = f"sqlite:///{tmp_path / 'ranks.db'}"
    done = _cli("run", str(config), "--storage", storage, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    best = _cli("best", "ranks", "--storage", storage, "--json", cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    report = json.loads(best.stdout)
    rec = report["recommended"]
    # The noise scale from the ranks' gradients: a rank's batch against the node's.
    noise = report["gradient_noise_scale"]
    assert noise is not None and noise["ranks"] == 2 and noise["steps"] > 0
    assert rec["ranks"] == 2 and rec["node"]["main_processes"] == 2
    workers = rec["params"]["num_workers"]
    assert rec["node"]["loader_processes"] == 2 * workers
    assert workers <= max(1, len(os.sched_getaffinity(0)) // 2)  # "auto": a rank's share
    assert "torchrun --nproc_per_node=2" in rec["snippet"]
    assert "sampler=sampler" in rec["snippet"] and "DistributedSampler" in rec["snippet"]
    study = optuna.load_study(study_name="ranks", storage=storage)
    finished = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert finished and all(t.user_attrs["ranks"] == 2 for t in finished)
    assert all(t.user_attrs["noise_big_batch"] == 128 for t in finished)
    assert all(len(t.user_attrs["per_rank"]["data_wait_fraction"]) == 2 for t in finished)
    assert study.user_attrs["fingerprint"]["training"]["ranks"] == 2


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loader_search", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )
