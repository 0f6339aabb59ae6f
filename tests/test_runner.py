from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import optuna
import pytest
import torch
import torch.nn.functional as F
from optuna.trial import TrialState

from loader_search.errors import StudyAborted, UserError
from loader_search.params import TrainingSettings
from loader_search.study import (
    CpuRange,
    IntRange,
    SamplerConfig,
    SearchSpace,
    StudyConfig,
    check_budget,
    make_sampler,
    run_study,
)
from loader_search.workloads import Workload
from tests._datasets import timed_workload

SPACE = SearchSpace(
    batch_sizes=(16, 32),
    num_workers=CpuRange(0, 1),
    prefetch_factor=IntRange(1, 2),
    persistent_workers=False,
    torch_threads=1,
)
CONFIG = StudyConfig(
    confirm_top=0,  # tests count trials; tests/test_reuse.py covers re-measurement
    name="runner",
    trials=3,
    device="cpu",
    training=TrainingSettings(train_samples=512, batch_size=16, eval_batch_size=64),
    space=SPACE,
)


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        (SamplerConfig(), optuna.samplers.TPESampler),
        (SamplerConfig(name="tpe", multivariate=True), optuna.samplers.TPESampler),
        (SamplerConfig(name="random"), optuna.samplers.RandomSampler),
        (SamplerConfig(name="nsga2", population_size=4), optuna.samplers.NSGAIISampler),
        (SamplerConfig(name="grid"), optuna.samplers.BruteForceSampler),
    ],
)
def test_make_sampler(sampler: SamplerConfig, expected: type) -> None:
    config = dataclasses.replace(CONFIG, sampler=sampler)
    assert isinstance(make_sampler(config), expected)


@pytest.mark.parametrize("name", ["nsga2", "grid"])
def test_other_samplers_run_real_studies(
    name: str, tiny_workload: Workload, sqlite_url: str
) -> None:
    config = dataclasses.replace(CONFIG, sampler=SamplerConfig(name=name))
    summary = run_study(config, workload=tiny_workload, storage=sqlite_url)
    assert summary.n_complete == 3
    study = optuna.load_study(study_name="runner", storage=sqlite_url)
    assert study.trials[0].user_attrs["baseline"] is True
    assert study.trials[0].params["num_workers"] == 0


def test_budget_check_names_the_fix() -> None:
    # Batch 32 with 1 worker x prefetch 2: 2 prefetched + 2 warm-up + 8 measured batches.
    space = SPACE.resolve(usable_cpus=1, cuda=False)
    small = TrainingSettings(train_samples=100, batch_size=16)
    with pytest.raises(UserError, match=r"needs 12 batches .* raise it to at least 384"):
        check_budget(small, space)
    with pytest.raises(UserError):
        check_budget(dataclasses.replace(small, train_samples=352), space)
    check_budget(dataclasses.replace(small, train_samples=384), space)


