"""The study's answer as an optuna-dashboard note.

optuna-dashboard draws Optuna's own front (``study.best_trials``) over raw trials: repeats of
one setting are separate points there, and it knows nothing of the baseline, the paired
confirmation or the recommendation. Its views cannot be changed, so the answer is written
where the dashboard shows text: the study's note (optuna-dashboard's ``save_note``, Markdown),
rewritten whenever a `run` or `worker` of the study ends. The note says which front the
dashboard's own views draw. Without optuna-dashboard installed nothing is written (nobody
could read the note through it, and its storage format is optuna-dashboard's own).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import optuna

from loader_search.study.stats import StudySummary, summaries


def note_text(results: Sequence[StudySummary]) -> str:
    """Markdown: per hardware class, the front as `best` shows it and the recommendation."""
    lines = [
        "## loader-search: the answer",
        "",
        "The front below is loader-search's: one point per setting, at the median of the trials"
        " that ran it. The dashboard's own *Best Trials* and Pareto plot use Optuna's front over"
        " raw trials, where repeats of a setting are separate points. `loader-search best`"
        " prints the same answer as this note.",
    ]
    for summary in results:
        if summary.hardware_class is not None:
            lines += ["", f"### Hardware class `{summary.hardware_class}`"]
        lines += ["", "| trial | setting | samples/s (median) | readings | val_loss |"]
        lines.append("|---:|---|---:|---:|---:|")
        for point in summary.pareto:
            lines.append(
                f"| #{point.number} | {point.params.describe()} | {point.throughput:,.0f} |"
                f" {max(1, len(point.measurements))} | {point.val_loss:.4f} |"
            )
        rec = summary.recommended
        lines.append("")
        if rec is None:
            lines.append("No completed feasible trial yet.")
            continue
        if summary.baseline_doubt is not None:
            lines += [f"**Warning:** {summary.baseline_doubt}.", ""]
        if rec.point.is_baseline:
            lines.append(
                f"**Recommended: keep the baseline** (trial #{rec.point.number}): no faster"
                " setting within the loss tolerance was found."
            )
        elif rec.keeps_baseline:  # the verdict rejects the best candidate: no trial named
            base = summary.baseline
            which = f" (trial #{base.number})" if base is not None else ""
            lines.append(f"**Recommended: keep the baseline**{which}: {rec.speedup_text()}.")
            lines += ["", f"Rule: {rec.rule}."]
            candidate = rec.worth_trying
            if candidate is not None:
                lines += [
                    "",
                    f"The best candidate, should you try it anyway: trial #{candidate.number},"
                    f" {candidate.params.describe()}.",
                    "",
                    "```python",
                    rec.snippet,
                    "```",
                ]
            continue
        else:
            lines.append(
                f"**Recommended:** trial #{rec.point.number}, {rec.point.params.describe()}:"
                f" {rec.speedup_text() or 'no baseline to compare with'}."
            )
        lines += ["", f"Rule: {rec.rule}.", "", "```python", rec.snippet, "```"]
    return "\n".join(lines) + "\n"


def write_note(study: optuna.Study, loss_tolerance: float) -> bool:
    """Write the study's answer as its optuna-dashboard note; False when optuna-dashboard is
    not installed. The caller holds the study lock (a note's versions must not race)."""
    save_note = _dashboard_save_note()
    if save_note is None:
        return False
    save_note(study, note_text(summaries(study, loss_tolerance)))
    return True


def _dashboard_save_note() -> Callable[[optuna.Study, str], None] | None:
    """optuna-dashboard's ``save_note``, or None without optuna-dashboard.

    Its module is loaded on its own when it can be (it imports only Optuna): the package's
    ``__init__`` imports the web app and, through Optuna's fANOVA, scikit-learn, which cost
    2.2 s at the end of every `run` and `worker` here. Should a later optuna-dashboard need
    its package for that module, the ordinary import is used instead."""
    spec = importlib.util.find_spec("optuna_dashboard")  # finds it, runs nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "_note.py"
    try:
        alone = importlib.util.spec_from_file_location("_loader_search_dashboard_note", path)
        assert alone is not None and alone.loader is not None
        module = importlib.util.module_from_spec(alone)
        alone.loader.exec_module(module)
        return cast(Callable[[optuna.Study, str], None], module.save_note)
    except Exception:
        from optuna_dashboard import save_note

        return cast(Callable[[optuna.Study, str], None], save_note)
