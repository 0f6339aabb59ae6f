"""The commands that read studies: ``best`` (the Pareto front and the recommendation),
``report`` (HTML or JSON), ``dashboard`` (optuna-dashboard) and ``studies`` (the list). They
never run a trial; heavy modules are imported inside them."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from loader_search.cli._console import (
    StudyRow,
    console,
    print_dashboard_ready,
    print_studies,
    report_destination,
    reports_errors,
    write_report,
)
from loader_search.cli._options import LossToleranceOption, StorageOption, StudyArgument
from loader_search.cli._summary import print_summaries
from loader_search.errors import UserError
from loader_search.team import mask_url

if TYPE_CHECKING:
    from loader_search.study import Recommendation


@reports_errors
def best(
    study: StudyArgument,
    storage: StorageOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    loss_tolerance: LossToleranceOption = None,
) -> None:
    """Show a study's Pareto front (throughput vs validation loss) and the recommendation."""
    from loader_search.study import open_existing_study, summaries

    existing = open_existing_study(study, storage, loss_tolerance=loss_tolerance)
    print_summaries(summaries(existing.study, existing.loss_tolerance), as_json=as_json)


REPORT_FORMATS = ("html", "json")


@reports_errors
def report(
    study: StudyArgument,
    storage: StorageOption = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help=(
                "File to write; '-' for standard output. Default: STUDY-report.html for html,"
                " standard output for json."
            ),
            show_default=False,
        ),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="html or json.")] = "html",
    loss_tolerance: LossToleranceOption = None,
    hardware_class: Annotated[
        str | None,
        typer.Option(
            "--hardware-class",
            help="For a study run on several machines: report the trials of this class.",
        ),
    ] = None,
) -> None:
    """Write a study's report: one HTML file that works offline (or its data as JSON).

    Pareto front, recommendation, hypervolume history, parameter importances, throughput by
    workers x prefetch, data-wait, memory, failures and hardware. The JSON holds the same
    data, with `best --json`'s output under "summary".
    """
    from loader_search.study import open_existing_study

    if fmt not in REPORT_FORMATS:
        raise UserError(f"--format {fmt!r}: use html or json")
    destination = report_destination(output, fmt, study)  # checked before the slow part
    existing = open_existing_study(study, storage, loss_tolerance=loss_tolerance)
    loaded, tolerance, classes = existing.study, existing.loss_tolerance, existing.hardware_classes
    if hardware_class is not None and hardware_class not in classes:
        raise UserError(
            f"--hardware-class {hardware_class!r}: study {study!r} has no trials of it"
            f" (its classes: {', '.join(classes) or 'none recorded'})"
        )
    if hardware_class is None and len(classes) > 1:
        raise UserError(
            f"study {study!r} ran on several hardware classes ({', '.join(classes)}) whose"
            " throughputs do not compare: pick one with --hardware-class"
        )

    import optuna

    from loader_search.reports import collect

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" lines
    try:
        data = collect(loaded, tolerance, hardware_class)
    finally:
        optuna.logging.set_verbosity(verbosity)
    write_report(data, fmt, destination, study)


@reports_errors
def dashboard(
    storage: StorageOption = None,
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Address to listen on; 0.0.0.0 exposes it to the network (no login)."
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", help="Port to listen on; 0 picks a free one.")
    ] = 8080,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            help="A Host header to answer (repeat for more); others get 403. Default: the"
            " --host address (and its loopback names), or any with --host 0.0.0.0.",
        ),
    ] = None,
) -> None:
    """Start optuna-dashboard on the studies' storage (Ctrl-C to stop).

    Objective names and every measured trial attribute are shown; infeasible trials are never
    on its Pareto front. On a remote machine: ssh -L 8080:127.0.0.1:8080 HOST, then open
    http://127.0.0.1:8080/dashboard/ locally. In a container that publishes its port on the
    host's 127.0.0.1: --host 0.0.0.0 --allow-host 127.0.0.1 --allow-host localhost.
    """
    from loader_search.reports import serve
    from loader_search.team import open_storage, resolve_storage_url

    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: must be between 1 and 65535 (0: any free port)")
    for name in allow_host or ():
        bare = name.strip("[]")
        if not bare or any(c.isspace() or c in "/@" for c in bare) or bare.count(":") == 1:
            raise UserError(
                f"--allow-host {name!r}: give a host name or address as a browser sends it,"
                " without scheme, port or path (e.g. --allow-host localhost)"
            )
    url = resolve_storage_url(storage)
    rdb = open_storage(url, must_exist=True)
    serve(
        rdb,
        host,
        port,
        on_ready=lambda address: print_dashboard_ready(mask_url(url), address, host),
        allowed_hosts=allow_host or (),
    )
    console.print("Dashboard stopped.")


@reports_errors
def studies(storage: StorageOption = None) -> None:
    """List the studies in a storage with their trial counts and recommendations."""
    import optuna
    from optuna.trial import TrialState

    from loader_search.study import (
        BUDGET_ATTR,
        DIRECTIONS,
        StudyConfig,
        hardware_classes,
        study_attrs,
        study_budget,
        study_names,
        study_tolerance,
        summarize,
    )
    from loader_search.team import open_storage, resolve_storage_url

    url = resolve_storage_url(storage)
    rdb = open_storage(url, must_exist=True)
    rows = []
    for name in study_names(rdb):
        study = optuna.load_study(study_name=name, storage=rdb)
        trials = study.get_trials(deepcopy=False)
        throughput: float | None = None
        speedup: str | None = "per machine: see best"
        budget: int | None = None
        try:
            attrs = study_attrs(study)
            if len(study.directions) != len(DIRECTIONS):
                speedup = "not a loader-search study"
            elif len(hardware_classes(study)) <= 1:
                tolerance = study_tolerance(name, attrs, StudyConfig().loss_tolerance)
                summary = summarize(study, tolerance)
                rec = summary.recommended
                # The samples/s of the setting the verdict recommends: the baseline's when
                # it is kept, never those of a candidate it rejected.
                kept = summary.baseline if rec and rec.keeps_baseline else None
                chosen = kept or (rec.recommended_point if rec else None)
                throughput = chosen.throughput if chosen else None
                speedup = _short_speedup(rec) if rec else None
            stored = attrs.get(BUDGET_ATTR) is not None
            budget = study_budget(name, attrs, 1) if stored else None
        except UserError:
            # One study's damaged settings (or attributes that cannot be read at all) must not
            # hide the others: marked, and `best` says what is wrong and how to fix it.
            see = f"best {shlex.quote(name)}"
            throughput, speedup, budget = None, f"damaged settings: see `{see}`", None
        rows.append(
            StudyRow(
                name=name,
                complete=sum(t.state == TrialState.COMPLETE for t in trials),
                failed=sum(t.state == TrialState.FAIL for t in trials),
                running=sum(t.state == TrialState.RUNNING for t in trials),
                budget=budget,
                recommended_throughput=throughput,
                speedup=speedup,
            )
        )
    print_studies(mask_url(url), rows)


def _short_speedup(rec: Recommendation) -> str:
    """The recommendation's speedup for one table cell."""
    if rec.point.is_baseline:
        return "keep the baseline"
    if rec.paired is None:
        return f"{rec.speedup_vs_baseline:.2f}x (unconfirmed)" if rec.speedup_vs_baseline else "-"
    # Short enough for the cell not to wrap in a terminal 132 columns wide.
    interval = rec.paired.interval_text(cell=True)
    if rec.keeps_baseline:
        return f"keep the baseline ({rec.paired.estimate:.2f}x, {interval})"
    return f"{rec.paired.estimate:.2f}x ({interval})"
