"""Goodput: the study's pooled gradient noise scale, the statistical efficiency of a batch size,
and the goodput rule of the recommendation and the paired rounds, on trials of real Optuna
studies (the training behind the noise scale itself: tests/test_noise.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams
from loader_search.study import (
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    PARAMS_ATTR,
    TrialPoint,
)
from loader_search.study.stats import (
    ConfirmSettings,
    NoiseScale,
    critical_batch_text,
    pooled_noise_scale,
    recommend,
    rounds_of,
    summarize_trials,
)
from loader_search.study.stats._confirm import paired_speedups
from tests.conftest import invoke

BASE = LoaderParams(64, 0, torch_threads=2)
BIG = LoaderParams(256, 1, 2, False, True, 1)  # faster per sample, less progress per sample
SMALL = LoaderParams(32, 1, 2, False, True, 1)


def _trial(
    params: LoaderParams,
    throughput: float,
    loss: float,
    *,
    noise: tuple[int, float, float] | None = None,
    **attrs: object,
) -> FrozenTrial:
    """A completed trial; ``noise``: (steps, mean |G|^2, mean tr(Sigma)) as a trial stores
    them."""
    if noise is not None:
        steps, grad_sq, trace = noise
        attrs.update(noise_steps=steps, noise_grad_sq=grad_sq, noise_trace=trace)
        attrs["gradient_noise_scale"] = trace / grad_sq
        attrs["gradient_noise_scale_se"] = 0.2 * trace / grad_sq
    return optuna.trial.create_trial(
        state=TrialState.COMPLETE,
        params={"num_workers": params.num_workers},
        distributions={"num_workers": IntDistribution(0, 3)},
        values=[throughput, loss],
        user_attrs={PARAMS_ATTR: params.as_dict(), **attrs},
    )


def _numbered(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    for number, trial in enumerate(trials):
        trial.number = number
    return trials


def test_the_pooled_noise_scale_is_the_ratio_of_the_step_weighted_means(tmp_path: Path) -> None:
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 's.db'}", directions=["maximize", "minimize"]
    )
    # Two trials that measured it (one of 30 steps, one of 10), one that did not, and a
    # confirmation trial, which never counts.
    study.add_trial(_trial(BASE, 1000, 1.0, noise=(30, 2.0, 100.0)))
    study.add_trial(_trial(BIG, 1500, 1.2, noise=(10, 1.0, 300.0)))
    study.add_trial(_trial(SMALL, 900, 0.9))
    study.add_trial(_trial(BIG, 1500, 1.2, noise=(50, 1.0, 9e9), **{CONFIRMATION_ATTR: True}))
    noise = pooled_noise_scale(study.get_trials())
    assert noise is not None
    grad_sq = (30 * 2.0 + 10 * 1.0) / 40
    trace = (30 * 100.0 + 10 * 300.0) / 40
    assert noise.value == pytest.approx(trace / grad_sq)  # 85.7, not the mean of 50 and 300
    assert (noise.trials, noise.steps) == (2, 40)
    assert 0 <= noise.low < noise.value < noise.high < math.inf
    assert pooled_noise_scale([_trial(BASE, 1000, 1.0)]) is None
    # |G|^2 within its noise of zero or below: no figure at all.
    assert pooled_noise_scale([_trial(BASE, 1, 1.0, noise=(9, -1.0, 5.0))]) is None


def test_the_interval_comes_from_resampling_the_trials_and_narrows_with_them() -> None:
    def trials(n: int) -> list[FrozenTrial]:
        # Trials whose own estimates scatter around 200 (between 150 and 250).
        return [
            _trial(BASE, 1000, 1.0, noise=(20, 1.0, 150.0 + 100.0 * (i % 5) / 4)) for i in range(n)
        ]

    few, many = pooled_noise_scale(trials(5)), pooled_noise_scale(trials(40))
    assert few is not None and many is not None
    assert few.low < 200 < few.high and many.low < 200 < many.high
    assert many.high - many.low < few.high - few.low
    assert pooled_noise_scale(trials(40)) == many  # seeded: every view states the same


def test_efficiency_is_one_at_the_reference_and_falls_above_the_noise_scale() -> None:
    noise = NoiseScale(value=64.0, low=32.0, high=128.0, trials=4, steps=100)
    assert noise.efficiency(64, 64) == 1.0
    # (64 + 64) / (64 + 256): a batch 4x the reference makes 0.4 of the progress per sample.
    assert noise.efficiency(256, 64) == pytest.approx(0.4)
    assert noise.efficiency(32, 64) == pytest.approx(128 / 96)
    low, high = noise.efficiency_range(256, 64)
    assert low == pytest.approx(96 / 288) and high == pytest.approx(192 / 384)
    unbounded = NoiseScale(value=64.0, low=0.0, high=math.inf, trials=1, steps=5)
    assert unbounded.efficiency_range(256, 64) == (pytest.approx(64 / 256), 1.0)
    text = critical_batch_text(noise)
    assert text.startswith("gradient noise scale B_noise ~ 64 (95% CI 32-128; 4 trial(s)")
    assert "above about B_noise = 64, a larger batch needs proportionally more samples" in text
    assert "at least 0;" in critical_batch_text(unbounded)


def test_with_ranks_the_efficiency_is_of_the_nodes_batch() -> None:
    # Trials of 2 ranks: a setting's batch_size is per rank, a step's batch twice it.
    trials = [_trial(BASE, 1000, 1.0, noise=(20, 1.0, 128.0), ranks=2) for _ in range(4)]
    noise = pooled_noise_scale(trials)
    assert noise is not None and noise.ranks == 2 and noise.value == pytest.approx(128)
    # (128 + 2 x 64) / (128 + 2 x 256) = 0.4, where one rank's batches would give 0.5.
    assert noise.efficiency(256, 64) == pytest.approx(0.4)
    assert noise.as_dict()["ranks"] == 2
    assert "B_noise = 128 samples a step (64 a rank on 2 ranks)" in critical_batch_text(noise)
    single = pooled_noise_scale([_trial(BASE, 1000, 1.0, noise=(20, 1.0, 128.0))])
    assert single is not None and single.ranks == 1
    assert single.efficiency(256, 64) == pytest.approx(0.5)


def _point(number: int, params: LoaderParams, throughput: float, loss: float) -> TrialPoint:
    return TrialPoint(number, params, throughput, loss, params == BASE)


def test_goodput_prefers_the_large_batch_only_when_the_noise_scale_allows_it() -> None:
    base = _point(0, BASE, 1000, 1.0)
    big = _point(1, BIG, 1600, 1.3)  # 1.6x the samples/s, a worse loss after the budget
    front = (big, base)
    # The throughput rule: the large batch's loss is beyond the tolerance.
    plain = recommend(front, base, 0.05)
    assert plain is not None and plain.point == base
    # A small noise scale: a batch of 256 makes 0.4 of the progress per sample, so its
    # goodput is 0.64x the baseline's: keep the baseline.
    small_noise = NoiseScale(64.0, 32.0, 128.0, 4, 100)
    rec = recommend(front, base, 0.05, noise=small_noise, points=front)
    assert rec is not None and rec.point == base and rec.objective == "goodput"
    # A large one: 256 is far below it, its goodput 1.6 x 0.97 = 1.55x: the large batch,
    # whatever its loss after the fixed budget.
    large_noise = NoiseScale(5000.0, 4000.0, 6000.0, 4, 100)
    rec = recommend(front, base, 0.05, noise=large_noise, points=front)
    assert rec is not None and rec.point == big
    assert rec.speedup_vs_baseline == pytest.approx(1.6 * 5064 / 5256)
    assert "goodput" in rec.rule and "B_noise ~ 5,000" in rec.rule
    assert "the baseline's goodput" in (rec.speedup_text() or "")


def _confirmed_study(trace: float) -> list[FrozenTrial]:
    """A search (the baseline, a batch-256 setting 1.6x as fast), then 6 paired rounds in
    which the 256 setting reads 1.6x the baseline again; the noise scale ``trace`` / 1."""
    trials = [
        _trial(BASE, 1000, 1.0, noise=(40, 1.0, trace), **{BASELINE_ATTR: True}),
        _trial(BIG, 1600, 1.3, noise=(10, 1.0, trace)),
        _trial(SMALL, 900, 0.9, noise=(80, 1.0, trace)),
        _trial(SMALL, 910, 0.9, noise=(80, 1.0, trace)),
    ]
    for round_ in range(6):
        wobble = 1 + 0.02 * (round_ % 3 - 1)
        for params, value in ((BASE, 1000.0), (BIG, 1600.0 * wobble)):
            attrs = {CONFIRMATION_ATTR: True, CONFIRM_ROUND_ATTR: round_}
            trials.append(_trial(params, value, 1.0, **attrs))
    return _numbered(trials)


def test_a_goodput_studys_rounds_and_claim_are_of_goodput() -> None:
    settings = ConfirmSettings(
        top=1, min_rounds=3, max_rounds=8, half_width=0.05, loss_tolerance=0.05
    )
    goodput = ConfirmSettings(
        top=1,
        min_rounds=3,
        max_rounds=8,
        half_width=0.05,
        loss_tolerance=0.05,
        objective="goodput",
    )
    trials = _confirmed_study(trace=5000.0)
    # By throughput the large batch is no candidate (its loss); by goodput it is.
    assert rounds_of(trials, settings).candidates == ()
    rounds = rounds_of(trials, goodput)
    assert rounds.candidates == (BIG,)
    assert rounds.scale[BIG] == pytest.approx(5064 / 5256)
    # Its paired ratios are the throughput ratios times its efficiency.
    plain = paired_speedups(trials, BASE)[BIG]
    scaled = paired_speedups(trials, BASE, scale=rounds.scale)[BIG]
    assert scaled.estimate == pytest.approx(plain.estimate * 5064 / 5256)
    summary = summarize_trials("s", trials, 0.05, objective="goodput")
    rec = summary.recommended
    assert rec is not None and rec.point.params == BIG and rec.paired is not None
    assert rec.verdict == "faster" and rec.paired.low > 1
    # The claim's interval is widened by the noise scale's own.
    assert rec.paired.low <= scaled.low and rec.paired.high >= scaled.high
    data = summary.as_dict()
    assert data["objective"] == "goodput" and data["gradient_noise_scale"]["value"] == 5000
    assert data["recommended"]["goodput"] == pytest.approx(rec.point.throughput * 5064 / 5256)
    assert data["baseline"]["goodput"] == pytest.approx(summary.baseline.throughput)
    # At a small noise scale the same readings give the large batch no goodput gain: 0.4 of
    # the progress per sample at 1.6x the samples/s. Keep the baseline.
    small = summarize_trials("s", _confirmed_study(trace=64.0), 0.05, objective="goodput")
    rec = small.recommended
    assert rec is not None and rec.verdict == "no_reliable_gain"
    assert rec.speedup_vs_baseline == pytest.approx(0.64, rel=0.02)
    assert "sure to reach your baseline's loss sooner" in (rec.speedup_text() or "")
    # A throughput study shows the goodput beside, and recommends by throughput.
    shown = summarize_trials("s", trials, 0.05)
    assert shown.objective == "throughput" and shown.noise is not None
    assert shown.recommended is not None and shown.recommended.objective == "throughput"


GOODPUT_STUDY = """
[study]
name = "goodput"
trials = {trials}
objective = "{objective}"
confirm_top = 1
confirm_min_rounds = 2
confirm_max_rounds = 3
[sampler]
name = "random"
[workload]
name = "{plugin}"
[workload.options]
offset = 0.3  # B_noise about 19 (tests/plugins/least_squares.py)
[training]
device = "cpu"
train_samples = 2048
batch_size = 16
[space]
batch_size = [16, 64]
num_workers = {{ min = 0, max = 1 }}
prefetch_factor = 2
torch_threads = 1
"""
PLUGIN = Path(__file__).parent / "plugins" / "least_squares.py"


def test_a_goodput_study_through_the_cli_states_the_noise_scale_and_goodput(
    tmp_path: Path, sqlite_url: str
) -> None:
    # A real small study that maximises goodput, of a least-squares problem whose noise scale
    # is known (split batches measure it).
    config = tmp_path / "goodput.toml"
    plugin = f"{PLUGIN}:build"
    config.write_text(GOODPUT_STUDY.format(trials=4, objective="goodput", plugin=plugin))
    ran = invoke("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    study = optuna.load_study(study_name="goodput", storage=sqlite_url)
    assert study.user_attrs["objective"] == "goodput"
    assert "gradient noise scale B_noise ~" in ran.stdout
    assert "goodput" in ran.stdout.split("Pareto front", 1)[1]  # the table's column
    best = invoke("best", "goodput", "--storage", sqlite_url, "--json")
    data = json.loads(best.stdout)
    assert data["objective"] == "goodput"
    noise = data["gradient_noise_scale"]
    assert noise["trials"] >= 4
    assert noise["ci95"][0] <= 19.2 <= noise["ci95"][1] or 8 < noise["value"] < 45
    assert data["recommended"]["objective"] == "goodput"
    assert "goodput" in data["recommended"]["rule"]
    assert all(p["goodput"] > 0 for p in data["pareto"])
    # An objective that is none is one line, exit 2.
    config.write_text(GOODPUT_STUDY.format(trials=2, objective="speed", plugin=plugin))
    bad = invoke("run", str(config), "--storage", sqlite_url)
    assert bad.returncode == 2 and "study.objective" in bad.stderr + bad.stdout
