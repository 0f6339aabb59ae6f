"""Paired, interleaved confirmation: the speedup a user can bet on.

Once the search has used its budget, the baseline and the fastest candidates (the ``top``
fastest settings within the loss tolerance that beat the baseline's reading, Pareto-optimal
or not: one reading cannot tell settings of one batch size apart) run again in rounds. Each
round measures every setting once, in an order rotated by one from the round before (B A C,
A C B, C B A, ...), one trial at a time per hardware class, so that a slow spell of the
machine, or a neighbour's load, hits every setting of a round alike. A candidate's speedup is
estimated from its per-round ratios against the baseline: the geometric mean, with a 95%
Student-t interval on the log ratios (the paired t-interval: the rounds are the pairs, and a
ratio of throughputs is closer to log-normal than to normal; `loader_search.study.stats._paired`
holds the statistics: how blocks of rounds widen the interval when the machine's state
moves, and how it counts the rounds' moment against a long run).

**A race, then the leader alone.** The first `RACE_ROUNDS` rounds measure the baseline and
every candidate; the race's leader is the candidate with the highest geometric-mean ratio to
the baseline over them, and the others leave. The leader then runs alone beside the baseline,
and its stated speedup (`Rounds.claims`) comes only from those later rounds (`Rounds.fresh`):
a leader chosen as the best of several noisy readings looks better on them than it is (the
winner's curse), so the rounds that chose it never count in its claim. A candidate with no
rival has no race: all its rounds count. A candidate also leaves when its trial failed
`MAX_FAILURES` times, or once measured in ``min_rounds`` when it is surely no faster than the
baseline (its interval over all its rounds lies below 1). The rounds stop once the leader was
measured alone in ``min_rounds`` rounds and it was measured in ``max_rounds`` (the cap, the
race's rounds included), or those rounds' blocks agree and decide it (surely faster than the
baseline, or its interval within ``half_width`` of its estimate), or a "faster" verdict is out
of reach (below); or when no candidate is left. Stopping once the interval clears 1 still
favours an early high estimate a little when the speedup lies near 1: ``python -m
benchmarks selection`` measures both effects on simulated readings, ``python -m benchmarks
claims`` against a plain training loop.

**Futility.** A leader close to the baseline (the case where loader workers do not pay) is
neither surely faster nor, at this noise, pinned within ``half_width``: its rounds would run to
the cap and end in "no_reliable_gain" anyway. After every round the rounds ask how likely the
rounds left before the cap are to end "faster" (`chance_of_gain`: the predictive probability
of group-sequential trials, which counts the uncertainty of the estimate so far as well as the
noise of the rounds to come) and stop when it is below ``futility``. A true gain is lost this
way only when its first rounds read far below it; ``python -m benchmarks selection`` measures
both the rounds saved and the gains lost, with and without the rule.

A reading taken while other processes kept more than `DISTURBED_LOAD` of the trial's CPUs busy
(``other_load``, measured over its window) is not a fair one: it is measured again, up to
`MAX_DISTURBED` times per slot, then taken as it is (a machine that is always busy still ends
its rounds).

The verdict is "faster" when the interval's lower end is above 1, else "no_reliable_gain":
at this noise level no setting is reliably faster than the baseline.

**Goodput** (``[study] objective = "goodput"``): the candidates are the ``top`` settings of the
highest goodput above the baseline's (`loader_search.study.stats._goodput`: throughput times the
statistical efficiency of their batch size at the study's noise scale), the loss tolerance
aside (the efficiency is what a larger batch's loss costs), and every round's ratio is scaled
by the candidate's efficiency: the race, the verdicts and the claims are of goodput, the time
to the baseline's loss.

Pure: everything is computed from the trials given (the worker reads them under the study
lock, the benchmarks' replay from its own study), so every worker of a team agrees.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean

from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams, Objective
from loader_search.study._keys import (
    CONFIRM_ROUND_ATTR,
    FAILURE_REASON,
    OTHER_LOAD_ATTR,
    WORKER_ATTR,
    is_confirmation,
    stored_params,
    trial_hardware_class,
)
from loader_search.study._points import is_feasible, points_of, tolerance_limit
from loader_search.study.stats._goodput import NoiseScale, pooled_noise_scale
from loader_search.study.stats._paired import (
    FASTER,
    BlockTest,
    PairedSpeedup,
    chance_of_gain,
    paired_speedup,
)
from loader_search.trial import INTERRUPTED

MAX_FAILURES = 2  # a setting whose re-measurement failed this often leaves the rounds
# A reading beside a neighbour that kept this share of the trial's CPUs busy is measured again
# (the ceiling's threshold too: loader_search.study.work._plan.BUSY_LIMIT), at most this often.
DISTURBED_LOAD = 0.25
MAX_DISTURBED = 2

RACE_ROUNDS = 1  # rounds of every candidate before the race chooses its leader


@dataclass(frozen=True)
class ConfirmSettings:
    """How the candidates are confirmed once the budget is used (``top`` 0: not at all)."""

    top: int  # candidates besides the baseline
    min_rounds: int
    max_rounds: int
    half_width: float  # stop once the leader's 95% interval is within this of its estimate
    loss_tolerance: float
    # Stop once a "faster" verdict by the cap is less likely than this (`chance_of_gain`; 0:
    # never). The code's value, not a study setting: it changes no claim's meaning. 0.3 (0.1
    # before) stated the recorded studies' claims and verdicts as well at a sixth less
    # confirmation (python -m benchmarks stopping); in simulation it loses some true gains at
    # a CPU's noisiest readings (python -m benchmarks selection).
    futility: float = 0.3
    # How the rounds' blocks are tested for a machine state that moved (`BlockTest`): the
    # code's choice too; "chi2", the test before, replays the studies recorded under it.
    block_test: BlockTest = "f"
    objective: Objective = "throughput"  # [study] objective: what the rounds compare


@dataclass(frozen=True)
class Rounds:
    """What the confirmation rounds of one hardware class measured so far."""

    baseline: LoaderParams | None
    candidates: tuple[LoaderParams, ...]  # fastest (by the search's readings) first
    # round -> settings -> its trial's throughput (None: the trial failed; see measured_rounds)
    measured: dict[int, dict[LoaderParams, float | None]]
    block_test: BlockTest = "f"  # `ConfirmSettings.block_test`
    # Goodput: each setting's statistical efficiency, by which its readings are scaled
    # (absent: 1, a throughput).
    scale: Mapping[LoaderParams, float] = field(default_factory=dict)

    @property
    def settings(self) -> tuple[LoaderParams, ...]:
        return (self.baseline, *self.candidates) if self.baseline else ()

    def ratios(self, candidate: LoaderParams, before: int | None = None) -> list[float]:
        """Per round (before round ``before``): candidate / baseline, where both measured."""
        if self.baseline is None:
            return []
        return self.between(candidate, self.baseline, before)

    def speedups(self, before: int | None = None) -> dict[LoaderParams, PairedSpeedup]:
        found = {}
        for candidate in self.candidates:
            speedup = paired_speedup(self.ratios(candidate, before), self.block_test)
            if speedup is not None:
                found[candidate] = speedup
        return found

    def failures(self, params: LoaderParams, before: int) -> int:
        return sum(
            params in values and values[params] is None
            for number, values in self.measured.items()
            if number < before
        )

    def between(self, a: LoaderParams, b: LoaderParams, before: int | None = None) -> list[float]:
        """Per round (before round ``before``): ``a`` / ``b``, where both measured."""
        out = []
        for number, values in sorted(self.measured.items()):
            if before is not None and number >= before:
                break
            mine, theirs = values.get(a), values.get(b)
            if mine and theirs:
                out.append(mine * self.scale.get(a, 1.0) / (theirs * self.scale.get(b, 1.0)))
        return out

    def fresh(self, candidate: LoaderParams, before: int | None = None) -> list[float]:
        """Per round (before round ``before``): candidate / baseline, in the rounds that
        measured nothing else (after the race, or with one candidate from the start): rounds
        its choice as the leader did not depend on."""
        if self.baseline is None:
            return []
        alone = {self.baseline, candidate}
        kept = {n: v for n, v in self.measured.items() if set(v) == alone}
        alone_rounds = Rounds(self.baseline, (candidate,), kept, self.block_test, self.scale)
        return alone_rounds.ratios(candidate, before)

    def claims(self) -> dict[LoaderParams, PairedSpeedup]:
        """The speedups to state: from the rounds after the race (`fresh`), so that neither
        the choice of the leader nor the race's stop favours it; the race's own figures
        only where no candidate has two such rounds (a study stopped during the race, or
        one stored by an older version)."""
        found = {}
        for candidate in self.candidates:
            speedup = paired_speedup(self.fresh(candidate), self.block_test)
            if speedup is not None:
                found[candidate] = speedup
        return found or self.speedups()

    def _together(
        self, candidates: Sequence[LoaderParams], before: int
    ) -> list[dict[LoaderParams, float]]:
        """Per round before ``before`` that measured the baseline and all ``candidates``:
        each one's ratio to the baseline (the race's rounds, paired by round)."""
        out = []
        for number, values in sorted(self.measured.items()):
            if number >= before:
                break
            base = values.get(self.baseline) if self.baseline else None
            mine = {p: values.get(p) for p in candidates}
            if base and all(mine.values()):
                out.append({p: v * self.scale.get(p, 1.0) / base for p, v in mine.items() if v})
        return out

    def active(self, round_: int, min_rounds: int) -> list[LoaderParams]:
        """The settings round ``round_`` measures: the baseline and every candidate that has
        not left (judged round by round on the rounds before each). A candidate leaves, for
        good, when its trial failed `MAX_FAILURES` times; once it was measured in
        ``min_rounds``, when it is surely no faster than the baseline (its interval lies
        below 1); and when the race ends, unless it leads it. The race ends once
        `RACE_ROUNDS` rounds measured the baseline and every candidate still in it; its
        leader has the highest geometric-mean ratio to the baseline over those rounds."""
        gone: set[LoaderParams] = set()
        for number in range(round_ + 1):
            speedups = self.speedups(before=number)
            for params in self.settings:
                if self.failures(params, number) >= MAX_FAILURES:
                    gone.add(params)
                mine = speedups.get(params)
                if mine is not None and mine.rounds >= min_rounds and mine.high < 1.0:
                    gone.add(params)
            racing = [p for p in self.candidates if p not in gone]
            together = self._together(racing, before=number)
            if len(racing) > 1 and len(together) >= RACE_ROUNDS:
                leader = max(racing, key=lambda p: fmean(math.log(r[p]) for r in together))
                gone.update(p for p in racing if p != leader)
        if self.baseline in gone or all(p in gone for p in self.candidates):
            return []  # nothing left to pair: the rounds are over
        return [p for p in self.settings if p not in gone]

    def order(self, round_: int, min_rounds: int) -> list[LoaderParams]:
        """Round ``round_``'s order: its active settings rotated by the round number."""
        active = self.active(round_, min_rounds)
        if not active:
            return []
        shift = round_ % len(active)
        return active[shift:] + active[:shift]


