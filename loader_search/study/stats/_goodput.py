"""Goodput: how fast a setting makes progress towards a good model, not only samples per second.

A larger batch trains more samples per second and needs more samples to reach the same loss.
McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") measure the trade with
the **gradient noise scale** ``B_noise = tr(Sigma) / |G|^2``: the samples a model needs to reach
a loss grow as ``E(B) ~ E_min (1 + B / B_noise)``. Against a reference batch ``B0`` (the
baseline's), a batch of ``B`` makes ``(B_noise + B0) / (B_noise + B)`` of the progress per
sample, its statistical efficiency, and its **goodput** is its throughput times that (Pollux,
OSDI'21): above about ``B_noise`` samples, what a larger batch adds in speed it loses in
samples. The speedup of goodput over the baseline is the speedup in time to the baseline's
loss, as far as the model holds.

The trials measure the noise scale's two parts in their own training (`loader_search.trial
._noise`: the means of the per-step estimates of ``|G|^2`` and ``tr(Sigma)`` over ``steps``);
`pooled_noise_scale` pools them over the study's search trials, each weighted by its steps, and
takes the ratio of the pooled means, as the estimator itself does over steps. Its 95% interval
comes from resampling the trials (a bootstrap over trials, seeded: every worker and every view
of a study states the same), or, with fewer than `MIN_BOOTSTRAP` trials, from their own
standard errors. The confirmation trials are left out: they train a part of the budget, and
the figure must not move while the paired rounds run on it.

With ranks, ``B`` is the node's batch: the settings' ``batch_size`` is per rank, and a step
averages the gradients of ``ranks`` times as many samples (`NoiseScale.ranks`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from loader_search.study._keys import is_confirmation, number

MIN_BOOTSTRAP = 4  # trials; fewer: the interval comes from their standard errors
BOOTSTRAP_DRAWS = 2000
Z_95 = 1.959964

# TrialResult's fields, as its trials store them.
_GRAD_SQ, _TRACE, _STEPS, _SE = (
    "noise_grad_sq",
    "noise_trace",
    "noise_steps",
    "gradient_noise_scale_se",
)


@dataclass(frozen=True)
class NoiseScale:
    """A study's gradient noise scale: the pooled estimate and its 95% interval (``low`` 0
    where it reaches down to no noise at all), from ``trials`` trials of ``steps`` steps, whose
    steps each trained ``ranks`` batches of a setting's ``batch_size`` (one per rank)."""

    value: float
    low: float
    high: float
    trials: int
    steps: int
    ranks: int = 1

    def efficiency(self, batch_size: int, reference: int, scale: float | None = None) -> float:
        """The progress per sample of a per-rank ``batch_size`` against ``reference`` (1 at
        the reference; below 1 above it), at this noise scale or at ``scale``: of the node's
        batches, ``ranks`` times each."""
        noise = max(0.0, self.value if scale is None else scale)
        big, base = batch_size * self.ranks, reference * self.ranks
        if math.isinf(noise) or noise + big <= 0:
            return 1.0  # no bound on the noise: nothing says a larger batch costs samples
        return (noise + base) / (noise + big)

    def efficiency_range(self, batch_size: int, reference: int) -> tuple[float, float]:
        """The efficiency at both ends of the interval, the lower first."""
        ends = (
            self.efficiency(batch_size, reference, self.low),
            self.efficiency(batch_size, reference, self.high),
        )
        return min(ends), max(ends)

    def as_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "ci95": [self.low, self.high],
            "trials": self.trials,
            "steps": self.steps,
            "ranks": self.ranks,
        }


def _rows(trials: Sequence[FrozenTrial]) -> list[tuple[float, float, float, float | None]]:
    """(steps, |G|^2 mean, tr(Sigma) mean, standard error) of each search trial that measured
    them."""
    rows = []
    for trial in trials:
        if trial.state != TrialState.COMPLETE or is_confirmation(trial):
            continue
        attrs = trial.user_attrs
        steps, grad_sq, trace = (
            number(attrs, _STEPS),
            number(attrs, _GRAD_SQ),
            number(attrs, _TRACE),
        )
        if steps is None or grad_sq is None or trace is None or steps < 1:
            continue
        rows.append((steps, grad_sq, trace, number(attrs, _SE)))
    return rows


