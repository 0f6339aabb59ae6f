"""The ``loader-search`` commands. A thin layer: parse options, call a service function, render.

What is printed (errors included) is drawn by `loader_search.cli._console`; what is decided
lives in the layers below (study, report, team). This module holds the app and registers the
commands in the order ``--help`` lists them: those that run a study
(`loader_search.cli._study_commands`), those that read studies
(`loader_search.cli._read_commands`), and the tools (`loader_search.cli._tool_commands`).
Options that several commands share are defined once, in `loader_search.cli._options`.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from loader_search.cli._console import DEBUG_ENV

# Heavy modules (torch, optuna) are imported inside the commands: `--help` and input errors
# answer at once.
from loader_search.cli._read_commands import best, dashboard, report, studies
from loader_search.cli._study_commands import init, run, worker
from loader_search.cli._tool_commands import doctor, make_images

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


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks for errors.")
    ] = False,
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


app.command()(run)
app.command()(init)
app.command()(worker)
app.command()(best)
app.command()(report)
app.command()(dashboard)
app.command()(studies)
app.command()(doctor)
app.command("make-images")(make_images)