def measured_rounds(
    trials: Sequence[FrozenTrial], hardware_class: str | None = None
) -> dict[int, dict[LoaderParams, float | None]]:
    """Round -> settings -> the throughput its finished trial measured (None: it failed on
    its own, was infeasible, or measured nothing). Trials still running, interrupted ones,
    those of a dead worker and disturbed readings (see the module docstring) are left out."""
    measured: dict[int, dict[LoaderParams, float | None]] = {}
    disturbed: dict[tuple[int, LoaderParams], int] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        number = trial.user_attrs.get(CONFIRM_ROUND_ATTR)
        params = stored_params(trial)
        if isinstance(number, bool) or not isinstance(number, int) or params is None:
            continue
        if hardware_class is not None and trial_hardware_class(trial) != hardware_class:
            continue
        if trial.state == TrialState.COMPLETE and _disturbed(trial):
            tries = disturbed.get((number, params), 0)
            if tries < MAX_DISTURBED:
                disturbed[number, params] = tries + 1
                continue  # measured again
        if trial.state == TrialState.COMPLETE:
            value = trial.values[0] if is_feasible(trial) and trial.values else 0.0
            measured.setdefault(number, {})[params] = value if value > 0 else None
        elif trial.state == TrialState.FAIL and trial.user_attrs.get(FAILURE_REASON) not in (
            None,
            INTERRUPTED,
        ):
            # A failure of its own. Not one: a Ctrl-C (interrupted) or a dead worker (no
            # reason: its retry keeps the round); the slot is measured again.
            measured.setdefault(number, {})[params] = None
    return measured


