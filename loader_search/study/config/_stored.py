"""What a study stores for the processes that join it, written by `run` and `init`: the
fingerprint a continued study must share, the config document, the environment, the trial
budget and the confirmation settings; and the config read back by a worker (`stored_config`).
"""

from __future__ import annotations

import platform
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import optuna

from loader_search._version import __version__
from loader_search.errors import UserError
from loader_search.params import STEP_KEYS, TrainingSettings
from loader_search.study._keys import (
    BUDGET_ATTR,
    CONFIG_ATTR,
    CONFIRM_ATTR,
    FINGERPRINT_ATTR,
    OBJECTIVE_ATTR,
    OPTUNA_VERSION_ATTR,
    PYTHON_VERSION_ATTR,
    SAMPLER_ATTR,
    TOLERANCE_ATTR,
    TORCH_VERSION_ATTR,
    VERSION_ATTR,
    WORKLOAD_DESCRIPTION_ATTR,
    study_budget,
)
from loader_search.study.config._command_config import OwnCommand, trusted_command
from loader_search.study.config._config import StudyConfig, parse_config
from loader_search.workloads import Workload


def fingerprint(config: StudyConfig, workload: Workload | None, spec: str) -> dict[str, Any]:
    """What a continued study must share with the one that created it: validation loss
    under other training settings would not compare. (Hardware is checked apart, per trial:
    see `loader_search.study.work._machine.check_hardware`.)"""
    return {
        # How throughput is measured: warm-up to the early-stop mark (loader_search.trial._run).
        # Studies that earlier versions measured over the whole run do not compare.
        "throughput_window": "warmup-to-mark",
        "workload": spec,
        "workload_options": dict(
            (workload.options if workload is not None else None) or config.workload_options
        ),
        # A command's words and how its trials read it; not its folder, which is each
        # machine's own.
        **(
            {"command": {**config.command.as_dict(), "workdir": None}}
            if config.command is not None
            else {}
        ),
        "space": config.space.as_dict(),
        "training": {
            "train_samples": config.training.train_samples,
            "batch_size": config.training.batch_size,
            "lr_scaling": config.training.lr_scaling,
            "lr": config.training.lr,
            "warmup_batches": config.training.warmup_batches,
            "eval_batch_size": config.training.eval_batch_size,
            "seed": config.training.seed,
            "reuse_val_loss": config.training.reuse_val_loss,
            # Only when off: studies from before accumulation existed keep their fingerprint.
            **(
                {"gradient_accumulation": "off"}
                if config.training.gradient_accumulation == "off"
                else {}
            ),
            # Only when not the default: studies from before the user's step keep theirs.
            **_step_fingerprint(config),
        },
    }


def describe(config: StudyConfig, workload: Workload | None) -> str:
    """The study's workload in a few words: its description, or the command it runs."""
    if config.command is not None:
        return f"your command: {config.command.line}"
    assert workload is not None
    return workload.description or workload.name


def _step_fingerprint(config: StudyConfig) -> dict[str, Any]:
    """The training step's settings that differ from the defaults (a worker training
    another step, another precision or compiled, measures another consumer: it cannot join)."""
    training, defaults = config.training, TrainingSettings()
    return {
        k: getattr(training, k) for k in STEP_KEYS if getattr(training, k) != getattr(defaults, k)
    }


def _environment() -> dict[str, Any]:
    import torch

    return {
        TORCH_VERSION_ATTR: torch.__version__,
        OPTUNA_VERSION_ATTR: optuna.__version__,
        PYTHON_VERSION_ATTR: platform.python_version(),
        VERSION_ATTR: __version__,
    }


def settle_budget(
    study: optuna.Study,
    config: StudyConfig,
    n_trials: int | None,
    finished: int,
    created: bool,
) -> tuple[int, list[str]]:
    """The total budget a created or continued study runs with: ``n_trials`` (never below
    the ``finished`` trials it has), else the config's for a new study, else the one stored
    with it (with a note when that is not the config's)."""
    name = study.study_name
    if n_trials is not None and n_trials < finished:
        raise UserError(
            f"--n-trials {n_trials} is below the {finished} trials study {name!r} already has;"
            f" give at least {finished}, or use `loader-search best {shlex.quote(name)}` to see"
            " its results"
        )
    if n_trials is not None:
        return n_trials, []
    stored = study.user_attrs
    budget = config.trials if created else study_budget(study.study_name, stored, config.trials)
    if budget == config.trials:
        return budget, []
    return budget, [
        f"continuing with the study's stored budget of {budget} trials, not the"
        f" config's {config.trials}; pass --n-trials to change it"
    ]


def store_settings(
    study: optuna.Study,
    config: StudyConfig,
    workload: Workload | None,
    fingerprint: Mapping[str, Any],
    created: bool,
    budget: int,
) -> list[str]:
    """Store what workers joining the study use: its config and fingerprint (unless results
    were measured under them), budget, tolerance and confirmation settings. Returns a note
    when a stored config is replaced."""
    notes = []
    if created or study.user_attrs.get(FINGERPRINT_ATTR) != fingerprint:
        # New, made by plain Optuna, or nothing measured yet under the old settings.
        if not created and study.user_attrs.get(FINGERPRINT_ATTR) is not None:
            notes.append(
                f"replaced study {study.study_name!r}'s stored config (no trial had completed"
                " under it); workers that join from now on use this one"
            )
        study.set_user_attr(FINGERPRINT_ATTR, dict(fingerprint))
        study.set_user_attr(CONFIG_ATTR, dict(config.document))
        study.set_user_attr(WORKLOAD_DESCRIPTION_ATTR, describe(config, workload))
        study.set_user_attr(SAMPLER_ATTR, config.sampler.name)
        for key, value in _environment().items():
            study.set_user_attr(key, value)
    study.set_user_attr(BUDGET_ATTR, budget)
    study.set_user_attr(TOLERANCE_ATTR, config.loss_tolerance)
    study.set_user_attr(OBJECTIVE_ATTR, config.objective)
    study.set_user_attr(
        CONFIRM_ATTR,
        {
            "top": config.confirm_top,
            "min_rounds": config.confirm_min_rounds,
            "max_rounds": config.confirm_max_rounds,
            "half_width": config.confirm_half_width,
        },
    )
    return notes


def trusted_config(
    config: StudyConfig, allowed: Sequence[str] = (), own: OwnCommand | None = None
) -> StudyConfig:
    """``config`` read from the database, its command as this worker runs it: named by this
    machine, in its folder, with its own pattern, loader and ranks (`trusted_command`)."""
    assert config.command is not None
    command = trusted_command(config.command, config.training.ranks, allowed, own)
    return replace(config, command=command)


def stored_config(study: optuna.Study) -> StudyConfig:
    """The config a study was created with, as `run` stored it for workers."""
    document = study.user_attrs.get(CONFIG_ATTR)
    if not document:
        raise UserError(
            f"study {study.study_name!r} has no stored config (it was not created by"
            " `loader-search run`, or was created from Python): start it with `loader-search"
            " run CONFIG --storage URL`, or call run_worker(..., config=...) from Python"
        )
    return parse_config(document, source=f"study {study.study_name!r}'s stored config")
