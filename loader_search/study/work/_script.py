"""A command's space, narrowed by a first look at the command (`loader_search.trial.probe_command`)
before any trial: a setting the script's training loader cannot take is not searched, and the
study says so in one line, never a silent no-op.

The first worker of a study looks and stores what it found with the study
(``script_facts``); every worker after it narrows its own space by the stored facts, so all
of them search the same space and no worker runs the command only to look. A look that found
nothing is looked at again until a trial completes, and the new look replaces it: the user
fixed the command, and the old note would say what is no longer true. A look that shows the
command cannot be tuned (`ScriptFacts.fatal`) stops the study in one line, and is not stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import optuna
from optuna.trial import TrialState

from loader_search.errors import StudyAborted
from loader_search.study.config import StudyConfig
from loader_search.study.search import IntRange, ResolvedSpace
from loader_search.trial import ScriptFacts, probe_command

SCRIPT_FACTS_ATTR = "script_facts"


def command_space(
    study: optuna.Study,
    config: StudyConfig,
    space: ResolvedSpace,
    device: object,
    ranks: int,
    preparing: Callable[[str], None] | None = None,
) -> tuple[ResolvedSpace, list[str]]:
    """``space`` narrowed for the study's command (unchanged for a workload), and the notes
    that say how. ``device``: where its trials train; ``preparing``: told what is being done
    (the progress display)."""
    if config.command is None:
        return space, []
    stored = study.user_attrs.get(SCRIPT_FACTS_ATTR)
    facts = ScriptFacts.from_dict(stored) if isinstance(stored, dict) else None
    if facts is None or (facts.failure and not _completed(study)):
        if preparing is not None:
            preparing("a first look at the command: which DataLoader it trains with")
        facts = probe_command(
            config.command.spec(),
            config.training,
            config.limits,
            device=str(device),
            ranks=ranks,
            max_workers=space.num_workers.high,
        )
        if facts.fatal:
            raise StudyAborted(f"the first look at the command, before any trial: {facts.failure}")
        study.set_user_attr(SCRIPT_FACTS_ATTR, facts.as_dict())
    return narrow(space, facts, config.training.batch_size)


def _completed(study: optuna.Study) -> bool:
    """Whether a trial of ``study`` completed: its space is then the stored look's for good."""
    return bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def narrow(
    space: ResolvedSpace, facts: ScriptFacts, batch_size: int
) -> tuple[ResolvedSpace, list[str]]:
    """``space`` without what ``facts`` say the script's loader cannot take; the notes."""
    notes: list[str] = []
    where = f" (the training DataLoader at {facts.site})" if facts.site else ""
    if "batch_size" in facts.fixed:
        keep = facts.batch_size or batch_size
        space = replace(space, batch_sizes=(keep,))
        notes.append(
            f"batch_size is not searched: {facts.fixed['batch_size']}{where}; every trial"
            f" runs at {keep}"
        )
    high = facts.max_workers
    if high is not None and space.num_workers.high > high:
        space = replace(space, num_workers=IntRange(min(space.num_workers.low, high), high))
        notes.append(
            f"num_workers is searched up to {high} only: {facts.fixed.get('num_workers')}{where};"
            " split it by worker to search more (docs/scripts.md)"
        )
    if facts.context:  # the baseline has no workers, whatever the space
        notes.append(
            f"the script's multiprocessing_context={facts.context!r}{where} is left out of"
            " trials with num_workers = 0: torch takes it only with loader workers"
        )
    if facts.failure:
        notes.append(
            f"a first look at the command found no training loader ({facts.failure});"
            " its settings are searched as declared"
        )
    return space, notes


def baseline_batch_size(space: ResolvedSpace, batch_size: int) -> int:
    """The baseline's batch size: the training's, unless the space fixes another."""
    if batch_size in space.batch_sizes or len(space.batch_sizes) != 1:
        return batch_size
    return space.batch_sizes[0]