def _disturbed(trial: FrozenTrial) -> bool:
    load = trial.user_attrs.get(OTHER_LOAD_ATTR)
    return isinstance(load, (int, float)) and load > DISTURBED_LOAD


def paired_speedups(
    trials: Sequence[FrozenTrial],
    baseline: LoaderParams,
    hardware_class: str | None = None,
    scale: Mapping[LoaderParams, float] | None = None,
) -> dict[LoaderParams, PairedSpeedup]:
    """The speedups over ``baseline`` to state from the rounds run so far (`Rounds.claims`:
    settings measured in fewer than 2 rounds beside it have none); of goodput with
    ``scale`` (`goodput_scale`)."""
    measured = measured_rounds(trials, hardware_class)
    settings = {p for values in measured.values() for p in values if p != baseline}
    return Rounds(baseline, tuple(settings), measured, scale=scale or {}).claims()


def goodput_scale(
    trials: Sequence[FrozenTrial], settings: Sequence[LoaderParams], baseline: LoaderParams
) -> dict[LoaderParams, float] | None:
    """Each setting's statistical efficiency against ``baseline``'s batch size at the study's
    noise scale, None where no trial measured it (a goodput study then compares
    throughputs, and says so)."""
    noise = pooled_noise_scale(trials, interval=False)  # the rounds scale by the estimate
    return None if noise is None else efficiencies(noise, settings, baseline)


