"""The statistics of paired rounds: a speedup and its 95% interval from per-round ratios
(candidate / baseline, one per round), and how likely more rounds are to show a gain.

The estimate is the geometric mean of the ratios, with a 95% Student-t interval on the log
ratios (the paired t-interval: the rounds are the pairs, and a ratio of throughputs is closer
to log-normal than to normal).

**Blocks.** Consecutive rounds form blocks of `BLOCK_ROUNDS` (tens of seconds of trials each).
When the machine's state changes during the rounds (a neighbour's load, the host's frequency), the
ratios of one block differ from another's by more than the rounds within a block do, and a
later run on the machine will meet such states too. The interval is then a random-effects
one (DerSimonian-Laird: the variance between blocks, ``tau^2``, is added to the within-block
noise), never narrower than the paired t-interval; where the blocks disagree beyond their
noise (the one-way analysis of variance's F test at 95%: the noise within the blocks is
estimated from the rounds themselves) the blocks, not the rounds, count as the
independent units (Student's t with blocks - 1 degrees of freedom), the speedup carries
``blocks_disagree``, the rounds go on (more blocks, `loader_search.study.stats._confirm`), and
every view says so.

**A later run.** The rounds take a minute or two; the training a user runs with the
recommendation takes hours, and the machine's state during the rounds as a whole (the
neighbours' load, the host's frequency, which regime the allocator settled in) is one draw of
the states that training will meet. The interval is for the speedup over that long run, so
it adds the variance of that draw, ``RERUN_NOISE`` times one round's standard deviation,
squared, to the variance of the rounds' mean: more rounds narrow the part that is the rounds'
noise, never this one. ``RERUN_NOISE`` was measured (``python -m benchmarks claims``: 38 studies
on two hosts, each followed minutes later by a plain training loop in a fresh process, the
claim's error beyond the noise of both, its mean taken out; benchmarks/RESULTS.md). On a
machine whose rounds agree within 1%, the term is a fraction of 1%.
What it does not cover: a systematic difference between a trial and the user's own loop (the
benchmarks' claims read a mean 4.0% high against a plain loop over 40 studies with
fresh-process confirmation, the runner's speedup itself 3.5% beside it; docs/how-it-works.md,
"Known bias"), and a machine far quieter or busier than it was during the whole study.

Pure functions of the ratios; `loader_search.study.stats._confirm` runs the rounds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean, stdev
from typing import Literal

Verdict = Literal["faster", "no_reliable_gain"]
# How the blocks' disagreement is tested (`_between_blocks`): "f", the one-way analysis of
# variance's F test; "chi2", Cochran's Q against its chi-square quantile, the test until
# 2026-12-06, kept so that the studies recorded under it replay as they ran
# (benchmarks/stopping.py).
BlockTest = Literal["f", "chi2"]
FASTER: Verdict = "faster"
NO_RELIABLE_GAIN: Verdict = "no_reliable_gain"

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; beyond the table
# the next smaller listed degree's value is used, which is slightly wider (conservative).
_T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
    17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000,
    120: 1.980,
}  # fmt: skip
# Chi-square, 0.95 quantile, by degrees of freedom: the blocks' test before the F test (the
# "chi2" `BlockTest`).
_CHI2_95 = {
    1: 3.841, 2: 5.991, 3: 7.815, 4: 9.488, 5: 11.070, 6: 12.592, 7: 14.067, 8: 15.507,
    9: 16.919, 10: 18.307,
}  # fmt: skip
BLOCK_ROUNDS = 2  # consecutive rounds per block (see the module docstring)
# The standard deviation of the rounds' moment against a long run, as a fraction of one
# round's (see the module docstring, "A later run"): 0.34 measured, rounded up.
RERUN_NOISE = 0.35
# An interval is given in numbers only from `MIN_SIZED_ROUNDS` paired rounds on, and only
# where its upper end is at most `MAX_SIZED_RATIO` times its lower (a lower end above 0):
# from two rounds Student's t has one degree of freedom (12.7), and the interval spans
# orders of magnitude ("0.00-60173.66"), which reads as a measurement when it is none.
MIN_SIZED_ROUNDS = 3
MAX_SIZED_RATIO = 10.0
TOO_NOISY = "too noisy to size"


def t_975(degrees: int) -> float:
    """The 0.975 quantile of Student's t with ``degrees`` degrees of freedom (>= 1)."""
    if degrees < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {degrees}")
    return _T_975[max(d for d in _T_975 if d <= degrees)]


