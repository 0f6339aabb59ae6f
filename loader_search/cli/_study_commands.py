"""The commands that run a study: ``run`` (create or continue it and run its trials), ``init``
(create it, run nothing) and ``worker`` (join it). Heavy modules (torch, optuna) are imported
inside the commands: ``--help`` and input errors answer at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from loader_search.cli._console import live_progress, print_study_ready, reports_errors
from loader_search.cli._options import (
    BudgetOption,
    ConfigArgument,
    CpusOption,
    GpuOption,
    MixedOption,
    RanksOption,
    StorageOption,
    StudyNameOption,
    TrainLoaderOption,
    ValLossPatternOption,
    WorkdirOption,
    parse_cpus,
)
from loader_search.cli._summary import print_summary
from loader_search.errors import UserError

RunTarget = Annotated[
    list[str],
    typer.Argument(
        help=(
            "A study config file (TOML), e.g. studies/quickstart.toml; or, after `--`, your"
            " own training command with placeholders: `-- python train.py --batch-size"
            " {batch_size}` (a study named after the script, every other setting at its"
            " default). One word is the config file, unless it is an executable program."
        ),
        metavar="CONFIG | -- COMMAND...",
        show_default=False,
    ),
]


def _is_program(word: str) -> bool:
    """Whether a lone ``run`` argument is a program to run (an executable file, not a study
    file): ``run -- ./train.sh``. Anything else is read as the study's config file."""
    path = Path(word)
    return path.suffix != ".toml" and path.is_file() and os.access(path, os.X_OK)


@reports_errors
def run(
    target: RunTarget,
    storage: StorageOption = None,
    study_name: StudyNameOption = None,
    n_trials: BudgetOption = None,
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
    val_loss_pattern: Annotated[
        str | None,
        typer.Option(
            "--val-loss-pattern",
            help=(
                "With `-- COMMAND...`: the regular expression (its first group the number) that"
                " finds the validation loss in the command's output. Default: lines such as"
                " val_loss=0.5, 'eval_loss': 0.5, Test set: Average loss: 0.5 (docs/scripts.md)."
            ),
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run (or continue) a study: every trial trains the workload with one loader setting.

    The first trial of a new study is the baseline (the config's batch size, num_workers=0).
    Running again with the same study name continues it until its trial budget is used; then
    the best candidates and the baseline are measured again (beyond the budget) so that the
    recommendation rests on medians. `loader-search worker` processes on other machines can
    join it meanwhile.

    With `-- COMMAND...` every trial runs your own training script, unchanged: the trial's
    settings reach it as the placeholders' values, and those without a placeholder are put
    into its training DataLoader (docs/scripts.md). Its validation loss is the one it reports
    (loader_search.report) or prints (val_loss=0.5 and other common forms, never a training
    loss; --val-loss-pattern for its own).
    """
    from loader_search.study import command_config, load_config
    from loader_search.team import check_shared, resolve_storage_url

    if len(target) == 1 and not _is_program(target[0]):
        if val_loss_pattern is not None:  # a study file says it: one place for it
            raise UserError(
                "--val-loss-pattern applies only with `-- COMMAND...`: set [workload]"
                f" val_loss_pattern in {target[0]!r} instead"
            )
        cfg = load_config(target[0])
    else:
        cfg = command_config(target, val_loss_pattern)
    cfg = cfg.with_overrides(name=study_name, timeout_s=timeout)
    pinned = parse_cpus(cpus)
    check_shared(resolve_storage_url(storage), "run")
    from loader_search.study import run_study

    with live_progress(interruptible=True) as reporter:
        summary = run_study(
            cfg,
            storage=storage,
            n_trials=n_trials,
            reporter=reporter,
            cpus=pinned,
            gpu=gpu,
            allow_mixed_hardware=allow_mixed_hardware,
        )
    print_summary(summary)


@reports_errors
def init(
    config: ConfigArgument,
    storage: StorageOption = None,
    study_name: StudyNameOption = None,
    n_trials: BudgetOption = None,
) -> None:
    """Create the schema and the study, run nothing: then start `worker`s on any machine.

    Safe to repeat: an existing study is continued (its budget updated with --n-trials).
    """
    from loader_search.study import load_config
    from loader_search.team import check_shared, resolve_storage_url

    cfg = load_config(config).with_overrides(name=study_name)
    check_shared(resolve_storage_url(storage), "init")
    from loader_search.study import init_study

    with live_progress() as reporter:
        info = init_study(cfg, storage=storage, n_trials=n_trials, reporter=reporter)
    print_study_ready(info)


@reports_errors
def worker(
    study: Annotated[str, typer.Argument(help="Name of an existing study to work on.")],
    storage: StorageOption = None,
    n_trials: Annotated[
        int | None,
        typer.Option(
            "--n-trials",
            help=(
                "Run at most this many trials here. Default: until the study's budget is used"
                " and its candidates are confirmed."
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
    allow_command: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-command",
            help=(
                "Run this training command if the study's workload is it, word for word"
                " (quote it whole: --allow-command 'python train.py --batch-size"
                " {batch_size}'); repeat for more. Without it a worker runs no command from"
                " the database (also: LOADER_SEARCH_ALLOW_COMMANDS, one a line)."
            ),
            show_default=False,
        ),
    ] = None,
    workdir: WorkdirOption = None,
    val_loss_pattern: ValLossPatternOption = None,
    train_loader: TrainLoaderOption = None,
    ranks: RanksOption = "1",
) -> None:
    """Join a study created by `run` (on this or another machine) and run its trials.

    The study's config and trial budget come from the database: start as many workers as
    you like, on as many machines; together they run exactly the budget. A trial whose
    worker dies is failed after the study's grace period and retried with the same settings.
    Ctrl-C (or SIGTERM) ends the running trial as interrupted and exits.

    Whoever can write to the database chooses the study's workload, so a worker runs a
    plug-in (code) only if this machine allows it with --allow-plugin, and a training
    command only if --allow-command names it exactly; it runs in the worker's own folder
    (--workdir), with the worker's own --val-loss-pattern, --train-loader and --ranks: a
    stored value that differs is refused.
    """
    from loader_search.study import OwnCommand, run_worker

    own = OwnCommand(
        str(workdir) if workdir is not None else None,
        val_loss_pattern,
        train_loader,
        int(ranks) if ranks.isdecimal() else ranks,
    )
    with live_progress(interruptible=True) as reporter:
        summary = run_worker(
            study,
            storage=storage,
            n_trials=n_trials,
            timeout_s=timeout,
            reporter=reporter,
            cpus=parse_cpus(cpus),
            gpu=gpu,
            allow_mixed_hardware=allow_mixed_hardware,
            allow_plugins=tuple(allow_plugin or ()),
            allow_commands=tuple(allow_command or ()),
            own_command=own,
        )
    print_summary(summary)
