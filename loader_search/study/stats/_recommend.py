"""From a study to plain results: the Pareto front, the baseline and one recommendation.

Everything here returns plain frozen dataclasses (or JSON-ready dicts) so the terminal output,
``best --json``, ``studies`` and the reports are all drawn from the same numbers: the points of
`loader_search.study._points` (repeats merged into medians) and their front.

The recommendation rule: "faster without making the model worse than what you have now". Its
validation loss is at most the baseline's plus ``loss_tolerance`` (relative; the best
validation loss of the study stands in for a baseline that did not complete, or whose
validation loss is not credible). Once the study has confirmed its candidates in paired
rounds against the baseline (see `loader_search.study.stats._confirm`), it is the confirmed
candidate with the highest paired speedup (one surely faster than the baseline before one
that may not be), stated with its 95% interval and a verdict. Before that (a study still
searching, or one run with confirmation off), it is the fastest Pareto-optimal point within
the tolerance, with a bare ratio of medians and no verdict.

With ``[study] objective = "goodput"`` and a noise scale measured
(`loader_search.study.stats._goodput`), the rule is "the baseline's loss soonest": the
confirmed candidate of the highest paired goodput speedup (throughput times the statistical
efficiency of its batch size), its interval widened by the noise scale's; before the rounds,
the setting of the highest goodput, Pareto-optimal or not. The loss tolerance does not apply:
the efficiency is what a larger batch's loss costs.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import optuna
from optuna.trial import FrozenTrial

from loader_search._snippets import dataloader_snippet, node_totals
from loader_search.errors import UserError
from loader_search.params import STEP_KEYS, LoaderParams, Objective, TrainingSettings
from loader_search.study._keys import (
    FINGERPRINT_ATTR,
    HARDWARE_CLASS_ATTR,
    PIPELINE_ATTR,
    stored_objective,
)
from loader_search.study._points import TrialPoint, points_of, tolerance_limit
from loader_search.study.search import Bottleneck, Lift, LimitSource, PipelineSnapshot
from loader_search.study.stats._confirm import efficiencies, paired_speedups
from loader_search.study.stats._goodput import NoiseScale, pooled_noise_scale
from loader_search.study.stats._paired import FASTER, NO_RELIABLE_GAIN, PairedSpeedup, preference
from loader_search.trial import placeholder_values, render_command

RecommendationVerdict = Literal["faster", "no_reliable_gain", "not_confirmed"]
NOT_CONFIRMED: RecommendationVerdict = "not_confirmed"
VERDICTS: tuple[RecommendationVerdict, ...] = (
    FASTER,  # confirmed in paired rounds: the 95% interval of the speedup lies above 1
    NO_RELIABLE_GAIN,  # keep the baseline: no candidate read faster than it, or none was
    # surely faster in the paired rounds (then the best one's figures are given)
    NOT_CONFIRMED,  # a faster reading, not yet confirmed: the study is still searching,
    # or it runs with confirm_top = 0
)
# The summary's labels beside "recommended" (the rule's best candidate, which the verdict may
# reject): the trial the verdict recommends, whether it keeps the baseline, and the candidate
# to try anyway (`Recommendation.worth_trying`); every view names what these name.
LABELS = ("recommended_trial", "keep_baseline", "worth_trying_trial")


@dataclass(frozen=True)
class PipelineView:
    """What the pipeline model says of the recommendation (see
    `loader_search.study.search._guide`): the best its batch size can do on this machine, how
    close it comes, what bounds it and what would lift the limit."""

    limit_samples_per_s: float
    limit_from: LimitSource  # "measurement" where a measured setting beat the model
    efficiency_vs_limit: float
    bottleneck: Bottleneck  # for the recommended setting
    predicted_samples_per_s: float
    limit_params: LoaderParams  # the setting the model predicts reaches the limit
    lifts: tuple[Lift, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "limit_samples_per_s": self.limit_samples_per_s,
            "limit_from": self.limit_from,
            "efficiency_vs_limit": self.efficiency_vs_limit,
            "bottleneck": self.bottleneck,
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "limit_params": self.limit_params.as_dict(),
            "lifts": [lift.as_dict() for lift in self.lifts],
        }


@dataclass(frozen=True)
class Recommendation:
    point: TrialPoint
    speedup_vs_baseline: float | None
    val_loss_change_vs_baseline: float | None  # relative: +0.01 is 1% worse
    rule: str
    pipeline: PipelineView | None = None
    # From the paired confirmation rounds; None before them (then the speedup is a bare
    # ratio of medians).
    paired: PairedSpeedup | None = None

    # The training step's settings that differ from the defaults (precision, compile, ...):
    # the snippet shows the step the measurement used.
    step: Mapping[str, Any] | None = None
    # A command's study: the command line that runs the recommendation (its placeholders
    # filled in with the recommended values), shown first.
    command_line: str | None = None
    # "goodput": ``speedup_vs_baseline`` and ``paired`` are of goodput (time to the
    # baseline's loss), not of samples per second.
    objective: Objective = "throughput"

    @property
    def snippet(self) -> str:
        lr = self.point.lr if self.point.lr is not None and math.isfinite(self.point.lr) else None
        code = dataloader_snippet(self.point.params, lr=lr, step=self.step)
        if self.command_line is None:
            return code
        return (
            f"# run: {self.command_line}\n# settings without a placeholder, as the study put"
            f" them into the script's training DataLoader:\n{code}"
        )

    def speedup_text(self) -> str | None:
        """The speedup as every view states it: with its interval once confirmed, a plain
        "keep it" when no setting is reliably faster, and never a bare number unmarked."""
        if self.speedup_vs_baseline is None:
            return None
        what = "the baseline"
        if self.objective == "goodput":
            what = "the baseline's goodput (its loss that much sooner)"
        if self.paired is None:
            return (
                f"{self.speedup_vs_baseline:.2f}x {what} (not confirmed in paired"
                " rounds: no interval)"
            )
        interval = self.paired.interval_text()
        if self.paired.blocks_disagree:
            interval += (
                "; warning: its blocks of rounds disagree, the machine's state changed during"
                " them, so a rerun may well differ"
            )
        if self.paired.verdict == "faster":
            return f"{self.speedup_vs_baseline:.2f}x {what} ({interval})"
        none = "no setting is reliably faster than your baseline"
        if self.objective == "goodput":
            none = "no setting is sure to reach your baseline's loss sooner than it"
        return (
            f"{none} at this noise level (the best candidate:"
            f" {self.speedup_vs_baseline:.2f}x, {interval}): keep it"
        )

    @property
    def verdict(self) -> RecommendationVerdict:
        """How sure the recommendation is, always one of `VERDICTS` (see its comments)."""
        if self.paired is not None:
            return self.paired.verdict
        if self.point.is_baseline:
            return NO_RELIABLE_GAIN  # no candidate read faster: there was nothing to confirm
        return NOT_CONFIRMED

    @property
    def keeps_baseline(self) -> bool:
        """The verdict is to keep the baseline. Every view labels from this one place: then
        no trial is called recommended (`point` is at most the best candidate) and the views
        say "keep the baseline"."""
        return self.verdict == NO_RELIABLE_GAIN

    @property
    def recommended_point(self) -> TrialPoint | None:
        """The trial the verdict recommends (None: keep the baseline)."""
        return None if self.keeps_baseline else self.point

    @property
    def worth_trying(self) -> TrialPoint | None:
        """With the baseline kept, the best candidate when it was measured faster than the
        baseline (ratio > 1), for a "try it anyway"; never the baseline, never a slower one."""
        ratio = self.speedup_vs_baseline
        if not self.keeps_baseline or self.point.is_baseline or ratio is None:
            return None
        return self.point if ratio > 1.0 else None

    def labels(self) -> dict[str, Any]:
        """The verdict's labels as ``best --json`` gives them (the keys of `LABELS`)."""
        chosen, worth = self.recommended_point, self.worth_trying
        numbers = (chosen.number if chosen else None, worth.number if worth else None)
        return dict(zip(LABELS, (numbers[0], self.keeps_baseline, numbers[1]), strict=True))

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.point.as_dict(),
            "speedup_vs_baseline": self.speedup_vs_baseline,
            "speedup_ci95": [self.paired.low, self.paired.high] if self.paired else None,
            # True: the interval is too wide to size (`PairedSpeedup.too_noisy`), its numbers
            # kept for the record but written in words by every view.
            "speedup_ci95_too_noisy": self.paired.too_noisy if self.paired else None,
            "verdict": self.verdict,
            "keep_baseline": self.keeps_baseline,
            "confirmation_rounds": self.paired.rounds if self.paired else 0,
            "blocks_disagree": self.paired.blocks_disagree if self.paired else None,
            "val_loss_change_vs_baseline": self.val_loss_change_vs_baseline,
            "rule": self.rule,
            "objective": self.objective,
            "snippet": self.snippet,
            "pipeline": self.pipeline.as_dict() if self.pipeline else None,
            "ranks": self.ranks,
            "node": node_totals(self.point.params, self.ranks),
        }

    @property
    def ranks(self) -> int:
        """Ranks per trial (``[training] ranks``): the settings are per rank."""
        ranks = (self.step or {}).get("ranks", 1)
        return ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else 1


