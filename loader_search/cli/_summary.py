"""The answer of a study as a person reads it: the Pareto front table, the baseline, the
recommendation with its measurements, the pipeline model's word on it, and the DataLoader
snippet (`best`, and the end of `run` and `worker`); or the same as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from loader_search.cli._console import console, shown
from loader_search.study import above_ceiling, critical_batch_text, efficiency_text

if TYPE_CHECKING:
    from loader_search.study import Bottleneck, PipelineView, StudySummary, TrialPoint


def print_summaries(summaries: Sequence[StudySummary], *, as_json: bool = False) -> None:
    """`best`: one study summary as tables (or JSON), or one per hardware class of a study run
    on several machines, each under a rule naming its class: throughputs from different
    machines never compare, so they are never in one table."""
    if as_json:
        if len(summaries) == 1:
            document: dict[str, Any] = summaries[0].as_dict()
        else:
            document = {"hardware_classes": [s.as_dict() for s in summaries]}
        print(json.dumps(document, indent=2))
        return
    if len(summaries) == 1:
        print_summary(summaries[0])
        return
    for summary in summaries:
        console.rule(f"hardware class {summary.hardware_class}")
        print_summary(summary)


BOTTLENECK_TEXT: dict[Bottleneck, str] = {
    "device": "the training step itself (the device)",
    "loader_workers": "the loader workers' CPU",
    "main_process": "the training process receiving and copying batches",
    "cpus": "the CPUs, which the training step and the loading share (no accelerator: more"
    " cores, a cheaper step or cheaper loading lift it)",
}


def pipeline_lines(view: PipelineView, batch_size: int) -> list[str]:
    """The pipeline model's word on the recommendation, for people (`best`, `run`)."""
    source = (
        "the model's best setting"
        if view.limit_from == "model"
        else "measured, above the model's prediction"
    )
    lines = [
        f"  pipeline limit at batch {batch_size}: {view.limit_samples_per_s:,.0f} samples/s"
        f" ({source}, {view.limit_params.describe()}); this setting reaches"
        f" {view.efficiency_vs_limit:.0%} of it, bound by"
        f" {BOTTLENECK_TEXT.get(view.bottleneck, view.bottleneck)}"
    ]
    if view.lifts:
        shown = "; ".join(
            f"{lift.what} -> {lift.predicted_limit_samples_per_s:,.0f}/s (+{lift.gain - 1:.0%})"
            for lift in view.lifts[:3]
        )
        lines.append(f"  what would lift the limit (the model's prediction): {shown}")
    return lines


def _efficiency(value: float | None) -> str:
    """A loader efficiency for a table cell (`efficiency_text`), "-" where none was read."""
    return efficiency_text(value) if value else "-"


def _goodput(summary: StudySummary, point: TrialPoint) -> str:
    value, base = summary.goodput(point), summary.baseline
    if value is None or base is None or base.throughput <= 0:
        return "-"
    return f"{value / base.throughput:.2f}x"


def print_summary(summary: StudySummary) -> None:
    """The Pareto front as a table, then the recommendation as paste-ready code."""
    out = console
    trials = f"{summary.n_complete} complete, {summary.n_failed} failed"
    if summary.n_infeasible:
        trials += f", {summary.n_infeasible} infeasible"
    if summary.n_running:
        trials += f", {summary.n_running} running"
    if not summary.pareto:
        out.print(shown(f"Study {summary.study_name}: {trials}; no completed trial yet."))
        return
    base = summary.baseline
    table = Table(title=shown(f"Pareto front of {summary.study_name} ({trials})"))
    columns = ("#", "batch", "workers", "prefetch", "persist", "pin", "threads", "samples/s")
    goodput = summary.noise is not None and base is not None
    for column in (*columns, "spread", "eff", "val_loss", "vs base"):
        table.add_column(column, justify="right", no_wrap=True)
    if goodput:
        table.add_column("goodput", justify="right", no_wrap=True)
    # The mark follows the verdict: the rule's best candidate, rejected by it, is no star.
    chosen = summary.recommended.recommended_point if summary.recommended else None
    recommended = chosen.number if chosen else None
    rows = list(summary.pareto)
    if summary.recommended is not None and summary.recommended.point not in rows:
        # Confirmed as the highest paired speedup while another setting's median sits on the
        # front (their difference is within the noise): shown too, where its median is.
        rows.append(summary.recommended.point)
        rows.sort(key=lambda p: -p.throughput)
    for point in rows:
        p = point.params
        marks = (" *" if point.number == recommended else "") + (" b" if point.is_baseline else "")
        table.add_row(
            f"{point.number}{marks}",
            str(p.batch_size)
            + (
                f" ({p.accumulation_steps}x{p.micro_batch_size})"
                if p.accumulation_steps > 1
                else ""
            ),
            str(p.num_workers),
            str(p.prefetch_factor) if p.prefetch_factor else "-",
            "yes" if p.persistent_workers else "no",
            "yes" if p.pin_memory else "no",
            str(p.torch_threads),
            f"{point.throughput:,.0f}",
            f"{point.spread:.0%} of {len(point.measurements)}"
            if point.spread is not None
            else "-",
            _efficiency(point.loader_efficiency),
            f"{point.val_loss:.4f}",
            f"{point.throughput / base.throughput:.2f}x" if base else "-",
            *([_goodput(summary, point)] if goodput else []),
        )
    out.print(table)
    out.print(
        "  * recommended (when off the front: the highest paired speedup, within the noise of"
        " a front setting)   b baseline   spread: (max-min)/median of repeated measurements\n"
        "  vs base: median / the baseline's median (the speedup below is the paired one)\n"
        "  eff: loader efficiency, samples/s / the same model fed pre-decoded data"
        " (! above 100%: that ceiling reading was low, taken under load or by noise; later"
        " trials read it again)"
        + (
            "\n  goodput: samples/s x the statistical efficiency of the batch size against the"
            " baseline's, as a multiple of the baseline's (the baseline's loss that much sooner)"
            if goodput
            else ""
        ),
        soft_wrap=True,
    )
    if summary.noise is not None:
        out.print(f"  {critical_batch_text(summary.noise)}", soft_wrap=True)
    if base is not None:
        measured = ""
        if base.measurements:
            values = ", ".join(f"{v:,.0f}" for v in base.measurements)
            measured = f" (median of {len(base.measurements)} trials: {values})"
        out.print(
            f"Baseline (trial #{base.number}, {base.params.describe()}):"
            f" {base.throughput:,.0f} samples/s{measured}, val_loss {base.val_loss:.4f}",
            soft_wrap=True,
        )
    if summary.baseline_doubt is not None:
        out.print(
            f"[bold yellow]Warning:[/] {shown(summary.baseline_doubt)}; the loss tolerance is"
            " applied to the best val_loss of the study instead (see the rule below)",
            soft_wrap=True,
        )
    _print_recommendation(summary, out)


