"""Every view labels from the verdict (`Recommendation.keeps_baseline`, `recommended_point`,
`worth_trying`, `PairedSpeedup.too_noisy`): the run's table and summary (`best`), `studies`,
`best --json`, the report and the dashboard note.

The studies are real SQLite studies whose trials are added through Optuna with the project's
own attribute keys and known readings: the search's readings, then paired confirmation rounds
beside the baseline, so that each verdict is known beforehand.
"""

from __future__ import annotations

import json
import re

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from loader_search.params import LoaderParams
from loader_search.reports import collect, render
from loader_search.reports._figures import pareto_figure
from loader_search.study import (
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    DIRECTIONS,
    PARAMS_ATTR,
    summarize,
)
from loader_search.study._keys import FINGERPRINT_ATTR
from loader_search.study._note import note_text
from loader_search.study.stats import PairedSpeedup
from tests.conftest import invoke

BASE = LoaderParams(64, 0, torch_threads=2)
FAST = LoaderParams(64, 2, 2, False, True, 1)
# Nothing in a CI "95% CI 1.02-1.08" (numbers) form, however it is written.
NUMBERED_CI = re.compile(r"95% CI \d")


def _add(study: optuna.Study, params: LoaderParams, throughput: float, **attrs: object) -> None:
    study.add_trial(
        create_trial(
            state=TrialState.COMPLETE,
            params={"num_workers": params.num_workers},
            distributions={"num_workers": IntDistribution(0, 3)},
            values=[throughput, 1.0],
            user_attrs={PARAMS_ATTR: params.as_dict(), **attrs},
        )
    )


def _study(url: str, name: str, search: list[float], rounds: list[tuple[float, float]]) -> None:
    """The baseline (100 samples/s) and FAST read ``search`` times in the search, then
    paired rounds of (baseline, FAST) readings."""
    study = optuna.create_study(storage=url, directions=list(DIRECTIONS), study_name=name)
    study.set_user_attr(FINGERPRINT_ATTR, {})  # what `best` looks for in a study of its own
    _add(study, BASE, 100.0, **{BASELINE_ATTR: True})
    for value in search:
        _add(study, FAST, value)
    for number, (base, fast) in enumerate(rounds):
        attrs = {CONFIRMATION_ATTR: True, CONFIRM_ROUND_ATTR: number}
        _add(study, BASE, base, **attrs)
        _add(study, FAST, fast, **attrs)


# "close": FAST reads faster than the baseline (its median and the paired estimate above 1),
# but its interval reaches below 1: keep the baseline, FAST worth trying anyway.
CLOSE = [(100.0, 100.0 * r) for r in (1.05, 0.95, 1.10, 0.97, 1.02, 1.08, 0.96, 1.04)]
# "slow": FAST's search readings make it the fastest by its median, the paired rounds measure
# it at 0.61x the baseline: keep the baseline, and never suggest FAST.
SLOW = [(100.0, 60.0), (100.0, 61.0), (100.0, 62.0)]
# "two": two rounds only: an interval that cannot be sized.
TWO = [(100.0, 140.0), (100.0, 110.0)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('verdict') / 'studies.db'}"
    _study(url, "close", [130.0], CLOSE)
    _study(url, "slow", [1000.0] * 5, SLOW)
    _study(url, "two", [150.0], TWO)
    return url


def _best(url: str, name: str) -> tuple[str, dict]:
    text = invoke("best", name, "--storage", url)
    document = invoke("best", name, "--storage", url, "--json")
    assert text.returncode == document.returncode == 0, text.stderr + document.stderr
    return " ".join(text.stdout.split()), json.loads(document.stdout)


def _front_row(text: str, number: int) -> str:
    """The table row of trial ``number`` (its first cell, marks included)."""
    found = re.search(rf"│ {number}( \*)?( b)? +│", text)
    assert found is not None, text
    return found.group(0)


def _studies_row(url: str, name: str) -> list[str]:
    listed = invoke("studies", "--storage", url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(f"│ {name} "))
    return [cell.strip() for cell in row.strip("│ ").split("│")]


def _report(url: str, name: str) -> tuple[str, dict]:
    """The HTML report as text, and its data (the JSON report's summary)."""
    study = optuna.load_study(study_name=name, storage=url)
    data = collect(study, 0.05)
    # The front's plot stars the recommended setting: none while the baseline is kept.
    rec = data.summary.recommended
    starred = [t for t in pareto_figure(data).data if t.name == "recommended"]
    assert len(starred) == (0 if rec is None or rec.keeps_baseline else 1)
    return " ".join(re.sub(r"<[^>]+>", " ", render(data)).split()), data.summary.as_dict()


