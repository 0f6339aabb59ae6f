"""Model-guided search on real tiny studies: every trial measures its stage costs, the model's
proposals run right after the baseline, its predictions and their errors are stored, and the
answer names the pipeline limit and the bottleneck (`best --json`). Real SQLite, real
training, real Optuna; the pure parts on hand-made trials."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study import (
    MODEL_ROUND_ATTR,
    PREDICTED_ATTR,
    CpuRange,
    IntRange,
    SamplerConfig,
    SearchSpace,
    StudyConfig,
    run_study,
)
from loader_search.study._keys import PIPELINE_ATTR, PREDICTION_ERROR_ATTR
from loader_search.study.search import BOTTLENECKS, Guide, Proposal
from loader_search.workloads import Workload
from tests.conftest import TINY_CONFIG, invoke

SPACE = SearchSpace(
    batch_sizes=(16, 32),
    num_workers=CpuRange(0, 1),
    prefetch_factor=IntRange(1, 2),
    persistent_workers=None,
    torch_threads=1,
)
CONFIG = StudyConfig(
    confirm_top=0,
    name="guided",
    trials=5,
    device="cpu",
    sampler=SamplerConfig(name="random"),
    training=TrainingSettings(train_samples=512, batch_size=16, eval_batch_size=64),
    space=SPACE,
)
STAGE_COSTS = (
    "producer_cpu_s_per_sample",
    "collate_cpu_s_per_batch",
    "main_cpu_s_per_batch",
    "cpu_used_cores",
    "cpus_available",
)


def test_the_model_picks_the_trials_after_the_baseline(
    tiny_workload: Workload, sqlite_url: str
) -> None:
    summary = run_study(CONFIG, workload=tiny_workload, storage=sqlite_url)
    study = optuna.load_study(study_name="guided", storage=sqlite_url)
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(trials) == 5
    baseline, *rest = trials
    assert baseline.user_attrs["baseline"] is True
    for trial in trials:  # every trial measured its stages, with units in the names
        for key in STAGE_COSTS:
            assert trial.user_attrs[key] > 0, (trial.number, key)
        assert trial.user_attrs["cpus_available"] >= 1
    # Round 1: the model's best setting of each batch size, right after the baseline.
    first_round = [t for t in rest if t.user_attrs.get(MODEL_ROUND_ATTR) == 1]
    assert first_round and [t.number for t in first_round] == list(range(1, 1 + len(first_round)))
    assert {t.user_attrs["loader_params"]["batch_size"] for t in first_round} <= {16, 32}
    # Every trial after the baseline was predicted, and its error is what was measured.
    for trial in rest:
        predicted = trial.user_attrs[PREDICTED_ATTR]
        error = trial.user_attrs[PREDICTION_ERROR_ATTR]
        assert error == pytest.approx(trial.values[0] / predicted - 1)
    # The model is stored with the study, and the answer reads it.
    stored = study.user_attrs[PIPELINE_ATTR]
    (snapshot,) = stored.values()
    assert set(snapshot["batch_sizes"]) == {"16", "32"}
    assert snapshot["model"]["fetch_cpu_s_per_sample"] > 0
    assert summary.recommended is not None  # the run's own summary predates the last write
    pipeline = summary.recommended.pipeline
    assert pipeline is not None
    assert pipeline.bottleneck in BOTTLENECKS
    assert 0 < pipeline.efficiency_vs_limit <= 1.0


def test_best_json_names_the_limit_and_the_bottleneck(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_CONFIG.format(trials=4))
    url = f"sqlite:///{tmp_path / 'guided.db'}"
    env = {"LOADER_SEARCH_LOCK_DIR": str(tmp_path / "locks")}
    assert invoke("run", str(config), "--storage", url, env=env).returncode == 0
    shown = invoke("best", "tiny", "--storage", url, "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    recommended = json.loads(shown.stdout)["recommended"]
    pipeline = recommended["pipeline"]
    assert pipeline["bottleneck"] in BOTTLENECKS
    assert pipeline["limit_samples_per_s"] >= recommended["throughput"]
    assert pipeline["efficiency_vs_limit"] == pytest.approx(
        recommended["throughput"] / pipeline["limit_samples_per_s"]
    )
    for lift in pipeline["lifts"]:
        assert lift["gain"] > 1 and lift["predicted_limit_samples_per_s"] > 0
    text = invoke("best", "tiny", "--storage", url, env=env).stdout
    assert "pipeline limit at batch" in text


def test_the_model_can_be_turned_off(tiny_workload: Workload, sqlite_url: str) -> None:
    config = dataclasses.replace(
        CONFIG, sampler=SamplerConfig(name="random", model=False), trials=3
    )
    run_study(config, workload=tiny_workload, storage=sqlite_url)
    study = optuna.load_study(study_name="guided", storage=sqlite_url)
    assert not any(MODEL_ROUND_ATTR in t.user_attrs for t in study.trials)
    assert not any(PREDICTED_ATTR in t.user_attrs for t in study.trials)
    assert PIPELINE_ATTR not in study.user_attrs


def _trial(
    params: LoaderParams, throughput: float, loss: float = 1.0, **attrs: object
) -> optuna.trial.FrozenTrial:
    user_attrs = {
        "loader_params": params.as_dict(),
        "producer_cpu_s_per_sample": 1e-4,
        "collate_cpu_s_per_batch": 1e-4 * params.batch_size / 10,
        "main_cpu_s_per_batch": 1e-4 * params.batch_size / 10,
        **attrs,
    }
    return optuna.trial.create_trial(
        params={},
        distributions={},
        values=[throughput, loss],
        user_attrs=user_attrs,
    )


def _propose(guide: Guide, trials: list[optuna.trial.FrozenTrial]) -> list[Proposal]:
    return guide.proposals(trials, guide.model(trials))


def test_proposals_wait_for_the_baseline_and_each_round_to_finish() -> None:
    space = SearchSpace(
        batch_sizes=(32, 64), num_workers=CpuRange(0, 2), persistent_workers=None
    ).resolve(2, cuda=False)
    guide = Guide(space, "cpu", 2)
    base_params = LoaderParams(64, torch_threads=2)
    assert _propose(guide, []) == []  # nothing measured: nothing to fit
    baseline = _trial(base_params, 5_000.0, baseline=True, ceiling_samples_per_s=10_000.0)
    first = _propose(guide, [baseline])
    assert {p.params.batch_size for p in first} == {32, 64}
    assert all(p.round == 1 and p.params != base_params for p in first)
    assert [p.predicted for p in first] == sorted((p.predicted for p in first), reverse=True)
    # While round 1 is queued, nothing more is proposed.
    queued = optuna.trial.create_trial(state=TrialState.WAITING, user_attrs={MODEL_ROUND_ATTR: 1})
    assert _propose(guide, [baseline, queued]) == []
    # Round 1 measured exactly as predicted: round 2 has nothing to check, so round 3 (the
    # leader's prefetch neighbours) comes next.
    round_one = {MODEL_ROUND_ATTR: 1, "ceiling_samples_per_s": 8e3}
    done = [
        _trial(p.params, p.predicted, **round_one, **{PREDICTED_ATTR: p.predicted}) for p in first
    ]
    second = _propose(guide, [baseline, *done])
    assert second and all(p.round == 3 for p in second)
    # A round-1 trial far off its prediction makes its batch size worth a second look.
    missed = first[0]
    off = _trial(
        missed.params, missed.predicted * 0.5, **round_one, **{PREDICTED_ATTR: missed.predicted}
    )
    again = _propose(guide, [baseline, off, *done[1:]])
    assert any(p.params.batch_size == missed.params.batch_size for p in again)
    assert math.isfinite(sum(p.predicted for p in again))


def test_later_rounds_skip_what_the_loss_rules_out_then_try_the_leaders_prefetch() -> None:
    space = SearchSpace(
        batch_sizes=(32, 64), num_workers=CpuRange(0, 2), persistent_workers=None
    ).resolve(2, cuda=False)
    guide = Guide(space, "cpu", 2, loss_tolerance=0.05)
    baseline = _trial(
        LoaderParams(64, torch_threads=2), 5_000.0, baseline=True, ceiling_samples_per_s=1e4
    )
    first = _propose(guide, [baseline])
    # Both round-1 trials miss their predictions (so both batch sizes are unsure), and batch
    # 32 trains to a val_loss far above the baseline's: it cannot be recommended.
    losses = {32: 2.0, 64: 1.01}
    done = [
        _trial(
            p.params,
            p.predicted * 0.5,
            losses[p.params.batch_size],
            **{MODEL_ROUND_ATTR: 1, PREDICTED_ATTR: p.predicted, "ceiling_samples_per_s": 8e3},
        )
        for p in first
    ]
    second = _propose(guide, [baseline, *done])
    assert [p.params.batch_size for p in second] == [64]
    assert second[0].round == 2
    # Round 2 measured the fastest setting within the tolerance: round 3 tries it with half
    # and twice its prefetch depth, and nothing else.
    leader = second[0].params
    assert leader.prefetch_factor == 2
    measured = _trial(leader, 9_000.0, 1.0, **{MODEL_ROUND_ATTR: 2})
    slower = _trial(dataclasses.replace(leader, batch_size=32), 9_500.0, 2.0)
    third = _propose(guide, [baseline, *done, measured, slower])
    assert {p.params for p in third} == {
        dataclasses.replace(leader, prefetch_factor=1),
        dataclasses.replace(leader, prefetch_factor=4),
    }
    assert all(p.round == 3 for p in third)
    # Once they ran, the model has nothing more to ask: the sampler goes on.
    ran = [_trial(p.params, 8_000.0, **{MODEL_ROUND_ATTR: 3}) for p in third]
    assert _propose(guide, [baseline, *done, measured, slower, *ran]) == []


NOISE = {"noise_steps": 20, "noise_grad_sq": 1.0}


def test_with_a_noise_scale_round_one_queues_by_goodput_and_a_goodput_study_prunes_by_it() -> None:
    space = SearchSpace(
        batch_sizes=(32, 256), num_workers=CpuRange(0, 2), persistent_workers=None
    ).resolve(2, cuda=False)
    base_params = LoaderParams(32, torch_threads=2)

    def measured(trace: float | None) -> list[optuna.trial.FrozenTrial]:
        # The baseline, and a batch-256 trial whose step is much faster per sample (its
        # ceiling): the model predicts batch 256 the faster of the two.
        noise = {} if trace is None else {**NOISE, "noise_trace": trace}
        return [
            _trial(base_params, 5_000.0, baseline=True, ceiling_samples_per_s=1e4, **noise),
            _trial(LoaderParams(256, torch_threads=2), 9_000.0, ceiling_samples_per_s=4e4),
        ]

    guide = Guide(space, "cpu", 2)
    by_speed = _propose(guide, measured(None))
    assert [p.params.batch_size for p in by_speed] == [256, 32]
    assert by_speed[0].predicted > by_speed[1].predicted
    # B_noise = 8: a batch of 256 makes (8 + 32) / (8 + 256) = 0.15 of the progress per
    # sample, so it comes last; at B_noise = 1e6 the speed decides, as without one.
    assert [p.params.batch_size for p in _propose(guide, measured(8.0))] == [32, 256]
    assert [p.params.batch_size for p in _propose(guide, measured(1e6))] == [256, 32]
    # A goodput study: after round 1, a batch size whose best predicted goodput cannot reach
    # the leader's is not proposed again, though its trial missed its prediction; the loss
    # tolerance rules nothing out.
    goodput = Guide(space, "cpu", 2, loss_tolerance=0.05, objective="goodput")
    first = _propose(goodput, measured(8.0))
    missed = [
        _trial(
            p.params,
            p.predicted * 0.5,
            5.0,  # far above the tolerance
            **{MODEL_ROUND_ATTR: 1, PREDICTED_ATTR: p.predicted, "ceiling_samples_per_s": 8e3},
        )
        for p in first
    ]
    again = _propose(goodput, [*measured(8.0), *missed])
    assert again and {p.params.batch_size for p in again} == {32}
    # A throughput study, the same trials: batch 256 again (its other trial's loss is within
    # the tolerance), whatever it costs in samples.
    plain = Guide(space, "cpu", 2, loss_tolerance=0.05)
    assert 256 in {p.params.batch_size for p in _propose(plain, [*measured(8.0), *missed])}
