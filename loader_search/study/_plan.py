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
on batch size and thread count only: measured once per pair, then reused.

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
    HARDWARE_CLASS_ATTR,
    VAL_LOSS_ATTR,
    stored_params,
)
from loader_search.study._recommend import is_feasible
from loader_search.trial._run import short_run_samples

# Trial user attributes (the measurements themselves are `TrialResult` fields).


@dataclass(frozen=True)
class Reuse:
    """What one trial measures itself (``plan``) and what it takes from earlier trials."""

    plan: RunPlan
    val_loss: float | None = None  # known for this batch size: the trial stops early
    val_loss_from: tuple[int, ...] = ()
    ceiling: float | None = None  # known for this batch size and thread count
    ceiling_from: tuple[int, ...] = ()


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
        if other is not None and other.batch_size == params.batch_size:
            same_batch.append((t, other))
    evaluated = [t for t, _ in same_batch if VAL_LOSS_ATTR in t.user_attrs]
    with_ceiling = [
        t
        for t, other in same_batch
        if CEILING_ATTR in t.user_attrs and other.torch_threads == params.torch_threads
    ]
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
