"""The ``loader-search`` command line. A thin layer: parse, call the runner, draw results."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.syntax import Syntax
from rich.table import Table

# Heavy modules (torch, optuna) are imported inside the commands: `--help` and input errors
# answer at once.
from loader_search.errors import StudyAborted, UserError
from loader_search.storage import STORAGE_ENV, mask_url

if TYPE_CHECKING:
    from loader_search.params import LoaderParams
    from loader_search.recommend import StudySummary
    from loader_search.runner import StudyInfo, TrialEvent

DEBUG_ENV = "LOADER_SEARCH_DEBUG"

app = typer.Typer(
    name="loader-search",
    help=(
        "Find the PyTorch DataLoader settings (batch_size, num_workers, prefetch_factor,"
        " pin_memory, persistent_workers, torch threads) that make real training fast without"
        " making the model worse. Every trial is a real training run, scored on throughput"
        " and validation loss."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Piped output (CI logs, `| tee`) gets a wide fixed width instead of rich's 80 columns.
_WIDTH = None if sys.stdout.isatty() else 120
console = Console(highlight=False, width=_WIDTH)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 120)

StorageOption = Annotated[
    str | None,
    typer.Option(
        "--storage",
        help=(
            f"Database URL (SQLAlchemy form). Default: ${STORAGE_ENV}, else"
            " sqlite:///loader_search.db in the current directory."
        ),
        show_default=False,
    ),
]


F = TypeVar("F", bound=Callable[..., Any])


def _reports_errors(command: F) -> F:
    """Turn known errors into one line on stderr and an exit code, no traceback.

    Bad input (`UserError`) exits 2; a study that cannot go on exits 1; Ctrl-C exits 130.
    ``--debug`` (or LOADER_SEARCH_DEBUG=1) adds the traceback.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            _debug_traceback()
            err_console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from None
        except StudyAborted as exc:
            _debug_traceback()
            err_console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print(
                "Interrupted. A trial that was running is recorded as failed (interrupted)"
                " and uses no budget; run the same command again to continue the study."
            )
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks for errors.")
    ] = False,
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


@app.command()
@_reports_errors
def run(
    config: Annotated[
        Path, typer.Argument(help="Study config file (TOML), e.g. studies/quickstart.toml.")
    ],
    storage: StorageOption = None,
    study_name: Annotated[
        str | None,
        typer.Option(
            "--study-name",
            help="Study name. Default: \\[study] name, else the config file's name.",
        ),
    ] = None,
    n_trials: Annotated[
        int | None,
        typer.Option(
            "--n-trials",
            help=(
                "Total trials of the study, stored with it. Default: a continued study's stored"
                " budget; for a new study, \\[study] trials."
            ),
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Stop starting new trials after this many seconds. Default: \\[study] timeout_s.",
        ),
    ] = None,
) -> None:
    """Run (or continue) a study: every trial trains the workload with one loader setting.

    The first trial of a new study is the baseline (the config's batch size, num_workers=0).
    Running again with the same study name continues it until its trial budget is used.
    """
    from loader_search.config import load_config

    cfg = load_config(config).with_overrides(name=study_name, timeout_s=timeout)
    from loader_search.runner import run_study  # torch: only once the config is known good

    reporter = RichReporter(console)
    try:
        summary = run_study(cfg, storage=storage, n_trials=n_trials, reporter=reporter)
    finally:
        reporter.close()
    print_summary(summary)


@app.command()
@_reports_errors
def best(
    study: Annotated[str, typer.Argument(help="Study name (see `loader-search studies`).")],
    storage: StorageOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    loss_tolerance: Annotated[
        float | None,
        typer.Option(
            "--loss-tolerance",
            help="Relative val-loss slack for the recommendation. Default: the study's (0.05).",
        ),
    ] = None,
) -> None:
    """Show a study's Pareto front (throughput vs validation loss) and the recommendation."""
    from loader_search.config import StudyConfig
    from loader_search.recommend import TOLERANCE_ATTR, summarize
    from loader_search.storage import open_storage, resolve_storage_url

    if loss_tolerance is not None and not (math.isfinite(loss_tolerance) and loss_tolerance >= 0):
        raise UserError(f"--loss-tolerance {loss_tolerance}: must be 0 or more, e.g. 0.05")
    url = resolve_storage_url(storage)
    loaded = _load_study(open_storage(url, must_exist=True), study, url)
    tolerance = loss_tolerance
    if tolerance is None:
        default = StudyConfig().loss_tolerance
        tolerance = float(loaded.user_attrs.get(TOLERANCE_ATTR, default))
    summary = summarize(loaded, tolerance)
    if as_json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print_summary(summary)