@dataclass(frozen=True)
class PairedSpeedup:
    """A candidate's speedup over the baseline from paired rounds."""

    estimate: float  # the geometric mean of the per-round ratios
    low: float  # its 95% interval
    high: float
    rounds: int  # rounds in which both it and the baseline were measured
    # Its blocks of rounds disagree beyond their noise: the machine's state changed during
    # the rounds (the interval then spans the blocks; see the module docstring).
    blocks_disagree: bool = False

    @property
    def half_width(self) -> float:
        """Half the interval, relative to the estimate."""
        return (self.high - self.low) / 2 / self.estimate

    @property
    def verdict(self) -> Verdict:
        return FASTER if self.low > 1.0 else NO_RELIABLE_GAIN

    @property
    def too_noisy(self) -> bool:
        """Its interval says nothing in numbers (see `MIN_SIZED_ROUNDS`): every view writes
        it in words (`interval_text`); ``best --json`` keeps the numbers beside this flag."""
        if self.rounds < MIN_SIZED_ROUNDS:
            return True
        # Written so that NaN and infinite ends count as too noisy too.
        return not (self.low > 0 and self.high / self.low <= MAX_SIZED_RATIO)

    def interval_text(self, *, cell: bool = False) -> str:
        """The 95% interval as every view writes it: in numbers, or in words when too noisy;
        with how many paired rounds it rests on, or (``cell``) as short as a table cell."""
        if cell:
            return TOO_NOISY if self.too_noisy else f"95% CI {self.low:.2f}-{self.high:.2f}"
        text = (
            f"95% CI {TOO_NOISY}" if self.too_noisy else f"95% CI {self.low:.2f}-{self.high:.2f}"
        )
        return f"{text}, paired over {self.rounds} round{'s' if self.rounds != 1 else ''}"


def preference(speedup: PairedSpeedup) -> tuple[bool, float]:
    """How candidates rank, the recommendation's and the rounds' leader alike: one surely
    faster than the baseline before one that may not be, then the higher estimate."""
    return speedup.verdict == FASTER, speedup.estimate


def chi2_95(degrees: int) -> float:
    """The 0.95 quantile of the chi-square distribution with ``degrees`` (>= 1) degrees of
    freedom: the table to 10, the Wilson-Hilferty approximation beyond (within 0.2%)."""
    if degrees < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {degrees}")
    if degrees in _CHI2_95:
        return _CHI2_95[degrees]
    a = 2 / (9 * degrees)
    return degrees * (1 - a + 1.6449 * math.sqrt(a)) ** 3


@functools.lru_cache(maxsize=1024)
def f_95(between: int, within: int) -> float:
    """The 0.95 quantile of the F distribution with ``between`` and ``within`` (each >= 1)
    degrees of freedom: the blocks' test (see `_between_blocks`). Its distribution function
    is the regularized incomplete beta function (`_beta_cdf`), inverted by bisection."""
    if between < 1 or within < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {between} and {within}")

    def cdf(x: float) -> float:
        return _beta_cdf(between / 2, within / 2, between * x / (between * x + within))

    low, high = 0.0, 1.0
    while cdf(high) < 0.95:
        low, high = high, 2 * high
    while high - low > 1e-12 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < 0.95 else (low, middle)
    return (low + high) / 2


def _beta_cdf(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz's
    method; Numerical Recipes, section 6.4), on the side of ``x`` where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _beta_cdf(b, a, 1.0 - x)
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction / a


def paired_speedup(ratios: Sequence[float], block_test: BlockTest = "f") -> PairedSpeedup | None:
    """The speedup and its 95% interval from per-round ratios, in round order (None for
    fewer than 2). See the module docstring for the blocks."""
    if len(ratios) < 2:
        return None
    spread = _log_spread(ratios, block_test)
    return PairedSpeedup(
        math.exp(spread.mean),
        math.exp(spread.mean - spread.margin),
        math.exp(spread.mean + spread.margin),
        len(ratios),
        blocks_disagree=spread.disagree,
    )


@dataclass(frozen=True)
class _LogSpread:
    """The mean of per-round log ratios, its variance and the interval's degrees of freedom."""

    mean: float
    variance: float  # of the mean
    degrees: int
    disagree: bool  # the blocks disagree (see the module docstring)
    round_sd: float  # one round's standard deviation

    @property
    def margin(self) -> float:
        """Half the 95% interval of the speedup over a long run (of the log ratios): the
        rounds' mean, its variance and the variance of the rounds' moment against that run."""
        return t_975(self.degrees) * math.sqrt(self.variance + rerun_variance(self.round_sd))