def _print_recommendation(summary: StudySummary, out: Console) -> None:
    """The recommendation's headline, how sure it is, its rule, and the snippet to paste."""
    rec = summary.recommended
    if rec is None:
        return
    if rec.keeps_baseline:
        _print_kept_baseline(summary, out)
        return
    headline = (
        f"[bold]Recommended:[/] trial #{rec.point.number}, {rec.point.throughput:,.0f} samples/s"
    )
    if rec.speedup_vs_baseline is not None and rec.val_loss_change_vs_baseline is not None:
        headline += (
            f" = [bold]{shown(rec.speedup_text() or '')}[/], val_loss"
            f" {rec.point.val_loss:.4f} ({rec.val_loss_change_vs_baseline:+.1%} vs baseline)"
        )
    out.print(headline, soft_wrap=True)
    _print_details(summary, out)


def _print_kept_baseline(summary: StudySummary, out: Console) -> None:
    """The verdict "keep the baseline": no trial called recommended; the best candidate
    offered to try only when it was measured faster than the baseline."""
    rec = summary.recommended
    assert rec is not None
    base = summary.baseline
    which = f" (trial #{base.number})" if base is not None else ""
    if rec.point.is_baseline:
        why = "no faster setting within the loss tolerance was found; try more trials"
    else:
        why = shown(rec.speedup_text() or "")
    out.print(f"[bold]Recommended: keep the baseline[/]{which}: {why}", soft_wrap=True)
    out.print(f"  rule: {rec.rule}", soft_wrap=True)
    if rec.point.is_baseline:  # the baseline's own settings, as the code to keep
        _print_details(summary, out, rule=False)
        return
    candidate = rec.worth_trying
    if candidate is None:  # slower than the baseline: nothing to try
        return
    out.print(
        f"  the best candidate, should you try it anyway: trial #{candidate.number},"
        f" {candidate.throughput:,.0f} samples/s, val_loss {candidate.val_loss:.4f}",
        soft_wrap=True,
    )
    _print_details(summary, out, rule=False)


def _print_details(summary: StudySummary, out: Console, *, rule: bool = True) -> None:
    """The recommendation's (or a candidate's) readings, pipeline, rule and snippet."""
    rec = summary.recommended
    assert rec is not None
    if rec.point.measurements and not rec.point.is_baseline:
        values = ", ".join(f"{v:,.0f}" for v in rec.point.measurements)
        out.print(
            f"  measured {len(rec.point.measurements)} times (trials"
            f" {', '.join(f'#{n}' for n in rec.point.numbers)}): {values} samples/s,"
            f" spread {rec.point.spread:.0%}; the median counts",
            soft_wrap=True,
        )
    if rec.point.loader_efficiency:
        out.print(
            f"  loader efficiency {_efficiency(rec.point.loader_efficiency)}: the same model"
            " fed pre-decoded data already on the device trains"
            f" {rec.point.throughput / rec.point.loader_efficiency:,.0f} samples/s"
            + (
                " (a reading below this setting's own: taken under load or by noise)"
                if above_ceiling(rec.point.loader_efficiency)
                else ""
            ),
            soft_wrap=True,
        )
    if rec.pipeline is not None:
        for line in pipeline_lines(rec.pipeline, rec.point.params.batch_size):
            out.print(line, soft_wrap=True, highlight=False)
    if rule:
        out.print(f"  rule: {rec.rule}", soft_wrap=True)
    snippet = rec.snippet
    if snippet.startswith("# run: "):
        # The command line to copy is printed whole, on one line however wide (a panel
        # would cut it at the console's width).
        run, snippet = snippet.split("\n", 1)
        out.print(f"  {run}", soft_wrap=True, highlight=False, markup=False)
    out.print(
        Panel(
            Syntax(snippet, "python", theme="ansi_dark", background_color="default"),
            expand=False,
        )
    )