def test_a_failing_trial_is_recorded_and_the_study_goes_on(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # A bug in the user's code that only one batch size triggers.
        if len(targets) == 32:
            raise RuntimeError("boom on batch 32")
        return F.cross_entropy(outputs, targets)

    workload = dataclasses.replace(tiny_workload, loss_fn=loss_fn)
    # 4 valid combinations: batch 16 or 32, with 0 workers or 1 worker x prefetch 1.
    space = dataclasses.replace(SPACE, prefetch_factor=IntRange(1, 1))
    config = dataclasses.replace(CONFIG, trials=6, space=space, sampler=SamplerConfig("grid"))
    run_study(config, workload=workload, storage=sqlite_url)
    trials = optuna.load_study(study_name="runner", storage=sqlite_url).get_trials()
    assert len(trials) == 4  # each once (the baseline is one), then the grid ends the study
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 4
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert failed
    for trial in failed:
        assert trial.params["batch_size"] == 32
        assert trial.user_attrs["failure_reason"] == "exception"
        assert "boom on batch 32" in trial.user_attrs["failure_message"]
        assert "RuntimeError" in trial.user_attrs["failure_traceback"]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert complete and all(t.params["batch_size"] == 16 for t in complete)


def test_a_failing_baseline_aborts_the_study(tiny_workload: Workload, sqlite_url: str) -> None:
    def broken_model() -> torch.nn.Module:
        raise RuntimeError("model cannot be built")

    workload = dataclasses.replace(tiny_workload, make_model=broken_model)
    with pytest.raises(StudyAborted, match="baseline trial \\(#0\\) failed"):
        run_study(CONFIG, workload=workload, storage=sqlite_url)
    trials = optuna.load_study(study_name="runner", storage=sqlite_url).get_trials()
    assert len(trials) == 1 and trials[0].state == TrialState.FAIL


def test_an_interrupted_baseline_is_run_again_and_uses_no_budget(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    # The state a Ctrl-C during the first trial leaves (see test_cli for the real signal).
    study = optuna.create_study(
        study_name="runner", storage=sqlite_url, directions=["maximize", "minimize"]
    )
    study.enqueue_trial({"batch_size": 16, "num_workers": 0}, user_attrs={"baseline": True})
    trial = study.ask()
    trial.set_user_attr("failure_reason", "interrupted")
    study.tell(trial, state=TrialState.FAIL)

    config = dataclasses.replace(CONFIG, trials=2)
    summary = run_study(config, workload=tiny_workload, storage=sqlite_url)
    trials = optuna.load_study(study_name="runner", storage=sqlite_url).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] + [TrialState.COMPLETE] * 2
    assert trials[1].user_attrs["baseline"] is True
    assert summary.baseline is not None and summary.baseline.number == 1
    assert summary.recommended is not None and summary.recommended.speedup_vs_baseline


def test_a_continued_study_proposes_new_settings(tiny_workload: Workload, sqlite_url: str) -> None:
    config = dataclasses.replace(CONFIG, sampler=SamplerConfig(name="random"))
    run_study(config, workload=tiny_workload, storage=sqlite_url, n_trials=4)
    run_study(config, workload=tiny_workload, storage=sqlite_url, n_trials=7)
    trials = optuna.load_study(study_name="runner", storage=sqlite_url).get_trials()
    assert len(trials) == 7
    first = [t.params for t in trials[1:4]]
    later = [t.params for t in trials[4:7]]
    assert first != later  # the sampler was not restarted from the same seed


def test_a_continued_study_keeps_its_stored_budget(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    run_study(CONFIG, workload=tiny_workload, storage=sqlite_url, n_trials=2)
    study = optuna.load_study(study_name="runner", storage=sqlite_url)
    assert study.user_attrs["trial_budget"] == 2
    study.set_user_attr("trial_budget", 4)  # as `run --n-trials 4` interrupted early leaves it
    run_study(CONFIG, workload=tiny_workload, storage=sqlite_url)  # config says 3
    study = optuna.load_study(study_name="runner", storage=sqlite_url)
    assert len(study.trials) == 4 and study.user_attrs["trial_budget"] == 4
    with pytest.raises(UserError, match="--n-trials 0"):
        run_study(CONFIG, workload=tiny_workload, storage=sqlite_url, n_trials=0)


def test_a_study_is_bound_to_its_hardware(
    tiny_workload: Workload, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_study(CONFIG, workload=tiny_workload, storage=sqlite_url, n_trials=1)
    # The same study continued on a machine with other usable CPUs.
    monkeypatch.setattr("loader_search.study.work._machine.usable_cpus", lambda: 64)
    with pytest.raises(UserError, match=r"measures hardware class cpu-\d+c-\w+, but this"):
        run_study(CONFIG, workload=tiny_workload, storage=sqlite_url, n_trials=2)


def test_a_finished_grid_is_not_measured_again(tiny_workload: Workload, sqlite_url: str) -> None:
    space = dataclasses.replace(SPACE, batch_sizes=(16,), prefetch_factor=IntRange(1, 1))
    config = dataclasses.replace(CONFIG, trials=5, space=space, sampler=SamplerConfig("grid"))
    run_study(config, workload=tiny_workload, storage=sqlite_url)  # 2 combinations
    run_study(config, workload=tiny_workload, storage=sqlite_url)
    trials = optuna.load_study(study_name="runner", storage=sqlite_url).get_trials()
    assert len(trials) == 2


def test_n_trials_below_what_the_study_has(tiny_workload: Workload, sqlite_url: str) -> None:
    run_study(CONFIG, workload=tiny_workload, storage=sqlite_url, n_trials=3)
    with pytest.raises(UserError, match="--n-trials 2 is below the 3 trials"):
        run_study(CONFIG, workload=tiny_workload, storage=sqlite_url, n_trials=2)
    study = optuna.load_study(study_name="runner", storage=sqlite_url)
    assert study.user_attrs["trial_budget"] == 3


def test_after_a_failed_baseline_the_fixed_study_runs_in_full(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    diverging = dataclasses.replace(CONFIG, training=dataclasses.replace(CONFIG.training, lr=1e30))
    with pytest.raises(StudyAborted):
        run_study(diverging, workload=timed_workload(), storage=sqlite_url)
    # The user fixes the learning rate: nothing was measured, so the study takes the new
    # settings, and the failed baseline used none of the budget.
    summary = run_study(CONFIG, workload=timed_workload(), storage=sqlite_url)
    trials = optuna.load_study(study_name="runner", storage=sqlite_url).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] + [TrialState.COMPLETE] * 3
    assert trials[0].user_attrs["failure_reason"] == "diverged"
    assert summary.baseline is not None and summary.baseline.number == 1


@pytest.mark.parametrize("prefetch_max", [1, 2])
def test_the_baseline_outside_the_grid_takes_none_of_its_points(
    prefetch_max: int, tiny_workload: Workload, sqlite_url: str
) -> None:
    # num_workers from 1: the baseline (0 workers) is no point of the grid, which has
    # 1 or 2 combinations (1 worker, prefetch 1 or 2); each is measured once, then it stops.
    space = dataclasses.replace(
        SPACE,
        batch_sizes=(16,),
        num_workers=CpuRange(1, 1),
        prefetch_factor=IntRange(1, prefetch_max),
    )
    config = dataclasses.replace(CONFIG, trials=5, space=space, sampler=SamplerConfig("grid"))
    run_study(config, workload=tiny_workload, storage=sqlite_url)
    trials = optuna.load_study(study_name="runner", storage=sqlite_url).get_trials()
    assert trials[0].user_attrs["baseline"] is True
    searched = [t.params for t in trials[1:]]
    assert sorted(p["prefetch_factor"] for p in searched) == list(range(1, prefetch_max + 1))
    assert all(p["num_workers"] == 1 for p in searched)
    assert all(t.state == TrialState.COMPLETE for t in trials)


def test_the_study_records_the_machine_it_is_bound_to(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    # What docs/how-it-works.md lists, read with plain Optuna.
    run_study(CONFIG, workload=tiny_workload, storage=sqlite_url, n_trials=1)
    study = optuna.load_study(study_name="runner", storage=sqlite_url)
    attrs = study.user_attrs
    hardware = study.trials[0].user_attrs["hardware"]
    assert attrs["device"] == "cpu"
    assert attrs["device_name"] == hardware["cpu_model"]
    assert attrs["usable_cpus"] == hardware["usable_cpus"] >= 1
    assert attrs["hardware_class"] == hardware["hardware_class"]
    assert attrs["torch_version"] == torch.__version__
    assert attrs["optuna_version"] == optuna.__version__
    for key in ("python_version", "trial_budget", "fingerprint"):
        assert key in attrs, key


def test_a_study_leaves_nothing_beside_its_database_but_the_database(
    tiny_workload: Workload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default storage, in the working folder, where a user would commit a stray file.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOADER_SEARCH_STORAGE", raising=False)
    run_study(CONFIG, workload=tiny_workload, n_trials=1, quiet=True)
    assert sorted(os.listdir(tmp_path)) == ["loader_search.db"]