def rerun_variance(round_sd: float) -> float:
    """The variance of the rounds' moment against a long run, for rounds whose log ratios
    have the standard deviation ``round_sd`` (see the module docstring, "A later run")."""
    return (RERUN_NOISE * round_sd) ** 2


def _log_spread(ratios: Sequence[float], block_test: BlockTest) -> _LogSpread:
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    round_sd = stdev(logs)
    variance = round_sd**2 / n  # of the mean, rounds independent
    degrees = n - 1
    blocks = [logs[i : i + BLOCK_ROUNDS] for i in range(0, n, BLOCK_ROUNDS)]
    disagree = False
    if len(blocks) >= 2 and n > len(blocks):
        between, disagree = _between_blocks(blocks, block_test)
        if between is not None:
            variance = max(variance, between)
        if disagree:
            degrees = len(blocks) - 1  # the blocks, not the rounds, are the independent units
    return _LogSpread(fmean(logs), variance, degrees, disagree, round_sd)


def chance_of_gain(ratios: Sequence[float], more: int, block_test: BlockTest = "f") -> float:
    """How likely ``more`` further rounds like ``ratios`` (per-round ratios, at least 2) are
    to end with a 95% interval above 1: the predictive probability, with the log ratios
    normal around the rounds' true mean, known only as well as the rounds so far tell it (the
    variance of their mean, blocks included; the rounds to come share their moment, so the
    rerun term is not part of it), each new round as noisy as theirs. The interval at the end
    is `paired_speedup`'s, rerun term included. With no round left: 1.0 when the interval is
    above 1 already, else 0.0."""
    if len(ratios) < 2:
        raise ValueError(f"a chance of gain needs at least 2 rounds, got {len(ratios)}")
    now = _log_spread(ratios, block_test)
    if more <= 0:
        return 1.0 if now.mean > now.margin else 0.0
    noise = now.round_sd
    if noise == 0:
        return 1.0 if now.mean > 0 else 0.0
    # At the cap the interval's low end lies above 1 when the mean of all the log ratios
    # exceeds its margin (the blocks taken to agree by then): the rounds to come must then
    # average at least `needed`.
    n, total = len(ratios), len(ratios) + more
    margin = t_975(total - 1) * math.sqrt(noise**2 / total + rerun_variance(noise))
    needed = (total * margin - n * now.mean) / more
    scale = math.sqrt(noise**2 / more + now.variance)
    return 0.5 * math.erfc((needed - now.mean) / scale / math.sqrt(2))


def _between_blocks(
    blocks: Sequence[Sequence[float]], test: BlockTest
) -> tuple[float | None, bool]:
    """For log ratios in ``blocks`` (at least two, more values than blocks): the variance of
    their mean under a random-effects model (DerSimonian-Laird: each block's true ratio
    varies around the overall one by ``tau^2``, the rounds within a block around their
    block's), None when it finds no variation between blocks; and whether the blocks
    disagree: Cochran's Q over its degrees of freedom above the 0.95 quantile of F(k - 1, n -
    k), the one-way analysis of variance's test (``test`` "f"). Q against its chi-square
    quantile (``test`` "chi2", the test before) takes the noise within the blocks for known;
    estimated from a study's few rounds, it made the blocks of rounds of pure noise
    "disagree" in 18-30% of studies, where the F test does in 5%."""
    n = sum(len(b) for b in blocks)
    k = len(blocks)
    means = [fmean(b) for b in blocks]
    overall = fmean(x for b in blocks for x in b)
    within = sum((x - m) ** 2 for b, m in zip(blocks, means, strict=True) for x in b) / (n - k)
    spread = sum(len(b) * (m - overall) ** 2 for b, m in zip(blocks, means, strict=True))
    if within <= 0:  # no noise inside the blocks: any difference between them is real
        if spread <= 0:
            return None, False
        tau2 = spread / n
        return sum((len(b) / n) ** 2 * tau2 for b in blocks), True
    q = spread / within
    weights = [len(b) / within for b in blocks]
    scale = sum(weights) - sum(w * w for w in weights) / sum(weights)
    tau2 = max(0.0, (q - (k - 1)) / scale)
    disagree = q > (chi2_95(k - 1) if test == "chi2" else (k - 1) * f_95(k - 1, n - k))
    if tau2 == 0:
        return None, disagree
    # The plain mean weighs every round alike; its variance under the model:
    return sum((len(b) / n) ** 2 * (within / len(b) + tau2) for b in blocks), disagree