def efficiencies(
    noise: NoiseScale, settings: Sequence[LoaderParams], baseline: LoaderParams
) -> dict[LoaderParams, float]:
    """Each setting's (and the baseline's) statistical efficiency at ``noise``'s estimate,
    against the baseline's batch size."""
    reference = baseline.batch_size
    return {p: noise.efficiency(p.batch_size, reference) for p in (*settings, baseline)}


def rounds_of(
    trials: Sequence[FrozenTrial], confirm: ConfirmSettings, hardware_class: str | None = None
) -> Rounds:
    """The candidates the search left (see the module docstring; the rounds themselves
    left out) and what the rounds measured of them."""
    searched = points_of([t for t in trials if not is_confirmation(t)], hardware_class)
    baseline = searched.baseline
    candidates: list[LoaderParams] = []
    scale: dict[LoaderParams, float] = {}
    if baseline is not None and searched.pareto and confirm.top > 0:
        limit = tolerance_limit(
            searched.pareto, baseline, confirm.loss_tolerance, searched.baseline_doubt
        )[0]
        if confirm.objective == "goodput":
            found = goodput_scale(trials, [p.params for p in searched.points], baseline.params)
            scale = found or {}
            if found is not None:
                limit = math.inf  # the efficiency is what a larger batch's loss costs
        faster = [
            p
            for p in searched.points
            if p.val_loss <= limit
            and p.throughput * scale.get(p.params, 1.0) > baseline.throughput
            and not p.is_baseline
        ]
        faster.sort(key=lambda p: (-p.throughput * scale.get(p.params, 1.0), p.number))
        candidates = [p.params for p in faster[: confirm.top]]
    return Rounds(
        baseline.params if baseline is not None else None,
        tuple(candidates),
        measured_rounds(trials, hardware_class),
        confirm.block_test,
        scale,
    )


