"""Opening a study in its storage: creating or continuing the one a config describes (checked
against the settings it was created with), opening an existing one by name for reading or
joining, and the sampler each process proposes with."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from loader_search.errors import UserError
from loader_search.study._keys import (
    DIRECTIONS,
    FINGERPRINT_ATTR,
    METRIC_NAMES,
    study_attrs,
    study_tolerance,
)
from loader_search.study._optuna_compat import study_names
from loader_search.study.config import StudyConfig
from loader_search.study.stats import hardware_classes
from loader_search.team import mask_url, open_storage, resolve_storage_url


def make_sampler(config: StudyConfig, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """The configured sampler. ``seed_offset`` (the trials a continued study already has)
    shifts the seed, so a continued study does not propose its first settings again."""
    sampler = config.sampler
    seed = (config.seed + seed_offset) % 2**32
    if sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler.name == "nsga2":
        kwargs: dict[str, Any] = {"seed": seed}
        if sampler.population_size is not None:
            kwargs["population_size"] = sampler.population_size
        return optuna.samplers.NSGAIISampler(**kwargs)
    if sampler.name == "grid":
        # Every valid combination once: unlike GridSampler, BruteForceSampler follows the
        # conditional parameters (no prefetch_factor grid for num_workers=0).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.BruteForceSampler(seed=seed)
    kwargs = {"seed": seed}
    if sampler.multivariate is not None:
        # Conditional parameters (prefetch only with workers) need group sampling.
        kwargs["multivariate"] = sampler.multivariate
        kwargs["group"] = sampler.multivariate
    if sampler.n_startup_trials is not None:
        kwargs["n_startup_trials"] = sampler.n_startup_trials
    return optuna.samplers.TPESampler(**kwargs)


def open_study(
    storage: optuna.storages.RDBStorage,
    name: str,
    config: StudyConfig,
    fingerprint: Mapping[str, Any],
) -> tuple[optuna.Study, bool]:
    """The study ``name`` in ``storage``, created (True) or continued (False). A continued
    study must be a loader-search one, and once it has results, one created with the same
    ``fingerprint``: other settings would not compare."""
    if name not in study_names(storage):
        try:
            study = optuna.create_study(
                study_name=name,
                storage=storage,
                sampler=make_sampler(config),
                directions=list(DIRECTIONS),
            )
        except optuna.exceptions.DuplicatedStudyError:
            pass  # another process created it a moment ago: continue it below
        else:
            study.set_user_attr(
                FINGERPRINT_ATTR, dict(fingerprint)
            )  # at once: see the check below
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(list(METRIC_NAMES))  # the dashboard shows these names
            return study, True
    study = optuna.load_study(study_name=name, storage=storage)
    study.sampler = make_sampler(config, seed_offset=seed_offset_of(study))
    stored = study_attrs(study).get(FINGERPRINT_ATTR)
    has_results = bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    if stored is not None and stored != fingerprint and has_results:
        differs = sorted(k for k in fingerprint if stored.get(k) != fingerprint[k])
        raise UserError(
            f"study {name!r} was created with different settings ({', '.join(differs)});"
            " its results would not compare: use another --study-name"
        )
    if [d.name.lower() for d in study.directions] != list(DIRECTIONS):
        raise UserError(f"study {name!r} is not a loader-search study: use another name")
    return study, False


def seed_offset_of(study: optuna.Study) -> int:
    """Shifts a continued study's sampler seed: by the trials it has (so it does not propose
    its first settings again) and by this process (so that workers joining at the same moment
    do not all propose the same settings)."""
    return len(study.get_trials(deepcopy=False)) + os.getpid() * 7919


@dataclass(frozen=True)
class ExistingStudy:
    """A loader-search study opened for reading (``best``, ``report``) or joining (``worker``)."""

    study: optuna.Study
    rdb: optuna.storages.RDBStorage  # the storage it was opened with (no heartbeat)
    storage: str  # its URL with any password masked
    loss_tolerance: float  # the one asked for, else the study's stored one
    hardware_classes: tuple[str, ...]  # of its trials, in the order they first ran


def open_existing_study(
    name: str,
    storage: str | None = None,
    *,
    loss_tolerance: float | None = None,
    on_busy: Callable[[str], None] | None = None,
) -> ExistingStudy:
    """Open the existing loader-search study ``name`` at the URL ``storage`` (``None``: the
    default, see `resolve_storage_url`); `UserError` (one line) when there is no such study
    (naming the ones there are) or the study is not a loader-search one. ``on_busy`` hears
    of each wait for a server that refuses connections for now (see `open_storage`)."""
    if loss_tolerance is not None and not (math.isfinite(loss_tolerance) and loss_tolerance >= 0):
        raise UserError(f"--loss-tolerance {loss_tolerance}: must be 0 or more, e.g. 0.05")
    url = resolve_storage_url(storage)
    opened, shown = open_storage(url, must_exist=True, on_busy=on_busy), mask_url(url)
    names = study_names(opened)
    if name not in names:
        known = ", ".join(names) if names else "none"
        raise UserError(
            f"no study named {name!r} in {shown} (studies there: {known});"
            " check the name or --storage, or create it with `loader-search run CONFIG`"
        )
    study = optuna.load_study(study_name=name, storage=opened)
    directions = [d.name.lower() for d in study.directions]
    attrs = study_attrs(study)
    if directions != list(DIRECTIONS) or FINGERPRINT_ATTR not in attrs:
        raise UserError(
            f"study {name!r} was not created by loader-search (it needs its two objectives,"
            " throughput and val_loss): pick one from `loader-search studies`"
        )
    if loss_tolerance is None:
        default = StudyConfig().loss_tolerance
        loss_tolerance = study_tolerance(name, attrs, default)
    return ExistingStudy(study, opened, shown, loss_tolerance, tuple(hardware_classes(study)))
