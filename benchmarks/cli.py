"""``python -m benchmarks {ground-truth,resolve,replay,speedup,claims,agreement,scale,backends,
all} [--quick]``, and ``python -m benchmarks {steps,ranks,selection,stopping,script,goodput}
...`` with options of their own (``--help`` after the name).

See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import (
    agreement,
    backends,
    claims,
    goodput,
    ground_truth,
    model,
    ranks,
    replay,
    resolve,
    scale,
    script,
    selection,
    speedup,
    steps,
    stopping,
)
from loader_search._system import cpu_model, usable_cpus
from loader_search.study import TrialPoint, load_config, pareto_front

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
# Parts of the suite that are not part of `all` and take options of their own: the name
# hands the rest of the command line to the module's own parser.
OWN_OPTIONS: dict[str, Callable[[list[str]], None]] = {
    "steps": steps.main,
    "ranks": ranks.main,
    "selection": selection.main,
    "stopping": stopping.main,
    "script": script.main,
    "goodput": goodput.main,
}


def machine() -> str:
    import optuna
    import torch

    return (
        f"{usable_cpus()} usable CPU(s) of {cpu_model()}, Python {platform.python_version()},"
        f" torch {torch.__version__}, optuna {optuna.__version__}"
    )


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Markdown: ``columns`` are (key, header, format)."""
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---:" if f else "---" for _, _, f in columns) + "|",
    ]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else (format(value, fmt) if fmt else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ground_truth_section(entries: list[ground_truth.Entry]) -> tuple[str, dict[str, Any]]:
    spreads = [e.spread for e in entries]
    short_vs_full = [
        e.throughput / statistics.median(e.full_window_throughputs) - 1 for e in entries
    ]

    def bias(keep: Any) -> float | None:
        kind = [e for e in entries if keep(e)]
        if not kind:
            return None
        return statistics.median(
            e.throughput / statistics.median(e.full_window_throughputs) - 1 for e in kind
        )

    by_batch: dict[int, list[float]] = {}
    for e in entries:
        by_batch.setdefault(e.params.batch_size, []).append(e.val_loss)
    truth = replay.Truth.of(entries)
    # The service's own definition of the front, over the table's medians (fastest first).
    points = [
        TrialPoint(i, e.params, e.throughput, e.val_loss, False) for i, e in enumerate(entries)
    ]
    front = [entries[p.number] for p in pareto_front(points)]
    stats = {
        "configs": len(entries),
        "repeats": statistics.median(len(e.throughputs) for e in entries),
        "spread_median": statistics.median(spreads),
        "spread_p90": _pct(spreads, 0.9),
        "spread_max": max(spreads),
        "short_vs_full_median": statistics.median(short_vs_full),
        "short_vs_full_p90_abs": _pct([abs(x) for x in short_vs_full], 0.9),
        "short_vs_full_by_kind": {
            "no workers": bias(lambda e: e.params.num_workers == 0),
            "persistent workers": bias(lambda e: e.params.persistent_workers),
            "workers restarted each epoch": bias(
                lambda e: e.params.num_workers > 0 and not e.params.persistent_workers
            ),
        },
        "val_loss_spread_within_batch": {
            b: (max(v) - min(v)) / statistics.median(v) for b, v in sorted(by_batch.items())
        },
        "best_throughput": truth.best_throughput,
        # What a ceiling reading adds to a trial (the replay charges it once per pair).
        "ceiling_reading_s_median": statistics.median(e.ceiling_wall_s for e in entries),
    }
    rows = [
        {
            "config": ground_truth.key(e.params),
            "throughput": e.throughput,
            "spread": e.spread,
            "val_loss": e.val_loss,
            "ceiling": e.ceiling,
            "eff": e.throughput / e.ceiling if e.ceiling else None,
            "wall": e.wall_s,
            "short": e.short_wall_s,
        }
        for e in front
    ]
    text = "\n".join(
        [
            f"{stats['configs']} configurations, {stats['repeats']:.0f} full trials each"
            " (medians below).",
            "",
            "True Pareto front (medians):",
            "",
            _table(
                rows,
                [
                    ("config", "configuration", ""),
                    ("throughput", "samples/s", ",.0f"),
                    ("spread", "spread", ".0%"),
                    ("val_loss", "val_loss", ".4f"),
                    ("ceiling", "ceiling", ",.0f"),
                    ("eff", "efficiency", ".0%"),
                    ("wall", "trial s", ".2f"),
                    ("short", "short trial s", ".2f"),
                ],
            ),
        ]
    )
    return text, stats


def noise_section(stats: dict[str, Any]) -> str:
    within = ", ".join(
        f"batch {b}: {v:.2%}" for b, v in stats["val_loss_spread_within_batch"].items()
    )
    return "\n".join(
        [
            "Run-to-run spread of one configuration's throughput, (max - min) / median over"
            f" its repeats: median {stats['spread_median']:.1%}, 90th percentile"
            f" {stats['spread_p90']:.1%}, worst {stats['spread_max']:.1%}.",
            "",
            "Throughput over the study's window (warm-up to the early-stop mark) vs over the"
            " whole run (warm-up to the end), median over configurations:"
            f" {stats['short_vs_full_median']:+.1%}; 90th percentile of the"
            f" absolute difference {stats['short_vs_full_p90_abs']:.1%}. By loader kind: "
            + ", ".join(
                f"{k} {v:+.1%}" for k, v in stats["short_vs_full_by_kind"].items() if v is not None
            )
            + ".",
            "",
            "Validation loss across all loader settings of one batch size, (max - min) /"
            f" median: {within}.",
        ]
    )


def _count(value: float) -> str:
    """A count or a median of counts: 9, 9.5."""
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def trials_to_5pct_text(row: dict[str, Any]) -> str:
    """``replay.trials_to_5pct`` as a cell: the median, or ">N" when it is not reached."""
    if row.get("trials_to_5pct") is not None:
        return _count(row["trials_to_5pct"])
    if row.get("trials_to_5pct_above") is not None:
        return ">" + _count(row["trials_to_5pct_above"])
    return "-"


def _regret_ci_text(row: dict[str, Any], budget: int) -> str | None:
    if f"regret_mean@{budget}" not in row:
        return None
    low, high = row[f"regret_ci@{budget}"]
    return f"{row[f'regret_mean@{budget}']:.1%} [{low:.1%}, {high:.1%}]"


def _paired_text(row: dict[str, Any], budget: int) -> str | None:
    paired = row.get(f"vs_{replay.BASE_VARIANT}@{budget}")
    if paired is None:
        return None
    low, high = paired["ci"]
    return (
        f"{paired['mean'] * 100:+.1f} pp [{low * 100:+.1f}, {high * 100:+.1f}],"
        f" {paired['wins']}/{paired['losses']}"
    )


def model_section(errors: dict[str, Any], cost_s: float, seeds: int) -> str:
    rows = [
        {
            "after": "the baseline alone" if n == "1" else f"{n} trials",
            "median": e["median_error"],
            "p90": e["p90_error"],
        }
        for n, e in errors.items()
    ]
    columns = [
        ("after", "fitted on", ""),
        ("median", "median |predicted/true - 1|", ".1%"),
        ("p90", "90th percentile", ".1%"),
    ]
    return "\n".join(
        [
            "Prediction error of the pipeline model over every configuration of the table"
            f" (true: the table's medians), fitted on the trials a model-guided study had run"
            f" by then (medians over {seeds} seeds).",
            "",
            _table(rows, columns),
            "",
            "Fitting it on a 20-trial study and finding each batch size's best:"
            f" {cost_s * 1000:.2f} ms (median of 50; a worker does this once per trial, under"
            " the study lock).",
        ]
    )


def _pm(half_width: float | None) -> str:
    return "unbounded (fewer than 6 repeats)" if half_width is None else f"+-{half_width:.1%}"


def resolve_section(stats: dict[str, Any]) -> str:
    rows = [{"batch": batch, **row} for batch, row in stats["per_batch"].items()]
    columns = [
        ("batch", "batch", ""),
        ("best_before", "best in the table", ""),
        ("best_before_samples_per_s", "samples/s (table)", ",.0f"),
        ("best_after", "best, resolved", ""),
        ("best_after_samples_per_s", "samples/s (resolved)", ",.0f"),
        ("within_3pct", "within 3%", ""),
        ("within_5pct", "within 5%", ""),
        ("resolved", "re-measured", ""),
    ]
    return "\n".join(
        [
            f"{stats['settings']} contenders (within {1 - resolve.CONTENDER_SHARE:.0%} of their"
            " batch size's best, the model's proposals, the baseline) re-measured in"
            f" interleaved rounds: {stats['trials']} trials, {stats['repeats_median']:.0f}"
            f" repeats per setting (median; at most {stats['repeats_max']}). The 95% interval"
            f" of a median is within {_pm(stats['half_width_median'])} of it (median; worst"
            f" {_pm(stats['half_width_max'])}; {stats['settled']} of {stats['settings']}"
            f" within +-{resolve.TARGET_HALF_WIDTH:.0%}; among the settings within"
            f" {1 - resolve.OUT_OF_RACE:.0%} of their batch size's best, the worst is"
            f" {_pm(stats['top_half_width_max'])}). A setting left the rounds once its interval"
            f" was within +-{resolve.TARGET_HALF_WIDTH:.0%}, or lay wholly below"
            f" {resolve.OUT_OF_RACE:.0%} of the best lower interval end of its batch size (after"
            f" {resolve.MIN_ROUNDS} rounds; at most {resolve.MAX_ROUNDS}). Medians moved by"
            f" {stats['median_shift_vs_3_repeats']:+.1%} against the table's repeats (median;"
            f" 90th percentile of the absolute move {stats['abs_shift_p90']:.1%}).",
            "",
            _table(rows, columns),
        ]
    )


def replay_section(rows: list[dict[str, Any]], budgets: list[int], seeds: int) -> str:
    rows = [{**row, "trials_to_5pct_text": trials_to_5pct_text(row)} for row in rows]
    columns: list[tuple[str, str, str]] = [("variant", "sampler / option", "")]
    for b in budgets:
        columns.append((f"hv_gap@{b}", f"HV gap @{b}", ".3f"))
    for b in budgets:
        columns.append((f"regret@{b}", f"regret @{b}", ".1%"))
    for b in budgets:
        columns.append((f"within5@{b}", f"<=5% @{b}", ".0%"))
    columns.append(("trials_to_5pct_text", f"trials to <=5% @{max(budgets)} (all trials run)", ""))
    columns.append(("reached_5pct", "reached", ""))
    paired = any(f"vs_{replay.BASE_VARIANT}@{b}" in row for row in rows for b in budgets)
    means = [
        {
            "variant": row["variant"],
            **{f"ci@{b}": _regret_ci_text(row, b) for b in budgets},
            **{f"vs@{b}": _paired_text(row, b) for b in budgets},
        }
        for row in rows
    ]
    mean_columns: list[tuple[str, str, str]] = [("variant", "sampler / option", "")]
    for b in budgets:
        mean_columns.append((f"ci@{b}", f"mean regret @{b} [95% CI]", ""))
        if paired:
            mean_columns.append(
                (
                    f"vs@{b}",
                    f"paired vs {replay.BASE_VARIANT} @{b}: mean diff [CI], wins/losses",
                    "",
                )
            )
    cost = [("variant", "sampler / option", "")]
    for b in budgets:
        cost.append((f"claim_error@{b}", f"claim error @{b}", ".1%"))
    for b in budgets:
        cost.append((f"trials@{b}", f"trials run @{b}", ".0f"))
        cost.append((f"cost_s@{b}", f"trial time @{b} (s)", ",.0f"))
    return "\n".join(
        [
            f"Medians over {seeds} seeds. Budgets count the search trials; confirmation trials"
            " come on top. 'random, 2x trials' runs twice each budget. Trials to <=5%: the median"
            " over all seeds of the trials run until the recommendation was first within 5% of"
            " the best (confirmation trials and the 2x variant's extra trials count); a seed that"
            " never got there counts as never, and '>N' means the median was not reached"
            " (N: that median with such a seed counted as the trials it ran).",
            "",
            _table(rows, columns),
            "",
            "Mean regret over seeds with its 95% bootstrap interval"
            + (
                f"; and, seed by seed at the same budget, the variant's regret minus"
                f" {replay.BASE_VARIANT}'s: mean difference in percentage points (negative is"
                " better) with its 95% bootstrap interval, and the seeds where the variant's"
                " regret was lower (wins) / higher (losses)"
                if paired
                else ""
            )
            + ":",
            "",
            _table(means, mean_columns),
            "",
            "Claim error: |speedup the study reported / true speedup of its recommendation - 1|;"
            " and what each study cost (sum of its trials' measured wall time, confirmation trials"
            " included):",
            "",
            _table(rows, cost),
        ]
    )


def _faults(pair: dict[str, float | None] | None) -> str:
    if not pair:
        return "-"
    return " / ".join(
        "-" if pair[k] is None else f"{pair[k]:,.0f}" for k in ("study", "reference")
    )


def claims_section(result: dict[str, Any]) -> str:
    rows = []
    for r in result["studies"]:
        measured = r["side_by_side"]
        rows.append(
            {
                "seed": r["seed"],
                "recommended": r["recommended"],
                "claim": f"{r['claim']:.3f}x",
                "ci": "-" if not r["claim_ci95"] else "{:.3f}-{:.3f}".format(*r["claim_ci95"]),
                "verdict": r["verdict"] or "-",
                "rounds": r["confirmation_rounds"],
                "truth": "-" if not measured else f"{measured['speedup']:.3f}x",
                "truth_ci": "-" if not measured else "{:.3f}-{:.3f}".format(*measured["ci95"]),
                "error": r["claim_error"],
                "covered": {True: "yes", False: "no", None: "-"}[r["covered"]],
                "study_s": r["study_s"],
                "share": r["confirmation"]["share"],
                "blocks": {True: "disagree", False: "agree", None: "-"}[r["blocks_disagree"]],
                "runner": " / ".join(
                    f"{r.get('study_over_reference', {}).get(k, float('nan')):.2f}"
                    for k in ("baseline", "recommended")
                ),
                "faults": _faults(r.get("faults_per_batch", {}).get("baseline")),
                "after": _runner_after(measured),
                "during": _beside_rounds(r.get("beside_rounds")),
            }
        )
    columns = [
        ("seed", "seed", ""),
        ("recommended", "recommended", ""),
        ("claim", "claimed", ""),
        ("ci", "claimed 95% CI", ""),
        ("verdict", "verdict", ""),
        ("rounds", "rounds", ""),
        ("truth", "side by side", ""),
        ("truth_ci", "its 95% CI", ""),
        ("error", "claim error", "+.1%"),
        ("covered", "CI covers it", ""),
        ("study_s", "study s", ".0f"),
        ("share", "confirmation share", ".0%"),
        ("blocks", "blocks", ""),
        ("runner", "study / reference (baseline / recommended)", ""),
        ("faults", "baseline's page faults per batch: study / reference", ""),
        ("after", "runner beside the reference: speedup (baseline / recommended over it)", ""),
    ]
    if any(r.get("beside_rounds") for r in result["studies"]):
        columns.append(("during", "during the rounds: trials / runner / reference speedup", ""))
    summary = "No study recommended anything but its baseline."
    if result["checked"]:
        summary = (
            f"Claim error |claimed / side by side - 1|: median"
            f" {result['median_abs_claim_error']:.1%}, worst {result['max_abs_claim_error']:.1%}"
            f" over {result['checked']} studies; the claimed 95% interval covers the side-by-side"
            f" speedup in {result['covered']} of {result['with_interval']} (the side-by-side"
            " estimate has noise of its own, so even an exact 95% interval covers it less"
            " often than 95%)."
        )
    firsts = [f for f in result["baseline_first_vs_later"] if f is not None]
    if firsts:
        summary += (
            " The baseline's first reading (the study's first trial) against the median of its"
            " later readings: " + ", ".join(f"{f:.2f}" for f in firsts) + "."
        )
    return "\n".join(
        [
            f"{len(result['studies'])} independent studies (seeds 0-{len(result['studies']) - 1})"
            " with the service's defaults; each one's claim against the baseline and its"
            f" recommendation measured afterwards side by side through the reference loop"
            f" (`benchmarks/reference.py`, {result['rounds']} paired rounds, alternating order)."
            " Confirmation share: the confirmation rounds' share of the time the study's"
            f" trials took (median {result['median_confirmation_share']:.0%}).",
            "",
            _table(rows, columns),
            "",
            summary,
        ]
    )


def _runner_after(measured: dict[str, Any] | None) -> str:
    """The runner's readings interleaved with the reference's: its speedup, and each setting's
    reading over the reference's in the same rounds."""
    runner = (measured or {}).get("runner")
    if not runner:
        return "-"
    over = runner["over_reference"]
    return f"{runner['speedup']:.3f}x ({over['baseline']:.2f} / {over['recommended']:.2f})"


def _beside_rounds(found: dict[str, Any] | None) -> str:
    """The rounds' speedup by the study's trials, by the runner beside them and by the
    reference beside them (files before the runner was added name the trials "runner")."""
    if not found:
        return "-"
    trials = found["trial"] if "trial" in found else found["runner"]
    if trials is None:
        return "-"
    runner = found.get("runner") if "trial" in found else None
    parts = [f"{trials:.3f}x", "-" if runner is None else f"{runner:.3f}x"]
    parts.append(f"{found['reference']:.3f}x")
    return " / ".join(parts) + f" ({found['rounds']} rounds)"


def speedup_section(result: dict[str, Any]) -> str:
    rows = [
        {
            "name": name,
            "params": c["params"],
            "throughput": c["throughput"],
            "spread": c["spread"],
            "vs_base": c["throughput"] / result["contenders"]["baseline"]["throughput"],
            "ceiling": c["ceiling"],
            "eff": c["efficiency"],
        }
        for name, c in result["contenders"].items()
    ]
    cost = result["cost"]
    wall = cost["study_wall_s"]
    shares = [
        {"part": "training (timed loop)", "s": cost["train_s"]},
        {"part": "evaluation", "s": cost["eval_s"]},
        {
            "part": "rest of the trial process (model set-up, ceiling reading)",
            "s": cost["trial_other_s"],
        },
        {"part": "isolation (fork, result transfer, teardown)", "s": cost["isolation_s"]},
        {"part": "service (sampler, storage, planning, study set-up)", "s": cost["service_s"]},
    ]
    for row in shares:
        row["share"] = row["s"] / wall
    return "\n".join(
        [
            f"Side by side on {result['device']} ({result['cpus']} CPUs), {result['rounds']}"
            " shuffled rounds of full trials, medians:",
            "",
            _table(
                rows,
                [
                    ("name", "loader", ""),
                    ("params", "settings", ""),
                    ("throughput", "samples/s", ",.0f"),
                    ("spread", "spread", ".0%"),
                    ("vs_base", "vs baseline", ".2f"),
                    ("ceiling", "ceiling", ",.0f"),
                    ("eff", "loader efficiency", ".0%"),
                ],
            ),
            "",
            f"Recommended vs baseline **{result['speedup_vs_baseline']:.2f}x**, vs rule of thumb"
            f" **{result['speedup_vs_rule']:.2f}x** (the study itself reported"
            f" {result['study_recommended_speedup']:.2f}x).",
            "",
            f"The study: {wall:.0f} s wall for {cost['trials']} trials"
            f" ({cost['stopped_early']} stopped early,"
            f" {cost['confirmations']} confirmation trials):",
            "",
            _table(
                shares,
                [
                    ("part", "where the time went", ""),
                    ("s", "s", ".1f"),
                    ("share", "share", ".0%"),
                ],
            ),
        ]
    )


def scale_section(rows: list[dict[str, Any]]) -> str:
    return _table(
        rows,
        [
            ("backend", "backend", ""),
            ("workers", "workers", ""),
            ("wait_ms", "trial wait ms", ""),
            ("idle_connections", "idle conns", ""),
            ("trials", "trials", ""),
            ("p50_ms", "coordination p50 ms", ",.0f"),
            ("p95_ms", "p95 ms", ",.0f"),
            ("max_ms", "max ms", ",.0f"),
            ("lock_hold_p50_ms", "lock hold p50 ms", ",.1f"),
            ("lock_hold_p95_ms", "lock hold p95 ms", ",.1f"),
            ("capacity_trials_per_s", "capacity trials/s", ",.1f"),
            ("trials_per_s", "study trials/s", ",.1f"),
            ("connections_per_worker", "conns/worker", ".2f"),
            ("errors", "errors", ""),
            ("lost", "lost", ""),
            ("duplicates", "dup", ""),
            ("over_budget", "over budget", ""),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN_OPTIONS:
        OWN_OPTIONS[argv[0]](argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument(
        "command",
        choices=[
            *OWN_OPTIONS,
            "ground-truth",
            "resolve",
            "replay",
            "speedup",
            "claims",
            "agreement",
            "scale",
            "backends",
            "all",
        ],
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it works")
    parser.add_argument("--repeats", type=int, default=3, help="ground truth: trials per config")
    parser.add_argument("--seeds", type=int, default=30, help="replay: seeds per variant")
    parser.add_argument("--budgets", default="10,20,40", help="replay: trial budgets")
    parser.add_argument("--rounds", type=int, default=5, help="speedup: side-by-side rounds")
    parser.add_argument("--studies", type=int, default=5, help="claims: independent studies")
    parser.add_argument(
        "--claim-rounds", type=int, default=12, help="claims: side-by-side paired rounds"
    )
    parser.add_argument(
        "--extend-rounds",
        type=int,
        default=claims.EXTEND_TO,
        help="claims: continue each study's confirmation rounds to this many after it stops,"
        " as its worker would have run them (0: none), for python -m benchmarks stopping",
    )
    parser.add_argument(
        "--beside-rounds",
        action="store_true",
        help="claims: also read each confirmation trial's setting with the service's runner"
        " and the reference loop right after it, during the study (the rounds' own time,"
        " against the claim)",
    )
    parser.add_argument(
        "--agreement-rounds",
        type=int,
        default=10,
        help="agreement: interleaved rounds of the runner (forked, and forked from a kept fresh"
        " process),"
        " a new process and the reference loop",
    )
    parser.add_argument(
        "--agreement-after-study",
        action="store_true",
        help="agreement: run a study in this process first, so that the runner's trials fork"
        " from a worker's state",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="replay: variant names separated by ; (default: all of them)",
    )
    parser.add_argument(
        "--regime",
        choices=sorted(ground_truth.REGIMES),
        default="quickstart",
        help="ground-truth, resolve, replay: the quickstart (CPU-bound) or the GPU stand-in"
        " (studies/standin.toml, loader-bound); the stand-in's files end in _standin",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=ground_truth.QUICKSTART,
        help="speedup: the study config (default: studies/quickstart.toml)",
    )
    parser.add_argument(
        "--backends",
        default="postgresql,mariadb",
        help="scale: database servers, comma-separated (postgresql, mariadb)",
    )
    parser.add_argument(
        "--workers",
        default=",".join(str(n) for n in scale.WORKERS),
        help="scale: team sizes, comma-separated",
    )
    parser.add_argument(
        "--wait-ms",
        default="0,100",
        help="scale: forward-pass waits of the plug-in's trials, comma-separated (0: trials"
        " of milliseconds, CPU-bound; 100: trials of seconds that leave the CPUs free)",
    )
    parser.add_argument(
        "--idle-beside",
        type=int,
        default=31,
        help="scale: one worker beside this many idle connections (0: no such run)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for results (default: benchmarks/data, or a temp folder with --quick)",
    )
    args = parser.parse_args(argv)
    if args.command in OWN_OPTIONS:  # after an option: its own parser never saw the rest
        parser.error(
            f"{args.command} takes its own options: python -m benchmarks {args.command} ..."
        )
    budgets = [int(b) for b in args.budgets.split(",")]
    seeds, repeats, rounds = args.seeds, args.repeats, args.rounds
    if args.quick:
        budgets, seeds, repeats, rounds = [6, 10], 2, 2, 2
    out: Path = args.out or (DATA if not args.quick else Path(tempfile.mkdtemp(prefix="bench-")))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.command == "scale":  # its own file: a list of rows (the shape README.md gives)
        rows = scale.run(
            out / ("scale_quick.json" if args.quick else "scale.json"),
            backends=args.backends.split(","),
            workers=[int(n) for n in args.workers.split(",")],
            quick=args.quick,
            idle_beside=args.idle_beside,
            waits_ms=[float(w) for w in args.wait_ms.split(",")],
        )
        report = f"Measured on: {machine()}\n\n{scale_section(rows)}\n"
        (out / ("scale_quick.md" if args.quick else "scale.md")).write_text(report)
        print(report)
        print(f"(results in {out}; {time.perf_counter() - started:.0f} s)")
        return
    sections: list[str] = [
        f"Measured on: {machine()}" + (" (--quick: sizes, not timings)" if args.quick else "")
    ]
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    regime = ground_truth.REGIMES[args.regime]
    suffix = regime.suffix + ("_quick" if args.quick else "")
    if args.command == "resolve" and not regime.resolvable:
        parser.error(f"--regime {regime.name}: resolve re-measures the quickstart's table only")
    data = out / f"ground_truth{suffix}.jsonl"
    resolved_data = out / f"resolve{suffix}.jsonl"
    if args.command in ("ground-truth", "resolve", "replay", "all"):
        if args.command not in ("replay", "resolve") or not data.exists():
            ground_truth.run(data, repeats=repeats, quick=args.quick, regime=regime)
        entries = ground_truth.aggregate(ground_truth.read_rows(data))
        text, stats = ground_truth_section(entries)
        ground_truth.save_table(
            entries, out / f"ground_truth_table{suffix}.json", {"machine": machine()}
        )
        results["ground_truth"] = stats
        sections += ["## Ground truth", text, "## Noise", noise_section(stats)]
        config = load_config(regime.config)
        training = ground_truth.quick_config(config).training if args.quick else config.training
        table = ground_truth.QUICK_SPACE if args.quick else regime.space
        if args.command in ("resolve", "all") and regime.resolvable:
            proposed = replay.measured_by_default(
                entries, table, training, seeds=seeds, budget=max(budgets)
            )
            min_rounds, max_rounds = (
                (3, 4) if args.quick else (resolve.MIN_ROUNDS, resolve.MAX_ROUNDS)
            )
            resolve.run(
                resolved_data,
                resolve.contenders(entries, proposed),
                quick=args.quick,
                min_rounds=min_rounds,
                max_rounds=max_rounds,
            )
        if regime.resolvable and resolved_data.exists():  # judge against the re-measured
            resolved_rows = ground_truth.read_rows(resolved_data)
            stats = resolve.summary(entries, resolved_rows)
            results["resolve"] = stats
            sections += ["## A truth that resolves 3%", resolve_section(stats)]
            entries = resolve.merged(entries, resolved_rows)
        if args.command in ("replay", "all"):
            chosen = args.variants.split(";") if args.variants else None
            runs = replay.replay_all(
                entries, table, training, seeds=seeds, budgets=budgets, chosen=chosen
            )
            rows = replay.table(runs, budgets)
            results["replay"] = rows
            results["replay_runs"] = [dataclasses.asdict(run) for run in runs]
            sections += ["## Search quality (replay)", replay_section(rows, budgets, seeds)]
            if all(e.costs for e in entries):  # tables measured before stage costs: no model
                errors = model.prediction_error(entries, table, training, seeds=seeds)
                cost_s = model.fit_cost(entries, table, training)
                results["model"] = {"prediction_error": errors, "fit_cost_s": cost_s}
                sections += ["## The pipeline model", model_section(errors, cost_s, seeds)]
    if args.command in ("speedup", "all"):
        result = speedup.run(config_path=args.config, quick=args.quick, rounds=rounds, workdir=out)
        results["speedup"] = result
        sections += ["## Speedup and cost", speedup_section(result)]
    if args.command in ("claims", "all"):
        result = claims.run(
            config_path=args.config,
            quick=args.quick,
            studies=args.studies,
            rounds=args.claim_rounds,
            workdir=out,
            beside_rounds=args.beside_rounds,
            extend_to=args.extend_rounds,
        )
        results["claims"] = result
        sections += ["## Claimed speedup against side by side", claims_section(result)]
    if args.command in ("agreement", "all"):
        result = agreement.run(
            config_path=args.config,
            quick=args.quick,
            rounds=args.agreement_rounds,
            after_study=args.agreement_after_study,
        )
        results["agreement"] = result
        sections += ["## The trial runner against a plain loop", agreement.section(result)]
    if args.command == "backends":
        result = backends.run(quick=args.quick, rounds=rounds)
        results["backends"] = result
        sections += ["## Processes, threads and out-of-order delivery", backends.section(result)]
    results["elapsed_s"] = time.perf_counter() - started
    name = args.command + regime.suffix
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    report = "\n\n".join(sections) + "\n"
    (out / f"{name}.md").write_text(report)
    print(report)
    print(f"(results in {out}; {results['elapsed_s']:.0f} s)")
