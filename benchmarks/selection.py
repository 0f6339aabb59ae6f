"""The confirmation rounds on simulated readings: how far the stated speedup is from the truth.

``python -m benchmarks selection [--studies 300]`` runs the study's own round logic
(`next_remeasure`, `summarize_trials`) on in-memory Optuna studies whose readings are drawn
from known speeds: the machine's drift (log-normal, 10%; shared by the readings of one round)
times each reading's own noise. Two candidates, true speedups given per case; the search's
single readings (each with a drift of its own) choose which of them beat the baseline and
their order, as a study's do. It prints, per case and noise level and per rule (a race of two
candidates, the same without the futility stop `ConfirmSettings.futility`, and no race:
``top`` 1, the default; all three with the study's default minimum, cap and futility; and
no race under the rules before them (at least 3 rounds; also with the blocks' test before
the F test; also with futility 0.1) and with a cap of 10, for comparison): the median and
mean of stated / true speedup and the median of |log(stated / true)| (the claims'
error, against the truth itself) for the claim as stated (the leader's rounds after the
race, `Rounds.claims`) and for the same studies' claim from every round of the leader (the
race's round included, `Rounds.speedups`), how often each interval covers the truth, how
often the verdict is "faster", how often the leader is truly the fastest and its true speed
over the fastest's (what the choice costs), and the trials the rounds took. Nothing is
timed: no machine noise, only the statistics of the rules (the winner's curse and the
confirmation's cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.distributions import IntDistribution
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams
from loader_search.study import (
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    PARAMS_ATTR,
    StudyConfig,
)
from loader_search.study.stats import ConfirmSettings, PairedSpeedup, next_remeasure, rounds_of

BASE = LoaderParams(64, 0, torch_threads=2)
A = LoaderParams(64, 2, 2, False, True, 1)
B = LoaderParams(64, 1, 2, False, True, 1)
DEFAULTS = StudyConfig()
SETTINGS = ConfirmSettings(
    top=2,
    min_rounds=DEFAULTS.confirm_min_rounds,
    max_rounds=DEFAULTS.confirm_max_rounds,
    half_width=DEFAULTS.confirm_half_width,
    loss_tolerance=DEFAULTS.loss_tolerance,
)
CASES = {
    "equal": (1.3, 1.3),
    "close": (1.3, 1.2),
    "apart": (1.3, 0.9),
    "near 1": (1.15, 1.1),  # the quickstart's regime: the stop rule binds
    "small": (1.08, 1.0),  # a gain the noise hides in most studies
    "none": (1.0, 0.97),  # workers do not pay: the verdict should be "keep the baseline"
}
RULES = {
    "race of 2": SETTINGS,
    "race of 2, no futility stop": dataclasses.replace(SETTINGS, futility=0.0),
    "no race (top 1)": dataclasses.replace(SETTINGS, top=1),
    # The default's rules before: at least 3 rounds (until 2026-12-06), with the
    # blocks' test of the day too (Cochran's Q against its chi-square quantile, which flagged
    # pure noise as a moved machine in 18-30% of studies), and futility below 10% (until
    # 2026-12-05); a shorter cap, weighed in it (benchmarks/stopping.py).
    "no race, at least 3 rounds": dataclasses.replace(SETTINGS, top=1, min_rounds=3),
    "no race, at least 3 rounds, chi-square blocks": dataclasses.replace(
        SETTINGS, top=1, min_rounds=3, block_test="chi2"
    ),
    "no race, 3 rounds, chi-square, futility 0.1": dataclasses.replace(
        SETTINGS, top=1, min_rounds=3, block_test="chi2", futility=0.1
    ),
    "no race, cap 10": dataclasses.replace(SETTINGS, top=1, max_rounds=10),
}
NOISE = (0.08, 0.15)  # each reading's own log-normal noise
DRIFT = 0.1  # the machine's log-normal drift, shared by the readings of one round


def _trial(number: int, params: LoaderParams, value: float, **attrs: object) -> FrozenTrial:
    trial = optuna.trial.create_trial(
        state=TrialState.COMPLETE,
        params={"num_workers": params.num_workers},
        distributions={"num_workers": IntDistribution(0, 3)},
        values=[value, 1.0],
        user_attrs={PARAMS_ATTR: params.as_dict(), **attrs},
    )
    trial.number = number
    return trial


@dataclass(frozen=True)
class Outcome:
    """One simulated study's rounds: the leader, both of its claims, the trials they took."""

    leader: LoaderParams  # the baseline where no candidate read faster in the search
    stated: PairedSpeedup | None  # from the rounds after the race (what the study states)
    every: PairedSpeedup | None  # from all the leader's rounds, the race's included
    trials: int