@dataclass(frozen=True)
class StudySummary:
    study_name: str
    n_complete: int
    n_failed: int
    n_running: int
    baseline: TrialPoint | None
    pareto: tuple[TrialPoint, ...]  # fastest first
    recommended: Recommendation | None
    loss_tolerance: float
    n_infeasible: int = 0  # completed, but ran out of memory or diverged: never recommended
    hardware_class: str | None = None  # set when the summary covers one class of several
    # Why the baseline's val_loss is not the recommendation's reference (None: it is).
    baseline_doubt: str | None = None
    # The study's gradient noise scale (None: no trial measured it) and what it maximises.
    noise: NoiseScale | None = None
    objective: Objective = "throughput"

    def goodput(self, point: TrialPoint) -> float | None:
        """``point``'s goodput against the baseline's batch size, in samples per second of
        the baseline's progress (None without a noise scale or a baseline)."""
        if self.noise is None or self.baseline is None:
            return None
        reference = self.baseline.params.batch_size
        return point.throughput * self.noise.efficiency(point.params.batch_size, reference)

    def _point(self, point: TrialPoint) -> dict[str, Any]:
        return {**point.as_dict(), "goodput": self.goodput(point)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "study": self.study_name,
            "hardware_class": self.hardware_class,
            "trials": {
                "complete": self.n_complete,
                "infeasible": self.n_infeasible,
                "failed": self.n_failed,
                "running": self.n_running,
            },
            "loss_tolerance": self.loss_tolerance,
            "objective": self.objective,
            "gradient_noise_scale": self.noise.as_dict() if self.noise else None,
            "baseline": self._point(self.baseline) if self.baseline else None,
            "baseline_doubt": self.baseline_doubt,
            "pareto": [self._point(p) for p in self.pareto],
            "recommended": (
                {**self.recommended.as_dict(), "goodput": self.goodput(self.recommended.point)}
                if self.recommended
                else None
            ),
            **(self.recommended.labels() if self.recommended else dict.fromkeys(LABELS)),
        }