def _ratio(rows: Sequence[tuple[float, float, float, float | None]]) -> float | None:
    weight = math.fsum(r[0] for r in rows)
    grad_sq = math.fsum(r[0] * r[1] for r in rows) / weight
    trace = math.fsum(r[0] * r[2] for r in rows) / weight
    return trace / grad_sq if grad_sq > 0 else None


def pooled_noise_scale(
    trials: Sequence[FrozenTrial], *, interval: bool = True
) -> NoiseScale | None:
    """The study's noise scale from its search trials (see the module docstring), None where
    no trial measured it or the pooled ``|G|^2`` is not positive (the noise swamped it).
    ``interval`` False: the estimate alone (its interval unbounded), without resampling."""
    noise = pool_noise(_rows(trials), interval=interval)
    ranks = [number(t.user_attrs, "ranks") for t in trials]
    world = int(max((r for r in ranks if r is not None), default=1))
    return noise if noise is None or world <= 1 else replace(noise, ranks=world)


def pool_noise(
    rows: Sequence[tuple[float, float, float, float | None]], *, interval: bool = True
) -> NoiseScale | None:
    """`pooled_noise_scale` over runs given as (steps, mean |G|^2, mean tr(Sigma), standard
    error of their ratio or None), as `TrialResult` holds them."""
    if not rows:
        return None
    value = _ratio(rows)
    if value is None:
        return None
    steps = int(sum(r[0] for r in rows))
    if not interval:
        return NoiseScale(value, 0.0, math.inf, len(rows), steps)
    if len(rows) >= MIN_BOOTSTRAP:
        draws = random.Random(0)
        found = []
        for _ in range(BOOTSTRAP_DRAWS):
            ratio = _ratio([rows[draws.randrange(len(rows))] for _ in rows])
            if ratio is not None:
                found.append(ratio)
        found.sort()
        if len(found) < BOOTSTRAP_DRAWS // 2:  # |G|^2 itself within its noise of zero
            low, high = 0.0, math.inf
        else:
            low, high = found[int(0.025 * len(found))], found[int(0.975 * len(found)) - 1]
    else:
        low, high = _from_errors(rows, value)
    return NoiseScale(value, max(0.0, low), high, len(rows), steps)


def _from_errors(
    rows: Sequence[tuple[float, float, float, float | None]], value: float
) -> tuple[float, float]:
    """The interval from the trials' own standard errors (their ratios' spread beside them
    counts too); unbounded above where a trial has none."""
    weight = math.fsum(r[0] for r in rows)
    grad_sq = math.fsum(r[0] * r[1] for r in rows) / weight
    variance = 0.0
    for steps, g, t, se in rows:
        if se is None:
            return 0.0, math.inf
        share = steps / weight
        variance += (share * g) ** 2 * (se**2 + (t / g - value) ** 2 if g > 0 else se**2)
    half = Z_95 * math.sqrt(variance) / grad_sq
    return value - half, value + half


def critical_batch_text(noise: NoiseScale) -> str:
    """The noise scale in words, as the summary and the report state it."""
    interval = (
        f"95% CI {noise.low:,.0f}-{noise.high:,.0f}"
        if math.isfinite(noise.high)
        else f"at least {noise.low:,.0f}"
    )
    node = (
        f" samples a step ({noise.value / noise.ranks:,.0f} a rank on {noise.ranks} ranks)"
        if noise.ranks > 1
        else ""
    )
    return (
        f"gradient noise scale B_noise ~ {noise.value:,.0f} ({interval}; {noise.trials}"
        f" trial(s), {noise.steps:,} steps): above about B_noise = {noise.value:,.0f}{node}, a"
        " larger batch needs proportionally more samples to reach the same loss: the speed it"
        " adds is spent on convergence"
    )
