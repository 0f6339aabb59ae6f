"""A command's placeholders: ``{batch_size}`` and its siblings filled in with a trial's values.

A setting with a placeholder reaches the script as a flag; one without is injected into its
training DataLoader by the start-up hook (`loader_search.trial._inject`). Values are rendered
so that an ordinary ``type=int`` / ``type=float`` flag takes them:

- ``{pin_memory}`` and ``{persistent_workers}`` are ``1`` or ``0`` (read them with
  ``type=int``; ``bool(int(value))``). ``{persistent_workers}`` is ``0`` without workers.
- ``{prefetch_factor}`` without workers has no value in the trial: it renders as ``2``
  (torch's own default with workers), and the hook drops it from a training loader built
  with ``num_workers=0``, so a script that passes its flags straight to ``DataLoader`` works.
- ``{lr}`` is ``[training] lr`` (the script's learning rate at ``[training] batch_size``)
  scaled to the trial's batch size by ``lr_scaling``.
- ``{max_steps}`` is the budget in steps: ``train_samples / batch_size``, rounded up.

``{{`` and ``}}`` stand for literal braces. Any other name in braces is an error, and so is
a placeholder with a format spec, a conversion, an attribute or an index (``{batch_size:>9}``,
``{batch_size!r}``, ``{batch_size.real}``): only the bare name is filled in, since a spec like
``>400000000`` would build a string of that many characters before the start fails.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence

from loader_search.errors import UserError, printable, shorten, show_value
from loader_search.params import LoaderParams, TrainingSettings, scaled_lr

PLACEHOLDERS = (
    "batch_size",
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "persistent_workers",
    "torch_threads",
    "lr",
    "train_samples",
    "max_steps",
    "seed",
    "ranks",
)
# The loader settings the hook injects where the command has no placeholder for them.
LOADER_SETTINGS = (
    "batch_size",
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "persistent_workers",
)
# Shown for a prefetch_factor a trial without workers has no value for.
PREFETCH_WITHOUT_WORKERS = 2


def placeholders_in(argv: Sequence[str]) -> set[str]:
    """The placeholders ``argv`` uses; `UserError` naming an unknown one, one that is more
    than a bare name, or a broken brace."""
    found: set[str] = set()
    for arg in argv:
        try:
            fields = [
                (name, spec, conversion)
                for _, name, spec, conversion in string.Formatter().parse(arg)
                if name is not None
            ]
        except ValueError as exc:
            raise UserError(
                f"workload.command argument {show_value(arg)}: {exc}; write a literal brace"
                " as {{ or }}"
            ) from None
        for name, spec, conversion in fields:
            found.add(_bare(arg, name, spec, conversion))
    return found


def _bare(arg: str, name: str, spec: str | None, conversion: str | None) -> str:
    """``name``, the placeholder of one field of ``arg``, if it is a bare one; else the
    `UserError` naming it. Formatting stays out of a user's command: a spec is rendered in
    this process (``{batch_size:>400000000}`` is 400 MB of spaces) and a conversion or an
    index changes or breaks the value a flag receives."""
    placeholder = re.split(r"[.\[]", name, maxsplit=1)[0]  # batch_size of batch_size.real
    if placeholder not in PLACEHOLDERS:
        raise UserError(
            f"workload.command argument {show_value(arg)}: unknown placeholder"
            f" {{{shorten(printable(name), 40)}}}; use one of"
            f" {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
        )
    if placeholder != name or spec or conversion is not None:
        raise UserError(
            f"workload.command argument {show_value(arg)}: only a bare {{{placeholder}}} is"
            f" filled in (no format spec, conversion, attribute or index); write"
            f" {{{placeholder}}}, or {{{{ and }}}} for literal braces"
        )
    return placeholder


def to_inject(argv: Sequence[str]) -> list[str]:
    """The loader settings that reach the script through its DataLoader, not a flag."""
    used = placeholders_in(argv)
    return [name for name in LOADER_SETTINGS if name not in used]


def placeholder_values(
    params: LoaderParams, settings: TrainingSettings, ranks: int
) -> dict[str, str]:
    """Every placeholder's text for a trial of ``params`` under ``settings`` on ``ranks``."""
    workers = params.num_workers > 0
    lr = ""
    if settings.lr is not None:
        lr = repr(
            scaled_lr(settings.lr, params.batch_size, settings.batch_size, settings.lr_scaling)
        )
    prefetch = params.prefetch_factor if workers else None
    return {
        "batch_size": str(params.batch_size),
        "num_workers": str(params.num_workers),
        "prefetch_factor": str(prefetch if prefetch is not None else PREFETCH_WITHOUT_WORKERS),
        "pin_memory": str(int(params.pin_memory)),
        "persistent_workers": str(int(params.persistent_workers and workers)),
        "torch_threads": str(params.torch_threads),
        "lr": lr,
        "train_samples": str(settings.train_samples),
        "max_steps": str(math.ceil(settings.train_samples / params.batch_size)),
        "seed": str(settings.seed),
        "ranks": str(ranks),
    }


def render_command(argv: Sequence[str], filled: Mapping[str, str]) -> list[str]:
    """``argv`` with its placeholders filled in from ``filled`` (see `values`)."""
    if "lr" in placeholders_in(argv) and not filled.get("lr"):
        raise UserError(
            "workload.command uses {lr}, but [training] lr is not set: give the script's own"
            " learning rate at [training] batch_size"
        )
    return [arg.format_map(filled) for arg in argv]