def recommend(
    pareto: tuple[TrialPoint, ...],
    baseline: TrialPoint | None,
    loss_tolerance: float,
    confirmed: Mapping[TrialPoint, PairedSpeedup] | None = None,
    doubt: str | None = None,
    *,
    noise: NoiseScale | None = None,
    points: Sequence[TrialPoint] = (),
) -> Recommendation | None:
    """Apply the recommendation rule (see the module docstring) to a Pareto front and the
    points ``confirmed`` in paired rounds; with ``doubt`` about the baseline's val_loss,
    the tolerance is applied to the best val_loss instead. With ``noise`` (a goodput study
    that measured it), the goodput rule over ``points`` (every setting), the ``confirmed``
    speedups being of goodput."""
    if not pareto:
        return None
    if noise is not None and baseline is not None:
        return _by_goodput(tuple(points) or pareto, baseline, noise, confirmed or {})
    limit, reference, what = tolerance_limit(pareto, baseline, loss_tolerance, doubt)
    allowed = f"val_loss <= {limit:.4g} ({what} {reference:.4g} + {loss_tolerance:.0%})"
    within = {p: s for p, s in (confirmed or {}).items() if p.val_loss <= limit}
    paired: PairedSpeedup | None = None
    if within and baseline is not None:
        chosen, paired = max(within.items(), key=lambda item: preference(item[1]))
        speedup: float | None = paired.estimate
        rule = (
            "the highest speedup over the baseline in paired rounds (a surely faster candidate"
            f" first), among the candidates confirmed with {allowed}"
        )
    else:
        candidates = [p for p in pareto if p.val_loss <= limit]
        chosen = max(candidates, key=lambda p: (p.throughput, -p.val_loss))
        speedup = chosen.throughput / baseline.throughput if baseline is not None else None
        rule = f"fastest Pareto-optimal trial with {allowed}"
    change = None
    if baseline is not None:
        change = (chosen.val_loss - baseline.val_loss) / abs(baseline.val_loss)
    return Recommendation(chosen, speedup, change, rule, paired=paired)


