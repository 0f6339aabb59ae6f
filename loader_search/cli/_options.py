"""The arguments and options several commands share, as `Annotated` aliases defined once so
that their help texts agree, and the parsing of ``--cpus``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from loader_search.cli._console import print_warning
from loader_search.errors import UserError
from loader_search.team import STORAGE_ENV, has_password


def _warn_of_a_password(value: str | None) -> str | None:
    """A password in ``--storage`` is in the process's command line, which every user of the
    machine reads (``ps``, /proc/PID/cmdline); the environment is readable by its owner
    alone. A warning, not an error: the command still runs. Never quotes the URL."""
    if value is not None and has_password(value):
        print_warning(
            "--storage holds a password, which every user of this machine can read in the"
            f" process list (ps); set the URL in ${STORAGE_ENV} instead and leave out --storage"
        )
    return value


ConfigArgument = Annotated[
    Path, typer.Argument(help="Study config file (TOML), e.g. studies/quickstart.toml.")
]
StudyArgument = Annotated[str, typer.Argument(help="Study name (see `loader-search studies`).")]
StorageOption = Annotated[
    str | None,
    typer.Option(
        "--storage",
        help=(
            f"Database URL (SQLAlchemy form). Default: ${STORAGE_ENV}, else"
            " sqlite:///loader_search.db in the current directory."
        ),
        show_default=False,
        callback=_warn_of_a_password,
    ),
]
StudyNameOption = Annotated[
    str | None,
    typer.Option(
        "--study-name",
        help="Study name. Default: \\[study] name, else the config file's name.",
    ),
]
BudgetOption = Annotated[
    int | None,
    typer.Option(
        "--n-trials",
        help=(
            "Total trials of the study, stored with it and shared by all workers. Default: a"
            " continued study's stored budget; for a new study, \\[study] trials."
        ),
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
# What a worker's operator says of a command taken from the database (besides its words):
# the stored values must match these (loader_search.study.config.trusted_command).
_OWN = "A command from the database runs only with this worker's own"
WorkdirOption = Annotated[
    Path | None,
    typer.Option(
        "--workdir",
        help=f"{_OWN} folder: this one. Default: the folder the worker runs in.",
        show_default=False,
    ),
]
ValLossPatternOption = Annotated[
    str | None,
    typer.Option(
        "--val-loss-pattern",
        help=f"{_OWN} val_loss_pattern: this regular expression (its first group the loss).",
        show_default=False,
    ),
]
TrainLoaderOption = Annotated[
    int | None,
    typer.Option(
        "--train-loader",
        help=f"{_OWN} train_loader: the N-th DataLoader the script builds trains.",
        show_default=False,
    ),
]
RanksOption = Annotated[
    str,
    typer.Option("--ranks", help=f"{_OWN} [training] ranks: N or auto."),
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
LossToleranceOption = Annotated[
    float | None,
    typer.Option(
        "--loss-tolerance",
        help="Relative val-loss slack for the recommendation. Default: the study's (0.05).",
    ),
]


_MAX_CPU = 8191  # Linux's largest CPU number (NR_CPUS is 8192 at most)


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """``0-3,8`` -> (0, 1, 2, 3, 8)."""
    if text is None:
        return None
    shown = text if len(text) <= 40 else text[:40] + "..."
    wrong = UserError(f"--cpus {shown!r}: use CPU numbers and ranges, e.g. 0-3 or 0,2,4")
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if max(first, last) > _MAX_CPU:
                raise UserError(
                    f"--cpus {shown!r}: CPU {max(first, last)} does not exist (Linux numbers"
                    f" them 0 to {_MAX_CPU} at most); give the CPUs of this machine, e.g. 0-3"
                )
            cpus.update(range(first, last + 1))
    except ValueError:
        raise wrong from None
    if not cpus or min(cpus) < 0:
        raise wrong
    return tuple(sorted(cpus))