@dataclass(frozen=True)
class Remeasure:
    """One confirmation trial to queue: its settings and its round."""

    params: LoaderParams
    round: int


def next_remeasure(
    trials: Sequence[FrozenTrial], confirm: ConfirmSettings, hardware_class: str | None = None
) -> Remeasure | None:
    """The next confirmation trial, or None when the rounds are done (see the module
    docstring). Asked with no trial of the study running, so one runs at a time.

    A study whose search went on after its rounds (``run --n-trials`` more) starts a new
    round: its candidates may have changed, and a new one is measured beside the baseline
    of its own time, never slotted into an old round."""
    rounds = rounds_of(trials, confirm, hardware_class)
    if not rounds.candidates:
        return None
    current = max(rounds.measured, default=0)
    if rounds.measured and _searched_since(trials, hardware_class):
        current += 1
    while True:
        order = rounds.order(current, confirm.min_rounds)
        missing = [p for p in order if p not in rounds.measured.get(current, {})]
        if missing:
            return Remeasure(missing[0], current)
        if not order or settled(rounds, current + 1, confirm):
            return None
        current += 1


def rounds_owner(
    trials: Sequence[FrozenTrial], hardware_class: str | None
) -> tuple[str, int] | None:
    """Who runs ``hardware_class``'s confirmation rounds: the worker that ran the last
    finished confirmation trial, with that trial's number; None when there is none yet, or
    it was interrupted (its worker left), so that anyone may take them."""
    finished = [
        t
        for t in trials
        if is_confirmation(t)
        and t.state in (TrialState.COMPLETE, TrialState.FAIL)
        and (hardware_class is None or trial_hardware_class(t) == hardware_class)
    ]
    if not finished:
        return None
    last = max(finished, key=lambda t: t.number)
    owner = last.user_attrs.get(WORKER_ATTR)
    if last.user_attrs.get(FAILURE_REASON) == INTERRUPTED or not isinstance(owner, str):
        return None
    return owner, last.number


def settled(rounds: Rounds, next_round: int, confirm: ConfirmSettings) -> bool:
    """Whether the rounds before ``next_round`` are enough: the race is over (one candidate
    left), the leader was measured alone beside the baseline in at least ``min_rounds``
    rounds (`Rounds.fresh`), and it was measured in ``max_rounds`` (the cap), or a "faster"
    verdict by the cap has become less likely than ``futility``, or those rounds' blocks agree
    and decide it: surely faster than the baseline, or its interval within ``half_width``.
    No candidate left: nothing to decide."""
    active = rounds.active(next_round, confirm.min_rounds)
    racing = [p for p in active if p != rounds.baseline]
    if not racing:
        return True  # the baseline failed, or every candidate left
    if len(racing) > 1:
        return False  # the race is still on
    (leader,) = racing
    fresh = paired_speedup(fresh_ratios := rounds.fresh(leader), rounds.block_test)
    if fresh is None or len(fresh_ratios) < confirm.min_rounds:
        return False
    measured = len(rounds.ratios(leader))
    if measured >= confirm.max_rounds:
        return True
    left = confirm.max_rounds - measured
    if (
        fresh.verdict != FASTER
        and chance_of_gain(fresh_ratios, left, rounds.block_test) < confirm.futility
    ):
        return True  # a gain is out of reach by the cap
    if fresh.blocks_disagree:
        return False  # the machine's state moved during the rounds: more blocks
    return fresh.verdict == FASTER or fresh.half_width <= confirm.half_width


def _searched_since(trials: Sequence[FrozenTrial], hardware_class: str | None) -> bool:
    """Whether a search trial ran after the last confirmation trial."""
    mine = [
        t for t in trials if hardware_class is None or trial_hardware_class(t) == hardware_class
    ]
    last = max((t.number for t in mine if is_confirmation(t)), default=-1)
    return any(t.number > last and not is_confirmation(t) for t in mine)