@app.command()
@_reports_errors
def studies(storage: StorageOption = None) -> None:
    """List the studies in a storage with their trial counts."""
    import optuna
    from optuna.trial import TrialState

    from loader_search.recommend import BUDGET_ATTR
    from loader_search.storage import open_storage, resolve_storage_url

    url = resolve_storage_url(storage)
    rdb = open_storage(url, must_exist=True)
    names = optuna.study.get_all_study_names(rdb)
    if not names:
        console.print(escape(f"No studies in {mask_url(url)}."))
        return
    table = Table(title=escape(f"Studies in {mask_url(url)}"))
    for column in ("study", "complete", "failed", "running", "budget", "best samples/s"):
        table.add_column(column, justify="left" if column == "study" else "right")
    for name in names:
        study = optuna.load_study(study_name=name, storage=rdb)
        trials = study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        best_tp = max((t.values[0] for t in done if t.values), default=None)
        table.add_row(
            escape(name),
            str(len(done)),
            str(sum(t.state == TrialState.FAIL for t in trials)),
            str(sum(t.state == TrialState.RUNNING for t in trials)),
            str(study.user_attrs.get(BUDGET_ATTR, "-")),
            f"{best_tp:,.0f}" if best_tp is not None else "-",
        )
    console.print(table)


def _load_study(storage: Any, name: str, url: str) -> Any:
    import optuna

    from loader_search.recommend import DIRECTIONS, FINGERPRINT_ATTR

    names = optuna.study.get_all_study_names(storage)
    if name not in names:
        known = ", ".join(names) if names else "none"
        raise UserError(
            f"no study named {name!r} in {mask_url(url)} (studies there: {known});"
            " check the name or --storage"
        )
    study = optuna.load_study(study_name=name, storage=storage)
    directions = [d.name.lower() for d in study.directions]
    if directions != list(DIRECTIONS) or FINGERPRINT_ATTR not in study.user_attrs:
        raise UserError(
            f"study {name!r} was not created by loader-search (it needs its two objectives,"
            " throughput and val_loss): pick one from `loader-search studies`"
        )
    return study


