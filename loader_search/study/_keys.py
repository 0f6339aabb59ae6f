"""Every name loader-search stores with a study or a trial, defined once, with typed readers.

A study lives in a database that outlives any one version of this code and that other tools
read (`optuna`'s CLI, optuna-dashboard, a user's notebook), so these names are a file format:
change one and older studies stop reading right. Every other module imports them from here
(a test fails on a stray copy of a key's string anywhere else in the package).

The measurements a trial stores are the fields of `loader_search.trial._run.TrialResult`
(their names carry their units); the ones read back by name are listed here too.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal

from optuna.trial import FrozenTrial

from loader_search._rules import check_value
from loader_search.errors import ConfigError, UserError, show_value
from loader_search.params import OBJECTIVES, LoaderParams, Objective
from loader_search.trial import CUDA_OOM, HOST_OOM

if TYPE_CHECKING:
    from optuna import Study

# -- Objectives (Optuna's values, in this order; their names are the study's metric names) --
THROUGHPUT = "throughput_samples_per_s"
VAL_LOSS = "val_loss"
METRIC_NAMES = (THROUGHPUT, VAL_LOSS)
DIRECTIONS: tuple[Literal["maximize"], Literal["minimize"]] = ("maximize", "minimize")
CONSTRAINT = "feasible"  # the name of `trial.set_constraint`'s value: > 0 means infeasible

# -- Study user attributes --
FINGERPRINT_ATTR = "fingerprint"  # what a continued study must share with its creator
CONFIG_ATTR = "config"  # the validated config document, for workers
BUDGET_ATTR = "trial_budget"  # the total trial budget, shared by every worker
TOLERANCE_ATTR = "loss_tolerance"  # the recommendation's relative val_loss slack
OBJECTIVE_ATTR = "objective"  # [study] objective: "throughput" or "goodput"
CONFIRM_ATTR = "confirm"  # {"top", "min_rounds", "max_rounds", "half_width"} (see _confirm)
STUDY_HARDWARE_ATTR = "hardware_class"  # the hardware class of the study's first trial
# ... and, stored with it, that class in words (each trial's `HARDWARE_ATTR` has all of it):
DEVICE_ATTR = "device"  # "cuda" or "cpu"
DEVICE_NAME_ATTR = "device_name"  # the GPU model on CUDA, else the CPU model
USABLE_CPUS_ATTR = "usable_cpus"  # the CPUs a trial may use (after any --cpus pinning)
MIXED_HARDWARE_ATTR = "mixed_hardware"  # True once a trial of another class ran
WORKLOAD_DESCRIPTION_ATTR = "workload_description"
SAMPLER_ATTR = "sampler"  # the configured sampler's name
PIPELINE_ATTR = "pipeline"  # the pipeline model and each batch size's limit (see _guide)
# The software a study was created with (`run`/`init` store them), and the machine it is bound
# to (stored with its first trial): the report shows what is there.
TORCH_VERSION_ATTR = "torch_version"
OPTUNA_VERSION_ATTR = "optuna_version"
PYTHON_VERSION_ATTR = "python_version"
VERSION_ATTR = "loader_search_version"
ENVIRONMENT_ATTRS = (
    DEVICE_ATTR,
    DEVICE_NAME_ATTR,
    USABLE_CPUS_ATTR,
    TORCH_VERSION_ATTR,
    OPTUNA_VERSION_ATTR,
    PYTHON_VERSION_ATTR,
    VERSION_ATTR,
)

# -- Trial user attributes --
PARAMS_ATTR = "loader_params"  # the full `LoaderParams` (Optuna's params omit fixed ones)
BASELINE_ATTR = "baseline"  # the plain loader every speedup is measured against
CONFIRMATION_ATTR = "confirmation"  # a trial of the confirmation rounds, beyond the budget
CONFIRM_ROUND_ATTR = "confirm_round"  # its paired round (see _confirm)
WORKER_ATTR = "worker"  # the worker that took the trial: "host:pid"
TRIAL_PROCESS_ATTR = "trial_process"  # "fork", "fresh" or "in-process" (see _worker)
HARDWARE_ATTR = "hardware"  # the machine a trial ran on (a dict)
HARDWARE_CLASS_ATTR = "hardware_class"  # its short class key
LOADER_EFFICIENCY_ATTR = "loader_efficiency"  # throughput / ceiling
LR_ATTR = "lr"  # the learning rate it trained with (scaled for its batch size)
VAL_LOSS_ATTR = VAL_LOSS  # only trials that evaluated store it
VAL_LOSS_FROM = "val_loss_from"  # stopped early: the trials whose median val_loss it reports
CEILING_ATTR = "ceiling_samples_per_s"  # the same model fed pre-decoded data on the device
CEILING_FROM = "ceiling_from"  # the trials whose ceiling reading it reuses
UNTRAINED_LOSS_ATTR = "untrained_loss"  # the first batch's loss, before any step
CEILING_LOAD_ATTR = "ceiling_other_load"  # share of the CPUs others used during the reading
OTHER_LOAD_ATTR = "other_load"  # ... and during the trial's throughput window
DATA_WAIT = "data_wait_fraction"
PEAK_RSS = "peak_host_rss_bytes"
PEAK_GPU = "peak_gpu_bytes"
TRAIN_TIME = "train_time_s"
MEASURED_SAMPLES = "measured_samples"  # samples in the throughput window
WINDOW_FAULTS = "window_minor_faults"  # the training process's page faults in the window
# Stage costs (`loader_search.trial._stages`), read by the pipeline model.
PRODUCER_COST = "producer_cpu_s_per_sample"
COLLATE_COST = "collate_cpu_s_per_batch"
MAIN_COST = "main_cpu_s_per_batch"
# The pipeline model (`loader_search.study.search._guide`): what it predicted for a trial before it
# ran, how far off that was, and which round of model trials proposed it (none: the sampler).
PREDICTED_ATTR = "predicted_samples_per_s"
PREDICTED_BOTTLENECK_ATTR = "predicted_bottleneck"
PREDICTION_ERROR_ATTR = "prediction_error"  # measured / predicted - 1
MODEL_ROUND_ATTR = "model_round"
FAILURE_REASON = "failure_reason"  # one of `loader_search.trial._failures`' reasons
FAILURE_MESSAGE = "failure_message"
FAILURE_HINT = "failure_hint"
FAILURE_TRACEBACK = "failure_traceback"
INFERRED_FROM = "inferred_from"  # the trial an inferred out-of-memory verdict comes from
# Gradient accumulation (see loader_search.study.work._plan.fit_in_memory):
MICRO_BATCH_ATTR = "micro_batch_size"  # the DataLoader's batch size
ACCUMULATION_ATTR = "accumulation_steps"  # micro-batches per optimizer step
ACCUMULATION_FROM = "accumulation_from"  # the trial whose out-of-memory made it accumulate
OOM_ATTEMPTS_ATTR = "oom_attempts"  # micro-batch sizes this trial ran out of memory with

# -- Failure reasons the study layer adds to the trial layer's --
INFERRED_OOM: Final = (
    "inferred_oom"  # not trained: settings that need more memory than a failed one
)
# Not run: queued settings outside the study's space (see `ResolvedSpace.problem`).
REFUSED: Final = "refused"
LOST: Final = "lost"  # shown, never stored: a result the database could not take in time
MEASURED_OOM_REASONS = (CUDA_OOM, HOST_OOM)  # trials that really ran out of memory
OOM_REASONS = (*MEASURED_OOM_REASONS, INFERRED_OOM)

# -- Trial system attributes (Optuna's own names) --
RETRY_HISTORY = "retry_history"  # set by Optuna on a trial retried after its worker died


def number(attrs: dict[str, Any], key: str) -> float | None:
    """A finite float stored under ``key``, else None (absent in older studies, or not a
    number: the database is written by other hands too)."""
    value = attrs.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def is_baseline(trial: FrozenTrial) -> bool:
    return bool(trial.user_attrs.get(BASELINE_ATTR, False))


def is_confirmation(trial: FrozenTrial) -> bool:
    return bool(trial.user_attrs.get(CONFIRMATION_ATTR, False))


def trial_hardware_class(trial: FrozenTrial) -> str | None:
    value = trial.user_attrs.get(HARDWARE_CLASS_ATTR)
    return value if isinstance(value, str) else None


def stored_params(trial: FrozenTrial) -> LoaderParams | None:
    """The effective settings a trial stored (``loader_params``), or None before it did, or
    when what it stored cannot be read (a damaged record is left out, not fatal)."""
    stored = trial.user_attrs.get(PARAMS_ATTR)
    if not stored:
        return None
    try:
        return LoaderParams.from_dict(stored)
    except ValueError:
        return None


def study_attrs(study: Study) -> dict[str, Any]:
    """The user attributes stored with ``study``; a `UserError` naming the study when one
    cannot be decoded: JSON nested deeper than Python's parser goes (`RecursionError`), a
    number longer than Python reads, or text that is not JSON (`ValueError`). Other hands
    write the database: a damaged study is an error of that study, not a traceback."""
    try:
        return study.user_attrs
    except (RecursionError, ValueError):
        name = study.study_name
        raise UserError(
            f"study {name!r}: its attributes cannot be read (a stored value is not JSON Python"
            " can decode, e.g. nested too deep); remove that row from the study_user_attributes"
            " table, or delete the study: `optuna delete-study --study-name"
            f" {shlex.quote(name)} --storage URL`"
        ) from None


_RESTORE = "run `loader-search init CONFIG --storage URL` to store the study's settings afresh"


def stored_setting(
    study: str,
    attrs: Mapping[str, Any],
    key: str,
    default: Any,
    rule: str,
    shown: str | None = None,
) -> Any:
    """The study setting ``key`` as stored with ``study`` (``default`` when absent), checked
    against `RANGES`' ``rule``: the database is written by other hands too, and a NaN
    tolerance or a negative budget would break every command of everyone who shares it. A
    bad value is a `UserError` naming the study, the key (``shown``) and the fix."""
    value = attrs.get(key, default)
    try:
        check_value(shown or key, value, rule)
    except ConfigError as exc:
        raise UserError(f"study {study!r} stores {exc}; {_RESTORE}") from None
    return value


def stored_table(study: str, attrs: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """The table of settings stored under ``key`` (empty when absent), which must be one."""
    table = attrs.get(key) or {}
    if not isinstance(table, Mapping):
        raise UserError(
            f"study {study!r} stores {key} = {show_value(table)}, not a table; {_RESTORE}"
        )
    return table


def study_budget(study: str, attrs: Mapping[str, Any], default: int) -> int:
    """The study's total trial budget, shared by every worker (`stored_setting`)."""
    return int(stored_setting(study, attrs, BUDGET_ATTR, default, "study.trials"))


def study_tolerance(study: str, attrs: Mapping[str, Any], default: float) -> float:
    """The recommendation's relative val_loss slack as stored (`stored_setting`)."""
    return float(stored_setting(study, attrs, TOLERANCE_ATTR, default, "study.loss_tolerance"))


def stored_objective(attrs: Mapping[str, Any], default: Objective) -> Objective:
    """The study's stored objective (the one ``run`` stored), else ``default``; a value
    someone else wrote that is no objective reads as the default."""
    value = attrs.get(OBJECTIVE_ATTR)
    return value if value in OBJECTIVES else default  # type: ignore[return-value]