def one_study(
    seed: int, speeds: dict[LoaderParams, float], noise: float, settings: ConfirmSettings
) -> Outcome:
    """The rounds of one simulated study."""
    rng = random.Random(seed)
    # The search's single readings, each at a time of its own (its own drift): they choose
    # the candidates and their order, as a study's do.
    trials = [
        _trial(number, params, 100.0 * speeds[params] * _noisy(rng, noise), **attrs)
        for number, (params, attrs) in enumerate([(BASE, {BASELINE_ATTR: True}), (A, {}), (B, {})])
    ]
    drift: dict[int, float] = {}
    asked = 0
    while (step := next_remeasure(trials, settings)) is not None:
        asked += 1
        shared = drift.setdefault(step.round, rng.lognormvariate(0, DRIFT))
        value = 100.0 * speeds[step.params] * shared * rng.lognormvariate(0, noise)
        attrs = {CONFIRMATION_ATTR: True, CONFIRM_ROUND_ATTR: step.round}
        trials.append(_trial(len(trials), step.params, value, **attrs))
    rounds = rounds_of(trials, settings)
    stated = rounds.claims()
    if not stated:  # no candidate read faster than the baseline in the search: no rounds
        return Outcome(BASE, None, None, asked)
    leader = max(stated, key=lambda p: (stated[p].low > 1, stated[p].estimate))
    return Outcome(leader, stated[leader], rounds.speedups()[leader], asked)


def _noisy(rng: random.Random, noise: float) -> float:
    """A reading's factor: the machine's drift at its time times its own noise."""
    return rng.lognormvariate(0, DRIFT) * rng.lognormvariate(0, noise)


def _row(
    name: str, rule: str, noise: float, results: list[Outcome], speeds: dict[LoaderParams, float]
) -> str:
    def summary(claim: Callable[[Outcome], PairedSpeedup | None]) -> str:
        # The studies that ran rounds (the others found no candidate in the search).
        claims = [(c, speeds[r.leader]) for r in results if (c := claim(r)) is not None]
        if not claims:
            return "- | -"
        errors = [c.estimate / true for c, true in claims]
        covers = [c.low <= true <= c.high for c, true in claims]
        off = statistics.median(abs(math.log(e)) for e in errors)  # the claims' error
        return (
            f"{statistics.median(errors):.3f} / {statistics.fmean(errors):.3f} | {off:.1%}"
            f" | {statistics.fmean(covers):.0%}"
        )

    best = max(speeds[A], speeds[B])
    # What the choice costs: the leader's true speed over the best candidate's (the
    # baseline's 1.0 where the search found nothing to confirm).
    chosen = statistics.fmean(speeds[r.leader] / best for r in results)
    fastest = statistics.fmean(speeds[r.leader] == best for r in results)
    faster = statistics.fmean(r.stated is not None and r.stated.low > 1.0 for r in results)
    trials = statistics.fmean(r.trials for r in results)
    return (
        f"| {name} ({speeds[A]}x, {speeds[B]}x) | {noise:.0%} | {rule} "
        f"| {summary(lambda r: r.stated)} | {summary(lambda r: r.every)} "
        f"| {faster:.0%} | {fastest:.0%} | {chosen:.3f} | {trials:.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks selection", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--studies", type=int, default=300, help="simulated studies per row")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(
        "| case (true speedups) | reading noise | rule | stated / true: median / mean"
        " | median error | covers | every round: median / mean | median error | covers"
        " | verdict faster | leader truly fastest | leader / fastest (true) | trials |"
    )
    print("|---" * 13 + "|")
    for name, (a, b) in CASES.items():
        speeds = {BASE: 1.0, A: a, B: b}
        for noise in NOISE:
            for rule, settings in RULES.items():
                results = [
                    one_study(seed, speeds, noise, settings) for seed in range(args.studies)
                ]
                print(_row(name, rule, noise, results, speeds), flush=True)


if __name__ == "__main__":  # the module's name, as comments in loader_search/ cite it
    main()