def test_a_kept_baseline_marks_no_trial_recommended_in_any_view(url: str) -> None:
    summary = summarize(optuna.load_study(study_name="close", storage=url), 0.05)
    rec = summary.recommended
    assert rec is not None and rec.keeps_baseline and rec.recommended_point is None
    assert summary.baseline is not None
    fast = rec.point
    # The candidate has the best raw throughput: the trap the views used to fall into.
    assert fast.params == FAST and fast.throughput > summary.baseline.throughput
    assert rec.worth_trying == fast  # measured faster (1.02x): offered to try anyway

    text, document = _best(url, "close")
    assert "*" not in _front_row(text, fast.number)
    assert "Recommended: keep the baseline (trial #0)" in text
    assert f"Recommended: trial #{fast.number}" not in text
    assert f"should you try it anyway: trial #{fast.number}," in text
    assert document["keep_baseline"] is True and document["recommended_trial"] is None
    assert document["worth_trying_trial"] == fast.number
    assert document["recommended"]["keep_baseline"] is True

    cells = _studies_row(url, "close")
    assert cells[5] == f"{summary.baseline.throughput:,.0f}"  # the kept setting's samples/s
    assert cells[6].startswith("keep the baseline")

    page, report = _report(url, "close")
    assert "Recommended keep the baseline (trial #0)" in page
    assert f"Try it anyway? the best candidate, trial #{fast.number}" in page
    assert report["recommended_trial"] is None and report["keep_baseline"] is True

    note = note_text([summary])
    assert "**Recommended: keep the baseline** (trial #0)" in note
    assert f"**Recommended:** trial #{fast.number}" not in note
    assert f"try it anyway: trial #{fast.number}" in note


def test_a_slower_candidate_is_never_suggested(url: str) -> None:
    summary = summarize(optuna.load_study(study_name="slow", storage=url), 0.05)
    rec = summary.recommended
    assert rec is not None and rec.paired is not None and not rec.paired.too_noisy
    assert rec.speedup_vs_baseline == pytest.approx(0.61, abs=0.01)
    assert rec.keeps_baseline and rec.worth_trying is None
    assert summary.baseline is not None and rec.point.throughput > summary.baseline.throughput

    text, document = _best(url, "slow")
    assert "*" not in _front_row(text, rec.point.number)
    assert "anyway" not in text and "DataLoader(" not in text
    assert "Recommended: keep the baseline (trial #0)" in text
    assert document["worth_trying_trial"] is None and document["recommended_trial"] is None

    page, _ = _report(url, "slow")
    assert "Try it anyway? none" in page and "DataLoader(" not in page
    note = note_text([summary])
    assert "anyway" not in note and "DataLoader(" not in note


def test_a_two_round_interval_is_written_in_words(url: str) -> None:
    summary = summarize(optuna.load_study(study_name="two", storage=url), 0.05)
    rec = summary.recommended
    assert rec is not None and rec.paired is not None and rec.paired.rounds == 2
    assert rec.paired.too_noisy

    text, document = _best(url, "two")
    assert "95% CI too noisy to size, paired over 2 rounds" in text
    assert not NUMBERED_CI.search(text)
    # The JSON keeps the numbers, flagged.
    assert document["recommended"]["speedup_ci95_too_noisy"] is True
    assert document["recommended"]["speedup_ci95"] == [rec.paired.low, rec.paired.high]

    cells = _studies_row(url, "two")
    assert "too noisy to size" in cells[6] and not NUMBERED_CI.search(cells[6])
    page, report = _report(url, "two")
    assert "too noisy to size" in page and not NUMBERED_CI.search(page)
    assert report["recommended"]["speedup_ci95_too_noisy"] is True
    note = note_text([summary])
    assert "too noisy to size" in note and not NUMBERED_CI.search(note)


@pytest.mark.parametrize(
    ("low", "high", "rounds", "too_noisy"),
    [
        (1.10, 1.30, 3, False),
        (1.10, 1.30, 2, True),  # too few rounds, however narrow
        (0.00, 60173.66, 6, True),  # a lower end at 0
        (0.50, 5.01, 6, True),  # wider than a factor of 10
        (0.50, 5.00, 6, False),
        (float("nan"), 2.0, 6, True),
    ],
)
def test_which_intervals_are_too_noisy_to_size(
    low: float, high: float, rounds: int, too_noisy: bool
) -> None:
    speedup = PairedSpeedup(1.2, low, high, rounds)
    assert speedup.too_noisy is too_noisy
    assert ("too noisy to size" in speedup.interval_text()) is too_noisy
    assert (speedup.interval_text(cell=True) == "too noisy to size") is too_noisy