def _by_goodput(
    points: Sequence[TrialPoint],
    baseline: TrialPoint,
    noise: NoiseScale,
    confirmed: Mapping[TrialPoint, PairedSpeedup],
) -> Recommendation:
    """The goodput rule (see the module docstring)."""
    reference = baseline.params.batch_size
    at = f"B_noise ~ {noise.value:,.0f}, the baseline's batch {reference}"
    paired: PairedSpeedup | None = None
    if confirmed:
        chosen, paired = max(confirmed.items(), key=lambda item: preference(item[1]))
        # The rounds scaled each reading by the efficiency at the estimate; the noise
        # scale's own interval widens the claim's.
        low, high = noise.efficiency_range(chosen.params.batch_size, reference)
        middle = noise.efficiency(chosen.params.batch_size, reference)
        paired = replace(paired, low=paired.low * low / middle, high=paired.high * high / middle)
        speedup: float = paired.estimate
        rule = (
            "the highest goodput speedup over the baseline in paired rounds (throughput times"
            f" the statistical efficiency of its batch size at {at}: the baseline's loss"
            " soonest), among the confirmed candidates"
        )
    else:

        def goodput(point: TrialPoint) -> float:
            return point.throughput * noise.efficiency(point.params.batch_size, reference)

        chosen = max(points, key=lambda p: (goodput(p), -p.val_loss))
        speedup = goodput(chosen) / baseline.throughput
        rule = (
            "the highest goodput (throughput times the statistical efficiency of its batch"
            f" size at {at}: the baseline's loss soonest)"
        )
    change = (chosen.val_loss - baseline.val_loss) / abs(baseline.val_loss)
    return Recommendation(chosen, speedup, change, rule, paired=paired, objective="goodput")


def hardware_classes(study: optuna.Study) -> list[str]:
    """The hardware classes the study's trials ran on, in order of first appearance."""
    seen: dict[str, None] = {}
    for trial in study.get_trials(deepcopy=False):
        key = trial.user_attrs.get(HARDWARE_CLASS_ATTR)
        if key is not None:
            seen.setdefault(key, None)
    return list(seen)


def summaries(study: optuna.Study, loss_tolerance: float) -> list[StudySummary]:
    """The study's results: one summary, or one per hardware class when it ran on several
    (throughputs from different machines never compare)."""
    classes = hardware_classes(study)
    if len(classes) > 1:
        return [summarize(study, loss_tolerance, key) for key in classes]
    return [summarize(study, loss_tolerance)]


def summarize(
    study: optuna.Study, loss_tolerance: float, hardware_class: str | None = None
) -> StudySummary:
    """The study's results, or those of one ``hardware_class`` (throughputs measured on
    different machines never compare). The Pareto set is that of the feasible completed
    trials (equal to Optuna's ``best_trials`` for a whole study), sorted fastest first."""
    objective = stored_objective(study.user_attrs, "throughput")
    summary = summarize_trials(
        study.study_name,
        study.get_trials(deepcopy=False),
        loss_tolerance,
        hardware_class,
        objective=objective,
    )
    rec = summary.recommended
    if rec is None:
        return summary
    stamp = study.user_attrs.get(FINGERPRINT_ATTR)
    training = stamp.get("training") if isinstance(stamp, dict) else None
    if isinstance(training, dict) and any(k in training for k in STEP_KEYS):
        rec = replace(rec, step={k: training[k] for k in STEP_KEYS if k in training})
    command = stamp.get("command") if isinstance(stamp, dict) else None
    if isinstance(command, dict) and isinstance(training, dict):
        rec = replace(rec, command_line=command_line(command, training, rec.point.params))
    stored = study.user_attrs.get(PIPELINE_ATTR)
    if isinstance(stored, dict) and stored:
        key = hardware_class if hardware_class is not None else next(iter(stored))
        rec = replace(rec, pipeline=pipeline_view(stored.get(key), rec.point))
    return replace(summary, recommended=rec)


