"""``[workload] command``: the user's own training script as a study's workload.

The keys beside ``command`` in ``[workload]``: ``workdir`` (where it runs; default the config
file's folder), ``val_loss_pattern`` (a regular expression whose first group is the validation
loss in the command's output) and ``train_loader`` (the N-th DataLoader the script builds is
the training loader). How a trial runs it: `loader_search.trial.CommandSpec`.

The shared database never chooses what a worker runs: a command comes from a config file on
the worker's own disk, or from the study's stored config only when ``--allow-command`` (or
``$LOADER_SEARCH_ALLOW_COMMANDS``) names it exactly, and then runs in the worker's own folder
with the worker's own pattern, training loader and ranks (`trusted_command`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import regex

from loader_search.errors import ConfigError, UserError, shorten, show_value
from loader_search.study.config._toml import Table
from loader_search.trial import CommandSpec, placeholders_in

COMMAND_WORKLOAD = "command"  # StudyConfig.workload of a study whose workload is a command
ALLOW_COMMANDS_ENV = "LOADER_SEARCH_ALLOW_COMMANDS"
MAX_ARGS = 1000
MAX_TRAIN_LOADER = 1000


@dataclass(frozen=True)
class CommandConfig:
    """The command (its arguments, placeholders unfilled), where it runs, and how the trial
    finds its validation loss and its training loader."""

    argv: tuple[str, ...]
    workdir: str = "."
    val_loss_pattern: str | None = None
    train_loader: int | None = None

    def __post_init__(self) -> None:
        if not self.argv or len(self.argv) > MAX_ARGS:
            raise ConfigError(
                "workload.command", list(self.argv), f"give the command: 1 to {MAX_ARGS} words"
            )
        if not all(isinstance(arg, str) and arg and "\0" not in arg for arg in self.argv):
            raise ConfigError(
                "workload.command", list(self.argv), "every word must be a non-empty string"
            )
        placeholders_in(self.argv)  # an unknown one: one line naming it
        if self.val_loss_pattern is not None:
            try:  # compiled as the trial compiles it (loader_search.trial._command)
                groups = regex.compile(self.val_loss_pattern).groups
            except (regex.error, RecursionError, OverflowError) as exc:
                raise ConfigError(
                    "workload.val_loss_pattern", self.val_loss_pattern, f"not a regex: {exc}"
                ) from None
            if groups < 1:
                raise ConfigError(
                    "workload.val_loss_pattern",
                    self.val_loss_pattern,
                    r"needs a group around the number, e.g. 'val_loss[=:]\s*([-+0-9.eE]+)'",
                )
        if self.train_loader is not None and not (
            isinstance(self.train_loader, int)
            and not isinstance(self.train_loader, bool)
            and 1 <= self.train_loader <= MAX_TRAIN_LOADER
        ):
            raise ConfigError(
                "workload.train_loader",
                self.train_loader,
                f"the N-th DataLoader the script builds: a whole number 1 to {MAX_TRAIN_LOADER}",
            )

    @property
    def placeholders(self) -> set[str]:
        """The placeholders the command uses (checked when it was built)."""
        return placeholders_in(self.argv)

    @property
    def line(self) -> str:
        """The command as a shell would show it."""
        return shlex.join(self.argv)

    @property
    def script(self) -> str:
        """The script's name, for a study named after it: the first word ending in ``.py``,
        else the program's."""
        for arg in self.argv:
            if arg.endswith(".py"):
                return Path(arg).stem
        return Path(self.argv[0]).name

    def spec(self, folder: Path | None = None) -> CommandSpec:
        """What a trial runs: the working folder resolved against ``folder`` (the config
        file's; else this process's)."""
        base = folder if folder is not None else Path.cwd()
        return CommandSpec(
            self.argv,
            str((base / self.workdir).resolve()),
            self.val_loss_pattern,
            self.train_loader,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": list(self.argv),
            "workdir": self.workdir,
            "val_loss_pattern": self.val_loss_pattern,
            "train_loader": self.train_loader,
        }


