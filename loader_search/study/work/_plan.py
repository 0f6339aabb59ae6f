"""What a trial can take from the trials before it, so that it costs less.

**Validation loss.** Loader settings do not change what the model learns: every trial trains
the same model from the same weights on the same samples in the same order (see
`loader_search.trial._loader.build_loader`) with the learning rate of its batch size. Batch size
(and the training settings, which a study fixes) decides the validation loss; ``num_workers``,
``prefetch_factor``, ``pin_memory``, ``persistent_workers`` and the thread count only decide
how fast the batches arrive. So once a trial of a batch size has trained its whole budget and
been evaluated, a later trial of that batch size trains only long enough to read its
throughput (`loader_search.trial._run.short_run_samples`), skips the evaluation, and reports the
median validation loss of the evaluated trials of its batch size, naming them in
``val_loss_from``. Multi-objective studies cannot be pruned in Optuna, and this is the early
stop that fits the problem: what is saved is the convergence part, which the loader does not
affect. `benchmarks/` measures both the saving and the search quality with and without it.

**Ceiling.** The throughput of the model on pre-decoded batches already on the device depends
on batch size and thread count only: measured once per pair, then reused, unless the reading
cannot be trusted: it was taken while other processes kept more than `BUSY_LIMIT` of the
machine's CPUs busy, or a trial of the pair has since trained faster than it (by more than
`BEATEN_BY`: no loader beats the model fed from memory, so that reading was low). Then the
next trial of the pair reads the ceiling again; the readings left are combined by their
median. After `MAX_CEILING_READINGS` readings of a pair none of which is trusted, the highest
stands, and a trial above it shows an efficiency over 100%, flagged where it is shown.

Only trials of the same hardware class are reused (a GPU's numerics differ from a CPU's).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams, RunPlan, TrainingSettings
from loader_search.study._keys import (
    CEILING_ATTR,
    CEILING_LOAD_ATTR,
    HARDWARE_CLASS_ATTR,
    VAL_LOSS_ATTR,
    number,
    stored_params,
)
from loader_search.study._points import is_feasible
from loader_search.trial import short_run_samples

# Trial user attributes (the measurements themselves are `TrialResult` fields).
BUSY_LIMIT = 0.25  # of the machine's CPUs, used by other processes during a ceiling reading
BEATEN_BY = 0.02  # a trial this much faster than a ceiling reading shows the reading was low
MAX_CEILING_READINGS = 3  # per batch size and thread count: then the highest one is used


@dataclass(frozen=True)
class Reuse:
    """What one trial measures itself (``plan``) and what it takes from earlier trials."""

    plan: RunPlan
    val_loss: float | None = None  # known for this batch size: the trial stops early
    val_loss_from: tuple[int, ...] = ()
    ceiling: float | None = None  # known for this batch size and thread count
    ceiling_from: tuple[int, ...] = ()


def trusted_ceiling(trial: FrozenTrial, fastest: float) -> bool:
    """Whether ``trial``'s ceiling reading may be reused, ``fastest`` being the best
    throughput a trial of its batch size and thread count has reached (see the module
    docstring)."""
    reading = number(trial.user_attrs, CEILING_ATTR)
    if reading is None or reading <= 0:
        return False
    load = number(trial.user_attrs, CEILING_LOAD_ATTR)
    if load is not None and load > BUSY_LIMIT:
        return False
    return fastest <= reading * (1 + BEATEN_BY)


def plan_trial(
    trials: Sequence[FrozenTrial],
    params: LoaderParams,
    settings: TrainingSettings,
    hardware_class: str | None,
    train_size: int | None,
    *,
    reuse_val_loss: bool = True,
) -> Reuse:
    """Decide how ``params``'s trial runs, given the study's finished ``trials``."""
    same_batch = []  # completed feasible trials of this batch size on this hardware class
    for t in trials:
        if t.state != TrialState.COMPLETE or not is_feasible(t):
            continue
        if t.user_attrs.get(HARDWARE_CLASS_ATTR) != hardware_class:
            continue
        other = stored_params(t)
        # Accumulated micro-batches see other BatchNorm statistics than the whole batch.
        if other is not None and (other.batch_size, other.accumulation_steps) == (
            params.batch_size,
            params.accumulation_steps,
        ):
            same_batch.append((t, other))
    evaluated = [t for t, _ in same_batch if VAL_LOSS_ATTR in t.user_attrs]
    pair = [(t, other) for t, other in same_batch if other.torch_threads == params.torch_threads]
    fastest = max((t.values[0] for t, _ in pair if t.values), default=0.0)
    with_ceiling = [t for t, _ in pair if trusted_ceiling(t, fastest)]
    readings = [t for t, _ in pair if number(t.user_attrs, CEILING_ATTR)]
    if not with_ceiling and len(readings) >= MAX_CEILING_READINGS:
        # Read often enough: the highest reading stands (a loader beating it is flagged).
        with_ceiling = [max(readings, key=lambda t: float(t.user_attrs[CEILING_ATTR]))]
    short = short_run_samples(params, settings, train_size)
    val_loss = None
    if reuse_val_loss and evaluated:
        val_loss = statistics.median(float(t.user_attrs[VAL_LOSS_ATTR]) for t in evaluated)
    ceiling = None
    if with_ceiling:
        ceiling = statistics.median(float(t.user_attrs[CEILING_ATTR]) for t in with_ceiling)
    return Reuse(
        plan=RunPlan(
            short_samples=short,
            stop_early=val_loss is not None,
            measure_ceiling=ceiling is None,
        ),
        val_loss=val_loss,
        val_loss_from=tuple(t.number for t in evaluated) if val_loss is not None else (),
        ceiling=ceiling,
        ceiling_from=tuple(t.number for t in with_ceiling),
    )
