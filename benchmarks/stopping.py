"""The confirmation's stop rules replayed on rounds that real studies measured.

Each `claims` run (``python -m benchmarks claims``) stores, for every study, the throughput
its confirmation rounds read per round (baseline and recommendation, in round order), since
2026-12-06 those rounds continued past the study's stop to ten, as its worker
would have run them (`benchmarks.claims.more_rounds`), the time its search and its
confirmation trials took, and the plain training loop's speedup read side by side right
after the study (`benchmarks.reference`). A stop rule only decides after how many of those
rounds to stop; the readings do not depend on it. So every rule can be replayed on the same
recorded rounds with the study's own code (`_confirm.settled`, asked after each round as
the worker asks it), and compared on what the issue counts:

- the claim (the geometric mean of the rounds up to the stop, `paired_speedup`) against the
  plain loop's: the median absolute log error, and how often the stated interval covers it;
- the confirmation's share of the time spent in trials, estimated as the search trials'
  time plus the study's own time per confirmation round times the rounds kept (runs
  recorded before the fresh process was started beside the worker's start-up paid its
  start, about 2.7 s, in their first confirmation trial: spread over the rounds here, so
  their shares are a little high for today's service);
- how many claims end "faster" (the stated interval above 1);
- the rounds run.

A rule that would have run past a study's recorded rounds is replayed to their end and
counted (``short``): its figures are then a bound. (The continued rounds ran a minute after
the study's own, in the same kind of process: a little of the machine's moment may differ.)
Only studies whose confirmation trials ran in a fresh process (``confirm_process =
"fresh"``) are worth replaying for that default.

Second, every rule on resampled rounds (`resampled`): each study with enough rounds on
record gives studies of rounds drawn from its own, its truth the mean of all of them, which
isolates the rule's own error on real noise. Run: ``python -m benchmarks stopping [FILE ...]
[--draws 150]`` (default: the fresh-process claims on record in benchmarks/data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import selection
from loader_search.params import LoaderParams
from loader_search.study.stats import ConfirmSettings, Rounds, paired_speedup
from loader_search.study.stats import settled as confirm_settled

DATA = Path(__file__).parent / "data"
# The claims runs on record whose confirmation trials were forked from a fresh process.
FRESH_RUNS = (
    "claims_zygote",
    "claims_zygote_2",
    "claims_amd_5",
    "claims_amd_6",
    "claims_amd_7",  # with the rounds continued to ten (`benchmarks.claims.more_rounds`)
    "claims_amd_8",
    "claims_amd_9",
    "claims_amd_10",  # 24 side-by-side rounds a study
)

# The study's default rule (`StudyConfig`'s defaults, as the simulation runs them), no race.
NOW = dataclasses.replace(selection.SETTINGS, top=1)
# The rules before it: at least 3 rounds, and until 2026-12-06 the blocks' test of
# the day (`BlockTest` "chi2"), so that the studies recorded under them replay as they ran.
THREE = dataclasses.replace(NOW, min_rounds=3)
CHI2 = dataclasses.replace(THREE, block_test="chi2")
RULES = {
    "min 3, cap 15, futility 0.1, chi-square blocks": dataclasses.replace(CHI2, futility=0.1),
    "min 3, cap 10, futility 0.3, chi-square blocks": dataclasses.replace(CHI2, max_rounds=10),
    "min 3, cap 15, futility 0.3, chi-square blocks": CHI2,
    "min 3, cap 15, futility 0.3 (before)": THREE,
    f"min {NOW.min_rounds}, cap {NOW.max_rounds}, futility {NOW.futility:g} (now)": NOW,
    "min 5, cap 15, futility 0.3": dataclasses.replace(NOW, min_rounds=5),
    "min 3, cap 10, futility 0.3": dataclasses.replace(THREE, max_rounds=10),
    "min 4, cap 10, futility 0.3": dataclasses.replace(NOW, max_rounds=10),
    "min 3, cap 6, futility 0.3": dataclasses.replace(THREE, max_rounds=6),
}
# Two stand-in settings: the rules look only at the readings.
BASELINE = LoaderParams(64, 0, torch_threads=2)
CANDIDATE = LoaderParams(64, 1, 2, False, True, 1)


@dataclass(frozen=True)
class Recorded:
    """One study's confirmation rounds as a claims run stored them."""

    name: str
    # Per round: the study's own rounds, then those the claims run measured after its stop
    # (`benchmarks.claims.more_rounds`, where it did).
    baseline: tuple[float, ...]
    recommended: tuple[float, ...]
    loop: float  # the plain loop's speedup, side by side after the study
    search_s: float
    round_s: float  # one of the study's own rounds (its confirmation time over its rounds)


@dataclass(frozen=True)
class Replayed:
    rounds: int
    short: bool  # the rule would have gone on past the recorded rounds
    error: float  # log(claim / loop)
    covered: bool
    faster: bool  # the stated interval lies above 1: the verdict is "faster"
    share: float


def recorded(paths: Sequence[Path]) -> list[Recorded]:
    found = []
    for path in paths:
        data: dict[str, Any] = json.loads(path.read_text())
        for study in data["claims"]["studies"]:
            if study["side_by_side"] is None:  # it kept its baseline: nothing was compared
                continue
            readings = study["study_readings"]
            more = study.get("more_rounds") or {"baseline": [], "recommended": []}
            confirmation = study["confirmation"]
            rounds = min(len(readings["baseline"]), len(readings["recommended"]))
            found.append(
                Recorded(
                    f"{path.stem} seed {study['seed']}",
                    (*readings["baseline"][:rounds], *more["baseline"]),
                    (*readings["recommended"][:rounds], *more["recommended"]),
                    study["side_by_side"]["speedup"],
                    confirmation["trials_s"] - confirmation["confirmation_s"],
                    confirmation["confirmation_s"] / rounds,
                )
            )
    return found