def parse_command(table: Table) -> CommandConfig | None:
    """``[workload] command`` and its keys, popped from ``table``; None without a command."""
    raw = table.pop("command", None)
    if raw is None:
        for key in ("workdir", "val_loss_pattern", "train_loader"):
            if key in table.data:
                raise table.error(key, table.data[key], "applies only with workload.command")
        return None
    if isinstance(raw, str):
        try:
            argv = shlex.split(raw)  # as a shell splits it; it never runs through one
        except ValueError as exc:
            raise table.error("command", raw, f"cannot be split into words: {exc}") from None
    elif isinstance(raw, list) and all(isinstance(arg, str) for arg in raw):
        argv = list(raw)
    else:
        raise table.error("command", raw, "use a list of strings, or one string")
    workdir = table.string("workdir", ".")
    val_loss_pattern = table.string("val_loss_pattern", None)
    train_loader = table.int("train_loader", None)
    try:
        return CommandConfig(tuple(argv), workdir, val_loss_pattern, train_loader)
    except ConfigError as exc:
        # The file's name in front, and the command as written: `command = ""` splits into
        # no words, which would show as [].
        value = raw if exc.key == "workload.command" else exc.value
        raise table.error(exc.key.removeprefix("workload."), value, exc.problem) from None
    except UserError as exc:  # a placeholder's: it names the argument
        raise UserError(f"{table.source}: {exc}") from None


@dataclass(frozen=True)
class OwnCommand:
    """What a worker's operator says of a command taken from the database, besides its words
    (``worker --workdir/--val-loss-pattern/--train-loader/--ranks``): everything else that
    decides what runs. ``workdir`` None is the worker's own working folder."""

    workdir: str | None = None
    val_loss_pattern: str | None = None
    train_loader: int | None = None
    ranks: int | str = 1


def trusted_command(
    command: CommandConfig,
    ranks: int | str,
    allowed: Iterable[str] = (),
    own: OwnCommand | None = None,
) -> CommandConfig:
    """The stored ``command`` (and ``[training] ranks``) as this worker runs it, or
    `UserError` in one line: its words must be named by this machine's operator
    (`check_command_allowed`), and everything else that decides what runs must be the
    worker's own (``own``): the folder it runs in (a stored ``"."`` means the worker's), the
    pattern matched against its output, the loader it trains with, its ranks. The command
    returned runs in the worker's folder."""
    check_command_allowed(command, allowed)
    own = own or OwnCommand()
    folder = Path(own.workdir or ".").absolute().resolve()
    stored = (Path.cwd() / command.workdir).resolve()
    if command.workdir != "." and stored != folder:
        _differs("workdir", command.workdir, str(folder), "--workdir", command.workdir)
    if command.val_loss_pattern != own.val_loss_pattern:
        _differs(
            "val_loss_pattern",
            command.val_loss_pattern,
            own.val_loss_pattern,
            "--val-loss-pattern",
            command.val_loss_pattern,
        )
    if command.train_loader != own.train_loader:
        _differs(
            "train_loader", command.train_loader, own.train_loader, "--train-loader",
            command.train_loader,
        )  # fmt: skip
    if str(ranks) != str(own.ranks):
        _differs("ranks", ranks, own.ranks, "--ranks", ranks, table="training")
    return replace(command, workdir=str(folder))


def _differs(
    key: str, stored: object, mine: object, flag: str, fix: object, table: str = "workload"
) -> None:
    shown = "none" if mine is None else repr(mine)
    to_pass = f"pass {flag} {shlex.quote(str(fix))}" if fix is not None else f"leave out {flag}"
    raise UserError(
        f"the study's stored {table}.{key} = {show_value(stored)} is not this worker's"
        f" ({shown}): a worker runs a command from the database only as its own operator"
        f" configured it; if you trust the stored value, {to_pass}"
    )


def check_command_allowed(command: CommandConfig, allowed: Iterable[str] = ()) -> None:
    """Refuse a command taken from the database unless this machine's operator named it
    exactly (``worker --allow-command``, or ``$LOADER_SEARCH_ALLOW_COMMANDS``, one command a
    line)."""
    from_env = os.environ.get(ALLOW_COMMANDS_ENV, "").splitlines()
    for entry in [*allowed, *from_env]:
        try:
            if tuple(shlex.split(entry)) == command.argv:
                return
        except ValueError:
            continue
    shown = shorten(command.line, 200)
    raise UserError(
        f"the study's workload is the command {shown!r}, which this machine has not allowed:"
        " a worker runs a command from the database only when its operator names it; if you"
        f" trust it, pass --allow-command {shlex.quote(command.line)} (or add it to"
        f" {ALLOW_COMMANDS_ENV})"
    )
