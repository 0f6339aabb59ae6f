"""Early stop by reused validation loss, the ceiling, and the re-measurement of candidates,
on real studies (SQLite file, real tiny training runs)."""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from loader_search.errors import UserError
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study import (
    BASELINE_ATTR,
    CEILING_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    LOADER_EFFICIENCY_ATTR,
    PARAMS_ATTR,
    VAL_LOSS_ATTR,
    VAL_LOSS_FROM,
    CpuRange,
    IntRange,
    NullReporter,
    SamplerConfig,
    SearchSpace,
    StudyConfig,
    TrialPoint,
    create_session,
    pareto_front,
    run_study,
)
from loader_search.study._keys import CEILING_FROM, TRIAL_PROCESS_ATTR
from loader_search.study._points import merge_repeats
from loader_search.study.stats._confirm import _disturbed
from loader_search.study.work import Machine, count_finished, fresh_recipe
from loader_search.study.work._plan import trusted_ceiling
from loader_search.trial import WorkloadRecipe
from loader_search.workloads import Workload

TRAINING = TrainingSettings(train_samples=512, batch_size=16, eval_batch_size=64)
CONFIG = StudyConfig(
    name="reuse",
    trials=6,
    device="cpu",
    training=TRAINING,
    space=SearchSpace(
        batch_sizes=(16, 32),
        num_workers=CpuRange(0, 1),
        prefetch_factor=IntRange(1, 2),
        persistent_workers=False,
        torch_threads=1,
    ),
    sampler=SamplerConfig(name="random"),
)


