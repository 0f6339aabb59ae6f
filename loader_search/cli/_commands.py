"""The ``loader-search`` command line. A thin layer: parse, call the runner, draw results."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
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
from loader_search.team._storage import STORAGE_ENV, mask_url, scrub_urls

if TYPE_CHECKING:
    from loader_search.params import LoaderParams
    from loader_search.study._recommend import StudySummary
    from loader_search.study._session import StudyInfo, TrialEvent

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


CpusOption = Annotated[
    str | None,
    typer.Option(
        "--cpus",
        help=(
            "Pin this process's trials to these CPUs (e.g. 0-7 or 0,2,4). Pinned workers with"
            " disjoint CPU sets (and, on a GPU machine, each its own --gpu) train side by side;"
            " unpinned, one trial runs per host at a time."
        ),
        show_default=False,
    ),
]
GpuOption = Annotated[
    int | None,
    typer.Option("--gpu", help="Pin this process's trials to this GPU index.", show_default=False),
]
MixedOption = Annotated[
    bool,
    typer.Option(
        "--allow-mixed-hardware",
        help=(
            "Join a study whose first trials ran on another hardware class; results are then"
            " reported per class."
        ),
    ),
]


def _parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """``0-3,8`` -> (0, 1, 2, 3, 8)."""
    if text is None:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise UserError(
            f"--cpus {text!r}: use CPU numbers and ranges, e.g. 0-3 or 0,2,4"
        ) from None
    if not cpus or min(cpus) < 0:
        raise UserError(f"--cpus {text!r}: use CPU numbers and ranges, e.g. 0-3 or 0,2,4")
    return tuple(sorted(cpus))


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
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            # Not a known case (a database down for longer than the retries, say): still one
            # line, without any password; --debug shows where it came from.
            _debug_traceback()
            line = scrub_urls(f"{type(exc).__name__}: {str(exc).strip()}".splitlines()[0])
            err_console.print(
                f"[red]error:[/] {escape(line)} (run with --debug for the traceback)",
                soft_wrap=True,
            )
            raise typer.Exit(1) from None

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
    cpus: CpusOption = None,
    gpu: GpuOption = None,
    allow_mixed_hardware: MixedOption = False,
) -> None:
    """Run (or continue) a study: every trial trains the workload with one loader setting.

    The first trial of a new study is the baseline (the config's batch size, num_workers=0).
    Running again with the same study name continues it until its trial budget is used; then
    the best candidates and the baseline are measured again (beyond the budget) so that the
    recommendation rests on medians. `loader-search worker` processes on other machines can
    join it meanwhile.
    """
    from loader_search.study._config import load_config

    cfg = load_config(config).with_overrides(name=study_name, timeout_s=timeout)
    pinned = _parse_cpus(cpus)
    from loader_search.study._session import run_study  # torch: only once the config is known good

    reporter = RichReporter(console)
    try:
        with _interrupts():
            summary = run_study(
                cfg,
                storage=storage,
                n_trials=n_trials,
                reporter=reporter,
                cpus=pinned,
                gpu=gpu,
                allow_mixed_hardware=allow_mixed_hardware,
            )
    finally:
        reporter.close()
    print_summary(summary)


@app.command()
@_reports_errors
def init(
    config: Annotated[Path, typer.Argument(help="Study config file (TOML).")],
    storage: StorageOption = None,
    study_name: Annotated[
        str | None,
        typer.Option("--study-name", help="Study name. Default: as for `run`."),
    ] = None,
    n_trials: Annotated[
        int | None,
        typer.Option(
            "--n-trials",
            help="Total trials of the study (shared by all workers). Default: \\[study] trials.",
        ),
    ] = None,
) -> None:
    """Create the schema and the study, run nothing: then start `worker`s on any machine.

    Safe to repeat: an existing study is continued (its budget updated with --n-trials).
    """
    from loader_search.study._config import load_config

    cfg = load_config(config).with_overrides(name=study_name)
    from loader_search.study._session import init_study

    reporter = RichReporter(console)
    try:
        info = init_study(cfg, storage=storage, n_trials=n_trials, reporter=reporter)
    finally:
        reporter.close()
    verb = "Created" if info.created else "Updated"
    console.print(
        f"{verb} study [bold]{escape(info.name)}[/] in {escape(info.storage)}:"
        f" {info.finished}/{info.budget} trials done. Start workers with\n"
        f"  loader-search worker {escape(info.name)} --storage URL"
    )
    for note in info.notes:
        console.print(f"  [yellow]note:[/] {escape(note)}")


@app.command()
@_reports_errors
def worker(
    study: Annotated[str, typer.Argument(help="Name of an existing study to work on.")],
    storage: StorageOption = None,
    n_trials: Annotated[
        int | None,
        typer.Option(
            "--n-trials",
            help=(
                "Run at most this many trials here. Default: until the study's budget is used"
                " and its candidates are re-measured."
            ),
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Stop starting new trials after this many seconds.",
            show_default=False,
        ),
    ] = None,
    cpus: CpusOption = None,
    gpu: GpuOption = None,
    allow_mixed_hardware: MixedOption = False,
    allow_plugin: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-plugin",
            help=(
                "Run this plug-in workload ('pkg.mod:factory' or 'path/file.py:factory') if"
                " the study names it; repeat for more. Without it a worker runs only built-in"
                " workloads (also: LOADER_SEARCH_ALLOW_PLUGINS, comma-separated)."
            ),
            show_default=False,
        ),
    ] = None,
) -> None:
    """Join a study created by `run` (on this or another machine) and run its trials.

    The study's config and trial budget come from the database: start as many workers as
    you like, on as many machines; together they run exactly the budget. A trial whose
    worker dies is failed after the study's grace period and retried with the same settings.
    Ctrl-C (or SIGTERM) ends the running trial as interrupted and exits.

    Whoever can write to the database chooses the study's workload, so a worker runs a
    plug-in (code) only if this machine allows it with --allow-plugin.
    """
    from loader_search.study._session import run_worker

    reporter = RichReporter(console)
    try:
        with _interrupts():
            summary = run_worker(
                study,
                storage=storage,
                n_trials=n_trials,
                timeout_s=timeout,
                reporter=reporter,
                cpus=_parse_cpus(cpus),
                gpu=gpu,
                allow_mixed_hardware=allow_mixed_hardware,
                allow_plugins=tuple(allow_plugin or ()),
            )
    finally:
        reporter.close()
    print_summary(summary)


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """Ctrl-C and SIGTERM (`docker stop`, schedulers) end the running trial as interrupted
    (see `loader_search.interrupts`)."""
    from loader_search.interrupts import STOP_REQUESTED, request_stop

    def interrupt(signum: int, frame: object) -> None:
        request_stop()

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        STOP_REQUESTED.clear()


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
    from loader_search.study._recommend import summarize
    from loader_search.study._session import open_existing_study

    existing = open_existing_study(study, storage, loss_tolerance=loss_tolerance)
    loaded, tolerance = existing.study, existing.loss_tolerance
    classes = existing.hardware_classes
    if len(classes) > 1:
        # Throughputs from different machines never compare: one summary per class.
        summaries = [summarize(loaded, tolerance, key) for key in classes]
        if as_json:
            print(json.dumps({"hardware_classes": [s.as_dict() for s in summaries]}, indent=2))
            return
        for summary in summaries:
            console.rule(f"hardware class {summary.hardware_class}")
            print_summary(summary)
        return
    summary = summarize(loaded, tolerance)
    if as_json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print_summary(summary)


REPORT_FORMATS = ("html", "json")


@app.command()
@_reports_errors
def report(
    study: Annotated[str, typer.Argument(help="Study name (see `loader-search studies`).")],
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
    loss_tolerance: Annotated[
        float | None,
        typer.Option(
            "--loss-tolerance",
            help="Relative val-loss slack for the recommendation. Default: the study's (0.05).",
        ),
    ] = None,
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
    from loader_search.study._session import open_existing_study

    if fmt not in REPORT_FORMATS:
        raise UserError(f"--format {fmt!r}: use html or json")
    if output is None and fmt == "html":
        output = Path(f"{study}-report.html")
    to_stdout = output is None or str(output) == "-"
    if output is not None and not to_stdout:
        _check_writable(output)
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

    from loader_search.report._data import collect

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" lines
    try:
        data = collect(loaded, tolerance, hardware_class)
    finally:
        optuna.logging.set_verbosity(verbosity)
    if fmt == "json":
        text = json.dumps(data.as_dict(), indent=2) + "\n"
    else:
        from loader_search.report._html import render

        text = render(data)
    if to_stdout:
        sys.stdout.write(text)
        return
    assert output is not None
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(
            f"cannot write the report to {str(output)!r}: {exc.strerror or exc}; pick another -o"
        ) from None
    console.print(escape(f"Report of {study} written to {output}"))


def _check_writable(path: Path) -> None:
    """Fail before the (slow) report is computed, not after."""
    if path.is_dir():
        raise UserError(f"-o {str(path)!r} is a directory: give a file name, e.g. report.html")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(
            f"-o {str(path)!r}: folder {str(folder)!r} does not exist; create it first"
        )
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"-o {str(path)!r} is not writable: pick another path")


@app.command()
@_reports_errors
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
) -> None:
    """Start optuna-dashboard on the studies' storage (Ctrl-C to stop).

    Objective names and every measured trial attribute are shown; infeasible trials are never
    on its Pareto front. On a remote machine: ssh -L 8080:127.0.0.1:8080 HOST, then open
    http://127.0.0.1:8080/dashboard/ locally.
    """
    from loader_search.report._dashboard import serve
    from loader_search.team._storage import open_storage, resolve_storage_url

    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: must be between 1 and 65535 (0: any free port)")
    url = resolve_storage_url(storage)
    rdb = open_storage(url, must_exist=True)

    def ready(address: str) -> None:
        console.print(
            escape(f"Dashboard of {mask_url(url)} at {address} (Ctrl-C to stop)"), soft_wrap=True
        )
        if host not in ("127.0.0.1", "localhost", "::1"):
            console.print(
                f"[yellow]note:[/] listening on {escape(host)}: anyone who can reach this"
                " machine can see and edit the studies (the dashboard has no login)"
            )

    serve(rdb, host, port, on_ready=ready)
    console.print("Dashboard stopped.")


@app.command()
@_reports_errors
def studies(storage: StorageOption = None) -> None:
    """List the studies in a storage with their trial counts."""
    import optuna
    from optuna.trial import TrialState

    from loader_search.study._recommend import BUDGET_ATTR
    from loader_search.team._storage import open_storage, resolve_storage_url

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


_VERDICT_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


@app.command()
@_reports_errors
def doctor(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Study config (TOML): check its device, space and limits too.",
            show_default=False,
        ),
    ] = None,
    storage: StorageOption = None,
) -> None:
    """Check what a search depends on here: device and CUDA, CPUs, memory, /dev/shm against
    the space's largest batches in flight, the start method, and the storage.

    Exits 1 when a check fails, 0 otherwise (warnings included).
    """
    from loader_search.study._config import load_config

    cfg = load_config(config) if config is not None else None
    from loader_search.cli._doctor import diagnose  # torch: only once the config is known good
    from loader_search.workloads import load_workload

    workload = None
    if cfg is not None:
        with console.status(escape(f"building workload {cfg.workload}") + " ..."):
            workload = load_workload(cfg.workload, cfg.workload_options)
    checks = diagnose(cfg, storage, workload)
    table = Table(title="loader-search doctor")
    for column in ("check", "verdict", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        style = _VERDICT_STYLE[check.verdict]
        table.add_row(
            escape(check.name),
            f"[{style}]{check.verdict}[/]",
            escape(check.detail),
            escape(check.fix),
        )
    console.print(table)
    if any(check.verdict == "fail" for check in checks):
        raise typer.Exit(1)


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
            f"  hardware: {escape(info.device)} (class {info.hardware_class});"
            f" {info.finished}/{info.budget} trials done",
            soft_wrap=True,
        )
        for note in info.notes:
            self.console.print(f"  [yellow]note:[/] {escape(note)}")
        if info.finished >= info.budget:
            self.console.print(
                f"  Trial budget already used; raise --n-trials above {info.budget} to search"
                " more (candidates not yet re-measured still are).",
                soft_wrap=True,
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
        if event.confirmation:
            settings += " [dim](re-measure)[/]"
        if event.complete:
            efficiency = f"  eff {event.loader_efficiency:4.0%}" if event.loader_efficiency else ""
            # An early-stopped trial reports its batch size's known val_loss: marked "~".
            mark = "~" if event.val_loss_from else " "
            self.console.print(
                f"  #{event.number:<3} {event.throughput:>7,.0f} samples/s  val_loss"
                f" {event.val_loss:.4f}{mark}{efficiency}  {event.duration_s:4.1f}s  {settings}",
                soft_wrap=True,
            )
        else:
            label = "[yellow]infeasible[/]" if event.state == "infeasible" else "[red]failed[/]"
            self.console.print(
                f"  #{event.number:<3} {label} ({event.duration_s:.1f}s) {settings}:"
                f" {escape(event.failure or '')}",
                soft_wrap=True,
            )
            if event.hint:
                self.console.print(f"       [dim]hint: {escape(event.hint)}[/]", soft_wrap=True)
        if self.task is not None:
            best = (
                f"Pareto {event.pareto_size} | best {event.best_throughput:,.0f} samples/s"
                f" | best val_loss {event.best_val_loss:.4f}"
                if event.best_throughput is not None and event.best_val_loss is not None
                else f"Pareto {event.pareto_size}"
            )
            self.progress.update(self.task, completed=event.finished, best=best, running="")

    def warning(self, what: str) -> None:
        self.console.print(f"  [yellow]warning:[/] {escape(what)}", soft_wrap=True)

    def close(self) -> None:
        self._stop_status()
        self.progress.stop()


def print_summary(summary: StudySummary) -> None:
    """The Pareto front as a table, then the recommendation as paste-ready code."""
    out = console
    trials = f"{summary.n_complete} complete, {summary.n_failed} failed"
    if summary.n_infeasible:
        trials += f", {summary.n_infeasible} infeasible"
    if summary.n_running:
        trials += f", {summary.n_running} running"
    if not summary.pareto:
        out.print(escape(f"Study {summary.study_name}: {trials}; no completed trial yet."))
        return
    base = summary.baseline
    table = Table(title=escape(f"Pareto front of {summary.study_name} ({trials})"))
    columns = ("#", "batch", "workers", "prefetch", "persist", "pin", "threads", "samples/s")
    for column in (*columns, "spread", "eff", "val_loss", "speedup"):
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
            f"{point.spread:.0%} of {len(point.measurements)}"
            if point.spread is not None
            else "-",
            f"{point.loader_efficiency:.0%}" if point.loader_efficiency else "-",
            f"{point.val_loss:.4f}",
            f"{point.throughput / base.throughput:.2f}x" if base else "-",
        )
    out.print(table)
    out.print(
        "  * recommended   b baseline   spread: (max-min)/median of repeated measurements\n"
        "  eff: loader efficiency, samples/s / the same model fed pre-decoded data",
        soft_wrap=True,
    )
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
    out.print(headline, soft_wrap=True)
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
            f"  loader efficiency {rec.point.loader_efficiency:.0%}: the same model fed"
            " pre-decoded data already on the device trains"
            f" {rec.point.throughput / rec.point.loader_efficiency:,.0f} samples/s",
            soft_wrap=True,
        )
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