def command_line(
    command: Mapping[str, Any], training: Mapping[str, Any], params: LoaderParams
) -> str | None:
    """The stored command with its placeholders filled in for ``params`` (None where the
    stored fingerprint does not read: the database is written by other hands too)."""
    try:
        settings = TrainingSettings(
            **{k: training[k] for k in _COMMAND_TRAINING if training.get(k) is not None}
        )
        argv = [str(word) for word in command["command"]]
        filled = placeholder_values(params, settings, ranks=1)
        # The study's ranks as it ran them ("auto", one per GPU, torchrun takes as it is).
        ranks = training.get("ranks", 1)
        filled["ranks"] = str(ranks) if isinstance(ranks, (int, str)) else "1"
        return shlex.join(render_command(argv, filled))
    except (KeyError, TypeError, ValueError, UserError):  # UserError: a placeholder's
        return None


_COMMAND_TRAINING = ("train_samples", "batch_size", "lr_scaling", "lr", "seed")


def pipeline_view(snapshot: Any, point: TrialPoint) -> PipelineView | None:
    """The stored pipeline model's word on ``point`` (None when there is none, or it is not
    readable: the database is written by other hands too)."""
    try:
        model, entry = PipelineSnapshot.read(snapshot, point.params.batch_size)
        prediction = model.predict(point.params)
    except (KeyError, TypeError, ValueError):
        return None
    limit, limit_params = entry.limit_samples_per_s, entry.limit_params
    source: LimitSource = entry.limit_from
    if limit <= 0:
        return None
    if point.throughput > limit:
        # The snapshot is taken while the model proposes; the point was measured faster
        # since (its confirmation rounds): a limit below a measurement is no limit.
        limit, limit_params, source = point.throughput, point.params, "measurement"
    return PipelineView(
        limit_samples_per_s=limit,
        limit_from=source,
        efficiency_vs_limit=point.throughput / limit,
        bottleneck=prediction.bottleneck,
        predicted_samples_per_s=prediction.throughput,
        limit_params=limit_params,
        lifts=entry.lifts,
    )


def summarize_trials(
    study_name: str,
    trials: Sequence[FrozenTrial],
    loss_tolerance: float,
    hardware_class: str | None = None,
    *,
    objective: Objective = "throughput",
) -> StudySummary:
    """`summarize` over given trials (the benchmarks replay studies trial by trial)."""
    found = points_of(trials, hardware_class)
    noise = pooled_noise_scale(trials)
    confirmed: dict[TrialPoint, PairedSpeedup] = {}
    by_goodput = objective == "goodput" and noise is not None
    if found.baseline is not None:
        base = found.baseline.params
        scale = None
        if by_goodput:
            assert noise is not None
            scale = efficiencies(noise, [p.params for p in found.points], base)
        speedups = paired_speedups(trials, base, hardware_class, scale)
        confirmed = {p: speedups[p.params] for p in found.points if p.params in speedups}
    recommended = recommend(
        found.pareto,
        found.baseline,
        loss_tolerance,
        confirmed,
        found.baseline_doubt,
        noise=noise if by_goodput else None,
        points=found.points,
    )
    if objective == "goodput" and not by_goodput and recommended is not None:
        recommended = replace(
            recommended,
            rule=f"{recommended.rule} (a goodput study, but no trial has measured the gradient"
            " noise scale: by throughput)",
        )
    return StudySummary(
        study_name=study_name,
        n_complete=found.n_complete,
        n_failed=found.n_failed,
        n_running=found.n_running,
        baseline=found.baseline,
        pareto=found.pareto,
        recommended=recommended,
        baseline_doubt=found.baseline_doubt,
        loss_tolerance=loss_tolerance,
        n_infeasible=found.n_infeasible,
        hardware_class=hardware_class,
        noise=noise,
        objective=objective,
    )
