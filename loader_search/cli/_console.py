"""What a user sees of a command: live progress lines, summary tables, the DataLoader snippet
panel, the report file, and errors as one line with an exit code.

Rendering only: every function here takes plain values the service layer computed (study info,
trial events, summaries, report data, doctor checks) and draws them, so the commands in
`loader_search.cli._commands` stay parse, call, render. Nothing here decides a search. Live
progress also owns the terminal's Ctrl-C: while trials run it ends the running trial as
interrupted instead of killing the process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loader_search.errors import StudyAborted, UserError, printable
from loader_search.study import efficiency_text
from loader_search.team import (
    describe_driver_error,
    is_read_only,
    is_transient,
    read_only_error,
    scrub_urls,
)

if TYPE_CHECKING:
    from loader_search.cli._doctor import Check
    from loader_search.params import LoaderParams
    from loader_search.reports import ReportData
    from loader_search.study import StudyInfo, TrialEvent

DEBUG_ENV = "LOADER_SEARCH_DEBUG"


def shown(text: str) -> str:
    """A string from a database, a file or a message, ready for the console: control
    characters written out (`printable`: a planted escape sequence never reaches the
    terminal) and rich's markup escaped."""
    return escape(printable(text))


# Piped output (CI logs, `| tee`) gets a wide fixed width instead of rich's 80 columns: 132,
# the width of the Pareto table with its goodput column, so no header is cut.
PIPED_WIDTH = 132
console = Console(highlight=False, width=None if sys.stdout.isatty() else PIPED_WIDTH)
err_console = Console(
    stderr=True, highlight=False, width=None if sys.stderr.isatty() else PIPED_WIDTH
)


F = TypeVar("F", bound=Callable[..., Any])


def reports_errors(command: F) -> F:
    """Turn known errors into one line on stderr and an exit code, no traceback.

    Bad input (`UserError`) exits 2; a study that cannot go on exits 1; Ctrl-C exits 130 and
    SIGTERM 143. ``--debug`` (or LOADER_SEARCH_DEBUG=1) adds the traceback.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            _print_error(str(exc))
            raise typer.Exit(2) from None
        except StudyAborted as exc:
            _print_error(str(exc))
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            from loader_search.interrupts import exit_code, interrupted_trials

            # A trial is named only where one was running and is recorded so: a stop before
            # any (during the first look at a command, say) ended none.
            numbers = ", ".join(f"#{number}" for number in interrupted_trials())
            said = (
                f"Interrupted. Trial {numbers}, which was running, is recorded as failed"
                " (interrupted) and uses no budget;"
                if numbers
                else "Interrupted;"
            )
            err_console.print(
                f"{said} run the same command again to continue the study.",
                soft_wrap=True,  # one line, however narrow the terminal
            )
            raise typer.Exit(exit_code()) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            # Not a known case (a database down for longer than the retries, say): still one
            # line, without any password; --debug shows where it came from. A database error
            # is what the database said, not what a wrapper made of it.
            if is_read_only(exc):
                _print_error(scrub_urls(str(read_only_error(exc))))
                raise typer.Exit(2) from None
            if is_transient(exc):
                line = scrub_urls(f"database unreachable: {describe_driver_error(exc)}")
            else:
                line = scrub_urls(f"{type(exc).__name__}: {str(exc).strip()}".splitlines()[0])
            _print_error(f"{line} (run with --debug for the traceback)")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _print_error(line: str) -> None:
    """One ``error: ...`` line on stderr; the traceback before it only under --debug."""
    if os.environ.get(DEBUG_ENV):
        # Scrubbed like the line: a traceback quotes URLs and connection strings.
        sys.stderr.write(printable(scrub_urls(traceback.format_exc())))
    err_console.print(f"[red]error:[/] {shown(line)}", soft_wrap=True)


def print_warning(line: str) -> None:
    """One ``warning: ...`` line on stderr; the command goes on."""
    err_console.print(f"[yellow]warning:[/] {shown(line)}", soft_wrap=True)


@contextlib.contextmanager
def live_progress(*, interruptible: bool = False) -> Iterator[RichReporter]:
    """A `RichReporter` on the console, closed (bar and spinner gone) however the block ends.

    ``interruptible``: meanwhile Ctrl-C and SIGTERM (`docker stop`, schedulers) end the running
    trial as interrupted at a safe point (see `loader_search.interrupts`) instead of killing
    the process in the middle of a database write.
    """
    reporter = RichReporter(console)
    try:
        with _stop_on_signals() if interruptible else contextlib.nullcontext():
            yield reporter
    finally:
        reporter.close()


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    from loader_search.interrupts import STOP_REQUESTED, on_signal

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        STOP_REQUESTED.clear()


def report_destination(output: Path | None, fmt: str, study: str) -> Path | None:
    """Where `report` writes (None: standard output), checked before the slow report is
    computed rather than failing after it.

    No ``-o``: STUDY-report.html for html, standard output for json; ``-o -``: standard output.
    """
    if output is None and fmt == "html":
        output = Path(f"{study}-report.html")
    if output is None or str(output) == "-":
        return None
    if output.is_dir():
        raise UserError(f"-o {str(output)!r} is a directory: give a file name, e.g. report.html")
    folder = output.parent if str(output.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(
            f"-o {str(output)!r}: folder {str(folder)!r} does not exist; create it first"
        )
    if not os.access(folder, os.W_OK) or (output.exists() and not os.access(output, os.W_OK)):
        raise UserError(f"-o {str(output)!r} is not writable: pick another path")
    return output


def write_report(data: ReportData, fmt: str, output: Path | None, study: str) -> None:
    """The report as JSON or as one offline HTML page, to standard output (``output`` None) or
    to a file, saying where."""
    if fmt == "json":
        text = json.dumps(data.as_dict(), indent=2) + "\n"
    else:
        from loader_search.reports import render

        text = render(data)
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(
            f"cannot write the report to {str(output)!r}: {exc.strerror or exc}; pick another -o"
        ) from None
    console.print(shown(f"Report of {study} written to {output}"))


def print_notes(notes: Iterable[str], out: Console = console) -> None:
    """The service's notes (a narrowed space, a replaced config), one indented line each."""
    for note in notes:
        out.print(f"  [yellow]note:[/] {shown(note)}")


