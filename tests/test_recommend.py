from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from loader_search.params import LoaderParams
from loader_search.study import BASELINE_ATTR, DIRECTIONS, PARAMS_ATTR, TrialPoint, summarize
from loader_search.study.stats import recommend


def point(number: int, throughput: float, loss: float, baseline: bool = False) -> TrialPoint:
    return TrialPoint(number, LoaderParams(64), throughput, loss, baseline)


def test_fastest_within_tolerance_of_the_baseline() -> None:
    base = point(0, 1000, 0.50, baseline=True)
    front = (point(3, 3000, 0.60), point(2, 2000, 0.51), point(1, 1500, 0.40))
    rec = recommend(front, base, loss_tolerance=0.05)
    assert rec is not None
    assert rec.point.number == 2  # 0.51 <= 0.525; 0.60 is too much worse
    assert rec.speedup_vs_baseline == pytest.approx(2.0)
    assert rec.val_loss_change_vs_baseline == pytest.approx(0.02)
    assert "0.525" in rec.rule and "baseline" in rec.rule
    loose = recommend(front, base, loss_tolerance=0.25)
    assert loose is not None and loose.point.number == 3


def test_without_a_baseline_the_best_loss_is_the_reference() -> None:
    front = (point(3, 3000, 0.60), point(1, 1500, 0.40))
    rec = recommend(front, None, loss_tolerance=0.05)
    assert rec is not None and rec.point.number == 1
    assert rec.speedup_vs_baseline is None
    assert recommend((), None, 0.05) is None


DISTRIBUTIONS = {
    "batch_size": CategoricalDistribution([32, 64]),
    "num_workers": IntDistribution(0, 2),
}


def _add(study: optuna.Study, params: dict, values: list[float] | None, **attrs) -> None:
    loader = LoaderParams(
        batch_size=params["batch_size"],
        num_workers=params["num_workers"],
        prefetch_factor=2 if params["num_workers"] else None,
    )
    study.add_trial(
        create_trial(
            params=params,
            distributions=DISTRIBUTIONS,
            values=values,
            state=TrialState.COMPLETE if values else TrialState.FAIL,
            user_attrs={PARAMS_ATTR: loader.as_dict(), **attrs},
        )
    )


def test_summary_of_a_real_study(tmp_path) -> None:
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 's.db'}", directions=list(DIRECTIONS), study_name="s"
    )
    _add(study, {"batch_size": 64, "num_workers": 0}, [1000, 0.5], **{BASELINE_ATTR: True})
    _add(study, {"batch_size": 64, "num_workers": 1}, [1800, 0.5])
    _add(study, {"batch_size": 64, "num_workers": 2}, [1700, 0.52])  # dominated
    _add(study, {"batch_size": 32, "num_workers": 2}, [1500, 0.3])
    _add(study, {"batch_size": 32, "num_workers": 1}, None)  # failed
    summary = summarize(study, loss_tolerance=0.05)
    assert (summary.n_complete, summary.n_failed) == (4, 1)
    assert [p.number for p in summary.pareto] == [1, 3]  # fastest first
    assert {p.number for p in summary.pareto} == {t.number for t in study.best_trials}
    assert summary.baseline is not None and summary.baseline.number == 0
    assert summary.baseline.measurements == ()
    assert summary.recommended is not None
    assert summary.recommended.point.number == 1
    assert summary.recommended.speedup_vs_baseline == pytest.approx(1.8)

    # The baseline's settings measured again: speedups divide by the median of both.
    _add(study, {"batch_size": 64, "num_workers": 0}, [1400, 0.5])
    summary = summarize(study, loss_tolerance=0.05)
    assert summary.baseline is not None and summary.baseline.number == 0
    assert summary.baseline.measurements == (1000, 1400)
    assert summary.baseline.throughput == pytest.approx(1200)
    assert summary.recommended is not None
    assert summary.recommended.speedup_vs_baseline == pytest.approx(1.5)
    data = summary.as_dict()
    assert data["recommended"]["params"]["num_workers"] == 1
    assert "DataLoader(" in data["recommended"]["snippet"]