def replay(study: Recorded, rule: ConfirmSettings) -> Replayed:
    """Where ``rule`` stops on ``study``'s rounds, and what it then claims."""
    total = min(len(study.baseline), len(study.recommended))
    measured: dict[int, dict[LoaderParams, float | None]] = {
        n: {BASELINE: study.baseline[n], CANDIDATE: study.recommended[n]} for n in range(total)
    }

    def settled(n: int) -> bool:  # asked after round n - 1, with the rounds measured so far
        so_far = dict(list(measured.items())[:n])
        return confirm_settled(Rounds(BASELINE, (CANDIDATE,), so_far, rule.block_test), n, rule)

    stop = next((n for n in range(1, total + 1) if settled(n)), None)
    kept = stop if stop is not None else total
    ratios = [r / b for r, b in zip(study.recommended[:kept], study.baseline[:kept], strict=True)]
    claim = paired_speedup(ratios, rule.block_test)
    assert claim is not None, "every study on record measured at least its minimum rounds"
    confirmation = study.round_s * kept
    return Replayed(
        kept,
        stop is None,
        math.log(claim.estimate / study.loop),
        claim.low <= study.loop <= claim.high,
        claim.low > 1,
        confirmation / (study.search_s + confirmation),
    )


def table(studies: Sequence[Recorded]) -> str:
    lines = [
        f"{len(studies)} studies on record (fresh-process confirmation), each rule replayed"
        " on their recorded rounds:",
        "",
        "| rule | median claim error | worst | mean log error | covered | said faster |"
        " confirmation share, median (range) | rounds, median (range) | ran out of rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rule in RULES.items():
        done = [replay(study, rule) for study in studies]
        errors = [abs(r.error) for r in done]
        shares = [r.share for r in done]
        rounds = [r.rounds for r in done]
        lines.append(
            f"| {name} | {statistics.median(errors):.1%} | {max(errors):.1%} |"
            f" {statistics.fmean(r.error for r in done):+.1%} |"
            f" {sum(r.covered for r in done)} of {len(done)} |"
            f" {sum(r.faster for r in done)} of {len(done)} |"
            f" {statistics.median(shares):.0%} ({min(shares):.0%}-{max(shares):.0%}) |"
            f" {statistics.median(rounds):g} ({min(rounds)}-{max(rounds)}) |"
            f" {sum(r.short for r in done)} |"
        )
    return "\n".join(lines)


MIN_RESAMPLED = 6  # rounds a study needs on record to be resampled


def resampled(studies: Sequence[Recorded], draws: int, seed: int = 0) -> list[Recorded]:
    """``draws`` studies per study on record with at least `MIN_RESAMPLED` rounds: rounds
    drawn with replacement from its own (as many as the default cap), its loop's speedup
    replaced by the geometric mean of all its rounds. A rule replayed on them shows its own
    error and coverage on this machine's real round-to-round noise (bimodal at times: the
    allocator's regime is a process's own), without the moment between the rounds and a
    later run or the loop's noise, which the recorded replay has."""
    rng = random.Random(seed)
    found = []
    for study in studies:
        pairs = list(zip(study.baseline, study.recommended, strict=False))
        if len(pairs) < MIN_RESAMPLED:
            continue
        truth = math.exp(statistics.fmean(math.log(r / b) for b, r in pairs))
        for draw in range(draws):
            drawn = [rng.choice(pairs) for _ in range(NOW.max_rounds)]
            found.append(
                dataclasses.replace(
                    study,
                    name=f"{study.name} draw {draw}",
                    baseline=tuple(b for b, _ in drawn),
                    recommended=tuple(r for _, r in drawn),
                    loop=truth,
                )
            )
    return found


def resampled_table(studies: Sequence[Recorded], draws: int) -> str:
    drawn = resampled(studies, draws)
    lines = [
        f"Each rule on resampled rounds: {len(drawn) // draws} studies with at least"
        f" {MIN_RESAMPLED} rounds on record, {draws} draws each of {NOW.max_rounds} rounds with"
        " replacement from its own; the truth is the mean of all its rounds (the rule's own"
        " error: no moment, no loop noise; a mean log error is the rule's own bias, as a rule"
        " that stopped on rounds that read high would have):",
        "",
        "| rule | median claim error | mean log error | covered | said faster | confirmation"
        " share, median | rounds, mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rule in RULES.items():
        done = [replay(study, rule) for study in drawn]
        lines.append(
            f"| {name} | {statistics.median(abs(r.error) for r in done):.1%}"
            f" | {statistics.fmean(r.error for r in done):+.2%}"
            f" | {statistics.fmean(r.covered for r in done):.1%}"
            f" | {statistics.fmean(r.faster for r in done):.0%}"
            f" | {statistics.median(r.share for r in done):.0%}"
            f" | {statistics.fmean(r.rounds for r in done):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks stopping", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("files", nargs="*", type=Path, help="claims runs' JSON files")
    parser.add_argument(
        "--draws", type=int, default=150, help="resampled studies per study on record (0: none)"
    )
    args = parser.parse_args(argv)
    files = args.files or [DATA / f"{name}.json" for name in FRESH_RUNS]
    studies = recorded([f for f in files if f.exists()])
    print(table(studies))
    if args.draws > 0:
        print()
        print(resampled_table(studies, args.draws))


if __name__ == "__main__":  # the module's name, as comments in loader_search/ cite it
    main()