def _complete(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(states=(TrialState.COMPLETE,))


def _params(trial: FrozenTrial) -> LoaderParams:
    return LoaderParams.from_dict(trial.user_attrs[PARAMS_ATTR])


def test_later_trials_of_a_batch_size_stop_early_with_its_known_val_loss(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    config = dataclasses.replace(CONFIG, confirm_top=0)
    run_study(config, workload=tiny_workload, storage=sqlite_url)
    study = optuna.load_study(study_name="reuse", storage=sqlite_url)
    trials = _complete(study)
    assert len(trials) == 6
    by_batch: dict[int, list[FrozenTrial]] = {}
    for trial in trials:
        by_batch.setdefault(_params(trial).batch_size, []).append(trial)
    early = 0
    for group in by_batch.values():
        first, *later = group
        # The first trial of a batch size trains its whole budget and is evaluated.
        assert VAL_LOSS_ATTR in first.user_attrs and VAL_LOSS_FROM not in first.user_attrs
        assert first.user_attrs["train_samples"] == TRAINING.train_samples
        for trial in later:
            sources = trial.user_attrs[VAL_LOSS_FROM]
            assert sources and all(study.trials[n] in group for n in sources)
            known = statistics.median(study.trials[n].user_attrs[VAL_LOSS_ATTR] for n in sources)
            assert trial.values[1] == known
            assert trial.user_attrs["stopped_early"] is True
            assert trial.user_attrs["train_samples"] < TRAINING.train_samples
            assert VAL_LOSS_ATTR not in trial.user_attrs
            early += 1
    assert early >= 1
    # Every trial reports its loader efficiency; the ceiling is measured by the first trial
    # of each batch size and thread count (threads are fixed here), then reused while a
    # reading can be trusted (see loader_search.study.work._plan); a trial reads it again only
    # when no earlier reading of its pair could be.
    assert all(t.user_attrs[LOADER_EFFICIENCY_ATTR] > 0 for t in trials)
    for group in by_batch.values():
        assert CEILING_ATTR in group[0].user_attrs
        for n, trial in enumerate(group[1:], start=1):
            before = group[:n]
            fastest = max(t.values[0] for t in before)
            trusted = [t for t in before if trusted_ceiling(t, fastest)]
            if CEILING_ATTR in trial.user_attrs:
                assert not trusted, "a trusted reading was read again"
            else:
                assert trial.user_attrs[CEILING_FROM]
                assert all(
                    _params(study.trials[n]).batch_size == _params(trial).batch_size
                    for n in trial.user_attrs[CEILING_FROM]
                )


def test_without_reuse_every_trial_is_evaluated(tiny_workload: Workload, sqlite_url: str) -> None:
    config = dataclasses.replace(
        CONFIG,
        trials=4,
        confirm_top=0,
        training=dataclasses.replace(TRAINING, reuse_val_loss=False),
    )
    run_study(config, workload=tiny_workload, storage=sqlite_url)
    study = optuna.load_study(study_name="reuse", storage=sqlite_url)
    trials = _complete(study)
    assert len(trials) == 4
    for trial in trials:
        assert trial.values[1] == trial.user_attrs[VAL_LOSS_ATTR]
        assert trial.user_attrs["train_samples"] == TRAINING.train_samples
        assert VAL_LOSS_FROM not in trial.user_attrs


@pytest.mark.slow
@pytest.mark.parametrize("process", ["fork", "fresh"])
def test_candidates_are_confirmed_in_paired_rounds_before_the_recommendation(
    sqlite_url: str, process: str
) -> None:
    # A training step that waits 200 us per sample with the GIL released (the GPU stand-in):
    # a persistent loader worker decodes during the wait, so settings with one beat the
    # baseline (no workers) and there is something to confirm. Every batch size is within
    # the loss tolerance. The workload is the config's, so that a fresh process can build it
    # for the rounds (`confirm_process = "fresh"`).
    options = {"image_size": 16, "train_size": 256, "val_size": 64, "device_us_per_sample": 200}
    config = dataclasses.replace(
        CONFIG,
        workload_options=options,
        confirm_process=process,
        trials=5,
        loss_tolerance=10.0,
        confirm_top=2,
        confirm_min_rounds=2,
        confirm_max_rounds=4,
        confirm_half_width=0.05,
        training=dataclasses.replace(TRAINING, train_samples=1024),
        space=dataclasses.replace(
            CONFIG.space, num_workers=CpuRange(1, 1), persistent_workers=True
        ),
    )
    summary = run_study(config, storage=sqlite_url)
    study = optuna.load_study(study_name="reuse", storage=sqlite_url)
    trials = _complete(study)
    repeats = [t for t in trials if t.user_attrs.get(CONFIRMATION_ATTR)]
    assert summary.baseline is not None and summary.recommended is not None
    assert repeats, "settings with a worker beat the baseline: they are confirmed"
    # The search forks its trials from the worker; the rounds train as configured.
    assert {t.user_attrs[TRIAL_PROCESS_ATTR] for t in repeats} == {process}
    searched = [t for t in trials if t not in repeats]
    assert {t.user_attrs[TRIAL_PROCESS_ATTR] for t in searched} == {"fork"}
    # They come on top of the budget, which still counts exactly the search trials.
    assert len(trials) == config.trials + len(repeats)
    assert count_finished(study) == config.trials
    # Whole rounds, each with the baseline, between the minimum and the cap.
    # A reading disturbed by other load is measured again in its round (see _confirm): only
    # then does a setting appear twice in one round.
    rounds: dict[int, list[LoaderParams]] = {}
    for trial in sorted(repeats, key=lambda t: t.number):
        order = rounds.setdefault(trial.user_attrs[CONFIRM_ROUND_ATTR], [])
        params = _params(trial)
        if params in order:
            earlier = [t for t in repeats if t.number < trial.number and _params(t) == params]
            assert any(_disturbed(t) for t in earlier), (trial.number, params)
            continue
        order.append(params)
    assert sorted(rounds) == list(range(len(rounds)))
    assert 2 <= len(rounds) <= 4
    assert all(summary.baseline.params in order for order in rounds.values())
    assert {len(order) for order in rounds.values()} <= {2, 3}
    # Rotated: no setting leads two rounds in a row unless it is alone with the baseline.
    if len(rounds[0]) > 1:
        assert rounds[0][0] != rounds[1][0]
    # The recommendation's speedup is the paired estimate, with its interval and verdict;
    # its samples/s is still the median of every measurement of its setting.
    rec = summary.recommended
    # The claim comes from the rounds after the race, which measure only the baseline and the
    # leader (so that choosing the leader does not favour it); with fewer than two of those,
    # from every round that measured both.
    fresh = [o for o in rounds.values() if set(o) == {summary.baseline.params, rec.point.params}]
    both = [o for o in rounds.values() if rec.point.params in o]
    assert rec.paired is not None
    assert rec.paired.rounds == (len(fresh) if len(fresh) >= 2 else len(both))
    assert rec.speedup_vs_baseline == rec.paired.estimate
    document = summary.as_dict()["recommended"]
    assert document["speedup_ci95"] == [rec.paired.low, rec.paired.high]
    assert document["verdict"] in ("faster", "no_reliable_gain")
    ran = [t for t in trials if _params(t) == rec.point.params]
    assert rec.point.throughput == statistics.median(t.values[0] for t in ran)
    assert len([t for t in trials if t.user_attrs.get(BASELINE_ATTR)]) == 1
    # Every worker confirms alike: the settings are stored with the study.
    assert study.user_attrs["confirm"] == {
        "top": 2,
        "min_rounds": 2,
        "max_rounds": 4,
        "half_width": 0.05,
    }
    # A second run of the finished study queues nothing more.
    run_study(config, storage=sqlite_url)
    assert len(_complete(optuna.load_study(study_name="reuse", storage=sqlite_url))) == len(trials)


def test_where_a_confirmation_trial_trains() -> None:
    recipe = WorkloadRecipe("synthetic-images", {"image_size": 16})
    assert fresh_recipe(recipe, "fresh") == recipe
    assert fresh_recipe(recipe, "fork") is None
    for choice in ("fresh", "fork"):  # the caller's workload, built in memory
        assert fresh_recipe(None, choice) is None
    assert StudyConfig().confirm_process == "fresh"


def test_the_session_starts_the_fresh_process_that_its_worker_waits_for(
    sqlite_url: str, tmp_path: Path
) -> None:
    # A plug-in that leaves a file named by the process that built it.
    (tmp_path / "builds.py").write_text(
        "import os\nfrom pathlib import Path\nfrom tests._faults import good\n\n"
        "def recorded(folder):\n"
        "    Path(folder, f'built-{os.getpid()}').touch()\n"
        "    return good()\n"
    )
    config = dataclasses.replace(
        CONFIG,
        workload=f"{tmp_path / 'builds.py'}:recorded",
        workload_options={"folder": str(tmp_path)},
    )
    _, session = create_session(config, NullReporter(), storage=sqlite_url, machine=Machine())
    assert session is not None
    with session.fresh as host:
        assert host.building and host.process is not None
        assert host.settle() is None  # what `work` waits for before its first trial
        builders = {int(p.name.removeprefix("built-")) for p in tmp_path.glob("built-*")}
        # The session built its own workload, the fresh process its own: two processes.
        assert builders == {os.getpid(), host.process.pid}
    assert host.process is None
    # None where its confirmation trials would not use it.
    for number, changed in enumerate(({"confirm_process": "fork"}, {"confirm_top": 0})):
        other = dataclasses.replace(config, name=f"reuse-{number}", **changed)
        _, session = create_session(other, NullReporter(), storage=sqlite_url, machine=Machine())
        assert session is not None and session.fresh.process is None


def _point(number: int, batch: int, workers: int, throughput: float, loss: float) -> TrialPoint:
    params = LoaderParams(batch, workers, 2 if workers else None, torch_threads=1)
    return TrialPoint(number, params, throughput, loss, is_baseline=number == 0)


def test_repeats_become_one_point_with_medians() -> None:
    points = [
        _point(0, 16, 0, 100.0, 1.0),
        _point(1, 16, 1, 300.0, 1.0),
        _point(2, 16, 0, 130.0, 1.2),
        _point(3, 16, 0, 90.0, 1.1),
    ]
    merged = merge_repeats(points)
    assert len(merged) == 2
    baseline = merged[0]
    assert baseline.numbers == (0, 2, 3) and baseline.is_baseline
    assert baseline.throughput == 100.0 and baseline.val_loss == 1.1
    assert baseline.measurements == (100.0, 130.0, 90.0)
    assert baseline.spread == (130.0 - 90.0) / 100.0
    assert merged[1].numbers == (1,) and merged[1].spread is None


def test_pareto_front_keeps_only_undominated_points() -> None:
    a = _point(1, 16, 1, 300.0, 1.0)  # fastest
    b = _point(2, 32, 1, 200.0, 0.8)  # slower, better loss
    c = _point(3, 32, 0, 150.0, 0.9)  # dominated by b
    d = _point(4, 64, 0, 300.0, 1.2)  # as fast as a, worse loss: dominated
    assert pareto_front([c, d, b, a]) == (a, b)


def test_a_study_measured_over_another_window_is_not_continued(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    config = dataclasses.replace(CONFIG, trials=2, confirm_top=0)
    run_study(config, workload=tiny_workload, storage=sqlite_url)
    study = optuna.load_study(study_name="reuse", storage=sqlite_url)
    # What an earlier version stored: no throughput window (it measured the whole run).
    old = dict(study.user_attrs["fingerprint"])
    del old["throughput_window"]
    study.set_user_attr("fingerprint", old)
    with pytest.raises(UserError, match="throughput_window"):
        run_study(
            dataclasses.replace(config, trials=3), workload=tiny_workload, storage=sqlite_url
        )
    assert len(optuna.load_study(study_name="reuse", storage=sqlite_url).trials) == 2