class RichReporter:
    """Live progress for `run`: a bar with the Pareto size and the bests, a line per trial."""

    def __init__(self, out: Console) -> None:
        self.console = out
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[best]}"),
            TextColumn("[dim]{task.fields[running]}"),
            console=out,
            transient=True,
        )
        self.task: Any = None
        self.status: Any = None

    def preparing(self, what: str) -> None:
        """A spinner while the workload is built and the storage opened (can take a while)."""
        if self.status is None:
            self.status = self.console.status(escape(what) + " ...")
            self.status.start()
        else:
            self.status.update(escape(what) + " ...")

    def _stop_status(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def study_started(self, info: StudyInfo) -> None:
        self._stop_status()
        verb = "Created" if info.created else "Continuing"
        self.console.print(
            f"{verb} study [bold]{escape(info.name)}[/] in {escape(info.storage)}\n"
            f"  workload: {escape(info.workload)}\n"
            f"  device: {info.device}, {info.usable_cpus} usable CPU(s);"
            f" {info.finished}/{info.budget} trials done"
        )
        for note in info.notes:
            self.console.print(f"  [yellow]note:[/] {escape(note)}")
        if info.finished >= info.budget:
            self.console.print(
                f"  Trial budget already used; raise --n-trials above {info.budget} to run more."
            )
            return
        self.progress.start()
        self.task = self.progress.add_task(
            "trials", total=info.budget, completed=info.finished, best="", running=""
        )

    def trial_started(self, number: int, params: LoaderParams) -> None:
        if self.task is not None:
            self.progress.update(self.task, running=f"running #{number}: {params.describe()}")

    def trial_finished(self, event: TrialEvent) -> None:
        settings = event.params.describe() if event.params else ""
        if event.complete:
            self.console.print(
                f"  #{event.number:<3} {event.throughput:>7,.0f} samples/s  val_loss"
                f" {event.val_loss:.4f}  {event.duration_s:4.1f}s  {settings}"
            )
        else:
            self.console.print(
                f"  #{event.number:<3} [red]failed[/] ({event.duration_s:.1f}s) {settings}:"
                f" {escape(event.failure or '')}",
                soft_wrap=True,
            )
        if self.task is not None:
            best = (
                f"Pareto {event.pareto_size} | best {event.best_throughput:,.0f} samples/s"
                f" | best val_loss {event.best_val_loss:.4f}"
                if event.best_throughput is not None and event.best_val_loss is not None
                else f"Pareto {event.pareto_size}"
            )
            self.progress.update(self.task, completed=event.finished, best=best, running="")

    def close(self) -> None:
        self._stop_status()
        self.progress.stop()


def print_summary(summary: StudySummary) -> None:
    """The Pareto front as a table, then the recommendation as paste-ready code."""
    out = console
    trials = f"{summary.n_complete} complete, {summary.n_failed} failed"
    if summary.n_running:
        trials += f", {summary.n_running} running"
    if not summary.pareto:
        out.print(escape(f"Study {summary.study_name}: {trials}; no completed trial yet."))
        return
    base = summary.baseline
    table = Table(title=escape(f"Pareto front of {summary.study_name} ({trials})"))
    columns = ("#", "batch", "workers", "prefetch", "persist", "pin", "threads", "samples/s")
    for column in (*columns, "val_loss", "speedup"):
        table.add_column(column, justify="right", no_wrap=True)
    recommended = summary.recommended.point.number if summary.recommended else None
    for point in summary.pareto:
        p = point.params
        marks = (" *" if point.number == recommended else "") + (" b" if point.is_baseline else "")
        table.add_row(
            f"{point.number}{marks}",
            str(p.batch_size),
            str(p.num_workers),
            str(p.prefetch_factor) if p.prefetch_factor else "-",
            "yes" if p.persistent_workers else "no",
            "yes" if p.pin_memory else "no",
            str(p.torch_threads),
            f"{point.throughput:,.0f}",
            f"{point.val_loss:.4f}",
            f"{point.throughput / base.throughput:.2f}x" if base else "-",
        )
    out.print(table)
    out.print("  * recommended   b baseline")
    if base is not None:
        measured = ""
        if base.measurements:
            values = ", ".join(f"{v:,.0f}" for v in base.measurements)
            measured = f" (median of {len(base.measurements)} trials: {values})"
        out.print(
            f"Baseline (trial #{base.number}, {base.params.describe()}):"
            f" {base.throughput:,.0f} samples/s{measured}, val_loss {base.val_loss:.4f}"
        )
    rec = summary.recommended
    if rec is None:
        return
    headline = (
        f"[bold]Recommended:[/] trial #{rec.point.number}, {rec.point.throughput:,.0f} samples/s"
    )
    if rec.point.is_baseline:
        headline = (
            f"[bold]Recommended: keep the baseline[/] (trial #{rec.point.number}): no faster"
            " setting within the loss tolerance was found; try more trials"
        )
    elif rec.speedup_vs_baseline is not None and rec.val_loss_change_vs_baseline is not None:
        headline += (
            f" = [bold]{rec.speedup_vs_baseline:.2f}x the baseline[/], val_loss"
            f" {rec.point.val_loss:.4f} ({rec.val_loss_change_vs_baseline:+.1%} vs baseline)"
        )
    out.print(headline)
    out.print(f"  rule: {rec.rule}", soft_wrap=True)
    out.print(
        Panel(
            Syntax(rec.snippet, "python", theme="ansi_dark", background_color="default"),
            expand=False,
        )
    )


def main() -> int:
    """Console-script entry point."""
    app(prog_name="loader-search")
    return 0


def _debug_traceback() -> None:
    if os.environ.get(DEBUG_ENV):
        traceback.print_exc(file=sys.stderr)