def print_study_ready(info: StudyInfo) -> None:
    """`init`'s answer: the study exists, and how to put workers on it."""
    verb = "Created" if info.created else "Updated"
    console.print(
        f"{verb} study [bold]{shown(info.name)}[/] in {shown(info.storage)}:"
        f" {info.finished}/{info.budget} trials done. Start workers with\n"
        f"  loader-search worker {shown(shlex.quote(info.name))} --storage URL"
    )
    print_notes(info.notes)


def print_dashboard_ready(storage: str, address: str, host: str) -> None:
    """The dashboard's address, and a warning when it listens beyond this machine (no login).

    ``storage`` must already be masked: it is printed as given.
    """
    console.print(shown(f"Dashboard of {storage} at {address} (Ctrl-C to stop)"), soft_wrap=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(
            f"[yellow]note:[/] listening on {shown(host)}: anyone who can reach this"
            " machine can see and edit the studies (the dashboard has no login)"
        )


@dataclass(frozen=True)
class StudyRow:
    """One line of `studies`: a study's trial counts and its recommendation as `best` states
    it (merged repeats; None: none yet, or per machine for a study run on several)."""

    name: str
    complete: int
    failed: int
    running: int
    budget: object  # as stored with the study; None: none recorded
    recommended_throughput: float | None
    speedup: str | None  # e.g. "1.17x (95% CI 1.08-1.27)"


def print_studies(storage: str, rows: Sequence[StudyRow]) -> None:
    """The `studies` table; ``storage`` must already be masked."""
    if not rows:
        console.print(shown(f"No studies in {storage}."))
        return
    table = Table(title=shown(f"Studies in {storage}"))
    columns = ("study", "complete", "failed", "running", "budget", "recommended samples/s")
    for column in (*columns, "speedup"):
        table.add_column(column, justify="left" if column in ("study", "speedup") else "right")
    for row in rows:
        table.add_row(
            shown(row.name),
            str(row.complete),
            str(row.failed),
            str(row.running),
            str(row.budget) if row.budget is not None else "-",
            f"{row.recommended_throughput:,.0f}" if row.recommended_throughput else "-",
            shown(row.speedup or "-"),
        )
    console.print(table)


_VERDICT_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def print_checks(checks: Sequence[Check]) -> None:
    """`doctor`'s table: one row per dependency, its verdict coloured, and the fix."""
    table = Table(title="loader-search doctor")
    for column in ("check", "verdict", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        style = _VERDICT_STYLE[check.verdict]
        table.add_row(
            shown(check.name),
            f"[{style}]{check.verdict}[/]",
            shown(check.detail),
            shown(check.fix),
        )
    console.print(table)


class RichReporter:
    """Live progress for `run`: a bar with the Pareto size and the bests, a line per trial."""

    def __init__(self, out: Console = console) -> None:
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
        """A spinner while the workload is built, the storage opened or a lock awaited (can
        take a while). Where output is not a terminal (a log), a spinner shows nothing: each
        message is a line instead (a wait repeats its line while it lasts)."""
        if not self.console.is_terminal:
            self.console.print(f"  {shown(what)} ...", soft_wrap=True)
            return
        if self.status is None:
            self.status = self.console.status(shown(what) + " ...")
            self.status.start()
        else:
            self.status.update(shown(what) + " ...")

    def _stop_status(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def study_started(self, info: StudyInfo) -> None:
        self._stop_status()
        verb = "Created" if info.created else "Continuing"
        self.console.print(
            f"{verb} study [bold]{shown(info.name)}[/] in {shown(info.storage)}\n"
            f"  workload: {shown(info.workload)}\n"
            f"  hardware: {shown(info.device)} (class {info.hardware_class});"
            f" {info.finished}/{info.budget} trials done",
            soft_wrap=True,
        )
        print_notes(info.notes, self.console)
        if info.finished >= info.budget:
            self.console.print(
                f"  Trial budget already used; raise --n-trials above {info.budget} to search"
                " more (unfinished confirmation rounds still run).",
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
            round_ = f", round {event.confirm_round}" if event.confirm_round is not None else ""
            settings += f" [dim](confirm{round_})[/]"
        if event.complete:
            efficiency = (
                f"  eff {efficiency_text(event.loader_efficiency):>4}"
                if event.loader_efficiency
                else ""
            )
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
                f" {shown(event.failure or '')}",
                soft_wrap=True,
            )
            if event.hint:
                self.console.print(f"       [dim]hint: {shown(event.hint)}[/]", soft_wrap=True)
        if self.task is not None:
            best = (
                f"Pareto {event.pareto_size} | best {event.best_throughput:,.0f} samples/s"
                f" | best val_loss {event.best_val_loss:.4f}"
                if event.best_throughput is not None and event.best_val_loss is not None
                else f"Pareto {event.pareto_size}"
            )
            self.progress.update(self.task, completed=event.finished, best=best, running="")

    def warning(self, what: str) -> None:
        self.console.print(f"  [yellow]warning:[/] {shown(what)}", soft_wrap=True)

    def close(self) -> None:
        self._stop_status()
        self.progress.stop()
